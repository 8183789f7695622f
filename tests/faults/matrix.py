"""The fault matrix: for each process of a run's tree and each phase of the run, kill it
(SIGKILL) or stop it (SIGSTOP), let the deployment restart what a process manager would
restart, and check the invariants of issue 23:

- the run reaches a terminal state within a bound derived from the settings
  (:func:`bound_s`); where the fault is outside the run's tree (the API) or one the
  service rides out (Postgres), the run succeeds;
- every record that was durable at the fault is kept (request rows and ``/metrics``
  samples in the database; the lines of the run's journal, where the build keeps one);
- ``GET /api/v1/runs/{id}/log`` serves a non-empty body (when an engine had started);
- no engine process of the run is left, and no second engine was started for it;
- the queue goes on: the run queued behind it is claimed and not failed at launch, and
  the plain run queued behind the row's last faulted run succeeds (the row's ``queued``
  cell, where the process exists while a run is queued);
- the service answers (``/healthz`` gives 200 or 503 within 10 s, never a hang or a 500).

A *row* is a process and a signal; its cells run one after the other on one deployment,
each with its own run, whose phase lengths (:class:`Profile`) make the phase the cell
aims at about 2 s long. Polling with deadlines, no fixed sleeps (but the length of a
Postgres stall, which is the fault itself).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from jobs.run.enginewatch import HANG_AFTER_S
from tests.faults.harness import (
    GCS_RECONNECT_S,
    POLL_INTERVAL_S,
    STALE_AFTER_S,
    STARTUP_TIMEOUT_S,
    TERMINAL,
    Deployment,
    PrivatePostgres,
    RunState,
    Sampler,
    TwoNodes,
    engine_pids,
    signal_pid,
    wait_for,
)

PHASES = ("queued", "claimed", "starting", "warm-up", "measuring", "recording")
TITLES = {
    "queued": "queued",
    "claimed": "claimed",
    "starting": "engine starting",
    "warm-up": "warm-up",
    "measuring": "measuring",
    "recording": "recording the result",
}
#: The phases in which each process exists (the other cells are n/a).
EXISTS = {
    "api": PHASES,
    "orchestrator": PHASES,
    "gcs": PHASES,
    "raylet": PHASES,
    "postgres": PHASES,
    "supervisor": PHASES[1:],
    "engine": PHASES[2:],
    # two-node PP=2 runs: the follower's launcher actor (EnginePart) and its whole node,
    # from the start of the engine parts on
    "launcher": PHASES[2:],
    "node": PHASES[2:],
}
#: The order in which a row's faulted cells run; ``queued`` is the plain run queued
#: behind the last one at its fault.
ORDER = ("claimed", "starting", "warm-up", "recording", "measuring")
#: Rows whose runs must succeed: the API is outside the run's tree, and the service
#: rides out a database outage (the dispatcher retries; the supervisor keeps measuring).
SURVIVES = {"api", "postgres"}

#: The hang bound of a silent engine: no sign of life for this long fails the run
#: (docs/MEASUREMENT.md).
HANG_BOUND_S = HANG_AFTER_S
#: How long a SIGSTOP of Postgres lasts (a stalled database, then it goes on).
POSTGRES_STALL_S = 6.0
#: How long the orchestrator may take to exit once its local Ray is gone: Ray's own
#: reconnect timeout for a lost GCS, plus a few seconds.
RAY_LOSS_EXIT_S = GCS_RECONNECT_S + 5.0
#: Seconds between the supervisor's checks of a follower's part
#: (``orchestrator.dispatch.ray.supervisor.PART_CHECK_INTERVAL_S``), and how long it waits
#: for the part's answer (its ``ray.get`` timeout) before it calls the node lost.
PART_CHECK_S = 1.0
PART_ANSWER_S = 30.0
#: What every run takes besides its phases, measured on an idle 2-core machine: the
#: claim, the placement group, the supervisor's start, the request list of a plain run,
#: the engine's process start, recording the result (about 2.5 s), doubled.
RUN_OVERHEAD_S = 5.0
#: How long Ray takes to call a node dead that stopped answering: its GCS health check,
#: 5 failed checks 3 s apart (``health_check_failure_threshold``, ``_period_ms``).
RAY_NODE_DEATH_S = 15.0
#: Slack on every bound for a loaded 2-core machine (process starts, Ray's own timers).
SLACK_S = 5.0
#: How long the service may take to answer ``/healthz`` (it probes the database with a
#: 3 s connect timeout).
ANSWER_S = 10.0


@dataclass(frozen=True)
class Profile:
    """Phase lengths of one run: the stub engine's knobs and the workload."""

    start_s: float = 0.5  # engine starting (the stub listens after this)
    stop_s: float = 0.5  # the drain after SIGTERM (recording the result)
    ttft_ms: float = 50.0
    itl_ms: float = 20.0
    warmups: int = 2
    requests: int = 16
    concurrency: int = 2
    output_tokens: int = 8
    question_tokens: int = 8
    pp: int = 1  # pipeline_parallel_size: 2 spans the two-node deployment's nodes
    build_s: float = 0.0  # building the request list (the claimed phase), measured

    def engine_args(self) -> dict[str, Any]:
        return {
            "fault_start_s": self.start_s,
            "fault_stop_s": self.stop_s,
            "fault_ttft_ms": self.ttft_ms,
            "fault_itl_ms": self.itl_ms,
        }

    def workload(self) -> dict[str, Any]:
        return {
            "num_requests": self.requests,
            "concurrency": self.concurrency,
            "prefix_tokens": 32,
            "question_tokens": self.question_tokens,
            "output_tokens": self.output_tokens,
            "warmup_requests": self.warmups,
        }

    @property
    def request_s(self) -> float:
        return (self.ttft_ms + (self.output_tokens - 1) * self.itl_ms) / 1000

    def nominal_s(self) -> float:
        """Seconds the run takes from its claim, on an idle machine: by construction,
        plus :data:`RUN_OVERHEAD_S` and the measured time to build its request list."""
        measuring = self.requests / self.concurrency * self.request_s
        phases = self.start_s + self.warmups * self.request_s + measuring + self.stop_s
        return RUN_OVERHEAD_S + self.build_s + phases


