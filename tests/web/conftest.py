"""Dashboard fixtures: a database of its own with real run data, the API served by
uvicorn on a free port, and a real headless Chromium (Debian ``chromium``) driven
by Playwright.

Every page a test opens records console errors, uncaught page errors and failed
requests; the ``page`` fixture fails the test if any happened.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, sync_playwright
from sqlalchemy import create_engine
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from orchestrator.core.db import normalize_url, upgrade_to_head
from orchestrator.core.settings import EngineSettings, Settings
from tests.api.livehttp import live_server as serve
from tests.conftest import fresh_database
from tests.web.seed import DATA, bulk_history, load_export

CHROMIUM = os.environ.get("VLAB_CHROMIUM", "/usr/bin/chromium")
REAL_EXPORT = DATA / "demo_experiment.json"
ENGINE_ARGS = Path(__file__).resolve().parent.parent / "data" / "engine_args_vllm032cpu.json"


@pytest.fixture(scope="session")
def web_db(server_url: str) -> Iterator[sessionmaker[Session]]:
    """A fresh, migrated database only the dashboard tests use (so counts are exact)."""
    with fresh_database(server_url) as url:
        upgrade_to_head(url)
        engine = create_engine(normalize_url(url))
        yield sessionmaker(bind=engine, expire_on_commit=False)
        engine.dispose()


@pytest.fixture(scope="session")
def seeded(web_db: sessionmaker[Session]) -> dict[str, Any]:
    """Real data (the demo experiment, APC off/on, 2 repeats, exported from a real run)
    twice under two names, plus 120 small runs in 30 experiments for the history table."""
    with web_db.begin() as session:
        real = load_export(session, REAL_EXPORT, name="demo apc")
        older = load_export(session, REAL_EXPORT, name="demo apc older", shift=-timedelta(days=3))
        bulk = bulk_history(session, experiments=30, runs_per_experiment=4)
    return {"real": real, "older": older, "bulk": bulk}


def web_settings(home: Path) -> Settings:
    """Settings for a dashboard served in a test: ``home``, no engine (a placeholder
    python), vLLM 0.32's argument list (CPU build) as the cached catalog."""
    python = home / "engine-python-placeholder"
    settings = Settings(home=home, engine=EngineSettings(python=python, resolve_configs=False))
    doc = json.loads(ENGINE_ARGS.read_text())
    doc["engine_python"] = str(python)
    settings.engine_args_cache.write_text(json.dumps(doc))
    return settings


@pytest.fixture(scope="session")
def live_server(
    web_db: sessionmaker[Session], seeded: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The API (and dashboard) on ``http://127.0.0.1:<port>``, served by uvicorn in a thread."""
    settings = web_settings(tmp_path_factory.mktemp("web-home"))
    with serve(create_app(settings, web_db)) as base:
        yield base


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Chromium for one module: Playwright's sync API keeps an event loop running in the
    thread while it is open, and a later test's ``asyncio.run`` on the same worker (the
    runner's) fails beside a session-long one."""
    if not Path(CHROMIUM).exists():
        pytest.fail(
            f"no Chromium at {CHROMIUM}: install Debian's chromium (apt-get install chromium; "
            ".ci/run does) or set VLAB_CHROMIUM"
        )
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh page (1400x900); the test fails on any console error, page error or
    failed request it saw, but a request the page itself gave up (``net::ERR_ABORTED``:
    a fetch still out when the test leaves the page or the page polls again; a server
    that fails answers with a status or drops the connection, never this)."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    pg = context.new_page()
    problems: list[str] = []
    pg.on(
        "console",
        lambda m: problems.append(f"console.error: {m.text}") if m.type == "error" else None,
    )
    pg.on("pageerror", lambda e: problems.append(f"pageerror: {e}"))
    pg.on(
        "requestfailed",
        lambda r: (
            None
            if r.failure == "net::ERR_ABORTED"
            else problems.append(f"requestfailed: {r.url} {r.failure}")
        ),
    )
    pg.set_default_timeout(15_000)
    # a page's first load on a 2-core machine running the suite beside real vLLM took over
    # 15 s once in CI; what a test waits for after it keeps 15 s
    pg.set_default_navigation_timeout(45_000)
    allowed: list[str] = []
    pg._vlab_allowed_errors = allowed  # type: ignore[attr-defined]
    yield pg
    context.close()
    unexpected = [p for p in problems if not any(a in p for a in allowed)]
    assert not unexpected, "browser errors:\n" + "\n".join(unexpected)


def allow_console_error(page: Page, fragment: str) -> None:
    """Let ``page`` log console errors containing ``fragment`` (e.g. the browser's
    "status of 404" line when a test opens a missing page on purpose)."""
    page._vlab_allowed_errors.append(fragment)  # type: ignore[attr-defined]


SCREENSHOTS = Path(__file__).resolve().parent.parent.parent / "docs" / "screenshots"


def screenshot(page: Page, name: str) -> None:
    """Save ``docs/screenshots/<name>.png`` when ``VLAB_SCREENSHOTS=1`` (kept in the repo)."""
    if os.environ.get("VLAB_SCREENSHOTS") == "1":
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)
