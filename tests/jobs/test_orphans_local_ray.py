"""An engine on a local Ray ends when the service that started that Ray dies, without
waiting for Ray to notice: every process of a local Ray a service starts carries the
service's mark (``VLAB_LOCAL_RAY_OWNER``, inherited by the run's supervisor and so by
its engine), and the launcher's lifetime guard watches that process too. Ray's worker
(the engine's owner) takes 1.6-2.1 s to notice its raylet died with the service.

Same doubles as ``tests/jobs/test_orphans.py``: a fake engine that makes its processes
the way vLLM does and ignores SIGTERM, started by an owner process through
:class:`jobs.engine.server.EngineServer`; here a third process plays the service, and it is the
one SIGKILLed while the owner lives on.
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
from jobs.engine.processes import LOCAL_RAY_OWNER_ENV, group_members, local_ray_marks
from jobs.launcher.lifetime_guard import GUARD_INTERVAL_S
from tests.jobs.test_orphans import FAKE_ENGINE, OWNER, REPO, _marked


def test_engine_ends_when_the_service_that_started_its_local_ray_dies(tmp_path: Path) -> None:
    engine = tmp_path / "fake_engine"
    engine.write_text(
        FAKE_ENGINE.format(python=sys.executable, launcher_dir=str(LAUNCHER_PATH.parent))
    )
    engine.chmod(engine.stat().st_mode | stat.S_IXUSR)
    run_id = uuid.uuid4().hex
    service = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    mark = local_ray_marks(str(tmp_path), service.pid)[LOCAL_RAY_OWNER_ENV]
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(engine), str(tmp_path / "engine.log"), run_id],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), LOCAL_RAY_OWNER_ENV: mark},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None
        pgid = int(owner.stdout.readline())
        deadline = time.monotonic() + 30
        while len(_marked(f"VLAB_RUN_ID={run_id}")) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(_marked(f"VLAB_RUN_ID={run_id}")) >= 3, (tmp_path / "engine.log").read_text()
        assert _marked(f"{LOCAL_RAY_OWNER_ENV}={mark}")  # the engine carries the mark
        time.sleep(GUARD_INTERVAL_S)  # every process has installed its guard
        service.send_signal(signal.SIGKILL)
        service.wait(timeout=10)
        t0 = time.monotonic()
        while _marked(f"VLAB_RUN_ID={run_id}") and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        gone_after = time.monotonic() - t0
        assert _marked(f"VLAB_RUN_ID={run_id}") == [], "the engine outlived the service"
        assert group_members(pgid) == []
        assert owner.poll() is None  # its owner still runs: the service's death ended it
        # one look of the guard, then SIGKILL to the group (slack for a loaded machine)
        assert gone_after < GUARD_INTERVAL_S + 2.5, gone_after
    finally:
        for proc in (service, owner):
            if proc.poll() is None:
                proc.kill()
        for pid in _marked(f"VLAB_RUN_ID={run_id}"):
            os.kill(pid, signal.SIGKILL)