#: The run behind the last fault (it must succeed) and the rows' other runs: short.
PLAIN = Profile(requests=8, concurrency=4)
#: A run per target phase: its phase about 2 s long (hit by polling), the others short.
PROFILES = {
    "queued": PLAIN,
    # a request list that takes about 2 s to build (a million question tokens to
    # tokenize) before the engine starts; then served fast
    "claimed": Profile(requests=250, concurrency=16, question_tokens=4000, itl_ms=5, build_s=2.5),
    "starting": Profile(start_s=2.5),
    "warm-up": Profile(warmups=12),
    "measuring": Profile(requests=40),
    "recording": Profile(stop_s=2.5),
}


@dataclass
class Cell:
    """One cell of the matrix and what was measured in it."""

    process: str
    sig: str  # "KILL" | "STOP"
    phase: str
    run_id: str = ""
    status: str | None = None
    error: str = ""
    outcome: str = "not run"  # "ok" (ran), "n/a", "missed", "not run", "full only"
    to_terminal_s: float | None = None
    bound_s: float | None = None
    durable: int | None = None  # request rows in the database at the fault
    journal: int | None = None  # request records journaled at the fault (None: none)
    journal_samples: int | None = None  # samples journaled at the fault
    kept: int | None = None  # request rows after the run ended
    samples_durable: int | None = None
    samples_kept: int | None = None
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.process}/{self.sig}/{self.phase}"

    def summary(self) -> str:
        if self.outcome != "ok":
            return self.outcome
        t = f"{self.to_terminal_s:.1f}s" if self.to_terminal_s is not None else "no end"
        durable = max(self.durable or 0, self.journal or 0)
        records = f"{self.kept}/{durable}" if self.durable is not None else "-"
        mark = "ok" if not self.violations else "FAIL"
        return f"{mark}: {self.status or '?'} {t}, rec {records}"


