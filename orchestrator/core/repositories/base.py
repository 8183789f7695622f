"""What every repository shares: the clock and the database's health check."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import Connection, text
from sqlalchemy.orm import Session


def utcnow() -> datetime:
    return datetime.now(UTC)


def ping(connection: Connection | Session) -> None:
    """``SELECT 1``: raises when the database does not answer (the health check)."""
    connection.execute(text("SELECT 1"))
