"""The files of a model directory with their SHA-256 digests, through a digest cache.

Shared by ``fingerprint`` and ``resolve-model``: a file whose path, size and
``mtime_ns`` match the cache is not read again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import sys
import tempfile
from typing import Any

#: Directory names never descended into when listing a model directory.
_FP_SKIP_DIRS = frozenset({".git"})


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


def model_facts(
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

    found = _files_under(root)
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

    facts["model_files"] = _hashed(root, found, digest_cache)
    return facts


def _files_under(root: str) -> list[tuple[str, str]]:
    """``(relative POSIX path, absolute path)`` of every file name under ``root``, sorted
    (``.git`` and the other skipped directories left out; raises ``OSError``)."""
    found: list[tuple[str, str]] = []

    def walk_error(exc: OSError) -> None:
        raise exc

    for dirpath, dirnames, filenames in os.walk(root, onerror=walk_error):
        dirnames[:] = sorted(d for d in dirnames if d not in _FP_SKIP_DIRS)
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames:
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            found.append((rel.replace(os.sep, "/"), os.path.join(dirpath, name)))
    found.sort()
    return found


def _hashed(
    root: str, found: list[tuple[str, str]], digest_cache: str | None
) -> list[dict[str, Any]]:
    """The regular files of ``found`` with their digests, through the digest cache."""
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
    return files
