"""What the dispatcher tests on real Ray and real Postgres set up alike: an engine python
(a TEST DOUBLE script, written executable), a local Ray node with 2 CPUs, a fresh
migrated database, a tiny generated model and a home folder."""

from __future__ import annotations

import contextlib
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray
from sqlalchemy import create_engine
from sqlalchemy.orm import sessionmaker

from jobs.modelgen.generator import generate_model
from orchestrator.core.db import normalize_url, upgrade_to_head
from tests.conftest import fresh_database


@contextlib.contextmanager
def ray_and_database(
    tmp_path: Path, server_url: str, engine_script: str
) -> Iterator[dict[str, Any]]:
    """``{"factory", "engine_python", "model", "home"}``; Ray and the database go at exit."""
    engine_python = tmp_path / "engine_python"
    engine_python.write_text(engine_script)
    engine_python.chmod(engine_python.stat().st_mode | stat.S_IXUSR)
    model = generate_model(tmp_path / "tiny", "tiny", seed=0)
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with fresh_database(server_url) as url:
            upgrade_to_head(url)
            engine = create_engine(normalize_url(url))
            try:
                yield {
                    "factory": sessionmaker(bind=engine, expire_on_commit=False),
                    "engine_python": engine_python,
                    "model": model,
                    "home": tmp_path / "home",
                }
            finally:
                engine.dispose()
    finally:
        ray.shutdown()
