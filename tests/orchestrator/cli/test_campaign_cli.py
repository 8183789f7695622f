"""``vlab campaign submit|list|show|cancel`` against the real API (a TestClient of
``api.app``; the CLI's HTTP calls routed to it). Runs are advanced by the service and
their results are **fake recorded results** (``finish_queued`` of the service tests: the
objective written as each run's stored metric). A fresh database per module."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient
from rich.console import Console
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from orchestrator.cli import campaign as campaign_cli
from orchestrator.cli.main import app
from orchestrator.core.db import unit_of_work
from orchestrator.core.settings import Settings, get_settings
from orchestrator.tuning import service
from tests.api.conftest import settings as settings  # noqa: F401 - fixture
from tests.orchestrator.tuning.test_campaign_service import campaign_doc, finish_queued

API = "http://vlab.test"


def cli(*args: str) -> Any:
    return CliRunner().invoke(app, ["campaign", *args, "--api", API])


def submit(tmp_path: Path, doc: dict[str, Any], name: str = "c.yaml") -> str:
    f = tmp_path / name
    f.write_text(yaml.safe_dump(doc) if name.endswith(".yaml") else json.dumps(doc))
    result = cli("submit", str(f))
    assert result.exit_code == 0, result.output
    assert "queued" in result.output
    return result.output.split("campaign ")[1].split(" ")[0]


def drive(factory: sessionmaker[Session], settings: Settings, cid: str) -> None:  # noqa: F811
    for _ in range(200):
        with unit_of_work(factory) as s:
            row = service.advance(s, settings, cid)
            assert row is not None
            if row.status != "running" and row.status != "queued":
                return
        finish_queued(factory, cid)
    raise AssertionError("the campaign did not end")


def test_submit_show_a_finished_campaign(
    api: TestClient,
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
    tmp_path: Path,
) -> None:
    cid = submit(tmp_path, campaign_doc(name="cli tune"))
    drive(factory, settings, cid)
    result = cli("show", cid)
    assert result.exit_code == 0, result.output
    out = result.output
    assert f"({cid}): succeeded, done" in out
    # the path: the variable, from -> to, its effect with the interval, verdict, reason
    path = out.split("path (adopted steps)")[1].split("candidates")[0]
    assert "engine_args.enable_prefix_caching" in path and "false -> true" in path
    assert "effect [interval]" in path and "pays" in path
    assert "effects are gains: positive is better" in path
    assert "% [" in path and "%]" in path
    # the candidates with their outcomes
    tables = [ln for ln in out.splitlines() if ln[:1] in "┏┃│┡└"]
    assert max(len(ln) for ln in tables) <= 100, out  # the tables fit; names whole
    cands = out.split("candidates")[-1].split("confirmation")[0]
    assert "adopted (pays)" in cands and "128 -> 64" in cands and "worse" in cands
    assert "inert" in cands and "equivalent within" in cands and "skipped" in cands
    conf = out.split("─ confirmation ─")[1] if "─ confirmation ─" in out else out
    assert "measured total" in conf and "product of the step gains" in conf
    assert "agrees with the path" in conf
    # the final configuration as a vllm serve line and a re-run spec
    line = next(ln.strip() for ln in out.splitlines() if ln.strip().startswith("vllm serve tiny"))
    argv = shlex.split(line)
    assert argv[:3] == ["vllm", "serve", "tiny"] and "--enable-prefix-caching" in argv
    assert argv[argv.index("--max-num-seqs") + 1] == "128"
    assert '"enable_prefix_caching": true' in out
    # where the wall time went (the fake results record no timings: zeros, no start)
    costs = out.split("where the wall time went")[1]
    assert "waiting for devices" in costs and "engine start-ups" in costs
    assert "server starts: 0" in costs
    # --json: the API's answer with the final configuration
    doc = json.loads(cli("show", cid, "--json").output)
    assert doc["id"] == cid and doc["serve_command"] == line
    assert doc["spec"]["baseline"]["engine_args"]["enable_prefix_caching"] is True


def test_list_and_cancel(api: TestClient, tmp_path: Path) -> None:
    cid = submit(tmp_path, campaign_doc(name="cli cancel me"), name="c.json")
    listed = cli("list")
    assert listed.exit_code == 0, listed.output
    assert cid in listed.output and "cli cancel me" in listed.output
    as_json = json.loads(cli("list", "--json").stdout)
    assert cid in [c["id"] for c in as_json]
    assert "output_throughput" in listed.output
    # within 100 columns: the id and the updated time whole, nothing cut
    assert max(len(ln) for ln in listed.output.splitlines()) <= 100, listed.output
    row = next(ln for ln in listed.output.splitlines() if cid in ln)
    assert re.search(r"\b\d{4}-\d\d-\d\d \d\d:\d\d\s*$", row), listed.output
    assert "…" not in listed.output
    show = cli("show", cid)
    assert show.exit_code == 0 and "queued" in show.output and "not run (yet)" in show.output
    cancelled = cli("cancel", cid)
    assert cancelled.exit_code == 0, cancelled.output
    assert f"campaign {cid}: cancelled" in cancelled.output
    again = cli("cancel", cid)  # 409: the problem, exit 2 (a refusal)
    assert again.exit_code == 2 and "409" in again.output and "already ended" in again.output


def test_bad_documents_and_unknown_ids(api: TestClient, tmp_path: Path) -> None:
    bad = campaign_doc(space=[{"name": "engine_args.max_num_seq", "levels": [1, 2], "start": 1}])
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(bad))
    result = cli("submit", str(f))
    assert result.exit_code == 2
    assert "422" in result.output and "body.space.0.levels.0" in result.output
    # each problem once: the bullet, not the detail restating it beside
    assert result.output.count("no engine argument") == 1, result.output
    missing = cli("show", "nope")
    assert missing.exit_code == 2 and "404" in missing.output
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    result = cli("submit", str(broken))
    assert result.exit_code == 2 and "Traceback" not in result.output


def test_an_unreachable_api_is_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["campaign", "list", "--api", "http://127.0.0.1:9"])
    assert result.exit_code == 4  # the service unreachable
    assert "cannot reach the API" in result.output and "Traceback" not in result.output


def test_settings_that_do_not_load_are_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLAB_API__PORT", "not-a-port")
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(app, ["campaign", "list"])
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()
    assert result.exit_code == 2, result.output
    assert "invalid setting VLAB_API__PORT" in result.output and "Traceback" not in result.output


def test_show_prints_where_the_wall_time_went_and_the_lost_runs() -> None:
    body = {
        "id": "c1",
        "name": "costs",
        "status": "running",
        "request": {"objective": {"metric": "output_throughput"}},
        "wall_time": {
            "elapsed_s": 200.0,
            "queue_wait_s": 50.0,
            "startup_s": 40.0,
            "warmup_s": 2.0,
            "measure_s": 80.0,
            "stop_s": 3.0,
            "other_s": 5.0,
            "lost_s": 10.0,
            "server_starts": 2,
            "servers_reused": 3,
        },
        "retried": {
            "r1.c1.incumbent": "r1.c1.incumbent.retry1",
            "r1.c3.x=1": "r1.c3.x=1.retry1",
            "r1.c4.x=2": "r1.c4.x=2.retry1",
        },
        "retry_reasons": {
            "r1.c1.incumbent": {
                "kind": "lost",
                "why": "lost to the infrastructure: launch failed: RayActorError",
            },
            "r1.c3.x=1": {
                "kind": "flagged",
                "why": "a finding flagged its objective: client_ttft_lag: token bursts",
            },
        },
        "unmeasured": {"r1.c2.x=1.retry2": "run r1.c2.x=1.retry2 was lost 3 times"},
        "slots": 4,
    }
    out = Console(width=200, record=True)
    campaign_cli.print_campaign(body, out)
    text = out.export_text()
    costs = text.split("where the wall time went")[1]
    rows = {ln.split("│")[1].strip(): ln for ln in costs.splitlines() if ln.count("│") >= 3}
    assert "50.0" in rows["waiting for devices"] and "25%" in rows["waiting for devices"]
    assert "40.0" in rows["engine start-ups"] and "20%" in rows["engine start-ups"]
    assert "80.0" in rows["measurement"] and "40%" in rows["measurement"]
    assert "200.0" in rows["elapsed (the campaign)"]
    assert "server starts: 2 (3 run(s) reused a running server)" in costs
    # each run measured again says why: lost, or flagged (never "lost" for a flagged one)
    assert (
        "measured again (lost to the infrastructure: launch failed: RayActorError): "
        "r1.c1.incumbent -> r1.c1.incumbent.retry1"
    ) in costs
    assert (
        "measured again (a finding flagged its objective: client_ttft_lag: token bursts): "
        "r1.c3.x=1 -> r1.c3.x=1.retry1"
    ) in costs
    assert "measured again: r1.c4.x=2 -> r1.c4.x=2.retry1" in costs  # kept before reasons
    assert "lost to the infrastructure, measured again" not in costs
    assert "not measured again: r1.c2.x=1.retry2: run r1.c2.x=1.retry2 was lost 3" in costs
    assert "measured side by side: up to 4 configurations at once" in costs
    campaign_cli.print_campaign({**body, "slots": 1}, quiet := Console(width=200, record=True))
    assert "measured side by side" not in quiet.export_text()


def test_a_confirmation_that_disagrees_says_why_it_can_for_one_change_and_for_several() -> None:
    gain = {"estimate": 0.26, "low": 0.1, "high": 0.4, "n": 3, "confidence": 0.95}
    conf = {"total": gain, "steps": gain, "interaction": gain, "agrees": False}
    body: dict[str, Any] = {
        "id": "c1",
        "name": "x",
        "status": "succeeded",
        "request": {"objective": {"metric": "output_throughput"}},
        "confirmation": conf,
    }
    step = {
        "round": 1,
        "variable": "a",
        "from_level": False,
        "to_level": True,
        "verdict": "pays",
        "effect": "+30.0% [+10.0%, +50.0%]",
        "gain": gain,
        "reason": "paid",
    }
    body["path"] = [step]
    one = Console(width=200, record=True)
    campaign_cli.print_campaign(body, one)
    assert "does NOT agree with the path (one change: noise or drift" in one.export_text()
    two = Console(width=200, record=True)
    campaign_cli.print_campaign({**body, "path": [step, {**step, "variable": "b"}]}, two)
    assert "does NOT agree with the path (the variables may interact" in two.export_text()


def test_show_follow_prints_progress_until_the_campaign_ends(
    api: TestClient,
    tmp_path: Path,
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--follow`` looks again every ``--interval`` while the campaign is queued or
    running (a line when something moved), then shows it all once it ended."""
    cid = submit(tmp_path, campaign_doc(name="followed"))
    looks: list[float] = []

    def wait(seconds: float) -> None:  # the campaign moves on while the CLI waits
        looks.append(seconds)
        drive(factory, settings, cid)

    monkeypatch.setattr(campaign_cli.time, "sleep", wait)
    result = cli("show", cid, "--follow", "--interval", "0.5")
    assert result.exit_code == 0, result.output
    assert looks == [0.5]
    first = result.output.splitlines()[0]
    assert first.startswith("queued (-): 0 of 40 runs, 0 step(s) adopted"), first
    assert "succeeded, done" in result.output and "path (adopted steps)" in result.output
    # an ended campaign: no waiting
    assert cli("show", cid, "--follow").exit_code == 0 and looks == [0.5]


