"""Quiet by default (issue 26): vlab's own lines on the terminal, third-party output
(Ray, Postgres, alembic, Python warnings, C-level writes to fd 2) in
``<home>/logs/vlab.log``; a refusal is the only line on stderr; a local Ray keeps its
session under ``VLAB_HOME``."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.cli import logsetup
from orchestrator.cli.runtime import RAY_SOCKET_ROOM, UNIX_SOCKET_MAX, local_ray_temp_dir
from tests.conftest import REPO, fresh_database
from tests.faults.harness import VLAB, ServiceProcess, free_port

LOG = Path("logs") / "vlab.log"


def _env(home: Path, url: str, **extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "DATABASE_URL": url, "VLAB_HOME": str(home)}
    for var in ("VLAB_TOKEN", "VLAB_API__AUTH", "VIRTUAL_ENV", "RAY_TMPDIR", logsetup.CONSOLE_ENV):
        env.pop(var, None)
    return {**env, **extra}


@pytest.fixture
def short_home() -> Iterator[Path]:
    """A home whose path is short enough for Ray's sockets under it."""
    home = Path(tempfile.mkdtemp(prefix="vq-", dir="/tmp"))
    try:
        yield home
    finally:
        subprocess.run(["rm", "-rf", str(home)], check=False)


def test_configure_sends_library_output_to_the_log_and_keeps_ours_on_the_terminal(
    tmp_path: Path,
) -> None:
    """Everything a library may write (its logger, a Python warning, a C-level write to
    fd 2, a child process's stderr) lands in the log file; vlab's lines and its error
    line stay on the terminal."""
    code = (
        "import logging, os, subprocess, sys, warnings\n"
        "from pathlib import Path\n"
        "from orchestrator.cli import logsetup\n"
        "path = logsetup.configure(Path(sys.argv[1]))\n"
        "logging.getLogger('ray').warning('ray-noise')\n"
        "logging.getLogger('urllib3.connectionpool').warning('urllib3-noise')\n"
        "warnings.warn('library-warning')\n"
        "os.write(2, b'c-level-noise\\n')\n"
        "subprocess.run(['sh', '-c', 'echo child-noise >&2'], check=True)\n"
        "logging.getLogger('orchestrator.x').info('our-line')\n"
        "logging.getLogger('orchestrator.x').debug('our-debug')\n"
        "print('error: our-refusal', file=sys.stderr)\n"
    )
    home = tmp_path / "home"
    done = _python(code, home)
    assert done.returncode == 0, done.stderr
    terminal = done.stderr.splitlines()
    assert len(terminal) == 2, done.stderr
    assert terminal[0].endswith("orchestrator.x: our-line"), done.stderr
    assert terminal[1] == "error: our-refusal", done.stderr
    log = (home / LOG).read_text()
    for noise in ("ray-noise", "urllib3-noise", "library-warning", "c-level-noise", "child-noise"):
        assert noise in log, (noise, log)
    assert "our-line" in log and "our-debug" not in log


def test_the_api_servers_and_mlflows_info_lines_go_to_the_log_and_their_errors_show(
    tmp_path: Path,
) -> None:
    """uvicorn's start-up and access lines (INFO) and MLflow's (which installs a stderr
    handler of its own on import unless told not to) are in the log file only; uvicorn's
    errors (a failed start, an exception in a request) still reach the terminal."""
    code = (
        "import logging, sys\n"
        "from pathlib import Path\n"
        "from orchestrator.cli import logsetup\n"
        "logsetup.configure(Path(sys.argv[1]))\n"
        "import mlflow\n"
        "logging.getLogger('mlflow.store.db.utils').info('mlflow-noise')\n"
        "logging.getLogger('uvicorn.error').info('Started server process [1]')\n"
        "logging.getLogger('uvicorn.access').info('GET /healthz 200')\n"
        "logging.getLogger('uvicorn.error').error('uvicorn-error')\n"
    )
    home = tmp_path / "home"
    done = _python(code, home)
    assert done.returncode == 0, done.stderr
    assert [ln.split(": ", 1)[-1] for ln in done.stderr.splitlines()] == ["uvicorn-error"]
    log = (home / LOG).read_text()
    for line in ("mlflow-noise", "Started server process", "GET /healthz 200", "uvicorn-error"):
        assert line in log, (line, log)


