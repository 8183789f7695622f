"""No orphans, without vLLM: when the process that owns an engine dies by SIGKILL, every
process of the engine goes, including those the engine started itself.

The engine is a test double that does what vLLM does with its processes: it imports
the real launcher module (:mod:`jobs.launcher.vllm_launcher`, as vLLM's API server runs it and
its spawned children re-import it), forks one child (vLLM's engine core on CPU) and
spawns another (``multiprocessing`` spawn: a re-import as ``__mp_main__``), and every
one of them ignores SIGTERM, so the launcher's parent-death SIGTERM alone cannot end
them. The owner is a separate Python process that started the engine with
:class:`jobs.engine.server.EngineServer` (as the run supervisor does) and is then SIGKILLed.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

from jobs.engine.command import LAUNCHER_PATH
from jobs.engine.processes import group_members

REPO = Path(__file__).resolve().parents[2]

FAKE_ENGINE = """\
#!{python}
# Test double for the engine venv's python: processes the way vLLM makes them.
import multiprocessing, os, signal, sys, time
sys.path.insert(0, {launcher_dir!r})
import vllm_launcher  # noqa: F401  (every vLLM process imports the launcher: its guard)


def child():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.fork() == 0:  # vLLM forks its engine core on CPU
        child()
        os._exit(0)
    spawned = multiprocessing.get_context("spawn").Process(target=child)  # and spawns others
    spawned.start()
    print("INFO fake engine up", flush=True)
    while True:
        time.sleep(0.2)
"""

OWNER = """\
import sys, time
from jobs.engine.server import EngineServer
from jobs.schemas import EngineLaunch

server = EngineServer(EngineLaunch(engine_python=sys.argv[1], model_dir="m",
    served_model_name="m", log_path=sys.argv[2], env={"VLAB_RUN_ID": sys.argv[3]}))
server.start()
print(server.pgid, flush=True)
time.sleep(600)
"""


def _marked(marker: str) -> list[int]:
    """Pids whose environment holds ``marker`` (``VLAB_RUN_ID=<id>``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker.encode() in env and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def test_sigkilled_owner_leaves_no_engine_process(tmp_path: Path) -> None:
    engine = tmp_path / "fake_engine"
    engine.write_text(
        FAKE_ENGINE.format(python=sys.executable, launcher_dir=str(LAUNCHER_PATH.parent))
    )
    engine.chmod(engine.stat().st_mode | stat.S_IXUSR)
    run_id = uuid.uuid4().hex
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(engine), str(tmp_path / "engine.log"), run_id],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None
        pgid = int(owner.stdout.readline())
        deadline = time.monotonic() + 30
        # the launcher, its forked and spawned children (and multiprocessing's tracker)
        while len(_marked(f"VLAB_RUN_ID={run_id}")) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        engine_pids = _marked(f"VLAB_RUN_ID={run_id}")
        assert len(engine_pids) >= 3, (engine_pids, (tmp_path / "engine.log").read_text())
        time.sleep(0.5)  # every process has installed its SIGTERM handler and its guard
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        t0 = time.monotonic()
        while _marked(f"VLAB_RUN_ID={run_id}") and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        gone_after = time.monotonic() - t0
        assert _marked(f"VLAB_RUN_ID={run_id}") == [], "engine processes outlived their owner"
        assert group_members(pgid) == []
        assert gone_after < 3.0, gone_after
        assert "is gone; pid" in (tmp_path / "engine.log").read_text()
    finally:
        if owner.poll() is None:
            owner.kill()
        for pid in _marked(f"VLAB_RUN_ID={run_id}"):
            os.kill(pid, signal.SIGKILL)
