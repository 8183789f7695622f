"""Warm starts on vLLM's CPU build: torch.compile's own cache instead of the AOT artefact.

vLLM 0.32's CPU build saves an AOT-compiled model at every start
(``~/.cache/vllm/torch_compile_cache/torch_aot_compile``) and cannot load it at the next
one (``Compiling model again due to a load failure``, ``'function' object has no attribute
'finalize_loading'``), so every start compiled the model again. With
``VLLM_USE_AOT_COMPILE=0`` the warm start is served by torch.compile's cache (keyed by
vLLM's config hashes, so variants that change only scheduler limits share it): on the
2-core machine, the tiny model's warm-up fell from 19 s to 6 s a start (docs/BENCHMARKS.md).
A value the user set wins; GPU builds are left as vLLM sets them.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from .cpu_alias import installed_vllm

AOT_COMPILE_ENV = "VLLM_USE_AOT_COMPILE"


def prefer_compile_cache(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set ``VLLM_USE_AOT_COMPILE=0`` in ``environ`` (default ``os.environ``) on the CPU
    build when the user has not set it; True when it was set here."""
    env = os.environ if environ is None else environ
    if AOT_COMPILE_ENV in env:
        return False
    _, dist = installed_vllm()
    if dist is None or dist == "vllm":
        return False
    env[AOT_COMPILE_ENV] = "0"
    return True
