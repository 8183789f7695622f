"""``resolve-model``: where a model named the vLLM way is on this node, and what it holds.

A directory, a name under one of the model roots, or a Hugging Face repo id (from
this node's Hugging Face cache, else only its metadata files fetched from the hub):
:func:`locate_model` finds it, :func:`resolve_model` describes it (files, config,
tokenizer files). ``huggingface_hub`` is optional and imported on first use.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fnmatch
import json
import os
import re
import sys
from typing import Any

from .model_files import model_facts

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
    directory = _directory_of(name, model_roots)
    if directory is not None:
        source, path = directory
        return {"source": source, "path": path, "revision": None, "hf_cache": None, **base}
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
    fetched = _fetch_meta(hub, name, rev, cache, missing)
    snapshot = os.path.abspath(str(fetched))
    return {
        "source": "hf_hub",
        "path": snapshot,
        "revision": os.path.basename(snapshot),
        "hf_cache": cache,
        **base,
    }


def _directory_of(name: str, model_roots: list[str] | tuple[str, ...]) -> tuple[str, str] | None:
    """``("local_dir" | "model_root", absolute path)`` of a directory with a ``config.json``
    that ``name`` names (itself, or relative under one of ``model_roots``), or None."""
    local = os.path.expanduser(name)
    if name and os.path.isdir(local) and _has_config(local):
        return "local_dir", os.path.abspath(local)
    parts = name.replace(os.sep, "/").split("/")
    relative = bool(name) and not os.path.isabs(name) and ".." not in parts and "" not in parts
    if relative:
        for root in model_roots:
            candidate = os.path.join(os.path.expanduser(root), *parts)
            if os.path.isdir(candidate) and _has_config(candidate):
                return "model_root", os.path.abspath(candidate)
    return None


def _fetch_meta(hub: Any, name: str, rev: str, cache: str, missing: str) -> Any:
    """The :data:`META_PATTERNS` files of ``name`` at ``rev`` fetched into ``cache``: the
    snapshot's path; :class:`ModelNotResolved` (after ``missing``) when the hub fails."""
    try:
        return hub.snapshot_download(
            name, revision=rev, cache_dir=cache, allow_patterns=list(META_PATTERNS)
        )
    except Exception as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        raise ModelNotResolved(
            f"{missing}, and fetching it from the Hugging Face Hub failed: "
            f"{type(exc).__name__}: {message}"
        ) from exc


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
    "meta_skipped"}``: ``files`` as ``model_files`` of :func:`model_facts`
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
    files = model_facts(path, digest_cache, digests=digests)["model_files"]
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


def add_model_options(parser: argparse.ArgumentParser) -> None:
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


def parse_resolve_model_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="vllm_launcher.py resolve-model",
        description="Resolve a model name (directory, name under a model root, or Hugging "
        "Face repo id) on this node and print a JSON description of it.",
    )
    parser.add_argument("--model", metavar="NAME", required=True, help="model to resolve")
    add_model_options(parser)
    parser.add_argument("--no-digests", action="store_true", help="do not hash the files")
    return parser.parse_args(argv)
