"""Node fingerprints for the multi-node parity check, collected on each node.

A *node fingerprint* describes one node's engine environment in the shape
:func:`orchestrator.cluster.parity.check_parity` consumes. It comes from the
engine's own interpreter (``vllm_launcher.py fingerprint``, run with the
engine venv's python: Python/vLLM/torch/CUDA/NCCL versions, GPUs, network
interfaces, the launch-relevant environment, the model directory's files and
their SHA-256 digests). What only the Ray side knows (``ray`` version, the
node's ``ip`` and Ray ``node_id``) and the Ray task that runs the probe on
every node are in :mod:`orchestrator.dispatch.ray.probe`: this module imports
no Ray.

Use::

    fp = probe_node(engine_python, "/models/x", "/var/cache/vlab/digests.json")
    report = check_parity([fp, other_node_fp], {**launch, "launch_env": launch_environment()})

The launching side's environment (:func:`launch_environment`: the process that
launches, e.g. the orchestrator, read with the same filter as a fingerprint's
``env``) lets the parity check catch a communication setting made only there.

Errors: :class:`ProbeError`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Mapping
from typing import Any

from jobs.engine.command import LAUNCHER_PATH, engine_env
from jobs.schemas import EngineLaunch

__all__ = [
    "ENV_NAMES",
    "ENV_PREFIXES",
    "ProbeError",
    "env_scope",
    "launch_environment",
    "node_name",
    "primary_ip",
    "probe_node",
]

#: Lines of the launcher's stderr kept in a :class:`ProbeError`.
STDERR_TAIL_LINES = 30

#: The variables a fingerprint's ``env`` covers: the same as ``jobs/launcher/vllm_launcher.py``'s
#: ``_FP_ENV_PREFIXES`` and ``_FP_ENV_NAMES`` (that file runs in the engine venv and is
#: not imported here; a test keeps the two equal).
ENV_PREFIXES = ("NCCL_", "GLOO_", "VLLM_", "HF_", "UCX_", "TORCH_")
ENV_NAMES = frozenset(
    {"CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT", "TP_SOCKET_IFNAME"}
)
_SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD")
_REDACTED = "<redacted>"


class ProbeError(RuntimeError):
    """A node probe failed: the launcher could not run, failed, timed out or printed no JSON.

    ``node``: the Ray node id of the failed probe (set by
    :func:`orchestrator.dispatch.ray.probe.probe_on_nodes`, else ``None``);
    ``stderr_tail``: the launcher's last stderr lines; ``failures``:
    ``{node_id: message}`` of every failed node (``probe_on_nodes``).
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


def primary_ip() -> str | None:
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

    Runs ``[engine_python, jobs/launcher/vllm_launcher.py, "fingerprint", "--model",
    model_dir, "--digest-cache", digest_cache]`` (options only when not
    ``None``) in the clean environment of :func:`jobs.engine.command.engine_env`
    (``env`` is added on top, like ``EngineLaunch.env``) and returns the JSON
    object it prints (:func:`orchestrator.dispatch.ray.probe.probe_node` adds
    ``ray``, ``ip`` and ``node_id``).

    The launcher's keys: ``hostname``, ``os``, ``kernel``, ``machine``,
    ``cpu_count``, ``python``, ``python_executable``, ``vllm``,
    ``vllm_distribution``, ``transformers``, ``torch``, ``torch_cuda``,
    ``cuda_runtime``, ``nccl``, ``nvidia_driver``, ``gpu_model``,
    ``gpu_count``, ``gpu_memory_mib`` (MiB per GPU), ``gpu_topology``,
    ``interfaces`` (names), ``env`` (``NCCL_*``, ``GLOO_*``, ``VLLM_*``,
    ``HF_*``, ``UCX_*``, ``TORCH_*``, ``CUDA_VISIBLE_DEVICES``,
    ``OMP_NUM_THREADS``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TP_SOCKET_IFNAME``
    only; values of names with a TOKEN/KEY/SECRET/PASSWORD part are
    ``"<redacted>"``), ``env_scope`` (what ``env`` covers: a covered name absent
    from ``env`` is unset); with
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
    return doc


def env_scope() -> dict[str, list[str]]:
    """What a fingerprint's ``env`` covers: ``{"prefixes": [...], "names": [...]}``."""
    return {"prefixes": list(ENV_PREFIXES), "names": sorted(ENV_NAMES)}


def launch_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The launch-relevant variables of ``environ`` (default: this process's), sorted.

    The filter of a fingerprint's ``env`` (:data:`ENV_PREFIXES`, :data:`ENV_NAMES`;
    values of names with a TOKEN/KEY/SECRET/PASSWORD part are ``"<redacted>"``), so
    the launching side compares with the nodes' Ray workers variable by variable.
    """
    environ = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for name in sorted(environ):
        if not (name.startswith(ENV_PREFIXES) or name in ENV_NAMES):
            continue
        secret = any(m in name.upper().split("_") for m in _SECRET_MARKERS)
        out[name] = _REDACTED if secret else environ[name]
    return out


def node_name(fp: Mapping[str, Any]) -> str:
    """A display name of a fingerprint's node: ``hostname``, else ``ip``, else ``"?"``."""
    for key in ("hostname", "ip"):
        value = fp.get(key)
        if value:
            return str(value)
    return "?"
