"""Back-pressure on submissions, and vLLM's configuration check kept warm.

A submission's expensive part is asking vLLM how it would resolve each engine
configuration (:func:`jobs.engine.queries.resolve_engine_configs`: a process of the engine
environment, ~400-600 MB, 6-80 s, nearly all of it vLLM's import). Two things keep
a burst of submissions from taking the service down:

- :class:`CheckGate`: at most ``max_concurrent_checks`` submissions (and configuration
  checks or model look-ups from elsewhere, e.g. scheduled sweeps) are processed at
  once in this process; up to ``max_waiting`` more wait, at most ``wait_timeout_s``;
  beyond that :class:`SubmissionsBusyError` (503 ``submissions_busy`` with
  ``Retry-After``). Re-entrant per thread, so a submission that holds a slot may call
  the resolver (which takes one too) without deadlocking.
- :class:`WarmResolver`: one engine-environment process (the launcher's ``resolve-server``,
  :mod:`jobs.launcher.resolve_server`) that imported vLLM once and answers each check in
  well under a second; it exits after ``warm_idle_s`` without work (and when this
  process ends). Any failure of the warm process falls back to the one-shot subprocess.

Settings: ``settings.submissions`` (:class:`orchestrator.core.settings.SubmissionSettings`).

:func:`engine_resolver` is the planner's :data:`orchestrator.experiments.planner.Resolver`
built on these; within :func:`remembered_checks` vLLM's answers (and the models
:func:`orchestrator.experiments.model_resolution.resolve_model` found) are remembered, so a check
done outside a transaction is not redone inside one.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import json
import logging
import os
import select
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import jobs.engine.queries
from jobs.engine.server import LAUNCHER_PATH, EngineError, engine_env
from jobs.schemas import EngineLaunch
from orchestrator.core.errors import EngineUnavailableError, SubmissionsBusyError
from orchestrator.core.settings import Settings
from orchestrator.core.telemetry import (
    CONFIG_CHECK,
    CONFIG_CHECKS_IN_FLIGHT,
    SUBMISSION_CHECKS_RUNNING,
    SUBMISSION_CHECKS_WAITING,
)
from orchestrator.experiments.planner import Resolver

if TYPE_CHECKING:  # models imports this module (for the gate and the memo)
    from orchestrator.experiments.model_resolution import ResolvedModel

log = logging.getLogger(__name__)

#: Seconds a configuration check may take (as :func:`jobs.engine.queries.resolve_engine_configs`).
RESOLVE_TIMEOUT_S = 300.0


class CheckGate:
    """At most ``slots`` holders at once, ``max_waiting`` waiting, ``wait_timeout_s`` each.

    :meth:`slot` is a context manager; it raises :class:`SubmissionsBusyError` at once
    when the waiting room is full (unless ``patient``: background work such as a
    scheduled sweep waits even then), or after ``wait_timeout_s`` without a free slot.
    A thread that already holds a slot enters again without waiting. The slots held and
    the waiting count are ``vlab_submission_checks_running`` / ``_waiting`` (summed over
    the process's gates).
    """

    def __init__(
        self, slots: int, max_waiting: int, wait_timeout_s: float, retry_after_s: int
    ) -> None:
        self.slots = slots
        self.max_waiting = max_waiting
        self.wait_timeout_s = wait_timeout_s
        self.retry_after_s = retry_after_s
        self._cond = threading.Condition()
        self._running = 0
        self._waiting = 0
        self._held = threading.local()

    def stats(self) -> dict[str, int]:
        """``{"running", "waiting", "slots", "max_waiting"}`` now."""
        with self._cond:
            return {
                "running": self._running,
                "waiting": self._waiting,
                "slots": self.slots,
                "max_waiting": self.max_waiting,
            }

    def _busy(self, why: str) -> SubmissionsBusyError:
        return SubmissionsBusyError(
            f"{why}; retry in {self.retry_after_s} s",
            retry_after_s=self.retry_after_s,
        )

    @contextlib.contextmanager
    def slot(self, *, patient: bool = False) -> Iterator[None]:
        depth = getattr(self._held, "depth", 0)
        if depth:
            self._held.depth = depth + 1
            try:
                yield
            finally:
                self._held.depth -= 1
            return
        with self._cond:
            if self._running >= self.slots:
                if self._waiting >= self.max_waiting and not patient:
                    raise self._busy(
                        f"{self._running} submissions are being checked and "
                        f"{self._waiting} are waiting (the most this service queues)"
                    )
                self._waiting += 1
                SUBMISSION_CHECKS_WAITING.inc()
                deadline = time.monotonic() + self.wait_timeout_s
                try:
                    while self._running >= self.slots:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise self._busy(
                                f"no check slot became free within {self.wait_timeout_s:g} s"
                            )
                        self._cond.wait(left)
                finally:
                    self._waiting -= 1
                    SUBMISSION_CHECKS_WAITING.dec()
            self._running += 1
            SUBMISSION_CHECKS_RUNNING.inc()
        self._held.depth = 1
        try:
            yield
        finally:
            self._held.depth = 0
            with self._cond:
                self._running -= 1
                SUBMISSION_CHECKS_RUNNING.dec()
                self._cond.notify()


_gates: dict[tuple[int, int, float, int], CheckGate] = {}
_gates_lock = threading.Lock()


def gate_for(settings: Settings) -> CheckGate:
    """The process-wide gate for ``settings.submissions`` (one per distinct setting)."""
    s = settings.submissions
    key = (s.max_concurrent_checks, s.max_waiting, s.wait_timeout_s, s.retry_after_s)
    with _gates_lock:
        gate = _gates.get(key)
        if gate is None:
            gate = _gates[key] = CheckGate(*key)
        return gate


class WarmResolverError(Exception):
    """The warm process failed (start, crash, timeout or a bad answer)."""


class WarmResolver:
    """One engine-environment process answering configuration checks, one at a time."""

    def __init__(self, engine_python: str, idle_s: float) -> None:
        self.engine_python = engine_python
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None
        self._buf = b""
        self._last_used = 0.0
        self._reaper: threading.Thread | None = None
        #: what this process answered so far (for tests and logs)
        self.started = 0
        self.answered = 0

    # -- process
    def _start(self, timeout_s: float) -> None:
        env = engine_env(
            EngineLaunch(
                engine_python=self.engine_python, model_dir="", served_model_name="", log_path=""
            )
        )
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the process
        self._buf = b""
        t0 = time.monotonic()
        self._proc = subprocess.Popen(
            [self.engine_python, str(LAUNCHER_PATH), "resolve-server"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
            start_new_session=True,
        )
        self.started += 1
        ready = self._read_doc(timeout_s)
        if not ready.get("ready"):
            raise WarmResolverError(f"warm resolver did not start: {ready.get('error')}")
        log.info(
            "warm vLLM resolver started (pid %s, vLLM %s) in %.1f s",
            self._proc.pid,
            ready.get("vllm_version"),
            time.monotonic() - t0,
        )
        if self._reaper is None or not self._reaper.is_alive():
            self._reaper = threading.Thread(target=self._reap, name="warm-resolver", daemon=True)
            self._reaper.start()

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        if proc is not None:
            for pipe in (proc.stdin, proc.stdout):
                with contextlib.suppress(OSError):
                    if pipe is not None:
                        pipe.close()
        if self._stderr is not None:
            with contextlib.suppress(OSError):
                self._stderr.close()
            self._stderr = None

    def close(self) -> None:
        """Stop the warm process now (a later check starts a new one)."""
        with self._lock:
            self._stop()

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def _reap(self) -> None:
        """Stop the process once it has been idle ``idle_s`` seconds."""
        while True:
            time.sleep(max(0.05, min(self.idle_s / 4, 30.0)))
            with self._lock:
                if self._proc is None:
                    return
                if time.monotonic() - self._last_used >= self.idle_s:
                    log.info("warm vLLM resolver idle for %.0f s: stopped", self.idle_s)
                    self._stop()
                    return

    def _stderr_tail(self) -> str:
        if self._stderr is None:
            return ""
        try:
            self._stderr.seek(0, os.SEEK_END)
            size = self._stderr.tell()
            self._stderr.seek(max(0, size - 2000))
            lines = self._stderr.read().decode("utf-8", "replace").strip().splitlines()
            return " | ".join(lines[-3:])
        except OSError:
            return ""

    def _read_doc(self, timeout_s: float) -> dict[str, Any]:
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WarmResolverError(f"warm resolver gave no answer within {timeout_s:.0f} s")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise WarmResolverError(
                    f"warm resolver exited (code {proc.poll()}): {self._stderr_tail()}"
                )
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            doc = json.loads(line)
        except ValueError as exc:
            raise WarmResolverError("warm resolver printed something that is not JSON") from exc
        if not isinstance(doc, dict):
            raise WarmResolverError("warm resolver printed something that is not an object")
        return doc

    # -- use
    def resolve(
        self, model_dir: str, configs: list[dict[str, Any]], timeout_s: float = RESOLVE_TIMEOUT_S
    ) -> dict[str, Any]:
        """``{"vllm_version", "results"}`` as :func:`jobs.engine.queries.resolve_engine_configs`.

        Raises :class:`WarmResolverError` (the process is stopped then) when the
        process cannot start, dies, or takes longer than ``timeout_s``.
        """
        with self._lock:
            try:
                if self._proc is None or self._proc.poll() is not None:
                    self._stop()
                    self._start(timeout_s)
                proc = self._proc
                assert proc is not None and proc.stdin is not None
                request = json.dumps({"model": model_dir, "configs": configs}) + "\n"
                try:
                    proc.stdin.write(request.encode())
                    proc.stdin.flush()
                except OSError as exc:
                    raise WarmResolverError(f"warm resolver is gone: {exc}") from exc
                doc = self._read_doc(timeout_s)
            except BaseException:
                self._stop()
                raise
            finally:
                self._last_used = time.monotonic()
            if "error" in doc:
                raise WarmResolverError(f"warm resolver refused the request: {doc['error']}")
            results = doc.get("results")
            if not isinstance(results, list) or len(results) != len(configs):
                self._stop()
                raise WarmResolverError("warm resolver answered with the wrong number of results")
            self.answered += 1
            return doc


_warm: dict[str, WarmResolver] = {}
_warm_lock = threading.Lock()


def warm_resolver(settings: Settings) -> WarmResolver:
    """The process-wide warm resolver of ``settings.engine.python``."""
    python = str(settings.engine.python)
    with _warm_lock:
        res = _warm.get(python)
        if res is None:
            res = _warm[python] = WarmResolver(python, settings.submissions.warm_idle_s)
        return res


@atexit.register
def close_warm_resolvers() -> None:
    """Stop every warm process (also called at exit)."""
    with _warm_lock:
        resolvers = list(_warm.values())
    for res in resolvers:
        res.close()


def resolve_configs(
    settings: Settings, model_dir: str, configs: list[dict[str, Any]]
) -> dict[str, Any]:
    """vLLM's resolved configuration of each of ``configs`` (shape of
    :func:`jobs.engine.queries.resolve_engine_configs`): through the warm process when
    ``settings.submissions.warm_resolver``, else (or when the warm process fails) a
    one-shot subprocess. Raises :class:`jobs.engine.server.EngineError` as the latter.

    Metrics: ``vlab_config_checks_in_flight`` while it runs, and its duration in
    ``vlab_config_check_duration_seconds`` (``resolver`` = the one that answered or
    failed last; a fallback's time includes the failed warm attempt)."""
    python = str(settings.engine.python)
    start = time.monotonic()
    with CONFIG_CHECKS_IN_FLIGHT.track_inprogress():
        if settings.submissions.warm_resolver and Path(python).exists():
            try:
                doc = warm_resolver(settings).resolve(model_dir, configs)
                CONFIG_CHECK.labels(resolver="warm").observe(time.monotonic() - start)
                return doc
            except WarmResolverError as exc:
                log.warning("warm vLLM resolver failed (%s); checking with a one-shot process", exc)
        try:
            # looked up on the module at call time (tests replace it)
            return jobs.engine.queries.resolve_engine_configs(python, model_dir, configs)
        finally:  # a failed check took its time too
            CONFIG_CHECK.labels(resolver="one_shot").observe(time.monotonic() - start)


@dataclass
class Remembered:
    """What one submission's checks found: vLLM's answers and the resolved models."""

    answers: dict[str, dict[str, Any]] = field(default_factory=dict)
    models: dict[tuple[str, str | None], ResolvedModel] = field(default_factory=dict)


_remembered: contextvars.ContextVar[Remembered | None] = contextvars.ContextVar(
    "vlab_remembered_checks", default=None
)


@contextlib.contextmanager
def remembered_checks() -> Iterator[None]:
    """Within the block, vLLM's answers (per model directory and configuration) and
    resolved models are remembered and reused: a check done outside a transaction is
    not redone (holding a database connection) when the same spec is checked again
    inside one."""
    token = _remembered.set(Remembered())
    try:
        yield
    finally:
        _remembered.reset(token)


def remembered() -> Remembered | None:
    """The memo of the enclosing :func:`remembered_checks` block, or None outside one."""
    return _remembered.get()


def engine_resolver(settings: Settings) -> Resolver | None:
    """vLLM's own configuration resolution, when enabled (``VLAB_ENGINE__RESOLVE_CONFIGS``).

    Each call takes a slot of the process-wide :func:`gate_for` (the API's submissions
    hold one already; other callers wait for one, 503 ``submissions_busy`` when none
    frees up in time) and asks the warm vLLM process (:func:`resolve_configs`). Within
    :func:`remembered_checks`, configurations already answered are not asked again.
    """
    if not settings.engine.resolve_configs:
        return None

    def resolve(model_dir: str, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        memo = _remembered.get()
        keys = [json.dumps([model_dir, c], sort_keys=True, default=str) for c in configs]
        if memo is not None and all(k in memo.answers for k in keys):
            return [memo.answers[k] for k in keys]
        with gate_for(settings).slot(patient=True):  # re-entered by API submissions
            try:
                doc = resolve_configs(settings, model_dir, configs)
            except EngineError as exc:
                raise EngineUnavailableError(
                    f"vLLM could not resolve the configurations: {exc}"
                ) from exc
        results: list[dict[str, Any]] = doc["results"]
        if memo is not None:
            memo.answers.update(zip(keys, results, strict=True))
        return results

    return resolve
