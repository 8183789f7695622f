"""Is the engine hung? A vLLM server whose processes run but that does nothing.

:meth:`jobs.engine.server.EngineServer.death` sees an engine process go; a hung engine has
every process still there (SIGSTOP, a deadlock, a process stuck in the kernel) and
answers nothing. :class:`HangWatch` tells it from a slow but working engine by its
signs of life, any of:

- an answer (any status) to its own ``GET /health`` probe: one every
  :data:`PROBE_INTERVAL_S` s, each given :data:`PROBE_TIMEOUT_S` s (a third of the
  bound at most), the next one sent at once when one failed;
- a ``/metrics`` scrape that worked, or a request that finished (the caller says so:
  :meth:`HangWatch.life`);
- a byte from the server on any request stream of this process
  (:func:`jobs.load.sseclient.last_bytes_at`): an engine still streaming tokens is alive,
  however slowly its API server answers probes.

It is hung when no sign of life came for ``after_s`` seconds (:data:`HANG_AFTER_S`)
and at least :data:`MIN_FAILED_PROBES` probes sent since the last one failed; or when a
process of the engine (API server, engine core, a worker) has been in state ``T``
(stopped, e.g. SIGSTOP) for ``after_s`` seconds: a stopped engine core leaves the API
server answering ``/health`` while every stream stands still. The verdict comes
``after_s`` seconds (plus the caller's polling interval) after the last sign of life.

:func:`hang_error` words the run's error: what stayed silent and since when, each
process with its ``/proc`` state, and the warnings and errors the engine logged since it
became healthy (never its ``INFO`` lines, never an access line), or that there were none.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx

from jobs.engine.server import EngineError, EngineServer
from jobs.load import sseclient
from jobs.run.segment import Segment

#: Seconds without any sign of life after which a live engine is judged hung.
HANG_AFTER_S = 15.0
#: Seconds between two ``/health`` probes that were answered.
PROBE_INTERVAL_S = 1.0
#: Seconds one ``/health`` probe may take (at most a third of the bound).
PROBE_TIMEOUT_S = 5.0
#: Failed probes, sent after the last sign of life, a hang verdict needs.
MIN_FAILED_PROBES = 2
#: Seconds between two probes that failed at once (a refused connection).
_RETRY_S = 0.2

NO_WARNINGS = "the engine logged no warning or error since it became healthy"


class EngineUnresponsiveError(EngineError):
    """The engine's processes run but it stopped answering (see :class:`HangWatch`)."""


class HangWatch:
    """Signs of life of the server at ``base_url``; :meth:`verdict` says when it is hung.

    ``stopped``: returns the engine's processes in state ``T`` now (e.g.
    :meth:`jobs.engine.server.EngineServer.stopped_processes`), checked with every probe.
    Run :meth:`probe` as a task of the event loop that drives the load.
    """

    def __init__(
        self,
        base_url: str,
        after_s: float | None = None,
        stopped: Callable[[], list[str]] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.after_s = HANG_AFTER_S if after_s is None else after_s
        self.probe_timeout_s = min(PROBE_TIMEOUT_S, self.after_s / 3)
        self.stopped = stopped
        self._life = time.perf_counter()
        self._failed: list[float] = []  # when each failed probe was sent
        self._stopped_since: float | None = None
        self._stopped_now: list[str] = []

    def life(self) -> None:
        """A sign of life seen now (a scrape that worked, a request that finished)."""
        self._life = time.perf_counter()

    def last_life(self) -> float:
        """``time.perf_counter()`` of the last sign of life (a byte on a stream included)."""
        streamed = sseclient.last_bytes_at(self.base_url)
        return self._life if streamed is None else max(self._life, streamed)

    def silent_s(self) -> float:
        """Seconds since the last sign of life."""
        return time.perf_counter() - self.last_life()

    def verdict(self) -> str | None:
        """Why the engine is hung, or None while it may be alive. Cheap: poll it."""
        now = time.perf_counter()
        if self._stopped_since is not None and now - self._stopped_since >= self.after_s:
            return (
                f"{', '.join(self._stopped_now)} of the vLLM engine has been stopped "
                f"(state T: SIGSTOP or a debugger) for {now - self._stopped_since:.1f} s; "
                "a stopped process does nothing until continued"
            )
        last = self.last_life()
        if now - last < self.after_s:
            return None
        failed = sum(1 for sent in self._failed if sent >= last)
        if failed < MIN_FAILED_PROBES:
            return None
        return (
            f"the vLLM server stopped answering: no answer to /health ({failed} probes of "
            f"{self.probe_timeout_s:g} s failed) or /metrics and no byte on any request "
            f"stream for {now - last:.1f} s"
        )

    async def probe(self) -> None:
        """``GET /health`` until cancelled (see the module docstring); never raises."""
        timeout = httpx.Timeout(self.probe_timeout_s)
        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
            while True:
                self._check_stopped()
                sent = time.perf_counter()
                try:
                    await client.get(self.base_url + "/health")
                except httpx.HTTPError:
                    self._failed = [t for t in self._failed if t >= self._life] + [sent]
                    await asyncio.sleep(max(0.0, sent + _RETRY_S - time.perf_counter()))
                    continue
                self._life = max(self._life, sent)  # it answered after ``sent``
                await asyncio.sleep(PROBE_INTERVAL_S)

    def _check_stopped(self) -> None:
        if self.stopped is None:
            return
        self._stopped_now = self.stopped()
        if not self._stopped_now:
            self._stopped_since = None
        elif self._stopped_since is None:
            self._stopped_since = time.perf_counter()


def hang_error(server: EngineServer, seg: Segment) -> EngineUnresponsiveError:
    """The error of run ``seg``, whose engine was judged hung (``seg.unresponsive``: why,
    ``seg.dead_at``: when, seconds into the run).

    The message says what had been measured and names each process of the engine with
    its ``/proc`` state; the log lines are the warnings and errors logged since the
    server became healthy, or the message says there were none (:data:`NO_WARNINGS`).
    """
    done = [r for r in seg.records if not r.warmup]
    ok = sum(1 for r in done if r.success)
    at = seg.dead_at if seg.dead_at is not None else seg.now()
    states = "; ".join(server.process_states()) or "unknown"
    lines = server.run_warning_lines()
    message = (
        f"the vLLM engine hung during run {seg.run_id}: {seg.unresponsive}; seen {at:.1f} s "
        f"into the run, when the load was stopped ({ok} measured requests had succeeded, "
        f"{len(done) - ok} failed, of {seg.measured_total} planned); its processes: {states}"
    )
    if not lines:
        message += f"; {NO_WARNINGS}"
    return EngineUnresponsiveError(message, lines)
