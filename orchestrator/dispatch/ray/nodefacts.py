"""What a Ray node's Python has of what vlab's Ray tasks and actors need: runs on bare nodes.

:func:`node_facts` runs as a Ray task on every node of a cluster the service joins
(:mod:`orchestrator.dispatch.ray.join`), possibly on a node whose Python has Ray and
nothing of ours. It is therefore pickled **by value**
(``ray.cloudpickle.register_pickle_by_value`` on this module) and this module imports
the standard library only: no ``ray``, nothing of ours, no third-party package.

:func:`code_digest` is computed the same way on the service (for the packages it
would ship) and on the node (for the packages the node would import), so "the node
runs this service's code" is a comparison of two digests, never a version string.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import socket
import sys
from pathlib import Path
from typing import Any

__all__ = ["code_digest", "node_facts"]

#: Files a package digest leaves out (byte code and caches differ between machines).
_SKIPPED_DIRS = ("__pycache__",)
_SKIPPED_SUFFIXES = (".pyc", ".pyo")


def code_digest(package_dir: str | os.PathLike[str]) -> str:
    """SHA-256 of a package folder: every file's relative POSIX path and bytes, sorted.

    Byte code (``__pycache__``, ``*.pyc``) is left out; returns ``"sha256:<hex>"``.
    """
    root = Path(package_dir)
    h = hashlib.sha256()
    files = []
    for path in root.rglob("*"):
        if not path.is_file() or path.suffix in _SKIPPED_SUFFIXES:
            continue
        rel = path.relative_to(root)
        if any(part in _SKIPPED_DIRS for part in rel.parts):
            continue
        files.append((rel.as_posix(), path))
    for rel_name, path in sorted(files):
        h.update(rel_name.encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return "sha256:" + h.hexdigest()


def _package_dir(name: str) -> str | None:
    """Where ``import name`` would load the package from on this node, without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return str(next(iter(spec.submodule_search_locations)))


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def node_facts(
    packages: list[str], dists: list[str], modules: list[str] | None = None
) -> dict[str, Any]:
    """This node's answer: its Python, our packages' code and the distributions it has.

    Args:
        packages: our top-level packages (``["jobs", "orchestrator"]``): for each, the
            folder ``import`` would use and its :func:`code_digest` (both None when the
            package cannot be found).
        dists: distribution names (``"numpy"``): the version installed, None if absent.
        modules: when given, each is imported here and a failure recorded as
            ``"ExceptionType: message"`` (the modules whose functions and actors Ray
            runs on the node).

    Returns:
        ``{"hostname", "python" (X.Y.Z), "executable", "platform", "packages": {name:
        {"path", "digest"}}, "dists": {name: version | None}, "import_errors":
        {module: error}}``. Never raises for a missing package: that is the answer.
    """
    found: dict[str, dict[str, str | None]] = {}
    for name in packages:
        where = _package_dir(name)
        found[name] = {"path": where, "digest": code_digest(where) if where else None}
    errors: dict[str, str] = {}
    for module in modules or []:
        try:
            importlib.import_module(module)
        except BaseException as exc:  # noqa: BLE001 - any failure is the node's answer
            errors[module] = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
    return {
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "executable": sys.executable,
        "platform": f"{sys.platform}-{platform.machine()}",
        "packages": found,
        "dists": {d: _version(d) for d in dists},
        "import_errors": errors,
    }
