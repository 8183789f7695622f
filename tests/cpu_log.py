"""Where the suite's CPU goes: with ``VLAB_TEST_CPU_LOG=<file>`` each test (its setup, call
and teardown) appends ``nodeid<TAB>wall s<TAB>machine CPU s<TAB>own CPU s<TAB>children CPU s``
to the file.

The CPU seconds are the whole machine's (``/proc/stat``: user, nice, system, irq, softirq),
because the processes a test starts (Ray's, vLLM's, the service's) leave pytest's process
tree and ``time`` or ``resource.getrusage`` miss them. So the figures mean something only in
a serial run (``-p no:xdist``) on an otherwise quiet machine; a module-scoped fixture's
start is counted in its module's first test. The last two columns hold in a parallel run
too: the pytest process's own CPU (the test's code and the threads it runs in-process: an
API, an orchestrator, a Ray driver) and that of the child processes it waited for
(``RUSAGE_CHILDREN``). docs/BENCHMARKS.md ("Where the suite's CPU
goes") has the command and a run's figures.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterator
from typing import IO

import pytest

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_log: IO[str] | None = None


def machine_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (``/proc/stat``)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:8]]
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / _TICKS_PER_S


def pytest_configure(config: pytest.Config) -> None:
    global _log
    path = os.environ.get("VLAB_TEST_CPU_LOG")
    if path:
        _log = open(path, "a", buffering=1)  # noqa: SIM115 (open for the whole session)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _log is not None:
        _log.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if _log is None:
        yield
        return
    wall0, cpu0, own0, kids0 = time.monotonic(), machine_cpu_s(), time.process_time(), _children()
    yield
    wall, cpu = time.monotonic() - wall0, machine_cpu_s() - cpu0
    own, kids = time.process_time() - own0, _children() - kids0
    _log.write(f"{item.nodeid}\t{wall:.2f}\t{cpu:.2f}\t{own:.2f}\t{kids:.2f}\n")


def _children() -> float:
    """CPU seconds of this process's children that have been waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
