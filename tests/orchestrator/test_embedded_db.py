"""The embedded default: no DATABASE_URL -> a real Postgres in a local folder, data kept."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select

from orchestrator.db import (
    make_engine,
    make_session_factory,
    resolve_database_url,
    stop_embedded_postgres,
    unit_of_work,
    upgrade_to_head,
)
from orchestrator.models import Experiment
from orchestrator.settings import Settings
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
