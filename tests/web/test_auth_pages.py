"""Dashboard sign-in in a real Chromium: log in with a token, cancel a run from its page
(the page sends its CSRF token), and a forged cross-site POST that carries the session
cookie but not the CSRF token fails.

Its own database and server: tokens exist here, so the API is closed, unlike the
other dashboard tests' open loopback server.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, expect
from sqlalchemy import create_engine
from sqlalchemy.orm import sessionmaker

from api.app import create_app
from orchestrator.core import auth
from orchestrator.core.db import normalize_url, upgrade_to_head
from orchestrator.core.models import Run
from tests.api.livehttp import live_server as serve
from tests.conftest import fresh_database
from tests.factories import make_experiment
from tests.web.conftest import allow_console_error, web_settings


@pytest.fixture(scope="module")
def site(server_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A server with an operator and a viewer token and two queued runs."""
    with fresh_database(server_url) as url:
        upgrade_to_head(url)
        engine = create_engine(normalize_url(url))
        factory = sessionmaker(bind=engine, expire_on_commit=False)
        with factory.begin() as s:
            _, operator = auth.create_token(s, name="pat", role="operator", created_by="test")
            _, viewer = auth.create_token(s, name="val", role="viewer", created_by="test")
            exp = make_experiment(s, n_runs=2)
            runs = [r.id for r in exp.runs]
        settings = web_settings(tmp_path_factory.mktemp("auth-web-home"))
        try:
            with serve(create_app(settings, factory)) as base:
                yield {
                    "base": base,
                    "factory": factory,
                    "operator": operator,
                    "viewer": viewer,
                    "runs": runs,
                }
        finally:
            engine.dispose()


def run_row(site: dict[str, Any], run_id: str) -> Run:
    with site["factory"]() as s:
        run = s.get(Run, run_id)
        assert run is not None
        return run


def sign_in(page: Page, base: str, token: str, path: str) -> None:
    page.goto(base + path)
    expect(page).to_have_url(f"{base}/login?next={path}")
    page.fill("#token", token)
    page.click("#sign-in")
    expect(page).to_have_url(base + path)


@pytest.fixture
def attacker() -> Iterator[tuple[str, dict[str, str]]]:
    """Another origin on this machine (same site, other port) serving ``pages[path]``."""
    pages: dict[str, str] = {"/favicon.ico": ""}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = pages.get(self.path, "not here").encode()
            self.send_response(200 if self.path in pages else 404)
            self.send_header("content-type", "text/html; charset=utf-8")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", pages
    server.shutdown()
    thread.join(5)


def test_sign_in_then_cancel_a_run_from_its_page(
    page: Page, site: dict[str, Any], attacker: tuple[str, dict[str, str]]
) -> None:
    base, (first, second) = site["base"], site["runs"]
    sign_in(page, base, site["operator"], f"/runs/{first}")
    expect(page.locator("#who-name")).to_have_text("pat")

    page.once("dialog", lambda d: d.accept())
    with page.expect_response(lambda r: r.url.endswith(f"/runs/{first}/cancel")) as sent:
        page.click("#cancel-run")
    assert sent.value.status == 202
    assert sent.value.request.headers.get("x-csrf-token")
    expect(page.locator("#status")).to_have_text("cancelled")
    expect(page.locator("#cancelled-by")).to_have_text("pat")
    row = run_row(site, first)
    assert (row.status, row.cancelled_by) == ("cancelled", "pat")

    # another origin's page posts a form to the cancel endpoint: the browser sends the
    # session cookie (127.0.0.1 on another port is the same site), not the CSRF token
    other, pages = attacker
    pages["/win-a-prize"] = (
        f'<form id="f" method="post" action="{base}/api/v1/runs/{second}/cancel"></form>'
        '<script>document.getElementById("f").submit()</script>'
    )
    evil = page.context.new_page()  # same browser, same cookies; the run page stays open
    with evil.expect_response(lambda r: r.url.endswith(f"/runs/{second}/cancel")) as forged:
        evil.goto(f"{other}/win-a-prize")
    assert forged.value.status == 403
    assert forged.value.json()["code"] == "csrf_failed"
    assert "vlab_session=" in (forged.value.request.header_value("cookie") or "")
    row = run_row(site, second)
    assert (row.status, row.cancel_requested, row.cancelled_by) == ("queued", False, None)

    # signing out ends the session: the pages ask for a token again
    page.wait_for_load_state("networkidle")  # the cancelled run's page has stopped polling
    page.goto(f"{base}/schedules")  # a page that does not poll within seconds
    page.click("#sign-out")
    expect(page).to_have_url(f"{base}/login")
    page.goto(f"{base}/runs/{second}")
    expect(page).to_have_url(f"{base}/login?next=/runs/{second}")


def test_a_viewer_sees_no_cancel_button(browser: Browser, site: dict[str, Any]) -> None:
    context = browser.new_context()
    try:
        page = context.new_page()
        sign_in(page, site["base"], site["viewer"], f"/runs/{site['runs'][1]}")
        expect(page.locator("#who-name")).to_have_text("val")
        expect(page.locator("#status")).to_have_text("queued")
        expect(page.locator("#cancel-run")).to_have_count(0)
    finally:
        context.close()


def test_a_wrong_token_is_refused_on_the_sign_in_page(page: Page, site: dict[str, Any]) -> None:
    allow_console_error(page, "401")
    page.goto(site["base"] + "/login")
    page.fill("#token", "vlab_0000000000000000_" + "x" * 43)
    page.click("#sign-in")
    expect(page.locator("#login-error")).to_contain_text("unknown, revoked or expired")