# --------------------------------------------------------------------------- bounds


def bound_s(process: str, sig: str, phase: str, profile: Profile, restart_s: float) -> float:
    """Seconds from the fault to the run's terminal state that the settings promise.

    ``restart_s``: how long the restarted process took to be ready (a process manager's
    restart, not the service's delay). Where the run goes on, the rest of it
    (``profile.nominal_s()``) counts too. Every bound has two poll intervals and
    :data:`SLACK_S` on top.
    """
    extra = 2 * POLL_INTERVAL_S + SLACK_S
    rest = profile.nominal_s()
    if process == "api":
        return rest + extra
    if process == "orchestrator":  # the restart's start-up reconcile ends the run
        return restart_s + extra
    if process in ("gcs", "raylet"):  # the orchestrator exits when its Ray is gone
        return RAY_LOSS_EXIT_S + restart_s + extra
    if process == "supervisor":
        # killed: Ray reports the actor's death at once; stopped: nothing answers, and
        # the heartbeat's staleness is the only bound the settings name
        return extra if sig == "KILL" else STALE_AFTER_S + extra
    if process == "engine":
        if sig == "KILL":
            return extra
        return (STARTUP_TIMEOUT_S if phase == "starting" else HANG_BOUND_S) + extra
    if process == "launcher":  # the supervisor's part watcher sees the actor's death
        return PART_CHECK_S + extra
    if process == "node":  # ... or the part not answering, once Ray calls the node dead
        return PART_CHECK_S + PART_ANSWER_S + extra
    if process == "postgres":  # the run goes on; the outage (restart or stall) delays it
        return rest + restart_s + (POSTGRES_STALL_S if sig == "STOP" else 0) + extra
    raise KeyError(process)


# --------------------------------------------------------------------------- phases


@dataclass
class Watch:
    """What the matrix knows of one run while it goes."""

    run_id: str
    profile: Profile
    #: supervisors of earlier runs (their engines' owners, as the sampler saw them)
    known: set[int]
    supervisor: int | None = None


def current_phase(d: Deployment, w: Watch, st: RunState | None) -> str | None:
    """The run's phase as seen from outside: the database (status, progress phase),
    the supervisor's Ray worker, the engine's processes and log. None when unknown
    (the database does not answer)."""
    if st is None:
        return None
    if st.status in TERMINAL:
        return "terminal"
    if w.supervisor is None:
        fresh = [p for p in d.supervisor_pids() if p not in w.known]
        if fresh:
            w.supervisor = fresh[-1]
    if st.phase in ("stopping", "done"):
        return "recording"
    if st.phase == "measuring":
        return "measuring"
    if st.phase == "warmup":
        return "warm-up"
    log = d.log_path(w.run_id)
    if log.exists() and engine_pids(w.run_id):  # the run's (rank 0) server was launched
        text = log.read_text(errors="replace")
        # started, but the run has not seen it healthy yet: between two phases
        return "started" if "Application startup complete" in text else "starting"
    if st.status == "queued":
        # the supervisor may be up while the claim's transaction is still open (the
        # launch runs inside it): a fault now rolls the claim back and the run is queued
        return "queued"
    return "claimed"


def at_target(w: Watch, st: RunState | None, phase: str | None, target: str) -> bool:
    """Whether the run, in ``phase`` (:func:`current_phase` of ``st``), is where the
    cell's fault goes."""
    if st is None or phase != target:
        return False
    if target == "measuring":  # some records durable first
        return st.requests >= w.profile.warmups + 4
    return True


# --------------------------------------------------------------------------- one row


