"""Node fingerprints for the multi-node parity check, collected on each node.

A *node fingerprint* describes one node's engine environment in the shape
:func:`orchestrator.cluster.parity.check_parity` consumes. Most of it comes from the
engine's own interpreter (``vllm_launcher.py fingerprint``, run with the
engine venv's python: Python/vLLM/torch/CUDA/NCCL versions, GPUs, network
interfaces, the launch-relevant environment, the model directory's files and
their SHA-256 digests); :func:`probe_node` adds what only the Ray side knows
(``ray`` version, the node's ``ip`` and Ray ``node_id``).

Use::

    fp = probe_node(engine_python, "/models/x", "/var/cache/vlab/digests.json")
    fps = probe_on_nodes(node_ids, engine_python, "/models/x", digest_cache)  # Ray driver
    report = check_parity([fps[n] for n in node_ids], launch)

Ray is imported lazily (only :func:`probe_on_nodes` needs it; the other
functions use it when it is there). Errors: :class:`ProbeError`.
"""

from __future__ import annotations

import json
import socket
import subprocess
from collections.abc import Mapping
from typing import Any

from jobs.engine import LAUNCHER_PATH, engine_env
from jobs.schemas import EngineLaunch

__all__ = ["ProbeError", "node_name", "probe_node", "probe_on_nodes"]

#: Lines of the launcher's stderr kept in a :class:`ProbeError`.
STDERR_TAIL_LINES = 30
#: Extra seconds :func:`probe_on_nodes` waits beyond ``timeout_s`` (worker start-up).
RAY_SCHEDULING_GRACE_S = 60.0


class ProbeError(RuntimeError):
    """A node probe failed: the launcher could not run, failed, timed out or printed no JSON.

    ``node``: the Ray node id of the failed probe (set by :func:`probe_on_nodes`,
    else ``None``); ``stderr_tail``: the launcher's last stderr lines;
    ``failures``: ``{node_id: message}`` of every failed node (``probe_on_nodes``).
    """

    def __init__(
        self,
        message: str,
        stderr_tail: list[str] | None = None,
        *,
        node: str | None = None,
        failures: dict[str, str] | None = None,
    ) -> None:
        self.message = message
        self.stderr_tail: list[str] = list(stderr_tail or [])
        self.node = node
        self.failures: dict[str, str] = dict(failures or {})
        full = message
        if self.stderr_tail:
            full += "\n--- launcher stderr (tail) ---\n" + "\n".join(self.stderr_tail)
        super().__init__(full)

    def __reduce__(self) -> tuple[Any, ...]:  # keep the fields across Ray's pickling
        return (
            _rebuild_probe_error,
            (self.message, self.stderr_tail, self.node, self.failures),
        )


def _rebuild_probe_error(
    message: str, stderr_tail: list[str], node: str | None, failures: dict[str, str]
) -> ProbeError:
    return ProbeError(message, stderr_tail, node=node, failures=failures)


def _tail(data: bytes | str | None, n: int = STDERR_TAIL_LINES) -> list[str]:
    if data is None:
        return []
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    lines = [ln.rsplit("\r", 1)[-1].rstrip() for ln in text.splitlines()]
    return [ln for ln in lines if ln.strip()][-n:]


def _ray() -> Any:
    """The ``ray`` module, or ``None`` when it is not importable."""
    try:
        import ray
    except ImportError:
        return None
    return ray


