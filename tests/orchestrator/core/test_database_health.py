"""Tests of :class:`orchestrator.core.db.DatabaseHealth`: one log line per outage."""

from __future__ import annotations

import logging

import pytest

from orchestrator.core import db
from orchestrator.core.db import DatabaseHealth


class Clock:
    """A hand-moved ``time.monotonic`` (a test double)."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(db.time, "monotonic", c)
    return c


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_a_flapping_shutdown_is_one_outage_logged_once(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=db.log.name)
    health = DatabaseHealth(settle_s=1.0)
    health.failed(RuntimeError("the database system is shutting down"))
    assert health.down and health.reason
    for step in range(5):  # a pooled connection answers, the next one is refused
        clock.t += 0.01
        health.ok()
        assert not health.down  # answers are served at once
        clock.t += 0.01
        health.failed(RuntimeError(f"connection refused {step}"))
        assert health.down
    clock.t += 2.0
    health.ok()
    assert not health.down
    assert _lines(caplog) == ["database unavailable: the database system is shutting down"]
    clock.t += 0.5
    health.ok()  # not settled yet
    assert len(_lines(caplog)) == 1
    clock.t += 0.5
    health.ok()
    assert _lines(caplog)[1:] == ["database is back after 2.1 s"]
    assert health.outages == 1


def test_a_failure_after_the_settled_recovery_is_a_new_outage(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=db.log.name)
    health = DatabaseHealth(settle_s=1.0)
    health.failed(RuntimeError("down"))
    clock.t += 3.0
    health.ok()
    clock.t += 1.0
    health.ok()
    clock.t += 5.0
    health.failed(RuntimeError("down again"))
    assert health.outages == 2
    assert _lines(caplog) == [
        "database unavailable: down",
        "database is back after 3.0 s",
        "database unavailable: down again",
    ]
