"""Offline: no page of the dashboard, nor the API docs, loads anything from another host."""

from __future__ import annotations

from typing import Any

from playwright.sync_api import Page, Request


def test_every_page_loads_only_local_assets(
    page: Page, live_server: str, seeded: dict[str, Any]
) -> None:
    requested: list[str] = []

    def record(req: Request) -> None:
        requested.append(req.url)

    page.on("request", record)
    real = seeded["real"]
    base, apc = real["runs"]["baseline#0"], real["runs"]["apc-on#0"]
    for path in (
        "/",
        f"/experiments/{real['experiment_id']}",
        f"/runs/{apc}",
        f"/compare?run={base}&run={apc}",
        "/schedules",
        "/docs",
    ):
        page.goto(live_server + path)
        page.wait_for_load_state("networkidle")
        if path.startswith("/runs/"):
            # the run page fetches its requests after drawing its charts, which on a busy
            # machine can leave the network idle for 0.5 s in between: leaving then aborts it
            page.wait_for_selector("#run[data-loaded='true']", state="attached")
    foreign = [u for u in requested if not u.startswith((live_server, "data:", "blob:"))]
    assert foreign == []
    # the API docs really rendered from the vendored Swagger UI
    assert page.locator(".swagger-ui .info .title").first.inner_text().startswith("vlab")
    assert any(u.endswith("/static/vendor/swagger-ui/swagger-ui-bundle.js") for u in requested)
