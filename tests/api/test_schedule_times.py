"""A schedule's ``created_at`` and ``updated_at`` come from one clock (issue #26): the
API showed a new schedule updated 30 s before it was created, ``updated_at`` being the
API's clock read before vLLM's check of the template and ``created_at`` the database's
at the write."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

import pytest
from fastapi.testclient import TestClient

from orchestrator.core.repositories import utcnow
from orchestrator.schedules import intake
from tests.api.test_api import demo_spec


def _times(doc: dict[str, str]) -> tuple[datetime, datetime]:
    return datetime.fromisoformat(doc["created_at"]), datetime.fromisoformat(doc["updated_at"])


def test_updated_at_is_never_before_created_at(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the API's clock read half a minute before the write (a slow template check, or
    # an API host whose clock is behind the database's)
    monkeypatch.setattr(intake, "utcnow", lambda: utcnow() - timedelta(seconds=30))
    body = {
        "name": f"times-{uuid.uuid4().hex[:6]}",
        "cron": "0 9 * * *",
        "timezone": "UTC",
        "template": demo_spec(),
    }
    resp = client.post("/api/v1/schedules", json=body)
    assert resp.status_code == 201, resp.text
    created, updated = _times(resp.json())
    assert updated == created  # a new schedule: created and last changed at once
    sid = resp.json()["id"]
    assert _times(client.get(f"/api/v1/schedules/{sid}").json()) == (created, updated)
    listed = client.get("/api/v1/schedules", params={"limit": 500}).json()["items"]
    assert _times(next(s for s in listed if s["id"] == sid)) == (created, updated)

    patched = client.patch(f"/api/v1/schedules/{sid}", json={"enabled": False})
    assert patched.status_code == 200, patched.text
    created_after, changed = _times(patched.json())
    assert created_after == created
    assert changed > created  # the change is later than the creation, on the same clock
    again = client.patch(f"/api/v1/schedules/{sid}", json={"cron": "5 * * * *"})
    assert again.status_code == 200, again.text
    assert _times(again.json())[1] > changed >= created
    assert _times(client.get(f"/api/v1/schedules/{sid}").json())[1] == _times(again.json())[1]
