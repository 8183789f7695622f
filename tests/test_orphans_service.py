"""No orphans, end to end, on a real vLLM CPU server: the service (a ``vlab up``-like
process running :class:`orchestrator.cli.runtime.Runtime`: Postgres, a local Ray, the
dispatcher, the API) is SIGKILLed while a run measures.

- within a few seconds no engine process of the run is left (``/proc``, the
  ``VLAB_RUN_ID`` marker every engine process carries);
- a restart of the service on the same home and database fails the interrupted run
  at once (not after its heartbeat goes stale), ``partial``, with the request records
  measured before the kill kept and its engine log readable at ``/log``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, func, select
from sqlalchemy.orm import Session, sessionmaker

from jobs.modelgen.generator import generate_model
from jobs.run.journal import read_journal
from orchestrator.core.db import normalize_url, upgrade_to_head
from orchestrator.core.models import Run, RunRequest
from tests.conftest import ENGINE_PYTHON, REPO, fresh_database, needs_engine
from tests.factories import make_experiment
from tests.ports import free_port as _free_port

pytestmark = [pytest.mark.engine, needs_engine]

ENGINE_ARGS = {"load_format": "dummy", "max_model_len": 2048, "enforce_eager": True}

SERVICE = """\
import sys, time
from orchestrator.cli.runtime import Runtime
from orchestrator.core.settings import Settings

rt = Runtime(Settings())
rt.start_database()
rt.start_orchestrator()
rt.start_api_thread("127.0.0.1", int(sys.argv[1]))
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def _engine_pids(run_id: str) -> list[int]:
    """Live pids whose environment marks them as an engine process of run ``run_id``."""
    marker = f"VLAB_RUN_ID={run_id}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker in env and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


class Service:
    """One ``vlab up``-like process, in its own process group (with the Ray it starts)."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.port = _free_port()
        self.api = f"http://127.0.0.1:{self.port}/api/v1"
        self.out = log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVICE, str(self.port)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self.out,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.strip() == b"ready", log.read_text()[-3000:]

    def kill(self) -> None:
        """SIGKILL the service process alone (its Ray and engines are left to themselves)."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self) -> None:
        """End whatever is left of its process group (its local Ray)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.out.close()


@pytest.fixture
def setup(server_url: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    with fresh_database(server_url) as url:
        upgrade_to_head(url)
        engine = create_engine(normalize_url(url))
        home = tmp_path / "home"
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "DATABASE_URL": url,
            "VLAB_HOME": str(home),
            "VLAB_ENGINE__PYTHON": str(ENGINE_PYTHON),
            "VLAB_ENGINE__RESOLVE_CONFIGS": "false",
            "VLAB_ORCHESTRATOR__POLL_INTERVAL_S": "0.5",
            "RAY_ADDRESS": "local",  # a Ray of its own, never another test's
        }
        try:
            yield {
                "factory": sessionmaker(bind=engine, expire_on_commit=False),
                "env": env,
                "home": home,
                "tmp": tmp_path,
            }
        finally:
            engine.dispose()


def test_sigkilled_service_leaves_no_engine_and_a_restart_keeps_what_was_measured(
    setup: dict[str, Any],
) -> None:
    factory: sessionmaker[Session] = setup["factory"]
    home: Path = setup["home"]
    model = generate_model(setup["tmp"] / "tiny", "tiny", seed=0)
    with factory() as s:
        exp = make_experiment(
            s,
            n_runs=1,
            model_path=str(model),
            engine_args=ENGINE_ARGS,
            explicit_engine_args=ENGINE_ARGS,
            workload={
                "num_requests": 3000,
                "concurrency": 2,
                "prefix_tokens": 64,
                "output_tokens": 16,
                "warmup_requests": 1,
            },
        )
        run_id = exp.runs[0].id
        s.commit()

    first = Service(setup["env"], setup["tmp"] / "service1.log")
    second: Service | None = None
    try:
        # the run measures, and its finished requests reach the database while it goes
        deadline = time.monotonic() + 600
        stored = 0
        while time.monotonic() < deadline:
            with factory() as s:
                stored = (
                    s.scalar(
                        select(func.count())
                        .select_from(RunRequest)
                        .where(RunRequest.run_id == run_id)
                    )
                    or 0
                )
                status = s.scalar(select(Run.status).where(Run.id == run_id))
            assert status in ("queued", "preparing", "running"), status
            if stored >= 40:
                break
            time.sleep(0.5)
        assert stored >= 40, "the run never measured 40 requests"
        pids = _engine_pids(run_id)
        assert len(pids) >= 3  # API server, engine core, worker (+ helpers)
        env = Path(f"/proc/{pids[0]}/environ").read_bytes().split(b"\0")
        assert f"VLAB_ENGINE_HOME={home.resolve()}".encode() in env  # the start-up sweep's

        first.kill()
        t0 = time.monotonic()
        while _engine_pids(run_id) and time.monotonic() - t0 < 30:
            time.sleep(0.1)
        orphans_gone_s = time.monotonic() - t0
        assert _engine_pids(run_id) == [], "engine processes outlived the service"
        assert orphans_gone_s < 10, orphans_gone_s
        with factory() as s:
            in_db = set(s.scalars(select(RunRequest.seq).where(RunRequest.run_id == run_id)))
            assert s.scalar(select(Run.status).where(Run.id == run_id)) == "running"
            log_path = (s.scalar(select(Run.engine_info).where(Run.id == run_id)) or {})["log_path"]

        t_restart = time.monotonic()
        second = Service(setup["env"], setup["tmp"] / "service2.log")
        ready_s = time.monotonic() - t_restart
        run = httpx.get(f"{second.api}/runs/{run_id}", timeout=30).json()
        assert run["status"] == "failed", run
        assert run["partial"] is True
        assert "died" in run["error"] and "are kept" in run["error"], run["error"]
        assert run["metrics"]["completed"] >= 30
        reqs = httpx.get(f"{second.api}/runs/{run_id}/requests?limit=1", timeout=30).json()
        # every record that reached durability is kept: the rows streamed before the kill,
        # and what the run's journal on disk holds (the supervisor's Ray worker outlives
        # the service by a second or two: read once the restart has ended it)
        journaled = set(read_journal(log_path).records.get(run_id, {}))
        kept_before = len(in_db | journaled)
        assert reqs["total"] == kept_before >= max(40, len(in_db))
        log = httpx.get(f"{second.api}/runs/{run_id}/log", timeout=30)
        assert log.status_code == 200 and "Application startup complete" in log.text
        assert _engine_pids(run_id) == []
        print(
            f"orphans gone {orphans_gone_s:.2f} s after SIGKILL; restart ready in "
            f"{ready_s:.1f} s; {kept_before} records kept"
        )
    finally:
        for service in (first, second):
            if service is not None:
                service.close()
        for pid in _engine_pids(run_id):
            os.kill(pid, signal.SIGKILL)
