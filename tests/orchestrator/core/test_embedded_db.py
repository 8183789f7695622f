"""The embedded default: no DATABASE_URL -> a real Postgres in a local folder, data kept."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select

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
    """``alembic upgrade head`` gives exactly the schema the ORM models declare."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    from sqlalchemy import create_engine

    from orchestrator.core.db import normalize_url, upgrade_to_head
    from orchestrator.core.models import Base
    from tests.conftest import fresh_database

    with fresh_database(server_url) as url:
        upgrade_to_head(url)
        engine = create_engine(normalize_url(url))
        try:
            with engine.connect() as conn:
                diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        finally:
            engine.dispose()
    assert diff == []