class Row:
    """The cells of one process and signal, on one deployment."""

    def __init__(
        self,
        d: Deployment,
        sampler: Sampler,
        process: str,
        sig: str,
        phases: tuple[str, ...] | None = None,
        postgres: PrivatePostgres | None = None,
        nodes: TwoNodes | None = None,
    ) -> None:
        self.d, self.sampler, self.process, self.sig = d, sampler, process, sig
        self.postgres, self.nodes = postgres, nodes
        #: PP of every run of the row (2: the two-node rows)
        self.pp = 2 if process in ("launcher", "node") else 1
        self.phases = tuple(p for p in (phases or PHASES) if p in EXISTS[process])
        self.cells = {p: Cell(process, sig, p) for p in PHASES}
        for p in PHASES:
            if p not in EXISTS[process]:
                self.cells[p].outcome = "n/a"
            elif p not in self.phases:
                self.cells[p].outcome = "full only"
        self._ended: tuple[str, float] | None = None

    # -- the fault --------------------------------------------------------------------

    def _pid(self, run_id: str) -> int | None:
        if self.process == "postgres":
            return self.postgres.pid if self.postgres is not None else None
        if self.process == "node":  # the follower node's raylet stands for the node
            follower = self.d.follower_node_id(run_id)
            if self.nodes is None or follower is None:
                return None
            return self.nodes.raylet_pid(follower)
        return self.d.pid_of(self.process, run_id)

    def _fault(self, cell: Cell, pid: int, t_fault: float) -> float:
        """Apply the fault; restart what a process manager restarts. Returns the
        restart's seconds (0 when nothing was restarted)."""
        d = self.d
        if self.sig == "STOP":
            signal_pid(pid, signal.SIGSTOP)
            if self.process == "postgres":
                self._check_answers(cell, "while Postgres is stopped")
                # the stall is the fault: it lasts POSTGRES_STALL_S
                time.sleep(max(0.0, POSTGRES_STALL_S - (time.monotonic() - t_fault)))
                signal_pid(pid, signal.SIGCONT)
            return 0.0
        if self.process == "api":
            assert d.api is not None
            d.api.kill()
            return d.start_api()
        if self.process == "orchestrator":
            assert d.orchestrator is not None
            d.orchestrator.kill()
            return d.start_orchestrator()
        if self.process == "postgres":
            assert self.postgres is not None
            self.postgres.kill()
            return self.postgres.start()
        if self.process == "node":
            assert self.nodes is not None
            follower = d.follower_node_id(cell.run_id)
            assert follower is not None
            self.nodes.remove(follower)
            return 0.0
        signal_pid(pid, signal.SIGKILL)
        if self.process in ("gcs", "raylet"):
            return self._restart_when_exited(cell, t_fault)
        return 0.0

    def _restart_when_exited(self, cell: Cell, t_fault: float) -> float:
        """Local Ray is gone: a process manager restarts the orchestrator once it exits
        (within :data:`RAY_LOSS_EXIT_S`); the run's end is noted meanwhile."""
        d, orch = self.d, self.d.orchestrator
        assert orch is not None

        def exited() -> bool:
            self._note_end(cell.run_id, t_fault)
            return not orch.running()

        if wait_for(exited, RAY_LOSS_EXIT_S, 0.1):
            cell.notes.append(
                f"the orchestrator exited {time.monotonic() - t_fault:.1f}s after the kill "
                f"(exit code {orch.proc.returncode if orch.proc else '?'}); restarted"
            )
            return d.start_orchestrator()
        return 0.0

    def _note_end(self, run_id: str, t_fault: float) -> None:
        if self._ended is None:
            st = self.d.state(run_id)
            if st is not None and st.status in TERMINAL:
                self._ended = (st.status, time.monotonic() - t_fault)

    def _repair(self, cell: Cell) -> None:
        """After the cell: an orchestrator that exited is restarted (a process
        manager's job); one still running without its local Ray is restarted by the
        harness (no process manager would: a violation)."""
        d = self.d
        assert d.orchestrator is not None
        if self.nodes is not None and len(self.nodes.nodes) < 2:
            # a node taken away is replaced (the cluster's operator or autoscaler)
            cell.notes.append(f"a new node joined in {self.nodes.replace():.1f}s")
        if not d.orchestrator.running():
            cell.notes.append("the orchestrator had exited; restarted")
            d.start_orchestrator()
            return
        if self.process in ("gcs", "raylet") and not d.ray_processes().get(self.process):
            cell.violations.append(
                f"the orchestrator kept running without local Ray's {self.process} "
                f"(no exit within {RAY_LOSS_EXIT_S:.0f}s); the harness restarted it"
            )
            d.orchestrator.kill()
            d.start_orchestrator()

    # -- checks -----------------------------------------------------------------------

    def _check_answers(self, cell: Cell, when: str) -> None:
        t0 = time.monotonic()
        try:
            resp = httpx.get(f"{self.d.base}/healthz", timeout=ANSWER_S)
        except httpx.HTTPError as exc:
            cell.violations.append(
                f"/healthz {when}: {type(exc).__name__} after {time.monotonic() - t0:.1f}s"
            )
            return
        if resp.status_code not in (200, 503):
            cell.violations.append(f"/healthz {when}: HTTP {resp.status_code}")

    def _check_after(self, cell: Cell, w: Watch) -> None:
        d, run_id = self.d, w.run_id
        if cell.status is not None and cell.status != "succeeded":
            cell.error = " ".join((d.run_row(run_id).error or "").split())[:300]
        if self.process in SURVIVES and cell.status != "succeeded":
            cell.violations.append(f"the run ended {cell.status}: {cell.error[:160]}")
        # no engine left (its lifetime guard ends it within 0.5 s of its owner)
        if not wait_for(lambda: not engine_pids(run_id), 5.0, 0.1):
            cell.violations.append(f"engine processes left: {engine_pids(run_id)}")
        groups = self.sampler.groups.get(run_id, set())
        if len(groups) > w.profile.pp:  # one engine process group per node
            cell.violations.append(f"{len(groups)} engines were started for the run")
        st = wait_for(lambda: d.state(run_id), 30.0, 0.2)
        if st is not None:
            cell.kept, cell.samples_kept = st.requests, st.samples
        floor = max(cell.durable or 0, cell.journal or 0)
        if cell.kept is not None and cell.kept < floor:
            cell.violations.append(
                f"records lost: {cell.kept} request rows kept of {cell.durable} in the "
                f"database and {cell.journal} in the journal at the fault"
            )
        floor = max(cell.samples_durable or 0, cell.journal_samples or 0)
        if (cell.samples_kept or 0) < floor:
            cell.violations.append(
                f"samples lost: {cell.samples_kept} kept of {cell.samples_durable} in the "
                f"database and {cell.journal_samples} in the journal at the fault"
            )
        self._check_answers(cell, "after the run ended")
        started = bool(groups) or d.log_path(run_id).exists()
        try:
            resp = httpx.get(f"{d.base}/api/v1/runs/{run_id}/log", timeout=ANSWER_S)
        except httpx.HTTPError as exc:
            cell.violations.append(f"/log: {type(exc).__name__}")
            return
        if started and (resp.status_code != 200 or not resp.text.strip()):
            cell.violations.append(f"/log: HTTP {resp.status_code}, {len(resp.text)} characters")
        elif resp.status_code >= 500:
            cell.violations.append(f"/log: HTTP {resp.status_code}")

    def _check_queue(self, cell: Cell, next_w: Watch) -> None:
        """The run queued behind is claimed (leaves ``queued``), not failed at launch:
        within a launch (about 5 s here) and the slack, plus Ray's time to call a lost
        node dead (its devices stay reserved until then) after a node loss."""
        bound = 10.0 + SLACK_S + (RAY_NODE_DEATH_S if self.process == "node" else 0.0)

        def moved() -> str | None:
            st = self.d.state(next_w.run_id)
            return None if st is None or st.status == "queued" else st.status

        status = wait_for(moved, bound, 0.1)
        if status is None:
            cell.violations.append(f"queue stuck: the next run not claimed within {bound:.0f}s")
        elif status == "failed":
            error = " ".join((self.d.run_row(next_w.run_id).error or "").split())[:160]
            cell.violations.append(f"the next run failed at once: {error}")

    # -- cells ------------------------------------------------------------------------

    def watch(self, profile: Profile) -> Watch:
        profile = replace(profile, pp=self.pp)
        run_id = self.d.insert_run(profile.engine_args(), profile.workload(), profile.pp)
        self.sampler.watch(run_id)
        return Watch(run_id, profile, self.sampler.supervisors)

    def _wait_terminal(self, run_id: str, t_fault: float, bound: float) -> tuple[str, float] | None:
        def done() -> tuple[str, float] | None:
            self._note_end(run_id, t_fault)
            return self._ended

        return wait_for(done, max(0.0, t_fault + bound - time.monotonic()), 0.1)

    def run_cell(self, target: str, w: Watch, next_w: Watch) -> None:
        """Wait for ``w`` to reach ``target``, apply the fault, check the invariants.
        ``next_w`` is the run queued behind it (inserted before the fault)."""
        d, cell = self.d, self.cells[target]
        cell.run_id = w.run_id
        deadline = time.monotonic() + 60.0 + w.profile.nominal_s()
        pid = None
        phase = st = None
        while time.monotonic() < deadline:
            st = d.state(w.run_id)
            phase = current_phase(d, w, st)
            if phase == "terminal":
                break
            if at_target(w, st, phase, target) and (pid := self._pid(w.run_id)) is not None:
                break
            time.sleep(0.05)
        if pid is None or st is None:
            cell.outcome = "missed"
            cell.notes.append(f"the run did not show phase {target} (last seen: {phase})")
            self._wait_terminal(w.run_id, time.monotonic(), 60.0 + w.profile.nominal_s())
            return
        cell.outcome = "ok"
        cell.durable, cell.samples_durable = st.requests, st.samples
        cell.journal, cell.journal_samples = d.journal_lines(w.run_id) or (None, None)
        self._ended = None
        t_fault = time.monotonic()
        restart_s = self._fault(cell, pid, t_fault)
        cell.bound_s = bound_s(self.process, self.sig, target, w.profile, restart_s)
        end = self._wait_terminal(w.run_id, t_fault, cell.bound_s)
        if end is None:
            cell.violations.append(f"no terminal state within {cell.bound_s:.0f}s")
            if self.sig == "STOP" and self.process != "postgres":
                cell.violations[-1] += f" while the {self.process} was stopped; SIGKILLed it"
                signal_pid(pid, signal.SIGKILL)
            else:
                self._repair(cell)
            end = self._wait_terminal(w.run_id, t_fault, cell.bound_s + 60.0)
        if end is not None:
            cell.status, cell.to_terminal_s = end
        if self.sig == "STOP":
            signal_pid(pid, signal.SIGCONT)
        self._repair(cell)
        self._check_after(cell, w)
        self._check_queue(cell, next_w)

    def run_follower(self, w: Watch, fault_cell: Cell) -> None:
        """The plain run that was queued behind the row's last faulted run: it must
        succeed, with the invariants; recorded as the row's ``queued`` cell, or else as
        violations of ``fault_cell``."""
        queued = "queued" in self.phases
        cell = self.cells["queued"] if queued else Cell(self.process, self.sig, "follower")
        cell.run_id = w.run_id
        if fault_cell.outcome != "ok":
            cell.outcome = "missed"
            cell.notes.append(f"the {fault_cell.phase} cell's fault did not happen")
        else:
            cell.outcome = "ok"
            cell.durable, cell.samples_durable = 0, 0
        cell.bound_s = (fault_cell.bound_s or 0) + w.profile.nominal_s() + SLACK_S
        t_fault = time.monotonic() - (fault_cell.to_terminal_s or 0)
        self._ended = None
        end = self._wait_terminal(w.run_id, t_fault, cell.bound_s)
        if end is None:
            cell.violations.append(f"no terminal state within {cell.bound_s:.0f}s")
            self._repair(cell)
            end = self._wait_terminal(w.run_id, t_fault, cell.bound_s + 60.0)
        if end is not None:
            cell.status, cell.to_terminal_s = end
        if cell.status != "succeeded":
            error = " ".join((self.d.run_row(w.run_id).error or "").split())[:160]
            cell.violations.append(f"the run queued behind ended {cell.status}: {error}")
        self._check_after(cell, w)
        if not queued and cell.violations:
            fault_cell.violations += [f"the run queued behind: {v}" for v in cell.violations]

    def run(self) -> dict[str, Cell]:
        """The row's cells in :data:`ORDER`, then the plain run queued behind the last
        (which must succeed); returns the cells by phase."""
        targets = [p for p in ORDER if p in self.phases]
        if not targets:
            return self.cells
        w = self.watch(PROFILES[targets[0]])
        for i, target in enumerate(targets):
            last = i == len(targets) - 1
            next_w = self.watch(PLAIN if last else PROFILES[targets[i + 1]])
            self.run_cell(target, w, next_w)
            if last:
                self.run_follower(next_w, self.cells[target])
            else:
                w = self._usable(next_w)
        return self.cells

    def _usable(self, w: Watch) -> Watch:
        """``w`` if its run can still reach its phase, else a new run with its profile
        (the queue check recorded why the old one ended early)."""
        st = self.d.state(w.run_id)
        if st is not None and st.status in TERMINAL:
            return self.watch(w.profile)
        return w


