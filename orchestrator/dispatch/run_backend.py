"""What the dispatcher asks of a run backend, and what a backend answers.

The Ray layer (:mod:`orchestrator.dispatch.ray.backend`) is the one backend of the
service; tests bring their own. A backend reserves a run's devices, runs a supervisor
that calls :mod:`jobs`, and answers :meth:`RunBackend.poll` once per tick of the
poll loop (:mod:`orchestrator.dispatch.active_runs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from jobs.schemas import BatchJob, RunResult
from orchestrator.cluster.placement import NodeInventory


@dataclass
class Poll:
    """What a backend knows about one active run."""

    done: bool
    results: list[RunResult] | None = None
    progress: dict[str, Any] | None = None
    error: str | None = None
    #: whether the run's supervisor answered this poll: one that did not (stopped, hung)
    #: gets no heartbeat for its runs and is not asked for records or samples
    answered: bool = True


@dataclass
class LaunchInfo:
    """What a launch got: the layout (nodes, ranks, devices) and the parity report if any."""

    placement: dict[str, Any]
    parity: dict[str, Any] | None = None


class NoCapacity(Exception):
    """The run fits the cluster but its devices are busy now: it stays queued."""


class LaunchRefused(Exception):
    """The cluster can never hold the run's shape (the message says why)."""


class LaunchBlocked(Exception):
    """Node parity failed before a launch (a multi-node launch's parity, or a chosen node
    without the engine environment): nothing was launched.

    The message names the blocking fields, then the per-node problems of the first
    findings that have them (``rank1:gpu-b: engine python /opt/vllm/bin/python does not
    exist on this node (...)``), at most :data:`BLOCKED_PROBLEMS_SHOWN`."""

    def __init__(self, report: dict[str, Any], placement: dict[str, Any]) -> None:
        self.report = report
        self.placement = placement
        fields = sorted({str(m.get("field")) for m in report.get("mismatches", [])})
        problems = [
            f"{node}: {text}"
            for m in report.get("mismatches", [])
            for node, text in (m.get("problems") or {}).items()
        ]
        shown = "; ".join(problems[:BLOCKED_PROBLEMS_SHOWN])
        more = len(problems) - BLOCKED_PROBLEMS_SHOWN
        detail = f" ({shown}{f'; {more} more' if more > 0 else ''})" if problems else ""
        super().__init__("node parity check failed: " + ", ".join(fields) + detail)


#: Per-node problems a :class:`LaunchBlocked` message names (the report holds them all).
BLOCKED_PROBLEMS_SHOWN = 3


class RunBackend(Protocol):
    #: the Ray resource one device maps to ("GPU" or "CPU"), as detected or set
    resource: str

    def resources(self) -> dict[str, float]: ...

    def nodes(self) -> list[NodeInventory]: ...

    def launch(self, run_id: str, job: BatchJob, layout: dict[str, Any]) -> LaunchInfo: ...

    def check_nodes(
        self,
        node_ids: list[str] | None,
        *,
        model_dir: str | None,
        engine_args: dict[str, Any],
        tp: int = 1,
        pp: int = 1,
        revision: str | None = None,
        by_id: bool = False,
    ) -> dict[str, Any]: ...

    def poll(self, run_id: str) -> Poll: ...

    def records(self, run_id: str, since: dict[str, int]) -> dict[str, list[dict[str, Any]]]:
        """Request records the batch's runs finished after ``since[run_id]`` of them."""
        ...

    def samples(self, run_id: str, since: dict[str, int]) -> dict[str, list[dict[str, Any]]]:
        """``/metrics`` samples the batch's runs took after ``since[run_id]`` of them."""
        ...

    def cancel(self, run_id: str) -> None: ...

    def attach(self, run_id: str) -> bool: ...

    def release(self, run_id: str) -> None: ...
