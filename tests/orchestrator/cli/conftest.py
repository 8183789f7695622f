"""What the CLI tests share: the ``api`` fixture (the CLI's HTTP answered by the real
app, the database out of the CLI's reach) and :func:`cli`."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from api.app import create_app
from orchestrator.cli import client as cli_client
from orchestrator.cli import common as cli_common
from orchestrator.cli import report as cli_report
from orchestrator.cli.main import app
from orchestrator.cli.runtime import Runtime
from orchestrator.core.settings import MlflowSettings, Settings
from tests.api.conftest import settings as settings  # noqa: F401 - fixture

API = "http://vlab.test"


class _Borrowed:
    """``httpx.Client(...)`` answered by the TestClient, left open on exit."""

    def __init__(self, client: TestClient) -> None:
        self.client = client

    def __enter__(self) -> TestClient:
        return self.client

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.fixture
def api(
    settings: Settings,  # noqa: F811
    factory: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[TestClient]:
    """Every HTTP call of the CLI answered by a TestClient of the real app; the database
    is out of the CLI's reach (a ``Runtime`` cannot be made)."""
    cfg = settings.model_copy(update={"mlflow": MlflowSettings(allow_local_stores=True)})
    with TestClient(create_app(cfg, factory), base_url=API) as client:

        def request(method: str, url: str, **kw: Any) -> httpx.Response:
            kw.pop("timeout", None)
            return client.request(method, url, **kw)

        fake = SimpleNamespace(
            request=request,
            get=lambda url, **kw: request("GET", url, **kw),
            Client=lambda **kw: _Borrowed(client),
            HTTPError=httpx.HTTPError,
            Response=httpx.Response,
        )
        for module in (cli_client, cli_common, cli_report):
            monkeypatch.setattr(module, "httpx", fake)

        def no_database(*args: Any, **kw: Any) -> None:
            raise AssertionError("a vlab command opened the database")

        monkeypatch.setattr(Runtime, "__init__", no_database)
        monkeypatch.delenv("VLAB_TOKEN", raising=False)
        yield client


def cli(*args: str) -> Any:
    """``vlab ARGS --api API`` (the result: exit code, output, stdout, stderr)."""
    return CliRunner().invoke(app, [*args, "--api", API])
