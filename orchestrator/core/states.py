"""The run state machine: the only way a run's status changes.

``queued -> preparing -> running -> succeeded | failed | cancelled | blocked``;
``queued`` and ``preparing`` may also end directly (cancelled, failed,
blocked). A terminal state never changes again.
"""

from __future__ import annotations

from enum import StrEnum

from orchestrator.core.errors import InvalidTransitionError


class RunStatus(StrEnum):
    QUEUED = "queued"
    PREPARING = "preparing"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    BLOCKED = "blocked"


TERMINAL: frozenset[RunStatus] = frozenset(
    {RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.BLOCKED}
)

# The statuses of a run that is not over yet: waiting, being prepared or
# running. The one definition; everything else imports it.
ACTIVE: frozenset[str] = frozenset({RunStatus.QUEUED, RunStatus.PREPARING, RunStatus.RUNNING})

# The statuses of a run an orchestrator has claimed (its devices are held).
CLAIMED: frozenset[str] = ACTIVE - {RunStatus.QUEUED}

ALLOWED: dict[RunStatus, frozenset[RunStatus]] = {
    RunStatus.QUEUED: frozenset({RunStatus.PREPARING, RunStatus.CANCELLED, RunStatus.FAILED}),
    RunStatus.PREPARING: frozenset(
        {
            RunStatus.RUNNING,
            RunStatus.FAILED,
            RunStatus.CANCELLED,
            RunStatus.BLOCKED,
            RunStatus.SUCCEEDED,
        }
    ),
    RunStatus.RUNNING: frozenset({RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED}),
    RunStatus.SUCCEEDED: frozenset(),
    RunStatus.FAILED: frozenset(),
    RunStatus.CANCELLED: frozenset(),
    RunStatus.BLOCKED: frozenset(),
}


def is_terminal(status: str) -> bool:
    return RunStatus(status) in TERMINAL


def check_transition(current: str, new: str) -> RunStatus:
    """Return ``new`` as a :class:`RunStatus` if ``current -> new`` is allowed.

    Raises :class:`InvalidTransitionError` otherwise (including any change
    out of a terminal state).
    """
    cur, nxt = RunStatus(current), RunStatus(new)
    if nxt not in ALLOWED[cur]:
        raise InvalidTransitionError(f"run cannot go from {cur.value} to {nxt.value}")
    return nxt
