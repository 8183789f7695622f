"""Request dependencies shared by the API routers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from orchestrator.core.db import unit_of_work
from orchestrator.core.settings import Settings


def _session(request: Request) -> Iterator[Session]:
    """One unit of work per request: commit on success, roll back on error.

    Used with ``scope="function"``: the commit happens when the path function returns,
    BEFORE the response is sent, so a 201 means the rows are visible to the next
    request (FastAPI's default for yield dependencies ends them after the response).
    """
    with unit_of_work(request.app.state.session_factory) as session:
        yield session


def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


SessionDep = Annotated[Session, Depends(_session, scope="function")]
SettingsDep = Annotated[Settings, Depends(_settings)]
