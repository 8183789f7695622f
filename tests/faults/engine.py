"""TEST DOUBLE: the engine environment's python for the fault matrix, on the CPU device kind.

Nothing here runs vLLM. The orchestrator starts engines as ``[engine_python,
jobs/launcher/vllm_launcher.py, <command>, ...]``; the fault matrix points
``VLAB_ENGINE__PYTHON`` at a wrapper (:func:`write_engine_python`) that runs this
module instead. Where the fault matrix depends on the engine it behaves like vLLM:

- ``serve``: loads the real launcher first (its module code installs the lifetime
  guard that ends the engine's process group once the run's supervisor is gone, as in
  every vLLM process), takes ``--fault-start-s`` seconds before it listens (vLLM
  loading a model: the run's "engine starting" phase), then serves the OpenAI API with
  the project's stub server (:class:`jobs.stub.stubserver.StubServer`, every request
  ``--fault-ttft-ms`` to its first token then ``--fault-itl-ms`` per token) and logs
  vLLM's start-up line; on SIGTERM it logs a shutdown line and takes
  ``--fault-stop-s`` seconds before it exits (vLLM draining: the window in which the
  measurement is over and the result is being made and recorded). A follower node's
  part (``--headless``) only waits for SIGTERM. The ``--fault-*``
  flags arrive as engine arguments of the run (``fault_start_s`` ...), so each run of
  the matrix sets its own phase lengths.
- ``engine-args``: the argument list vLLM 0.32 (CPU build) reported.
- anything else (``fingerprint``, ``resolve-model``): the real launcher, run by this
  interpreter (no vLLM here: the fingerprint says so).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

ENGINE_ARGS = REPO / "tests" / "data" / "engine_args_vllm032cpu.json"


def write_engine_python(path: Path) -> Path:
    """An executable that runs this module with the service's interpreter (the engine's
    environment drops ``PYTHONPATH``, so the wrapper sets it)."""
    path.write_text(
        "#!/bin/sh\n"
        f'PYTHONPATH="{REPO}" exec "{sys.executable}" "{Path(__file__).resolve()}" "$@"\n'
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def _opt(argv: list[str], name: str, default: str) -> str:
    return argv[argv.index(name) + 1] if name in argv else default


def _say(level: str, message: str) -> None:
    print(f"{level} {time.strftime('%m-%d %H:%M:%S')} [fault engine] {message}", flush=True)


def _launcher() -> Any:
    """Load the real launcher by path: its module code installs the lifetime guard."""
    spec = importlib.util.spec_from_file_location(
        "vllm_launcher", REPO / "jobs/launcher/vllm_launcher.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def serve(argv: list[str]) -> None:
    _launcher()
    from jobs.stub.stubserver import StubServer

    start_s = float(_opt(argv, "--fault-start-s", "0"))
    stop_s = float(_opt(argv, "--fault-stop-s", "0"))
    ttft_ms = float(_opt(argv, "--fault-ttft-ms", "20"))
    itl_ms = float(_opt(argv, "--fault-itl-ms", "5"))
    host = _opt(argv, "--host", "127.0.0.1")
    port = int(_opt(argv, "--port", "0"))
    model = _opt(argv, "--served-model-name", "model")
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    if "--headless" in argv:  # a follower node's part: it only holds its node's share
        _say("INFO", f"SIMULATED vLLM headless part, pid {os.getpid()}")
        stopping.wait()
        sys.exit(0)
    _say("INFO", f"SIMULATED vLLM (stub server), pid {os.getpid()}, loading for {start_s:g} s")
    if stopping.wait(start_s):
        sys.exit(0)
    with StubServer(ttft_ms / 1000, itl_ms / 1000, host, port, model=model):
        _say("INFO", "Started server process; Application startup complete.")
        stopping.wait()
        _say("INFO", f"Shutting down (simulated drain of {stop_s:g} s)")
        time.sleep(stop_s)
    _say("INFO", "stopped")


def main(argv: list[str]) -> None:
    command = argv[1] if len(argv) > 1 else ""
    if command == "serve":
        serve(argv[2:])
    elif command == "engine-args":
        print(ENGINE_ARGS.read_text(), flush=True)
    else:
        os.execv(sys.executable, [sys.executable, *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