def test_show_follow_wait_timeout_exits_3_while_the_campaign_goes_on(
    api: TestClient,
    tmp_path: Path,
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    """``--wait-timeout`` bounds ``--follow`` like ``submit``/``watch``: exit code 3, the
    progress said, the reason last on stderr, the campaign as it stands on stdout with
    --json; the campaign keeps going and a later follow sees it end."""
    cid = submit(tmp_path, campaign_doc(name="bounded"))
    result = cli("show", cid, "--follow", "--interval", "0.1", "--wait-timeout", "0.3", "--json")
    assert result.exit_code == 3, result.output
    now = json.loads(result.stdout)
    assert now["id"] == cid and now["status"] == "queued"
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("queued (-): 0 of 40 runs"), lines
    assert lines[-1].startswith("error: --wait-timeout 0.3 s passed: campaign " + cid)
    assert "is queued (it keeps going" in lines[-1]

    assert cli("show", cid, "--follow", "--wait-timeout", "0").exit_code == 3
    assert cli("show", cid, "--wait-timeout", "5").exit_code == 2  # needs --follow

    drive(factory, settings, cid)
    ended = cli("show", cid, "--follow", "--wait-timeout", "0", "--json")
    assert ended.exit_code == 0, ended.output
    assert json.loads(ended.stdout)["status"] == "succeeded"