def _primary_ip() -> str | None:
    """This host's outward-facing IPv4 address (no packet is sent), else its resolved name."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(("10.255.255.255", 1))  # UDP connect: only picks the route
            ip = str(sock.getsockname()[0])
            if ip and not ip.startswith("0."):
                return ip
    except OSError:
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return None


def _ray_facts() -> dict[str, Any]:
    """``ray`` (version or ``None``), ``ip`` and ``node_id`` of the calling process."""
    ray = _ray()
    if ray is None:
        return {"ray": None, "ip": _primary_ip(), "node_id": None}
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
        facts["ip"] = _primary_ip()
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
    """Fingerprint of this node's engine environment (shape: :mod:`orchestrator.cluster.parity`).

    Runs ``[engine_python, jobs/vllm_launcher.py, "fingerprint", "--model",
    model_dir, "--digest-cache", digest_cache]`` (options only when not
    ``None``) in the clean environment of :func:`jobs.engine.engine_env`
    (``env`` is added on top, like ``EngineLaunch.env``), then adds ``ray``
    (``ray.__version__`` of this process, ``None`` without Ray), ``ip`` (the
    Ray node IP when Ray is initialized, else this host's primary IPv4) and
    ``node_id`` (the Ray node id when called in a Ray worker, else ``None``).

    The launcher's keys: ``hostname``, ``os``, ``kernel``, ``machine``,
    ``cpu_count``, ``python``, ``python_executable``, ``vllm``,
    ``vllm_distribution``, ``transformers``, ``torch``, ``torch_cuda``,
    ``cuda_runtime``, ``nccl``, ``nvidia_driver``, ``gpu_model``,
    ``gpu_count``, ``gpu_memory_mib`` (MiB per GPU), ``gpu_topology``,
    ``interfaces`` (names), ``env`` (``NCCL_*``, ``GLOO_*``, ``VLLM_*``,
    ``HF_*``, ``UCX_*``, ``TORCH_*``, ``CUDA_VISIBLE_DEVICES``,
    ``OMP_NUM_THREADS``, ``MASTER_ADDR``, ``MASTER_PORT`` only; values of
    names containing TOKEN/KEY/SECRET/PASSWORD are ``"<redacted>"``); with
    ``model_dir`` also ``model_path``, ``model_path_exists`` and
    ``model_files`` (``[{"path", "size" (bytes), "sha256"}]`` sorted by path).
    Unknown facts are ``None``. Takes a few seconds (the engine imports torch);
    unchanged model files are not re-hashed when ``digest_cache`` (a JSON file
    on this node) is given.

    Raises:
        ProbeError: the launcher cannot be started, exits non-zero, runs longer
            than ``timeout_s`` seconds or prints no JSON object; carries the
            stderr tail.
    """
    launch = EngineLaunch(
        engine_python=engine_python,
        model_dir=model_dir or "",
        served_model_name="",
        log_path="",
        env=dict(env or {}),
    )
    argv = [engine_python, str(LAUNCHER_PATH), "fingerprint"]
    if model_dir is not None:
        argv += ["--model", model_dir]
        if revision is not None:  # a Hugging Face id: resolved in this node's HF cache
            argv += ["--revision", revision]
    if digest_cache is not None:
        argv += ["--digest-cache", digest_cache]
    try:
        proc = subprocess.run(
            argv,
            capture_output=True,
            env=engine_env(launch),
            stdin=subprocess.DEVNULL,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise ProbeError(
            f"node probe timed out after {timeout_s:g} s ({engine_python})", _tail(exc.stderr)
        ) from exc
    except OSError as exc:
        raise ProbeError(f"cannot run the engine python {engine_python!r}: {exc}") from exc
    tail = _tail(proc.stderr)
    if proc.returncode != 0:
        raise ProbeError(f"node probe exited with code {proc.returncode} ({engine_python})", tail)
    lines = proc.stdout.decode("utf-8", "replace").strip().splitlines()
    try:
        doc = json.loads(lines[-1])
    except (ValueError, IndexError) as exc:
        raise ProbeError(f"node probe printed no JSON ({engine_python})", tail) from exc
    if not isinstance(doc, dict):
        raise ProbeError(f"node probe printed a {type(doc).__name__}, not an object", tail)
    doc.update(_ray_facts())
    return doc


def node_name(fp: Mapping[str, Any]) -> str:
    """A display name of a fingerprint's node: ``hostname``, else ``ip``, else ``"?"``."""
    for key in ("hostname", "ip"):
        value = fp.get(key)
        if value:
            return str(value)
    return "?"


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
        node_id = _ray().get_runtime_context().get_node_id()
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
    system). The tasks run in the Ray workers' environment (the ``jobs``
    package must be importable there). Ray 2.60 leaves
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
        RuntimeError: Ray is not importable or not initialized.
    """
    ray = _ray()
    if ray is None or not ray.is_initialized():
        raise RuntimeError("probe_on_nodes needs a connected Ray (call ray.init first)")
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

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
