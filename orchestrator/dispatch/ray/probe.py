"""The Ray half of the node probe: Ray facts of a node, and the probe run on every node.

:func:`jobs.nodeprobe.probe_node` fingerprints the engine environment of the node it
runs on (no Ray there); this module adds what only the Ray side knows (``ray``
version, the node's ``ip`` and Ray ``node_id``: :func:`probe_node`) and runs that
probe on every node of a cluster at once, one Ray task pinned to each
(:func:`probe_on_nodes`).

Use::

    fps = probe_on_nodes(node_ids, engine_python, "/models/x", digest_cache)  # Ray driver
    report = check_parity([fps[n] for n in node_ids], launch)

Errors: :class:`jobs.nodeprobe.ProbeError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from jobs import nodeprobe
from jobs.nodeprobe import ProbeError, primary_ip

__all__ = ["RAY_SCHEDULING_GRACE_S", "probe_node", "probe_on_nodes", "ray_facts"]

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
    """:func:`jobs.nodeprobe.probe_node` plus :func:`ray_facts` (``ray``, ``ip``, ``node_id``).

    Raises :class:`jobs.nodeprobe.ProbeError` as that function.
    """
    doc = nodeprobe.probe_node(
        engine_python, model_dir, digest_cache, timeout_s=timeout_s, env=env, revision=revision
    )
    doc.update(ray_facts())
    return doc


def _probe_task(
    engine_python: str,
    model_dir: str | None,
    digest_cache: str | None,
    timeout_s: float,
    revision: str | None = None,
) -> dict[str, Any]:
    """Body of the Ray task of :func:`probe_on_nodes` (module level: pickled by reference).

    ``{node_id}`` in ``digest_cache`` becomes this node's Ray node id.
    """
    if digest_cache is not None and "{node_id}" in digest_cache:
        node_id = ray.get_runtime_context().get_node_id()
        digest_cache = digest_cache.replace("{node_id}", str(node_id))
    return probe_node(
        engine_python, model_dir, digest_cache, timeout_s=timeout_s, revision=revision
    )


def probe_on_nodes(
    node_ids: list[str],
    engine_python: str,
    model_dir: str | None,
    digest_cache: str | None,
    *,
    timeout_s: float = 120,
    revision: str | None = None,
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
    node's GPUs. Duplicate ids are probed once.

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
    refs = {
        node_id: remote.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            name=f"vlab-nodeprobe-{node_id[:12]}",
        ).remote(engine_python, model_dir, digest_cache, timeout_s, revision)
        for node_id in dict.fromkeys(node_ids)
    }
    if not refs:
        return {}
    results: dict[str, dict[str, Any]] = {}
    failures: dict[str, str] = {}
    tails: dict[str, list[str]] = {}
    _ready, pending = ray.wait(
        list(refs.values()), num_returns=len(refs), timeout=timeout_s + RAY_SCHEDULING_GRACE_S
    )
    for ref in pending:
        ray.cancel(ref, force=True)
    for node_id, ref in refs.items():
        if ref in pending:
            failures[node_id] = "probe did not finish in time (node unreachable or busy?)"
            continue
        try:
            results[node_id] = ray.get(ref)
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
