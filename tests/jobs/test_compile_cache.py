"""Tests of :mod:`jobs.launcher.compile_cache`: AOT compile off on vLLM's CPU build only."""

from __future__ import annotations

import json
import subprocess

from jobs.launcher.compile_cache import AOT_COMPILE_ENV, prefer_compile_cache
from jobs.launcher.vllm_launcher import __file__ as LAUNCHER
from tests.conftest import ENGINE_PYTHON, needs_engine


def test_without_vllm_nothing_is_set() -> None:
    env: dict[str, str] = {}
    assert prefer_compile_cache(env) is False and env == {}


PROBE = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("launcher_main", sys.argv[1])
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
cc = sys.modules[mod.PACKAGE + ".compile_cache"]
unset, mine = {}, {"VLLM_USE_AOT_COMPILE": "1"}
print(json.dumps([cc.prefer_compile_cache(unset), unset, cc.prefer_compile_cache(mine), mine]))
"""


@needs_engine
def test_the_cpu_build_gets_aot_off_unless_the_user_set_it() -> None:
    assert ENGINE_PYTHON is not None
    out = subprocess.run(
        [ENGINE_PYTHON, "-c", PROBE, LAUNCHER], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    set_here, unset, kept, mine = json.loads(out.stdout.strip().splitlines()[-1])
    assert set_here is True and unset == {AOT_COMPILE_ENV: "0"}
    assert kept is False and mine == {AOT_COMPILE_ENV: "1"}
