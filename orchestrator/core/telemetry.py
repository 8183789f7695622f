"""The service's own metrics (Prometheus): every metric object, and what one scrape reads.

Two kinds of series, all named ``vlab_*`` (the table with every series is in
docs/OPERATIONS.md, "The service's own metrics"):

- **Read from the database at scrape time** (:class:`DatabaseCollector`): runs by
  status, the age of the oldest queued run, and ``vlab_database_up``. They are the
  same whichever process serves them (``vlab up``, ``vlab serve``, ``vlab orchestrate
  --metrics-port``), since every process reads the one database. When the database
  does not answer, ``vlab_database_up`` is 0 and these series are absent (unknown,
  never a stale or made-up count); the scrape itself still answers.
- **Counted in this process** (the module-level objects below, in
  :data:`PROCESS_REGISTRY`): the dispatcher's tick duration and its loops' turns,
  failures, durations and last successes, vLLM configuration checks
  (duration, in flight), the submission gate and the API's 503 refusals, engine
  start-up seconds and failed starts, schedule fires and misses, and the database
  pool (:func:`orchestrator.core.db.pool_status`).
  Prometheus-style, each process counts what it did. ``vlab up`` runs the API and the
  dispatcher in one process, so its ``/metrics`` has everything. With ``vlab serve``
  and ``vlab orchestrate`` apart, the dispatcher's series live in the orchestrator
  process (``vlab orchestrate --metrics-port``): a process that runs no dispatcher
  leaves those series out (:func:`mark_dispatcher_running`;
  ``vlab_dispatcher_in_process`` says which), instead of exporting a zero that looks
  like "no ticks, no fires" while another process does them.

No multiprocess mode: the API is one uvicorn process (no forked workers), so one
in-memory registry per process is exact.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import ProcessCollector as StandardProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

from orchestrator.core.db import database_health, is_unavailable, pool_status
from orchestrator.core.repositories import RunRepository
from orchestrator.core.states import RunStatus

log = logging.getLogger(__name__)

#: Every metric this process counts itself (not the per-scrape database series).
PROCESS_REGISTRY = CollectorRegistry(auto_describe=True)

DISPATCHER_TICK = Histogram(
    "vlab_dispatcher_tick_duration_seconds",
    "Duration of one dispatcher tick (poll active runs, fire due schedules, answer a "
    "parity check, claim at most one queued run), failed ticks included.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
    registry=PROCESS_REGISTRY,
)
CONFIG_CHECK = Histogram(
    "vlab_config_check_duration_seconds",
    "Duration of one vLLM configuration check (all of a submission's configurations "
    "resolved by vLLM itself); resolver=warm: the warm engine-environment process, "
    "one_shot: a new process (cold vLLM import). Failed checks included.",
    labelnames=("resolver",),
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 300.0),
    registry=PROCESS_REGISTRY,
)
CONFIG_CHECKS_IN_FLIGHT = Gauge(
    "vlab_config_checks_in_flight",
    "vLLM configuration checks running now in this process.",
    registry=PROCESS_REGISTRY,
)
SUBMISSION_CHECKS_RUNNING = Gauge(
    "vlab_submission_checks_running",
    "Submissions (and scheduled sweeps, model look-ups) holding a slot of the submission "
    "gate now: at most VLAB_SUBMISSIONS__MAX_CONCURRENT_CHECKS.",
    registry=PROCESS_REGISTRY,
)
SUBMISSION_CHECKS_WAITING = Gauge(
    "vlab_submission_checks_waiting",
    "Submissions waiting for a slot of the submission gate now: at most "
    "VLAB_SUBMISSIONS__MAX_WAITING; beyond it, 503 submissions_busy.",
    registry=PROCESS_REGISTRY,
)
ENGINE_STARTUP = Histogram(
    "vlab_engine_startup_seconds",
    "Seconds from starting `vllm serve` to its /health answering, one observation per "
    "engine start recorded with a run's result (timings.startup_s).",
    buckets=(5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0, 1200.0),
    registry=PROCESS_REGISTRY,
)
ENGINE_START_FAILURES = Counter(
    "vlab_engine_start_failures",
    "Engine starts that never answered /health (`vllm serve` exited, hung or timed out "
    "while starting), one per start, counted when the failed result of the run that "
    "started it is recorded.",
    registry=PROCESS_REGISTRY,
)
#: The 503 problem codes (:class:`orchestrator.core.errors.UnavailableError`'s kinds).
REFUSAL_CODES = (
    "submissions_busy",
    "engine_unavailable",
    "database_unavailable",
    "database_busy",
    "ray_cluster_unusable",
)
REQUESTS_REFUSED = Counter(
    "vlab_requests_refused",
    "API requests answered 503 (a retry may cure them), by problem code: submissions_busy "
    "(the submission gate is full), engine_unavailable (vLLM could not check a "
    "submission), database_unavailable, database_busy, ray_cluster_unusable.",
    labelnames=("code",),
    registry=PROCESS_REGISTRY,
)
SCHEDULE_FIRES = Counter(
    "vlab_schedule_fires",
    "Fire times of scheduled sweeps handled on time or by catch-up, by the fire row's "
    "status: fired (an experiment was created), failed (its template was refused), "
    "skipped_busy (policy skip: the previous sweep still had unfinished runs).",
    labelnames=("status",),
    registry=PROCESS_REGISTRY,
)
SCHEDULE_MISSES = Counter(
    "vlab_schedule_misses",
    "Fire times of scheduled sweeps missed (the service was down or behind beyond the "
    "grace period) and recorded as skipped instead of run.",
    registry=PROCESS_REGISTRY,
)
#: The dispatcher's loops (:mod:`orchestrator.dispatch.loops`), in the order a tick runs them.
DISPATCHER_LOOPS = (
    "heartbeat",
    "poll",
    "reconcile",
    "parity",
    "schedules",
    "claim",
    "campaigns",
)
DISPATCHER_LOOP_RUNS = Counter(
    "vlab_dispatcher_loop_runs",
    "Turns of each dispatcher loop (heartbeat, poll, reconcile, parity, schedules, claim, "
    "campaigns), "
    "failed ones included.",
    labelnames=("loop",),
    registry=PROCESS_REGISTRY,
)
DISPATCHER_LOOP_FAILURES = Counter(
    "vlab_dispatcher_loop_failures",
    "Turns of each dispatcher loop that raised (logged; the other loops go on), database "
    "outages included.",
    labelnames=("loop",),
    registry=PROCESS_REGISTRY,
)
DISPATCHER_LOOP_SECONDS = Histogram(
    "vlab_dispatcher_loop_seconds",
    "Duration of one turn of each dispatcher loop, failed turns included.",
    labelnames=("loop",),
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
    registry=PROCESS_REGISTRY,
)
DISPATCHER_LOOP_LAST_SUCCESS = Gauge(
    "vlab_dispatcher_loop_last_success_timestamp_seconds",
    "Unix time of the last turn of each dispatcher loop that succeeded (0: none yet).",
    labelnames=("loop",),
    registry=PROCESS_REGISTRY,
)
# every label value exported from the start, at 0 (a series that appears only with its
# first event breaks rate() and alerts on absence)
for _status in ("fired", "failed", "skipped_busy"):
    SCHEDULE_FIRES.labels(status=_status)
for _code in REFUSAL_CODES:
    REQUESTS_REFUSED.labels(code=_code)
for _resolver in ("warm", "one_shot"):
    CONFIG_CHECK.labels(resolver=_resolver)
for _loop in DISPATCHER_LOOPS:
    DISPATCHER_LOOP_RUNS.labels(loop=_loop)
    DISPATCHER_LOOP_FAILURES.labels(loop=_loop)
    DISPATCHER_LOOP_SECONDS.labels(loop=_loop)
    DISPATCHER_LOOP_LAST_SUCCESS.labels(loop=_loop)

#: Families only a process that runs a dispatcher exports (see the module docstring).
DISPATCHER_FAMILIES = frozenset(
    {
        "vlab_dispatcher_tick_duration_seconds",
        "vlab_dispatcher_loop_runs",
        "vlab_dispatcher_loop_failures",
        "vlab_dispatcher_loop_seconds",
        "vlab_dispatcher_loop_last_success_timestamp_seconds",
        "vlab_engine_startup_seconds",
        "vlab_engine_start_failures",
        "vlab_schedule_fires",
        "vlab_schedule_misses",
    }
)

_dispatcher_running = threading.Event()


def mark_dispatcher_running() -> None:
    """Say that this process runs a dispatcher: its series are exported from now on."""
    _dispatcher_running.set()


def dispatcher_running() -> bool:
    return _dispatcher_running.is_set()


def record_schedule_outcomes(statuses: Iterable[str]) -> None:
    """Count the fire rows one committed schedule transaction wrote: ``skipped`` is a
    miss, any other status a fire."""
    for status in statuses:
        if status == "skipped":
            SCHEDULE_MISSES.inc()
        else:
            SCHEDULE_FIRES.labels(status=status).inc()


def observe_engine_startup(
    timings: Mapping[str, object],
    status: str = "succeeded",
    engine_info: Mapping[str, object] | None = None,
) -> None:
    """Observe ``timings["startup_s"]`` (a run result's timings) when present: only the
    first run of a batch that shared one server carries it, so each start counts once.
    A failed result of the run that started the server (``engine_info["server_reused"]``
    False) without ``startup_s`` is a start that never answered ``/health``: one
    ``vlab_engine_start_failures_total``."""
    value = timings.get("startup_s")
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
        ENGINE_STARTUP.observe(float(value))
    elif status == "failed" and (engine_info or {}).get("server_reused") is False:
        ENGINE_START_FAILURES.inc()


def count_refusal(status: int, code: str) -> None:
    """Count an API answer ``status``/``code`` in ``vlab_requests_refused_total`` when it
    is a 503."""
    if status == 503:
        REQUESTS_REFUSED.labels(code=code).inc()


class ServiceCollector(Collector):
    """This process's own counters (:data:`PROCESS_REGISTRY`), without the dispatcher's
    families when no dispatcher runs here, plus ``vlab_dispatcher_in_process``."""

    def describe(self) -> list[Metric]:
        return []  # registered without a collect at registration time

    def collect(self) -> Iterator[Metric]:
        running = dispatcher_running()
        for family in PROCESS_REGISTRY.collect():
            if running or family.name not in DISPATCHER_FAMILIES:
                yield family
        yield GaugeMetricFamily(
            "vlab_dispatcher_in_process",
            "1 when this process runs a dispatcher (vlab up, vlab orchestrate), else 0: "
            "the dispatcher's series are exported only where it is 1.",
            value=1.0 if running else 0.0,
        )


class DatabaseCollector(Collector):
    """The series read at scrape time: the pool of the service's engine, and from the
    database runs by status, the oldest queued run's age and ``vlab_database_up``.

    The queries run on a connection of their own (no pool, ``connect_timeout`` and a
    ``statement_timeout`` of ``timeout_s``), so a scrape neither waits for a busy pool
    nor shows up in the pool figures it reports, and a database that does not answer
    costs the scrape at most a few seconds.
    """

    def __init__(self, session_factory: sessionmaker[Session], timeout_s: int = 3) -> None:
        bind = session_factory.kw.get("bind")
        self.engine: Engine | None = bind if isinstance(bind, Engine) else None
        self.session_factory = session_factory
        self.timeout_s = timeout_s
        self._scrape_factory: sessionmaker[Session] | None = None

    def describe(self) -> list[Metric]:
        return []

    def _sessions(self) -> sessionmaker[Session]:
        if self._scrape_factory is None:
            if self.engine is None:  # a factory without an engine (tests): use it as is
                self._scrape_factory = self.session_factory
            else:
                scrape_engine = create_engine(
                    self.engine.url,
                    poolclass=NullPool,
                    connect_args={
                        "connect_timeout": self.timeout_s,
                        "options": f"-c statement_timeout={self.timeout_s * 1000}",
                    },
                )
                self._scrape_factory = sessionmaker(bind=scrape_engine)
        return self._scrape_factory

    def collect(self) -> Iterator[Metric]:
        yield from self._pool()
        counts: dict[str, int] | None = None
        age: float | None = None
        try:
            with self._sessions()() as session:
                repo = RunRepository(session)
                counts = repo.count_by_status()
                age = repo.oldest_queued_age_s()
            database_health.ok()
        except Exception as exc:  # noqa: BLE001 - the scrape answers; the series are absent
            if is_unavailable(exc):
                database_health.failed(exc, "metrics")
            else:
                log.warning("metrics: reading the runs failed: %s", exc)
        yield GaugeMetricFamily(
            "vlab_database_up",
            "1 when this scrape's database queries answered, else 0 (then the series read "
            "from the database are absent).",
            value=0.0 if counts is None else 1.0,
        )
        if counts is None:
            return
        runs = GaugeMetricFamily(
            "vlab_runs",
            "Runs in each status, from the database (status=queued is the queue length).",
            labels=("status",),
        )
        for status in RunStatus:
            runs.add_metric((status.value,), float(counts.get(status.value, 0)))
        yield runs
        if age is not None:
            yield GaugeMetricFamily(
                "vlab_queue_oldest_age_seconds",
                "Seconds the oldest queued run has waited (database clock); absent when "
                "nothing is queued.",
                value=max(0.0, age),
            )

    def _pool(self) -> Iterator[Metric]:
        status = pool_status(self.engine) if self.engine is not None else None
        if status is None:
            return
        for key, name, doc in (
            ("size", "vlab_database_pool_size", "Connections the pool keeps (pool_size)."),
            (
                "max_overflow",
                "vlab_database_pool_max_overflow",
                "Connections the pool may open beyond its size (max_overflow).",
            ),
            ("open", "vlab_database_pool_open_connections", "Pooled connections open now."),
            (
                "checked_out",
                "vlab_database_pool_checked_out_connections",
                "Pooled connections in use now; at size + max_overflow a request waits "
                "(then 503 database_busy).",
            ),
            (
                "overflow",
                "vlab_database_pool_overflow_connections",
                "Connections open now beyond the pool's size.",
            ),
        ):
            yield GaugeMetricFamily(name, doc, value=float(status[key]))


def scrape_registry(
    session_factory: sessionmaker[Session], *collectors: Collector
) -> CollectorRegistry:
    """A registry for one service's scrapes: this process's counters
    (:class:`ServiceCollector`), the database series (:class:`DatabaseCollector`),
    the standard ``process_*`` series, and ``collectors``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceCollector())
    registry.register(DatabaseCollector(session_factory))
    StandardProcessCollector(registry=registry)
    for collector in collectors:
        registry.register(collector)
    return registry