def _python(code: str, home: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter of this project, ``home`` its first argument,
    ``extra`` added to its environment (:data:`logsetup.CONSOLE_ENV` only from there)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(logsetup.CONSOLE_ENV, None)
    return subprocess.run(
        [sys.executable, "-c", code, str(home)],
        cwd=REPO,
        env={**env, **extra},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_verbose_shows_library_output_on_the_terminal(tmp_path: Path) -> None:
    code = (
        "import logging, os, sys, warnings\n"
        "from pathlib import Path\n"
        "from orchestrator.cli import logsetup\n"
        "logsetup.configure(Path(sys.argv[1]), verbose=True)\n"
        "logging.getLogger('ray').warning('ray-noise')\n"
        "warnings.warn('library-warning')\n"
        "os.write(2, b'c-level-noise\\n')\n"
        "logging.getLogger('orchestrator.x').debug('our-debug')\n"
    )
    home = tmp_path / "home"
    done = _python(code, home)
    assert done.returncode == 0, done.stderr
    for line in ("ray-noise", "library-warning", "c-level-noise", "our-debug"):
        assert line in done.stderr, done.stderr
    assert "ray-noise" in (home / LOG).read_text()


#: A library's logger, a Python warning, a C-level write to fd 2 and a child's stderr,
#: then vlab's own lines (INFO and DEBUG), after ``logsetup.configure(home)``.
NOISY = (
    "import logging, os, subprocess, sys, warnings\n"
    "from pathlib import Path\n"
    "from orchestrator.cli import logsetup\n"
    "logsetup.configure(Path(sys.argv[1]))\n"
    "logging.getLogger('ray').warning('ray-noise')\n"
    "warnings.warn('library-warning')\n"
    "os.write(2, b'c-level-noise\\n')\n"
    "subprocess.run(['sh', '-c', 'echo child-noise >&2'], check=True)\n"
    "logging.getLogger('orchestrator.x').info('our-line')\n"
    "logging.getLogger('orchestrator.x').debug('our-debug')\n"
    "print('verbose' if logsetup.is_verbose() else 'quiet')\n"
)


@pytest.mark.parametrize("value", ["true", "1", "Yes", "ON"])
def test_log_to_console_shows_library_output_on_the_terminal(tmp_path: Path, value: str) -> None:
    """``VLAB_LOG_TO_CONSOLE`` (what the container image sets: a container's log is its
    stdout/stderr): everything on stderr, fd 2 left alone; vlab's lines at INFO (no
    DEBUG); the log file still written; no line sends the user to the file."""
    home = tmp_path / "home"
    done = _python(NOISY, home, VLAB_LOG_TO_CONSOLE=value)
    assert done.returncode == 0, done.stderr
    for line in ("ray-noise", "library-warning", "c-level-noise", "child-noise", "our-line"):
        assert line in done.stderr, done.stderr
    assert "our-debug" not in done.stderr
    assert done.stdout == "verbose\n"
    log = (home / LOG).read_text()
    assert "ray-noise" in log and "our-line" in log


@pytest.mark.parametrize("value", ["false", "0", "no", ""])
def test_log_to_console_off_is_the_quiet_default(tmp_path: Path, value: str) -> None:
    home = tmp_path / "home"
    done = _python(NOISY, home, VLAB_LOG_TO_CONSOLE=value)
    assert done.returncode == 0, done.stderr
    assert [ln.split(": ", 1)[-1] for ln in done.stderr.splitlines()] == ["our-line"]
    assert done.stdout == "quiet\n"
    assert "child-noise" in (home / LOG).read_text()


def test_a_log_to_console_typo_is_refused(tmp_path: Path) -> None:
    done = _python(NOISY, tmp_path / "home", VLAB_LOG_TO_CONSOLE="ture")
    assert done.returncode == 1
    assert "invalid setting VLAB_LOG_TO_CONSOLE: 'ture' is neither true nor false" in (done.stderr)
    assert not (tmp_path / "home").exists()


def test_a_refusal_is_the_only_line_on_stderr_and_the_rest_is_in_the_log(
    server_url: str, tmp_path: Path
) -> None:
    """``vlab up`` with ``RAY_ADDRESS`` where no cluster is: its refusal is the one line
    it prints; alembic's and pgserver's lines went to the log file."""
    home = tmp_path / "home"
    with fresh_database(server_url) as url:
        nobody = free_port()
        done = subprocess.run(
            [str(VLAB), "up", "--port", str(free_port())],
            cwd=tmp_path,
            env=_env(home, url, RAY_ADDRESS=f"127.0.0.1:{nobody}"),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert done.returncode == 2, done.stdout + done.stderr
    errors = done.stderr.splitlines()
    assert errors == [
        f"error: cannot join the Ray cluster at 127.0.0.1:{nobody} (RAY_ADDRESS): "
        "connection refused"
    ], done.stderr
    assert done.stdout == "", done.stdout  # the refusal is the first and only line
    assert "alembic.runtime.migration" in (home / LOG).read_text()


def test_in_a_container_vlab_up_writes_the_libraries_output_to_stderr(
    server_url: str, tmp_path: Path
) -> None:
    """``vlab up`` with ``VLAB_LOG_TO_CONSOLE=true`` (as in the image): alembic's and
    pgserver's lines reach stderr, what ``docker logs`` / ``kubectl logs`` read; the
    refusal is still the last line. A typo in the value is refused in one line."""
    home = tmp_path / "home"
    nobody = free_port()
    with fresh_database(server_url) as url:
        env = _env(home, url, RAY_ADDRESS=f"127.0.0.1:{nobody}", VLAB_LOG_TO_CONSOLE="true")
        done = subprocess.run(
            [str(VLAB), "up", "--port", str(free_port())],
            cwd=tmp_path,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=300,
        )
        typo = subprocess.run(
            [str(VLAB), "up", "--port", str(free_port())],
            cwd=tmp_path,
            env={**env, "VLAB_LOG_TO_CONSOLE": "maybe"},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert done.returncode == 2, done.stdout + done.stderr
    errors = done.stderr.splitlines()
    assert errors[-1] == (
        f"error: cannot join the Ray cluster at 127.0.0.1:{nobody} (RAY_ADDRESS): "
        "connection refused"
    ), done.stderr
    assert "alembic.runtime.migration" in done.stderr, done.stderr
    assert "--verbose shows them here" not in done.stdout + done.stderr
    assert typo.returncode == 2, typo.stdout + typo.stderr
    assert typo.stderr.splitlines() == [
        "error: invalid setting VLAB_LOG_TO_CONSOLE: 'maybe' is neither true nor false "
        "(1, true, yes, on / 0, false, no, off)"
    ], typo.stderr


def test_local_ray_keeps_its_session_under_the_home_and_its_output_in_the_log(
    server_url: str, short_home: Path, tmp_path: Path
) -> None:
    """``vlab orchestrate`` on a local Ray: the session folder (the record the service
    keeps) is ``<home>/ray/session_*``; Ray's start-up lines are in the log, which the
    terminal names, not on the terminal; SIGTERM stops it cleanly."""
    with fresh_database(server_url) as url:
        env = _env(short_home, url, RAY_ADDRESS="local")
        service = ServiceProcess(
            [str(VLAB), "orchestrate"], env, tmp_path / "terminal.log", tmp_path
        )
        try:
            # printed once its SIGTERM handler is in place
            up = "a device is one of the cluster's"
            service.start(lambda: up in service.log_text(), timeout_s=240)
            record = json.loads((short_home / "local-ray" / f"{service.pid}.json").read_text())
            session = Path(record["session_dir"])
            assert session.parent == short_home.resolve() / "ray", record
            assert session.name.startswith("session_") and session.is_dir()
            assert (session / "sockets").is_dir()
            service.kill(signal.SIGTERM)
            assert service.proc is not None
            code = service.proc.wait(timeout=120)
            assert code == 0, service.log_text()[-2000:] + (short_home / LOG).read_text()[-4000:]
        finally:
            service.close()
    terminal = service.log_text()
    log = (short_home / LOG).read_text()
    assert "Started a local Ray instance" in log, log[-3000:]
    assert "Started a local Ray instance" not in terminal, terminal
    said = f"log: {(short_home / LOG).resolve()} (Ray, Postgres and libraries; --verbose"
    assert said in terminal, terminal
    assert "pixeltable" not in terminal and "alembic" not in terminal, terminal


def test_a_home_too_long_for_rays_sockets_links_to_a_short_folder(tmp_path: Path) -> None:
    home = tmp_path / ("h" * 60)
    home.mkdir()
    folder, note = local_ray_temp_dir(home)
    try:
        ray_temp = folder / "ray"
        assert len(str(ray_temp).encode()) + RAY_SOCKET_ROOM <= UNIX_SOCKET_MAX
        assert (home / "ray").is_symlink() and (home / "ray").resolve() == ray_temp.resolve()
        assert str(ray_temp) in note and "too long" in note
        # the same home gets the same folder again
        assert local_ray_temp_dir(home)[0] == folder
    finally:
        subprocess.run(["rm", "-rf", str(folder)], check=False)


def test_a_short_home_keeps_rays_folder_inside(short_home: Path) -> None:
    folder, note = local_ray_temp_dir(short_home)
    assert folder == short_home.resolve()
    assert note == f"Ray's session folder: {short_home.resolve() / 'ray'}"


def test_configure_leaves_a_host_programs_logging_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run inside another program that captures stderr (a test runner's CliRunner), a
    service command changes neither the logging nor the file descriptors of it."""
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    handlers = list(logging.getLogger().handlers)
    assert logsetup.configure(tmp_path / "home") is None
    assert logging.getLogger().handlers == handlers
    assert not (tmp_path / "home").exists()
