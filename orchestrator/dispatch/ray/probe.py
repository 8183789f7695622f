"""The Ray half of the node probe: Ray facts of a node, and the probe run on every node.

:func:`jobs.engine.nodeprobe.probe_node` fingerprints the engine environment of the node it
runs on (no Ray there); this module adds what only the Ray side knows (``ray``
version, the node's ``ip`` and Ray ``node_id``: :func:`probe_node`) and runs that
probe on every node of a cluster at once, one Ray task pinned to each
(:func:`probe_on_nodes`). :func:`engine_env_on_nodes` is the cheap check that runs
before anything of a run is placed: is each node's engine python there
(:func:`jobs.engine.envfacts.engine_env_facts`, a stat; in the container image when the
engine runs in one)?

Use::

    fps = probe_on_nodes(node_ids, engine_python, "/models/x", digest_cache)  # Ray driver
    report = check_parity([fps[n] for n in node_ids], launch)
    answers = engine_env_on_nodes({node_id: {"kind": "path", "python": ...}}, timeout_s=60)

Errors: :class:`jobs.engine.nodeprobe.ProbeError`.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any

import ray
from ray.exceptions import RuntimeEnvSetupError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from jobs.engine import nodeprobe
from jobs.engine.envfacts import engine_env_facts
from jobs.engine.nodeprobe import ProbeError, primary_ip
from orchestrator.cluster.parity_engineenv import engine_env_problem

__all__ = [
    "RAY_SCHEDULING_GRACE_S",
    "engine_env_on_nodes",
    "probe_node",
    "probe_on_nodes",
    "ray_facts",
]

#: Extra seconds :func:`probe_on_nodes` waits beyond ``timeout_s`` (worker start-up).
RAY_SCHEDULING_GRACE_S = 60.0


def ray_facts() -> dict[str, Any]:
    """``ray`` (version), ``ip`` and ``node_id`` of the calling process.

    ``ip``: the Ray node IP when Ray is initialized, else this host's primary IPv4;
    ``node_id``: the Ray node id when called in a Ray worker, else ``None``.
    """
    facts: dict[str, Any] = {"ray": ray.__version__, "ip": None, "node_id": None}
    if ray.is_initialized():
        try:
            facts["ip"] = ray.util.get_node_ip_address()
        except Exception:  # very old Ray / odd network set-ups: fall back below
            facts["ip"] = None
        context = ray.get_runtime_context()
        if getattr(context.worker, "mode", None) == ray.WORKER_MODE:
            facts["node_id"] = context.get_node_id()
    if not facts["ip"]:
        facts["ip"] = primary_ip()
    return facts


def probe_node(
    engine_python: str,
    model_dir: str | None,
    digest_cache: str | None,
    *,
    timeout_s: float = 120,
    env: Mapping[str, str] | None = None,
    revision: str | None = None,
) -> dict[str, Any]:
    """:func:`jobs.engine.nodeprobe.probe_node` plus :func:`ray_facts` (``ray``, ``ip``,
    ``node_id``).

    Raises :class:`jobs.engine.nodeprobe.ProbeError` as that function.
    """
    doc = nodeprobe.probe_node(
        engine_python, model_dir, digest_cache, timeout_s=timeout_s, env=env, revision=revision
    )
    doc.update(ray_facts())
    return doc


def _spec_facts(spec: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`jobs.engine.envfacts.engine_env_facts` of an engine spec (``kind``, ``python``...)."""
    return engine_env_facts(
        str(spec["python"]),
        kind=str(spec.get("kind") or "path"),
        source=spec.get("source"),
        image_uri=spec.get("image_uri"),
    )


