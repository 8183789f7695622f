"""API test fixtures: settings with the real vLLM 0.32.0 argument catalogue, a TestClient."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from orchestrator.core.settings import EngineSettings, Settings
from tests.factories import DATA


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    python = tmp_path / "engine-python-placeholder"
    # vLLM's own config resolution needs the engine; it is covered by the end-to-end test
    s = Settings(
        home=tmp_path / "home", engine=EngineSettings(python=python, resolve_configs=False)
    )
    s.home.mkdir()
    doc = json.loads((DATA / "engine_args_vllm032cpu.json").read_text())
    doc["engine_python"] = str(python)
    s.engine_args_cache.write_text(json.dumps(doc))
    return s


@pytest.fixture
def client(settings: Settings, session_factory: sessionmaker[Session]) -> Iterator[TestClient]:
    with TestClient(create_app(settings, session_factory)) as c:
        yield c
