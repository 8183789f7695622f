"""TEST DOUBLE: a response-surface engine, launched the way runs launch vLLM.

Nothing here runs vLLM. The orchestrator starts engines as ``[engine_python,
jobs/launcher/vllm_launcher.py, <command>, ...]``; a test points ``VLAB_ENGINE__PYTHON`` at
a wrapper (:func:`write_engine_python`) that runs this module instead. Its ``serve`` reads
the engine arguments it was started with, as ``vllm serve`` would (``--enable-prefix-caching``
/ ``--no-enable-prefix-caching``, ``--max-num-seqs N``, ``--max-num-batched-tokens N``,
``--block-size N``, ``--enforce-eager`` / ``--no-enforce-eager``), and serves the OpenAI API
with the project's stub server (:class:`jobs.stub.stubserver.StubServer`) on a timetable that
is a **known function** of them: the response surface of the pure proof
(:func:`tests.orchestrator.campaigns.surface.objective`, output tokens/s relative to a base):

- prefix caching on: x1.30 faster;
- ``max_num_seqs``: concave, best at 128, x0.90 per doubling away from it;
- ``max_num_batched_tokens``: x1.10 per doubling above 2048, **only with prefix caching on**
  (the interaction);
- ``block_size``: no effect (the **inert** knob);
- ``enforce_eager`` on: x0.75 (the **harmful** knob).

The engine's speed is ``s = (objective(config) / 1000) ** sharpness`` (``sharpness`` from
``VLAB_SURFACE_SHARPNESS``, default 1: the proof's surface; a test may sharpen it so a few
repeats decide on a loaded machine), times a per-start noise ``exp(N(0, sigma))``
(``VLAB_SURFACE_SIGMA``, default 0.02; seeded by ``VLAB_SURFACE_SEED`` and the run's id, so
each run draws its own). Every request then takes ``TTFT_MS / s`` to its first token and
``ITL_MS / s`` per further token (a few ms a token: a run measures in well under a second),
so E2EL is inversely and output tokens/s (at a fixed concurrency) directly proportional to
the surface: the capacity at a concurrency is the surface too. With prefix caching on the
stub also simulates vLLM's prefix cache (its cached tokens and ``vllm:prefix_cache_*``
counters), with the block size it was given. An argument it was not given takes the
default of :data:`DEFAULTS`. It logs what it read and the timetable it serves
(``[surface engine] config ...``), and like the fault engine
(:mod:`tests.faults.engine`) loads the real launcher first (its lifetime guard).

``engine-args`` prints the argument list vLLM 0.32 (CPU build) reported; any other
command runs the real launcher with this interpreter.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.faults.engine import ENGINE_ARGS, _launcher, _opt  # noqa: E402
from tests.orchestrator.campaigns.surface import (  # noqa: E402
    APC,
    BASE,
    BATCHED,
    BLOCK,
    EAGER,
    SEQS,
    objective,
)

#: What the engine serves at the surface's base (speed 1): ms to the first token, ms per
#: further token.
TTFT_MS = 30.0
ITL_MS = 4.0
#: The level of each surface variable when its argument is not on the command line.
DEFAULTS: dict[str, Any] = {APC: False, SEQS: 256, BATCHED: 2048, BLOCK: 16, EAGER: False}


def write_engine_python(
    path: Path, *, sharpness: float = 1.0, sigma: float = 0.02, seed: int = 0
) -> Path:
    """An executable that runs this module with the service's interpreter (the engine's
    environment drops ``PYTHONPATH``, so the wrapper sets it, and the surface's knobs)."""
    path.write_text(
        "#!/bin/sh\n"
        f'export PYTHONPATH="{REPO}" VLAB_SURFACE_SHARPNESS={sharpness} '
        f"VLAB_SURFACE_SIGMA={sigma} VLAB_SURFACE_SEED={seed}\n"
        f'exec "{sys.executable}" "{Path(__file__).resolve()}" "$@"\n'
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def _bool_flag(argv: list[str], flag: str, default: bool) -> bool:
    """vLLM's ``BooleanOptionalAction``: the last of ``--flag`` / ``--no-flag`` wins."""
    value = default
    for arg in argv:
        if arg == f"--{flag}":
            value = True
        elif arg == f"--no-{flag}":
            value = False
    return value


def read_config(argv: list[str]) -> dict[str, Any]:
    """The surface variables as ``argv`` (a ``serve`` command line) sets them."""

    def num(flag: str, key: str) -> int:
        return int(_opt(argv, flag, str(DEFAULTS[key])))

    return {
        APC: _bool_flag(argv, "enable-prefix-caching", DEFAULTS[APC]),
        SEQS: num("--max-num-seqs", SEQS),
        BATCHED: num("--max-num-batched-tokens", BATCHED),
        BLOCK: num("--block-size", BLOCK),
        EAGER: _bool_flag(argv, "enforce-eager", DEFAULTS[EAGER]),
    }


def speed(config: dict[str, Any], sharpness: float = 1.0) -> float:
    """The noiseless speed of ``config``: the surface relative to its base, sharpened."""
    return float((objective(config) / BASE) ** sharpness)


def timetable(config: dict[str, Any], sharpness: float, noise: float) -> tuple[float, float]:
    """``(ttft_s, itl_s)`` served for ``config`` with the start's ``noise`` factor."""
    s = speed(config, sharpness) * noise
    return TTFT_MS / s / 1000, ITL_MS / s / 1000


def _say(message: str) -> None:
    print(f"INFO {time.strftime('%m-%d %H:%M:%S')} [surface engine] {message}", flush=True)


def serve(argv: list[str]) -> None:
    _launcher()
    from jobs.stub.stubserver import StubServer

    host = _opt(argv, "--host", "127.0.0.1")
    port = int(_opt(argv, "--port", "0"))
    model = _opt(argv, "--served-model-name", "model")
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    if "--headless" in argv:
        stopping.wait()
        sys.exit(0)
    sharpness = float(os.environ.get("VLAB_SURFACE_SHARPNESS", "1"))
    sigma = float(os.environ.get("VLAB_SURFACE_SIGMA", "0.02"))
    seed = os.environ.get("VLAB_SURFACE_SEED", "0")
    rng = random.Random(f"{seed}:{os.environ.get('VLAB_RUN_ID', '')}:{os.getpid()}")
    noise = math.exp(rng.gauss(0.0, sigma))
    config = read_config(argv)
    ttft_s, itl_s = timetable(config, sharpness, noise)
    _say(
        "config "
        + json.dumps({k.split(".", 1)[1]: v for k, v in config.items()}, sort_keys=True)
        + f" speed {speed(config, sharpness):.4f} noise {noise:.4f}"
        + f" ttft {ttft_s * 1000:.2f} ms itl {itl_s * 1000:.3f} ms, pid {os.getpid()}"
    )
    with StubServer(
        ttft_s,
        itl_s,
        host,
        port,
        model=model,
        prefix_cache=bool(config[APC]),
        block_size=int(config[BLOCK]),
    ):
        _say("Started server process; Application startup complete.")
        stopping.wait()
        _say("Shutting down")
    _say("stopped")


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