# --------------------------------------------------------------------------- the table


ROW_TITLES = {
    "api": "API process (vlab serve)",
    "orchestrator": "orchestrator (dispatcher)",
    "gcs": "local Ray GCS (gcs_server)",
    "raylet": "local Ray raylet",
    "supervisor": "run supervisor (ray::RunSupervisor)",
    "engine": "engine server (stub)",
    "postgres": "Postgres (private postmaster)",
    "launcher": "follower's launcher actor (ray::EnginePart), PP=2 on 2 nodes",
    "node": "whole follower node (raylet and all under it), PP=2 on 2 nodes",
}


def table(rows: list[dict[str, Cell]], extra: tuple[tuple[str, str], ...] = ()) -> str:
    """The matrix as a Markdown table: one line per process and signal, one column per
    phase; a cell reads ``ok|FAIL: <status> <seconds to terminal>, rec <request rows
    kept>/<durable at the fault: in the database or the journal>``. ``extra``: (row
    title, text) for rows covered elsewhere."""
    lines = [
        "| process | signal | " + " | ".join(TITLES[p] for p in PHASES) + " |",
        "|" + " --- |" * (len(PHASES) + 2),
    ]
    for cells in rows:
        first = cells[PHASES[0]]
        lines.append(
            f"| {ROW_TITLES.get(first.process, first.process)} | {first.sig} | "
            + " | ".join(cells[p].summary() for p in PHASES)
            + " |"
        )
    for title, text in extra:
        lines.append(f"| {title} | KILL | {text} |" + " |" * (len(PHASES) - 1))
    return "\n".join(lines)


def findings(rows: list[dict[str, Cell]]) -> list[str]:
    """One line per cell with violations, notes or a run error."""
    out = []
    for cells in rows:
        for cell in cells.values():
            parts = cell.violations + [f"({n})" for n in cell.notes]
            if cell.error and not any(cell.error[:60] in p for p in parts):
                parts.append(f"[run error: {cell.error[:200]}]")
            if parts:
                out.append(f"- {cell.key} (run {cell.run_id[:8]}): " + "; ".join(parts))
    return out
