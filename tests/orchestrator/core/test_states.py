from __future__ import annotations

import pytest

from orchestrator.core.errors import InvalidTransitionError
from orchestrator.core.states import TERMINAL, RunStatus, check_transition


def test_happy_path() -> None:
    s = RunStatus.QUEUED
    for nxt in ("preparing", "running", "succeeded"):
        s = check_transition(s, nxt)
    assert s == RunStatus.SUCCEEDED


@pytest.mark.parametrize("terminal", sorted(TERMINAL))
@pytest.mark.parametrize("target", list(RunStatus))
def test_terminal_states_never_change(terminal: RunStatus, target: RunStatus) -> None:
    with pytest.raises(InvalidTransitionError):
        check_transition(terminal, target)


def test_cannot_skip_back_to_queued() -> None:
    with pytest.raises(InvalidTransitionError):
        check_transition("running", "queued")
    with pytest.raises(InvalidTransitionError):
        check_transition("queued", "running")
