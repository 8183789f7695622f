"""Authentication and roles: the loopback rule, the role matrix, tokens (API and CLI),
dashboard sessions with CSRF, the start-up refusal, and who-did-what records.

A fresh database per module: tokens created here must not close the API for the
other tests (they run with no token, i.e. open on loopback).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, delete, select
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from api.app import create_app
from orchestrator.core import auth
from orchestrator.core.db import normalize_url, upgrade_to_head
from orchestrator.core.models import (
    ApiToken,
    AuditEvent,
    Experiment,
    Run,
    Schedule,
    WebSession,
)
from orchestrator.core.repositories import utcnow
from orchestrator.core.settings import ApiSettings, Settings
from tests.api.test_api import demo_spec
from tests.conftest import fresh_database
from tests.factories import make_experiment

PROBLEM = "application/problem+json"


@pytest.fixture(scope="module")
def factory(server_url: str) -> Iterator[sessionmaker[Session]]:
    with fresh_database(server_url) as url:
        upgrade_to_head(url)
        engine = create_engine(normalize_url(url))
        factory = sessionmaker(bind=engine, expire_on_commit=False)
        factory.url = url  # type: ignore[attr-defined]
        try:
            yield factory
        finally:
            engine.dispose()


@pytest.fixture(autouse=True)
def no_tokens(factory: sessionmaker[Session]) -> Iterator[None]:
    """Every test starts (and ends) with no token, session or audit event."""

    def wipe() -> None:
        with factory.begin() as s:
            s.execute(delete(WebSession))
            s.execute(delete(ApiToken))
            s.execute(delete(AuditEvent))

    wipe()
    yield
    wipe()


@pytest.fixture
def client(settings: Settings, factory: sessionmaker[Session]) -> Iterator[TestClient]:
    with TestClient(create_app(settings, factory)) as c:
        yield c


def make_token(
    factory: sessionmaker[Session], role: str, name: str | None = None, **kw: Any
) -> str:
    with factory.begin() as s:
        _, secret = auth.create_token(
            s, name=name or f"{role}-user", role=role, created_by="test", **kw
        )
    return secret


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def queued_run(factory: sessionmaker[Session]) -> str:
    with factory.begin() as s:
        exp = make_experiment(s, n_runs=1)
        return exp.runs[0].id


def assert_problem(resp: Any, status: int, code: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith(PROBLEM)
    body: dict[str, Any] = resp.json()
    assert body["code"] == code, body
    return body


# ------------------------------------------------------------------ the loopback rule


def test_no_token_on_loopback_is_open_as_anonymous_admin(
    client: TestClient, factory: sessionmaker[Session]
) -> None:
    assert client.get("/api/v1/experiments").status_code == 200
    assert client.get("/api/v1/auth/me").json() == {
        "name": "anonymous",
        "role": "admin",
        "via": "open",
    }
    run_id = queued_run(factory)
    resp = client.post(f"/api/v1/runs/{run_id}/cancel")
    assert resp.status_code == 202 and resp.json()["cancelled_by"] == "anonymous"
    assert client.get("/api/v1/tokens").status_code == 200  # admin things too
    assert client.get("/").status_code == 200  # pages: no sign-in
    assert client.get("/openapi.json").status_code == 200


def test_no_token_but_a_remote_client_is_not_open(
    settings: Settings, factory: sessionmaker[Session]
) -> None:
    """Open access trusts loopback clients only, whatever the bind address claims."""
    with TestClient(create_app(settings, factory), client=("203.0.113.7", 4000)) as c:
        assert_problem(c.get("/api/v1/experiments"), 401, "unauthenticated")
    with TestClient(create_app(settings, factory), client=("127.0.0.1", 4000)) as c:
        assert c.get("/api/v1/experiments").status_code == 200


def test_once_a_token_exists_every_request_needs_one(
    client: TestClient, factory: sessionmaker[Session]
) -> None:
    make_token(factory, "viewer")
    for method, path in [
        ("GET", "/api/v1/experiments"),
        ("GET", "/api/v1/runs"),
        ("POST", "/api/v1/experiments"),
        ("GET", "/api/v1/schedules"),
        ("POST", "/api/v1/analyze/kv-cache"),
        ("GET", "/openapi.json"),
    ]:
        resp = client.request(method, path)
        body = assert_problem(resp, 401, "unauthenticated")
        assert resp.headers["www-authenticate"].startswith("Bearer")
        assert "Authorization: Bearer" in body["detail"]
    # open: health, static assets, the sign-in page
    assert client.get("/healthz").status_code == 200
    assert client.get("/static/css/app.css").status_code == 200
    assert client.get("/login").status_code == 200
    # pages send the browser to the sign-in page, keeping where it was going
    page = client.get("/schedules?page=2", follow_redirects=False)
    assert page.status_code == 303
    assert page.headers["location"] == "/login?next=/schedules%3Fpage%3D2"
    assert client.get("/docs", follow_redirects=False).status_code == 303


def test_wrong_revoked_and_expired_tokens_are_401(
    client: TestClient, factory: sessionmaker[Session]
) -> None:
    good = make_token(factory, "viewer", "alice")
    assert client.get("/api/v1/runs", headers=bearer(good)).status_code == 200
    key_id = auth.parse_token(good)[0]  # type: ignore[index]
    for wrong in (
        "nonsense",
        good[:-4] + "AAAA",  # the right key id, a wrong secret
        f"vlab_{'0' * 16}_{'x' * 43}",
        "",
    ):
        resp = client.get("/api/v1/runs", headers=bearer(wrong))
        body = assert_problem(resp, 401, "unauthenticated")
        assert resp.headers["www-authenticate"].startswith("Bearer")
        if wrong:
            assert "unknown, revoked or expired" in body["detail"]

    with factory.begin() as s:
        auth.revoke_token(s, key_id, by="test")
    make_token(factory, "viewer", "bob")  # a token still exists: no open access
    assert_problem(client.get("/api/v1/runs", headers=bearer(good)), 401, "unauthenticated")

    expired = make_token(factory, "admin", "old", expires_at=utcnow() - timedelta(seconds=1))
    assert_problem(client.get("/api/v1/runs", headers=bearer(expired)), 401, "unauthenticated")


# ------------------------------------------------------------------ the role matrix


def test_role_matrix(client: TestClient, factory: sessionmaker[Session]) -> None:
    viewer = bearer(make_token(factory, "viewer"))
    operator = bearer(make_token(factory, "operator"))
    admin = bearer(make_token(factory, "admin"))
    run_id = queued_run(factory)

    # viewers read everything
    for path in (
        "/api/v1/experiments",
        "/api/v1/runs",
        f"/api/v1/runs/{run_id}",
        "/api/v1/schedules",
        "/api/v1/auth/me",
        "/openapi.json",
    ):
        assert client.get(path, headers=viewer).status_code == 200, path
    # ... and change nothing: 403 naming the role needed
    for method, path, body in [
        ("POST", "/api/v1/experiments", demo_spec()),
        ("POST", f"/api/v1/runs/{run_id}/cancel", None),
        ("POST", f"/api/v1/runs/{run_id}/variants", {"name": "x", "changes": {"seed": 1}}),
        ("POST", "/api/v1/schedules", {}),
        ("PATCH", "/api/v1/schedules/nope", {"enabled": False}),
        ("DELETE", "/api/v1/schedules/nope", None),
        ("POST", "/api/v1/analyze/kv-cache", {}),
    ]:
        resp = client.request(method, path, json=body, headers=viewer)
        problem = assert_problem(resp, 403, "forbidden")
        assert problem["required_role"] == "operator" and problem["role"] == "viewer"
        assert "needs the operator role" in problem["detail"]
    # a viewer asking for an admin action is told it needs admin
    resp = client.post("/api/v1/cluster/parity", json={}, headers=viewer)
    assert assert_problem(resp, 403, "forbidden")["required_role"] == "admin"

    # operators change things, but neither tokens nor cluster parity checks
    assert client.post(f"/api/v1/runs/{run_id}/cancel", headers=operator).status_code == 202
    for method, path, body in [
        ("POST", "/api/v1/tokens", {"name": "eve", "role": "admin"}),
        ("GET", "/api/v1/tokens", None),
        ("DELETE", "/api/v1/tokens/viewer-user", None),
        ("GET", "/api/v1/audit", None),
        ("POST", "/api/v1/cluster/parity", {}),
    ]:
        resp = client.request(method, path, json=body, headers=operator)
        problem = assert_problem(resp, 403, "forbidden")
        assert problem["required_role"] == "admin" and "needs the admin role" in problem["detail"]

    # admins do everything
    resp = client.post("/api/v1/cluster/parity", json={}, headers=admin)
    assert resp.status_code == 202, resp.text
    assert client.get("/api/v1/tokens", headers=admin).status_code == 200
    assert client.get("/api/v1/auth/me", headers=admin).json() == {
        "name": "admin-user",
        "role": "admin",
        "via": "token",
    }


def test_tokens_over_the_api(client: TestClient, factory: sessionmaker[Session]) -> None:
    admin = bearer(make_token(factory, "admin", "root"))
    resp = client.post(
        "/api/v1/tokens",
        json={"name": "ci", "role": "operator", "expires_in_days": 1},
        headers=admin,
    )
    assert resp.status_code == 201, resp.text
    created = resp.json()
    assert created["token"].startswith("vlab_") and created["created_by"] == "root"
    assert created["active"] and created["expires_at"] is not None
    ci = bearer(created["token"])
    assert client.get("/api/v1/auth/me", headers=ci).json()["role"] == "operator"

    listed = client.get("/api/v1/tokens", headers=admin).json()
    assert {t["name"] for t in listed} == {"root", "ci"}
    assert all("token" not in t and "secret_hash" not in t for t in listed)
    dup = client.post("/api/v1/tokens", json={"name": "ci", "role": "viewer"}, headers=admin)
    assert_problem(dup, 409, "token_name_taken")
    bad = client.post("/api/v1/tokens", json={"name": "x", "role": "root"}, headers=admin)
    assert_problem(bad, 422, "request_invalid")

    revoked = client.delete("/api/v1/tokens/ci", headers=admin)
    assert revoked.status_code == 200 and revoked.json()["revoked_by"] == "root"
    assert_problem(client.get("/api/v1/runs", headers=ci), 401, "unauthenticated")
    assert_problem(client.delete("/api/v1/tokens/ci", headers=admin), 404, "token_not_found")

    # only the hash and salt are stored
    with factory() as s:
        row = s.scalar(select(ApiToken).where(ApiToken.name == "ci"))
        assert row is not None and created["token"].split("_", 2)[2] not in (
            row.secret_hash + row.salt
        )
        assert row.last_used_at is not None


# ------------------------------------------------------------------ who did what


def test_submitter_canceller_and_schedule_editors_are_recorded(
    client: TestClient, factory: sessionmaker[Session]
) -> None:
    op = bearer(make_token(factory, "operator", "olga"))
    admin = bearer(make_token(factory, "admin", "ada"))
    resp = client.post("/api/v1/experiments", json=demo_spec(name="audited"), headers=op)
    assert resp.status_code == 201, resp.text
    exp_id = resp.json()["id"]
    exp = client.get(f"/api/v1/experiments/{exp_id}", headers=op).json()
    assert exp["submitted_by"] == "olga"
    assert {r["submitted_by"] for r in exp["runs"]} == {"olga"}
    assert {r["cancelled_by"] for r in exp["runs"]} == {None}

    run_id = exp["runs"][1]["id"]
    cancelled = client.post(f"/api/v1/runs/{run_id}/cancel", headers=admin)
    assert cancelled.status_code == 202 and cancelled.json()["cancelled_by"] == "ada"
    # an active run: the cancel is a request, recorded the same way
    with factory.begin() as s:
        run = s.get(Run, exp["runs"][0]["id"])
        assert run is not None
        run.status = "running"
    asked = client.post(f"/api/v1/runs/{exp['runs'][0]['id']}/cancel", headers=op).json()
    assert asked["cancel_requested"] and asked["cancelled_by"] == "olga"

    body = {"name": "nightly-auth", "cron": "0 3 * * *", "timezone": "UTC", "template": demo_spec()}
    sched = client.post("/api/v1/schedules", json=body, headers=op)
    assert sched.status_code == 201, sched.text
    assert sched.json()["created_by"] == "olga" and sched.json()["updated_by"] == "olga"
    sid = sched.json()["id"]
    patched = client.patch(f"/api/v1/schedules/{sid}", json={"enabled": False}, headers=admin)
    assert patched.json()["created_by"] == "olga" and patched.json()["updated_by"] == "ada"

    with factory() as s:
        stored = s.get(Experiment, exp_id)
        assert stored is not None and stored.submitted_by == "olga"
        row = s.get(Schedule, sid)
        assert row is not None and (row.created_by, row.updated_by) == ("olga", "ada")

    # ... and on the pages (which take a bearer token too)
    page = client.get(f"/experiments/{exp_id}", headers=op).text
    assert '<span id="exp-submitted-by">olga</span>' in page
    page = client.get(f"/runs/{run_id}", headers=op).text
    assert '<span id="submitted-by">olga</span>' in page
    assert '<dd id="cancelled-by">ada</dd>' in page
    page = client.get(f"/schedules/{sid}", headers=op).text
    assert '<span id="created-by">olga</span>' in page
    assert '<span id="updated-by">ada</span>' in page

    events = client.get("/api/v1/audit", headers=admin).json()["items"]
    seen = [(e["actor"], e["action"], e["target"]) for e in reversed(events)]
    assert seen == [
        ("olga", "POST", "/api/v1/experiments"),
        ("ada", "POST", f"/api/v1/runs/{run_id}/cancel"),
        ("olga", "POST", f"/api/v1/runs/{exp['runs'][0]['id']}/cancel"),
        ("olga", "POST", "/api/v1/schedules"),
        ("ada", "PATCH", f"/api/v1/schedules/{sid}"),
    ]
    # a refused request changes nothing and leaves no event
    client.delete(f"/api/v1/schedules/{sid}", headers=bearer(make_token(factory, "viewer")))
    assert client.get("/api/v1/audit", headers=admin).json()["total"] == len(events)


# ------------------------------------------------------------------ dashboard sessions


def sign_in(client: TestClient, token: str, next_url: str = "/") -> Any:
    form = client.get(f"/login?next={next_url}")
    csrf = re.search(r'name="csrf" value="([^"]+)"', form.text)
    assert csrf, form.text
    return client.post(
        "/login",
        data={"csrf": csrf.group(1), "next": next_url, "token": token},
        follow_redirects=False,
    )


def page_csrf(html: str) -> str:
    m = re.search(r'<meta name="csrf-token" content="([^"]+)">', html)
    assert m, "no CSRF token on the page"
    return m.group(1)


def test_dashboard_session_cookie_and_csrf(
    client: TestClient, factory: sessionmaker[Session]
) -> None:
    token = make_token(factory, "operator", "dana")
    bad = sign_in(client, "vlab_0000000000000000_" + "x" * 43)
    assert bad.status_code == 401 and "unknown, revoked or expired" in bad.text

    resp = sign_in(client, token, "/schedules")
    assert resp.status_code == 303 and resp.headers["location"] == "/schedules"
    cookie = next(c for c in resp.headers.get_list("set-cookie") if c.startswith("vlab_session="))
    attrs = {a.strip().lower() for a in cookie.split(";")}
    assert "httponly" in attrs and "samesite=strict" in attrs and "path=/" in attrs
    assert token not in cookie

    page = client.get("/schedules")
    assert page.status_code == 200 and "signed in as" in page.text and "dana" in page.text
    csrf = page_csrf(page.text)
    assert client.get("/api/v1/auth/me").json() == {
        "name": "dana",
        "role": "operator",
        "via": "session",
    }

    run_id = queued_run(factory)
    # the cookie alone does not change anything (what a forged cross-site form would send)
    forged = client.post(f"/api/v1/runs/{run_id}/cancel")
    assert "CSRF" in assert_problem(forged, 403, "csrf_failed")["detail"]
    wrong = client.post(f"/api/v1/runs/{run_id}/cancel", headers={"X-CSRF-Token": "guess"})
    assert_problem(wrong, 403, "csrf_failed")
    with factory() as s:
        run = s.get(Run, run_id)
        assert run is not None and run.status == "queued"
    ok = client.post(f"/api/v1/runs/{run_id}/cancel", headers={"X-CSRF-Token": csrf})
    assert ok.status_code == 202 and ok.json()["cancelled_by"] == "dana"

    # sign-out needs the CSRF token too, then the cookie is worthless
    assert client.post("/logout", data={"csrf": "guess"}).status_code == 403
    out = client.post("/logout", data={"csrf": csrf}, follow_redirects=False)
    assert out.status_code == 303 and out.headers["location"] == "/login"
    assert_problem(client.get("/api/v1/runs"), 401, "unauthenticated")


def test_login_form_needs_its_csrf_cookie_and_sessions_end_with_their_token(
    client: TestClient, factory: sessionmaker[Session]
) -> None:
    token = make_token(factory, "viewer", "vic")
    # a login form posted from elsewhere (no login CSRF cookie) is refused
    forged = client.post(
        "/login", data={"csrf": "x", "next": "/", "token": token}, follow_redirects=False
    )
    assert forged.status_code == 403
    # next never leaves the site
    resp = sign_in(client, token, "//evil.example/")
    assert resp.status_code == 303 and resp.headers["location"] == "/"
    assert client.get("/api/v1/auth/me").json()["via"] == "session"
    with factory.begin() as s:
        auth.revoke_token(s, "vic", by="test")
    make_token(factory, "admin", "keeper")
    assert_problem(client.get("/api/v1/auth/me"), 401, "unauthenticated")
    assert client.get("/", follow_redirects=False).status_code == 303
    with factory() as s:
        assert s.scalars(select(WebSession)).all() == []


# ------------------------------------------------------------------ start-up rule


def test_non_loopback_without_a_token_refuses_to_start(
    settings: Settings, factory: sessionmaker[Session], caplog: pytest.LogCaptureFixture
) -> None:
    public = settings.model_copy(update={"api": ApiSettings(host="0.0.0.0")})
    with pytest.raises(auth.AuthSetupError, match="refusing to listen on 0.0.0.0"):
        create_app(public, factory)

    # explicitly without authentication: starts, warns loudly, everyone is admin
    off = settings.model_copy(update={"api": ApiSettings(host="0.0.0.0", auth="none")})
    with caplog.at_level(logging.WARNING):
        app = create_app(off, factory)
    assert any("authentication is OFF" in r.getMessage() for r in caplog.records)
    with TestClient(app, client=("203.0.113.7", 4000)) as c:
        assert c.get("/api/v1/auth/me").json()["via"] == "disabled"

    # with a token: starts, and requires it
    token = make_token(factory, "viewer")
    with TestClient(create_app(public, factory), client=("127.0.0.1", 4000)) as c:
        assert_problem(c.get("/api/v1/runs"), 401, "unauthenticated")
        assert c.get("/api/v1/runs", headers=bearer(token)).status_code == 200


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_hosts(host: str) -> None:
    assert auth.is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.0.0.5", "example.com", "192.168.1.2"])
def test_not_loopback_hosts(host: str) -> None:
    assert not auth.is_loopback(host)


def cli_settings(settings: Settings, factory: sessionmaker[Session], **api: Any) -> Settings:
    return settings.model_copy(
        update={
            "database_url": factory.url,  # type: ignore[attr-defined]
            "api": ApiSettings(**api),
        }
    )


def test_cli_serve_on_all_interfaces_without_a_token_refuses_in_one_line(
    settings: Settings, factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    from orchestrator.cli import main as cli
    from orchestrator.cli import serving

    monkeypatch.setattr(serving, "get_settings", lambda: cli_settings(settings, factory))
    monkeypatch.setattr(serving, "_setup_logging", lambda verbose=False: None)
    result = CliRunner().invoke(cli.app, ["serve", "--host", "0.0.0.0", "--port", "1"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error: refusing to listen on 0.0.0.0: no API token exists")
    assert "VLAB_API__AUTH=none" in lines[0]


def test_cli_token_create_list_revoke(
    settings: Settings,
    factory: sessionmaker[Session],
    client: TestClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``vlab token`` goes through the API (its HTTP answered by ``client``): the first
    token needs none (loopback is open), the others an admin's VLAB_TOKEN."""
    from types import SimpleNamespace

    from orchestrator.cli import client as cli_client
    from orchestrator.cli import main as cli

    def request(method: str, url: str, **kw: Any) -> Any:
        kw.pop("timeout", None)
        return client.request(method, url, **kw)

    monkeypatch.setattr(
        cli_client, "httpx", SimpleNamespace(request=request, HTTPError=httpx.HTTPError)
    )
    monkeypatch.delenv("VLAB_TOKEN", raising=False)
    runner = CliRunner()

    def vlab(*args: str) -> Any:
        return runner.invoke(cli.app, [*args, "--api", "http://testserver"])

    root = vlab("token", "create", "--name", "root", "--role", "admin")
    assert root.exit_code == 0, root.output
    monkeypatch.setenv(
        "VLAB_TOKEN", next(ln for ln in root.output.splitlines() if ln.startswith("vlab_"))
    )
    made = vlab("token", "create", "--name", "carol", "--role", "operator")
    assert made.exit_code == 0, made.output
    secret = next(line for line in made.output.splitlines() if line.startswith("vlab_"))
    assert client.get("/api/v1/auth/me", headers=bearer(secret)).json()["name"] == "carol"

    dup = vlab("token", "create", "--name", "carol", "--role", "viewer")
    assert dup.exit_code == 2 and "an active token is named 'carol'" in dup.output
    bad = vlab("token", "create", "--name", "x", "--role", "root")
    assert bad.exit_code == 2 and "role" in bad.output and "admin" in bad.output

    listed = vlab("token", "list")
    assert listed.exit_code == 0 and "carol" in listed.output and "operator" in listed.output
    assert secret not in listed.output

    gone = vlab("token", "revoke", "carol")
    assert gone.exit_code == 0 and "revoked" in gone.output
    assert "carol" not in vlab("token", "list").output
    assert "carol" in vlab("token", "list", "--all").output
    assert vlab("token", "revoke", "root").exit_code == 0
    # no active token left: loopback is open again
    assert client.get("/api/v1/auth/me").json()["via"] == "open"
    with factory() as s:
        actions = [
            (e.action, e.target) for e in s.scalars(select(AuditEvent).order_by(AuditEvent.id))
        ]
    assert ("POST", "/api/v1/tokens") in actions
    assert ("DELETE", "/api/v1/tokens/carol") in actions


def test_a_scheduled_sweep_is_submitted_by_its_schedule(
    settings: Settings, factory: sessionmaker[Session]
) -> None:
    from orchestrator.experiments.engine_catalog import load_catalog
    from orchestrator.schedules.service import fire_due_schedules

    now = utcnow().replace(second=0, microsecond=0) + timedelta(seconds=10)
    with factory.begin() as s:
        s.add(
            Schedule(
                name="sweeper",
                cron="* * * * *",
                timezone="UTC",
                template=demo_spec(name="swept"),
                concurrency_policy="queue",
                catch_up="latest",
                next_fire_at=now - timedelta(seconds=10),
            )
        )
    fired = fire_due_schedules(factory, settings, load_catalog(settings), now=now)
    exp_ids = [f.experiment_id for f in fired if f.status == "fired"]
    assert len(exp_ids) == 1, fired
    with factory() as s:
        exp = s.get(Experiment, exp_ids[0])
        assert exp is not None and exp.submitted_by == "schedule:sweeper"
        assert {r.submitted_by for r in exp.runs} == {"schedule:sweeper"}
