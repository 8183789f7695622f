"""The suite's CPU log (tests/cpu_log.py): one line per test with its wall and CPU figures."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import REPO


def test_each_test_gets_its_wall_and_the_cpu_of_the_processes_it_started(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.cpu_log"]\n')
    (tmp_path / "test_inner.py").write_text(
        textwrap.dedent(
            """
            import subprocess, sys

            def test_busy_child():  # about 1 s of CPU in a process of its own
                subprocess.run([sys.executable, "-c",
                    "import time\\nt = time.process_time()\\n"
                    "while time.process_time() - t < 1.0: pass"], check=True)

            def test_idle():
                pass
            """
        )
    )
    log = tmp_path / "cpu.tsv"
    env = {**os.environ, "VLAB_TEST_CPU_LOG": str(log), "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         str(tmp_path)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {
        line.split("\t")[0].split("::")[-1]: line.split("\t")[1:]
        for line in log.read_text().splitlines()
    }
    assert set(rows) == {"test_busy_child", "test_idle"}
    wall, cpu, own, kids = (float(v) for v in rows["test_busy_child"])
    assert cpu >= 0.9 and wall >= 0.9  # the child's CPU, which pytest's own CPU misses
    assert own < 0.9 and kids >= 0.9  # ... and which the waited-for children's figure has
    assert float(rows["test_idle"][1]) < 0.9 and float(rows["test_idle"][3]) < 0.9


def test_no_log_without_the_setting(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "VLAB_TEST_CPU_LOG"}
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.cpu_log"]\n')
    (tmp_path / "test_inner.py").write_text("def test_ok():\n    pass\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        env={**env, "PYTHONPATH": str(REPO)}, cwd=tmp_path, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert list(tmp_path.glob("*.tsv")) == []