def _probe_task(
    engine_python: str,
    model_dir: str | None,
    digest_cache: str | None,
    timeout_s: float,
    revision: str | None = None,
    env: dict[str, str] | None = None,
    spec: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Body of the Ray task of :func:`probe_on_nodes` (module level: pickled by reference).

    ``{node_id}`` in ``digest_cache`` becomes this node's Ray node id. With ``spec`` (the
    node's engine environment) the fingerprint's ``engine_env`` holds what the node has
    of it; when its python is not there the engine is not run and the fingerprint is
    that and the node's identity only.
    """
    facts = _spec_facts(spec) if spec is not None else None
    if facts is not None and engine_env_problem(facts) is not None:
        return {"hostname": socket.gethostname(), **ray_facts(), "engine_env": facts}
    if digest_cache is not None and "{node_id}" in digest_cache:
        node_id = ray.get_runtime_context().get_node_id()
        digest_cache = digest_cache.replace("{node_id}", str(node_id))
    doc = probe_node(
        engine_python, model_dir, digest_cache, timeout_s=timeout_s, env=env, revision=revision
    )
    if facts is not None:  # the launcher's packages digest, and where this python is
        doc["engine_env"] = {**(doc.get("engine_env") or {}), **facts}
    return doc


def _engine_env_task(spec: dict[str, Any]) -> dict[str, Any]:
    """Body of the Ray task of :func:`engine_env_on_nodes`: identity and ``engine_env``."""
    return {"hostname": socket.gethostname(), **ray_facts(), "engine_env": _spec_facts(spec)}


def _setup_failure(spec: Mapping[str, Any], exc: BaseException) -> dict[str, Any]:
    """The answer of a node where Ray could not set up the task's runtime environment
    (the engine's container image did not start there): an ``engine_env`` error."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln and not ln.startswith(("File ", "raise "))]
    said = (errors[-1] if errors else " / ".join(lines[-3:]))[:1500] or type(exc).__name__
    facts: dict[str, Any] = {
        "kind": spec.get("kind") or "path",
        "python": spec.get("python"),
        "source": spec.get("source"),
        "error": f"Ray could not set up the runtime environment: {said}",
    }
    if spec.get("image_uri"):
        facts["image_uri"] = spec["image_uri"]
    return {"engine_env": facts}


def engine_env_on_nodes(
    specs: Mapping[str, Mapping[str, Any]],
    *,
    timeout_s: float = 60,
    runtime_env: Mapping[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Is each node's engine environment there? One zero-CPU task pinned to each node.

    Args:
        specs: ``{node_id: {"kind": "path" | "image", "python", "source", "image_uri"?}}``
            (:meth:`orchestrator.dispatch.ray.backend.RayRunBackend.engine_specs`).
        timeout_s: seconds to wait for every answer (a first use of an image includes
            its pull).
        runtime_env: the task's Ray ``runtime_env`` (``{"image_uri": ...}`` when the
            engine runs in a container image: the check then looks inside it).

    Returns:
        ``{node_id: {"hostname", "ray", "ip", "node_id", "engine_env": facts}}`` in the
        order of ``specs``; a node where Ray could not set up ``runtime_env`` (the image
        did not start) answers ``{"engine_env": {..., "error": ...}}``.

    Raises:
        ProbeError: a node did not answer in time, or its task failed otherwise (node
            lost...): no answer is no verdict; names every such node.
    """
    if not specs:
        return {}
    remote = ray.remote(num_cpus=0, max_retries=0)(_engine_env_task)
    options: dict[str, Any] = {"runtime_env": dict(runtime_env)} if runtime_env else {}
    refs = {
        node_id: remote.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            name=f"vlab-engine-env-{node_id[:12]}",
            **options,
        ).remote(dict(spec))
        for node_id, spec in specs.items()
    }
    _ready, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    answers: dict[str, dict[str, Any]] = {}
    failures: dict[str, str] = {}
    for node_id, ref in refs.items():
        if ref in pending:
            ray.cancel(ref, force=True)
            failures[node_id] = f"no answer within {timeout_s:g} s (node unreachable or busy?)"
            continue
        try:
            answer: dict[str, Any] = ray.get(ref)
            answers[node_id] = answer
        except RuntimeEnvSetupError as exc:
            answers[node_id] = _setup_failure(specs[node_id], exc)
        except Exception as exc:  # noqa: BLE001 - any other failure: no verdict on the node
            cause = getattr(exc, "cause", None)
            failures[node_id] = f"{type(cause or exc).__name__}: {cause or exc}".splitlines()[0]
    if failures:
        detail = "; ".join(f"node {n}: {msg}" for n, msg in failures.items())
        raise ProbeError(
            f"engine environment check failed on {len(failures)} of {len(refs)} node(s): " + detail,
            node=next(iter(failures)),
            failures=failures,
        )
    return answers


def probe_on_nodes(
    node_ids: list[str],
    engine_python: str | Mapping[str, str],
    model_dir: str | None,
    digest_cache: str | None,
    *,
    timeout_s: float = 120,
    revision: str | None = None,
    env: Mapping[str, str] | None = None,
    engine_envs: Mapping[str, Mapping[str, Any]] | None = None,
    runtime_env: Mapping[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Run :func:`probe_node` on every Ray node of ``node_ids``, in parallel.

    Call from a process connected to Ray (``ray.init`` done). One zero-CPU
    task per node, pinned with ``NodeAffinitySchedulingStrategy(node_id,
    soft=False)``; ``engine_python``, ``model_dir`` and ``digest_cache`` are
    paths *on the nodes* (``{node_id}`` in ``digest_cache`` is replaced by
    each node's id: one cache per node, also where nodes share a file
    system). The tasks run in the Ray workers' environment (the ``jobs`` and
    ``orchestrator`` packages must be importable there, as for the run supervisor). Ray 2.60 leaves
    ``CUDA_VISIBLE_DEVICES`` alone for zero-GPU tasks, so the probe sees the
    node's GPUs. ``env`` is added on top of each node's Ray worker environment
    (what the engine there gets, like ``EngineLaunch.env``). Duplicate ids are
    probed once.

    Per node: ``engine_python`` may map node ids to each node's python; with
    ``engine_envs`` (``{node_id: spec}``, see :func:`engine_env_on_nodes`) each
    fingerprint carries ``engine_env`` (where the python is, whether it is there, and
    the launcher's digest of its packages), and a node whose python is not there
    answers with its identity and ``engine_env`` only (no launcher run), as does a
    node where Ray could not set up ``runtime_env`` (the engine's image: the tasks run
    in it).

    Returns:
        ``{node_id: fingerprint}`` in the order of ``node_ids`` (see
        :func:`probe_node`; ``node_id`` and ``ip`` are those of the node).

    Raises:
        ProbeError: a probe failed, or did not finish within ``timeout_s`` +
            :data:`RAY_SCHEDULING_GRACE_S` seconds (node gone, no worker...);
            waits for every node, then names the failed ones (``.node``: the
            first, ``.failures``: all of them).
        RuntimeError: Ray is not initialized.
    """
    if not ray.is_initialized():
        raise RuntimeError("probe_on_nodes needs a connected Ray (call ray.init first)")
    remote = ray.remote(num_cpus=0, max_retries=0)(_probe_task)
    options: dict[str, Any] = {"runtime_env": dict(runtime_env)} if runtime_env else {}
    specs = dict(engine_envs or {})
    refs = {
        node_id: remote.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            name=f"vlab-nodeprobe-{node_id[:12]}",
            **options,
        ).remote(
            engine_python if isinstance(engine_python, str) else engine_python[node_id],
            model_dir,
            digest_cache,
            timeout_s,
            revision,
            dict(env or {}),
            dict(specs[node_id]) if node_id in specs else None,
        )
        for node_id in dict.fromkeys(node_ids)
    }
    if not refs:
        return {}
    return _collect(refs, specs, timeout_s + RAY_SCHEDULING_GRACE_S)


def _collect(
    refs: dict[str, Any], specs: Mapping[str, Mapping[str, Any]], timeout_s: float
) -> dict[str, dict[str, Any]]:
    """The fingerprint of every node's probe task, waited for ``timeout_s`` in all;
    :class:`ProbeError` naming every node that failed or did not finish."""
    results: dict[str, dict[str, Any]] = {}
    failures: dict[str, str] = {}
    tails: dict[str, list[str]] = {}
    _ready, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    for ref in pending:
        ray.cancel(ref, force=True)
    for node_id, ref in refs.items():
        if ref in pending:
            failures[node_id] = "probe did not finish in time (node unreachable or busy?)"
            continue
        try:
            results[node_id] = ray.get(ref)
        except RuntimeEnvSetupError as exc:
            if node_id not in specs:
                failures[node_id] = f"{type(exc).__name__}: {exc}".splitlines()[0]
                continue
            results[node_id] = _setup_failure(specs[node_id], exc)
        except Exception as exc:
            cause = getattr(exc, "cause", None)  # RayTaskError wraps the task's exception
            if not isinstance(cause, Exception):
                cause = exc
            if isinstance(cause, ProbeError):
                failures[node_id] = cause.message
                tails[node_id] = cause.stderr_tail
            else:
                failures[node_id] = f"{type(cause).__name__}: {cause}".splitlines()[0]
    if failures:
        first = next(iter(failures))
        detail = "; ".join(f"node {n}: {msg}" for n, msg in failures.items())
        raise ProbeError(
            f"node probe failed on {len(failures)} of {len(refs)} node(s): {detail}",
            tails.get(first),
            node=first,
            failures=failures,
        )
    return results
