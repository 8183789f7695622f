"""The command line as a client of the API, for people and for CI (issue 26): every command
goes through the real app (a TestClient of ``api.app``; the CLI's HTTP routed to it) and
none opens the database (``Runtime`` refuses to start). ``--json`` prints the API's shapes,
the exit codes are the documented ones (1 a run failed / a regression, 2 a refusal,
3 ``--wait-timeout``, 4 the service unreachable), tables fit 100 columns with the changed
variable whole, numbers are plain, and a refusal is said once.

Seeded data: ``tests/web/data/demo_experiment.json`` (recorded results of the demo
experiment, APC off vs on) and :func:`tests.factories.make_experiment` (queued runs)."""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import yaml
from fastapi.testclient import TestClient
from rich.console import Console
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from orchestrator.cli import client as cli_client
from orchestrator.cli import resources as cli_resources
from orchestrator.cli.main import app
from orchestrator.core import auth
from orchestrator.core.db import unit_of_work
from orchestrator.core.repositories import RunRepository, TokenRepository
from orchestrator.core.settings import get_settings
from orchestrator.core.states import RunStatus
from tests.factories import make_experiment
from tests.orchestrator.cli.conftest import API, cli
from tests.web.seed import DATA, load_export


def lines_of(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


@pytest.fixture
def demo(factory: sessionmaker[Session]) -> str:
    """The recorded demo experiment (baseline and apc-on, two repeats each)."""
    with unit_of_work(factory) as session:
        doc = load_export(
            session, DATA / "demo_experiment.json", name=f"demo-{uuid.uuid4().hex[:6]}"
        )
    return str(doc["experiment_id"])


def test_experiments_show_fits_100_columns_with_the_changed_variable_whole(
    api: TestClient, demo: str
) -> None:
    result = cli("experiments", "show", demo)
    assert result.exit_code == 0, result.output
    out = result.output
    assert max(len(ln) for ln in out.splitlines()) <= 100, out
    assert "engine_args.enable_prefix_caching" in out  # whole, on one line
    assert "…" not in out and "e+0" not in out
    assert "faster" in out and "334" in out  # a ratio, a plain number
    # three significant figures, whole from 1000, as docs/USAGE.md says (not 333.7)
    assert "333.7" not in out and "90.2%" in out, out


def test_runs_show_gives_each_metric_its_unit(api: TestClient, demo: str) -> None:
    run = api.get(f"/api/v1/experiments/{demo}").json()["runs"][1]
    out = cli("runs", "show", run["id"]).output
    rows = {
        cells[0]: cells[1]
        for ln in out.splitlines()
        if len(cells := [c.strip() for c in ln.strip("│ ").split("│")]) == 2
    }
    assert rows["duration"].endswith(" s"), out
    assert rows["median_ttft_ms"].endswith(" ms"), out
    assert rows["output_throughput"].endswith(" tok/s"), out
    assert rows["request_throughput"].endswith(" req/s"), out
    assert rows["prefix_cache_hit_rate"] == "90.2%", out
    assert rows["completed"] == "16", out  # a count: bare


def test_runs_show_prints_the_runs_findings_below_its_metrics(
    api: TestClient, demo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each finding of ``GET /runs/{id}/findings`` on a line (severity, code, message)
    below the metrics; ``--json`` stays the run as the API gives it (no key added)."""
    run = api.get(f"/api/v1/experiments/{demo}").json()["runs"][1]
    findings = api.get(f"/api/v1/runs/{run['id']}/findings").json()["findings"]
    if not findings:  # the recorded run has none: the API's answer, with two
        advice = {"scope": "run", "run_id": run["id"], "action": "-", "evidence": {}}
        findings = [
            {**advice, "code": "client_stalled", "severity": "warning",
             "message": "the load generator stalled for 1.2 s"},
            {**advice, "code": "tpot_bursty", "severity": "info", "message": "TPOT in bursts"},
        ]  # fmt: skip
        real_get = cli_client.Api.get

        def get(self: cli_client.Api, path: str, **params: Any) -> Any:
            if path.endswith("/findings"):
                return {"run_id": run["id"], "findings": findings}
            return real_get(self, path, **params)

        monkeypatch.setattr(cli_client.Api, "get", get)
    shown = cli("runs", "show", run["id"])
    assert shown.exit_code == 0, shown.output
    out = [ln.strip() for ln in shown.output.splitlines()]
    said = [f"{f['severity']} {f['code']}: {f['message']}" for f in findings]
    assert all(line in out for line in said), shown.output
    assert out.index(said[0]) > max(i for i, ln in enumerate(out) if "median_ttft_ms" in ln)
    as_json = cli("runs", "show", run["id"], "--json")
    assert json.loads(as_json.stdout) == api.get(f"/api/v1/runs/{run['id']}").json()


@pytest.mark.parametrize("width", [70, 100])
def test_experiments_list_keeps_each_id_whole_beside_a_long_name(
    api: TestClient, factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch, width: int
) -> None:
    at_width(monkeypatch, width)
    with unit_of_work(factory) as session:
        exp = make_experiment(session, n_runs=1)
        exp.name = "a rather long experiment name: prefix caching on a long shared prompt"
        exp_id = exp.id
    table = cli("experiments", "list", "--limit", "0").output
    assert exp_id in table, table
    assert max(len(ln) for ln in table.splitlines()) <= width, table
    assert "succeeded" in table.split() or "queued" in table.split(), table  # not cut
    assert all(w in table.split() for w in ("experiment", "caching", "prompt")), table


def test_json_shapes_parse_and_are_the_apis(api: TestClient, demo: str) -> None:
    exp = json.loads(cli("experiments", "show", demo, "--json").output)
    assert exp == api.get(f"/api/v1/experiments/{demo}").json()
    listed = json.loads(cli("experiments", "list", "--json").output)
    assert isinstance(listed, list) and demo in [e["id"] for e in listed]
    runs = json.loads(cli("runs", "list", "--experiment-id", demo, "--json").output)
    assert sorted(r["id"] for r in runs) == sorted(r["id"] for r in exp["runs"])
    one = json.loads(cli("runs", "show", runs[0]["id"], "--json").output)
    assert one["id"] == runs[0]["id"] and "metrics" in one
    comp = json.loads(cli("compare", demo, "--json").output)
    assert comp == api.get(f"/api/v1/experiments/{demo}/comparison").json()


def test_runs_list_follows_every_page_and_filters(api: TestClient, demo: str) -> None:
    all_runs = json.loads(
        cli("runs", "list", "--experiment-id", demo, "--limit", "0", "--json").output
    )
    assert len(all_runs) == 4
    # pages of one: the client walks them (offset, or a next link / cursor when given)
    first_two = []
    for item in cli_client.Api(API).pages("/api/v1/runs", {"experiment_id": demo}, 2):
        first_two.append(item["id"])
    assert first_two == [r["id"] for r in all_runs[:2]]
    apc = json.loads(
        cli(
            "runs", "list", "--experiment-id", demo, "--engine-arg",
            "enable_prefix_caching=true", "--json",
        ).output
    )  # fmt: skip
    assert {r["name"] for r in apc} == {"apc-on"}
    table = cli("runs", "list", "--experiment-id", demo, "--sort", "ttft_p50")
    assert table.exit_code == 0, table.output
    assert max(len(ln) for ln in table.output.splitlines()) <= 100, table.output
    assert "engine_args.enable_prefix_caching" in table.output
    assert "p50 ms" in table.output and "37.2" in table.output and "e+0" not in table.output
    # repeats numbered from 1, as the dashboard and MLflow number them
    assert "apc-on #1" in table.output and "apc-on #2" in table.output, table.output
    assert "#0" not in table.output
    assert all(r["id"] in table.output for r in all_runs)  # each id whole, to copy


def at_width(monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    """The commands' console as a terminal ``width`` columns wide."""
    from orchestrator.cli import campaign as cli_campaign
    from orchestrator.cli import main as cli_main
    from orchestrator.cli import resources as cli_resources

    narrow = Console(width=width, color_system=None)
    for module in (cli_resources, cli_campaign, cli_main):
        monkeypatch.setattr(module, "console", narrow)


@pytest.mark.parametrize("width", [70, 100])
def test_runs_list_in_a_narrow_terminal_cuts_and_drops_nothing(
    api: TestClient,
    demo: str,
    factory: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
    width: int,
) -> None:
    """A terminal narrower than 100 columns gets its width: the changed variable whole,
    the TTFT column kept, each id whole; a campaign's one-word run name whole."""
    at_width(monkeypatch, width)
    runs = json.loads(cli("runs", "list", "--experiment-id", demo, "--json").output)
    table = cli("runs", "list", "--experiment-id", demo)
    assert table.exit_code == 0, table.output
    out = table.output
    assert max(len(ln) for ln in out.splitlines()) <= width, out
    assert "engine_args.enable_prefix_caching =" in out and "…" not in out, out
    assert "p50 ms" in out and "37.2" in out and "334" in out, out  # TTFT kept
    assert all(r["id"] in out for r in runs), out
    with unit_of_work(factory) as session:
        exp_id = make_experiment(
            session,
            n_runs=1,
            name="engine_args.enable_prefix_caching=true",
            is_baseline=False,
            changes={"engine_args.enable_prefix_caching": True},
        ).id
    campaign_run = cli("runs", "list", "--experiment-id", exp_id).output
    assert max(len(ln) for ln in campaign_run.splitlines()) <= width, campaign_run
    assert "engine_args.enable_prefix_caching=true " in campaign_run, campaign_run  # whole
    assert "…" not in campaign_run


def test_results_in_a_narrow_terminal_keep_every_column(
    api: TestClient, demo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 70 columns the results table comes in two parts, each with the run and its
    status, rather than dropping the run's column or squeezing it to nothing."""
    at_width(monkeypatch, 70)
    out = cli("experiments", "show", demo).output
    start = out.index("results: ")
    results = out[start : out.index("comparison (", start)]
    assert max(len(ln) for ln in results.splitlines()) <= 70, results
    for label in ("baseline #1", "apc-on #1", "baseline #2", "apc-on #2"):
        assert results.count(label) == 2, results  # in both parts
    for figure in ("334", "90.2%", "7.77x", "tok/s", "KV"):
        assert figure in results, results


def test_a_failed_run_makes_watch_and_show_exit_1(
    api: TestClient, factory: sessionmaker[Session]
) -> None:
    with unit_of_work(factory) as session:
        exp = make_experiment(session, n_runs=2)
        repo = RunRepository(session)
        first, second = sorted(exp.runs, key=lambda r: r.position)
        for run in (first, second):
            repo.transition(run, RunStatus.PREPARING)
            repo.transition(run, RunStatus.RUNNING)
        repo.transition(first, RunStatus.SUCCEEDED)
        repo.transition(second, RunStatus.FAILED, "engine died")
        exp_id = exp.id
    watched = cli("watch", exp_id, "--interval", "0.05")
    assert watched.exit_code == 1, watched.output
    assert "did not succeed" in watched.output and "failed" in watched.output
    as_json = cli("watch", exp_id, "--json", "--interval", "0.05")
    assert as_json.exit_code == 1
    assert json.loads(as_json.stdout)["id"] == exp_id  # stdout is the JSON alone
    shown = cli("experiments", "show", exp_id)
    assert shown.exit_code == 1
    # why, as submit and watch say it (on stderr; stdout keeps the JSON alone with --json)
    assert "1 of 2 run(s) did not succeed: v1 #1 failed" in shown.stderr, shown.output
    shown_json = cli("experiments", "show", exp_id, "--json")
    assert shown_json.exit_code == 1 and "did not succeed" in shown_json.stderr
    assert json.loads(shown_json.stdout)["id"] == exp_id


def test_wait_timeout_exits_3_in_one_line(api: TestClient, factory: sessionmaker[Session]) -> None:
    with unit_of_work(factory) as session:
        exp_id = make_experiment(session, n_runs=1).id  # queued: nothing advances it here
    result = cli("watch", exp_id, "--wait-timeout", "0.2", "--interval", "0.05", "--json")
    assert result.exit_code == 3, result.output
    errors = [ln for ln in lines_of(result.stderr) if ln.startswith("error:")]
    assert len(errors) == 1 and "--wait-timeout" in errors[0] and exp_id in errors[0]
    # with --json, the experiment as it stands on stdout (a CI script reads its id)
    doc = json.loads(result.stdout)
    assert doc["id"] == exp_id and doc["runs"][0]["status"] == "queued"


def test_a_refusal_is_said_once_with_exit_2(api: TestClient, tmp_path: Path) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text("name: bad\nmodel: tiny\nrepeats: 0\nbaseline:\n  workload: {kind: nope}\n")
    result = cli("submit", str(spec))
    assert result.exit_code == 2, result.output
    out = lines_of(result.output)
    assert out[0].startswith("error:") and "(422)" in out[0] and "problem(s)" in out[0]
    fields = out[1:]
    assert fields and all(ln.startswith("  - ") for ln in fields)
    assert len(set(fields)) == len(fields)  # no field said twice
    assert "Traceback" not in result.output
    missing = cli("runs", "show", "no-such-run")
    assert missing.exit_code == 2 and len(lines_of(missing.output)) == 1


def test_unreachable_service_exits_4_in_one_line() -> None:
    result = CliRunner().invoke(app, ["runs", "list", "--api", "http://127.0.0.1:9"])
    assert result.exit_code == 4, result.output
    (line,) = lines_of(result.output)
    assert line.startswith("error: cannot reach the API at http://127.0.0.1:9")


@pytest.mark.parametrize("command", [["runs", "list"], ["campaign", "list"], ["watch", "x"]])
def test_an_api_that_is_not_a_url_is_bad_input_exit_2(command: list[str]) -> None:
    for bad in ("notaurl", "ftp://host", "http://", "http://host:port"):
        result = CliRunner().invoke(app, [*command, "--api", bad])
        assert result.exit_code == 2, result.output  # bad input, not "cannot reach" (4)
        assert "cannot reach" not in result.output and "base URL" in result.output


def test_runs_list_experiment_id_must_be_an_id(api: TestClient, demo: str) -> None:
    """The API answers 200 and no runs for an id that is no UUID (it filters by it); the
    command says the input is bad instead of "no runs match"."""
    assert api.get("/api/v1/runs", params={"experiment_id": "not-a-uuid"}).json()["items"] == []
    result = cli("runs", "list", "--experiment-id", "not-a-uuid")
    assert result.exit_code == 2, result.output
    assert "no runs match" not in result.output and "not an id" in result.output
    assert cli("runs", "list", "--experiment-id", demo).exit_code == 0


def test_compare_exits_1_on_a_regression(api: TestClient, demo: str) -> None:
    comp = api.get(f"/api/v1/experiments/{demo}/comparison").json()
    worse = cli_resources.regressions(comp)
    result = cli("compare", demo)
    assert result.exit_code == (1 if worse else 0), result.output
    assert max(len(ln) for ln in result.output.splitlines()) <= 100
    assert "e+0" not in result.output
    # the verdict of a metric flipped to worse, 30 % worse: a regression named
    regressed = json.loads(json.dumps(comp))
    regressed["variants"][0]["metrics"][0].update(verdict="worse", ratio=1.3)
    assert cli_resources.regressions(regressed)
    assert cli_resources.regressions({"variants": []}) == []


def _tpot_worse(comp: dict[str, Any], ratio: float) -> dict[str, Any]:
    """``comp`` with apc-on's TPOT p50 ``worse`` at ``ratio``, its interval tight around
    it, and every other worse verdict gone: the statistics say worse, the size varies."""
    out = json.loads(json.dumps(comp))
    for v in out["variants"]:
        v["capacity"] = None
        for m in v["metrics"]:
            if m["verdict"] == "worse":
                m["verdict"] = "no clear difference"
            if v["variant"] == "apc-on" and m["metric"] == "median_tpot_ms":
                m.update(verdict="worse", ratio=ratio, ci_low=ratio - 0.001, ci_high=ratio + 0.001)
                m.update(variant=m["reference"] * ratio, ci_of="ratio")
    return out


def test_compare_a_tiny_worse_is_under_the_floor_and_exits_0(
    api: TestClient, demo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A significant but negligible worse change (TPOT +0.2 %, tight interval) keeps its
    ``worse`` verdict in the table, is said once under the 5 % floor, and does not fail
    the command; a large one does; ``--min-change 0`` makes any worse verdict fail it."""
    comp = api.get(f"/api/v1/experiments/{demo}/comparison").json()
    served: dict[str, Any] = {}
    real_call = cli_client.Api.call

    def call(self: cli_client.Api, method: str, path: str, **kw: Any) -> Any:
        if path.endswith("/comparison"):
            return served["comp"]
        return real_call(self, method, path, **kw)

    monkeypatch.setattr(cli_client.Api, "call", call)
    served["comp"] = _tpot_worse(comp, 1.002)
    tiny = cli("compare", demo)
    assert tiny.exit_code == 0, tiny.output
    notes = [ln for ln in lines_of(tiny.output) if "regression floor" in ln]
    assert notes == [
        "apc-on median_tpot_ms worse by 0.2 %: under the 5 % regression floor, not a regression"
    ]
    assert "regression:" not in tiny.output
    assert "worse" in [c.strip() for c in _row(tiny.output, "median_tpot_ms")]  # the verdict
    # --json: the API's answer as it is, the same exit code
    as_json = cli("compare", demo, "--json")
    assert as_json.exit_code == 0 and json.loads(as_json.output) == served["comp"]
    # no floor: any worse verdict is a regression again
    strict = cli("compare", demo, "--min-change", "0")
    assert strict.exit_code == 1, strict.output
    assert "regression: apc-on median_tpot_ms: worse" in strict.output
    assert "regression floor" not in strict.output
    served["comp"] = _tpot_worse(comp, 1.3)
    large = cli("compare", demo)
    assert large.exit_code == 1, large.output
    assert "regression: apc-on median_tpot_ms: worse" in large.output
    assert "regression floor" not in large.output
    assert cli("compare", demo, "--min-change", "40").exit_code == 0
    assert "regression: apc-on median_tpot_ms: worse by 30 %" in large.output  # its size
    # a floor out of 0..1000 % (or not finite) is bad input: one line, exit 2
    for bad in ("-1", "nan", "inf", "1e308", "1001"):
        refused = cli("compare", demo, "--min-change", bad)
        assert refused.exit_code == 2, refused.output
        (line,) = lines_of(refused.output)
        assert line == "error: --min-change must be a percent from 0 to 1000", line
    assert cli("compare", demo, "--min-change", "1000").exit_code == 0
    # just under the floor: never reads as the floor itself (not "5.0 %")
    served["comp"] = _tpot_worse(comp, 1.0496)
    near = [ln for ln in lines_of(cli("compare", demo).output) if "regression floor" in ln]
    assert near == [
        "apc-on median_tpot_ms worse by 4.96 %: under the 5 % regression floor, not a regression"
    ]
    # worse, its interval above 1 but its point ratio below: no negative size
    served["comp"] = _tpot_worse(comp, 0.995)
    for m in served["comp"]["variants"][-1]["metrics"]:
        if m["metric"] == "median_tpot_ms":
            m.update(ci_low=1.001, ci_high=1.01)
    odd = cli("compare", demo)
    assert "-0.5" not in odd.output and "by -" not in odd.output, odd.output
    assert (
        "apc-on median_tpot_ms worse (its point ratio is on the good side of 1): under the 5 % "
        "regression floor, not a regression"
    ) in " ".join(odd.output.split()), odd.output  # wrapped at 100 columns


def test_compare_sizes_a_higher_is_better_worse_by_its_drop() -> None:
    """A throughput ratio 0.96 reads "worse by 4 %" (the drop), not 1 / 0.96 - 1 = 4.2 %;
    the 5 % floor is a drop of 4.76 %: a 4.76 % drop stays under it, said apart from it."""

    def comp(ratio: float) -> dict[str, Any]:
        metric = {"metric": "output_throughput", "verdict": "worse", "ratio": ratio,
                  "direction": "higher_is_better"}  # fmt: skip
        return {"variants": [{"variant": "apc-on", "metrics": [metric]}]}

    assert cli_resources.under_floor(comp(0.96)) == [
        "apc-on output_throughput worse by 4 %: under the 5 % regression floor (a drop of "
        "4.8 % here), not a regression"
    ]
    (line,) = cli_resources.under_floor(comp(0.9524))
    assert "worse by 4.760 %" in line and "a drop of 4.762 % here" in line, line
    assert cli_resources.regressions(comp(0.9)) == ["apc-on output_throughput: worse by 10 %"]
    assert cli_resources.regressions(comp(0.952)) == ["apc-on output_throughput: worse by 4.8 %"]


def test_compare_says_a_variant_with_no_verdict_checked_nothing(
    api: TestClient, demo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every metric of apc-on untrusted or not applicable: the exit code stays 0 (no
    regression), but a line below the table says the comparison checked nothing;
    ``--json`` stays the API's answer."""
    comp = api.get(f"/api/v1/experiments/{demo}/comparison").json()
    blind = json.loads(json.dumps(comp))
    for v in blind["variants"]:
        v["capacity"] = None
        for i, m in enumerate(v["metrics"]):
            if i % 2:
                m.update(verdict="not applicable", ratio=None)
            else:
                m.update(verdict="untrusted", trustworthy=False, untrusted_reason="warm cache")
    real_call = cli_client.Api.call

    def call(self: cli_client.Api, method: str, path: str, **kw: Any) -> Any:
        return blind if path.endswith("/comparison") else real_call(self, method, path, **kw)

    monkeypatch.setattr(cli_client.Api, "call", call)
    result = cli("compare", demo)
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())  # wrapped at 100 columns
    assert said.count("no verdict for ") == len(blind["variants"]), result.output
    for v in blind["variants"]:
        assert (
            f"no verdict for {v['variant']}: every metric is untrusted or not applicable, so "
            "this comparison checked nothing"
        ) in said, result.output
    as_json = cli("compare", demo, "--json")
    assert as_json.exit_code == 0 and json.loads(as_json.stdout) == blind
    assert cli_resources.no_verdict(comp) == []  # the recorded comparison has verdicts


def test_compare_says_a_shared_untrusted_reason_once(
    api: TestClient, demo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several metrics flagged for the same run, with the same long reason (a run's id
    in it): one note below the table, each row referring to its number."""
    comp = api.get(f"/api/v1/experiments/{demo}/comparison").json()
    flagged = json.loads(json.dumps(comp))
    v = flagged["variants"][-1]
    why = f"variant run {uuid.uuid4()}: its load generator stalled"
    other = f"reference run {uuid.uuid4()}: a warm prefix cache"
    shown = [m for m in v["metrics"] if m["metric"] in ("median_ttft_ms", "p99_ttft_ms",
             "median_tpot_ms", "median_e2el_ms")]  # fmt: skip
    assert len(shown) == 4
    for i, m in enumerate(shown):
        m.update(verdict="untrusted", trustworthy=False, untrusted_reason=why if i != 2 else other)
    real_call = cli_client.Api.call

    def call(self: cli_client.Api, method: str, path: str, **kw: Any) -> Any:
        return flagged if path.endswith("/comparison") else real_call(self, method, path, **kw)

    monkeypatch.setattr(cli_client.Api, "call", call)
    out = cli("compare", demo).output
    notes = [ln for ln in lines_of(out) if ln.startswith("note ")]
    assert notes == [f"note 1: untrusted: {why}", f"note 2: untrusted: {other}"], out
    cells = {m["metric"]: _row(out, m["metric"])[-1].strip() for m in shown}
    assert cells == {
        "median_ttft_ms": "untrusted (note 1)",
        "p99_ttft_ms": "untrusted (note 1)",
        "median_tpot_ms": "untrusted (note 2)",
        "median_e2el_ms": "untrusted (note 1)",
    }, out


def _row(table: str, metric: str) -> list[str]:
    """The cells of ``metric``'s row in a rich table."""
    (line,) = [ln for ln in table.splitlines() if ln.startswith("│") and f" {metric} " in ln]
    return line.strip("│ ").split("│")


def test_schedules_create_pause_resume_list_delete(api: TestClient, tmp_path: Path) -> None:
    spec = Path(__file__).resolve().parents[3] / "examples" / "quick-tiny.yaml"
    doc: dict[str, Any] = {"name": f"nightly-{uuid.uuid4().hex[:6]}", "cron": "0 3 * * *"}
    doc["template"] = yaml.safe_load(spec.read_text())
    f = tmp_path / "sched.json"
    f.write_text(json.dumps(doc))
    made = cli("schedules", "create", str(f), "--json")
    assert made.exit_code == 0, made.output
    sid = json.loads(made.stdout)["id"]
    paused = json.loads(cli("schedules", "pause", sid, "--json").stdout)
    assert paused["enabled"] is False
    resumed = cli("schedules", "resume", sid)
    assert resumed.exit_code == 0 and "enabled" in resumed.output
    listed = json.loads(cli("schedules", "list", "--json").stdout)
    assert sid in [s["id"] for s in listed]
    fires = cli("schedules", "fires", sid, "--json")
    assert fires.exit_code == 0 and json.loads(fires.stdout) == []
    table = cli("schedules", "list")  # the id whole on one line, within 100 columns
    assert table.exit_code == 0, table.output
    assert sid in table.output and max(len(ln) for ln in table.output.splitlines()) <= 100
    assert cli("schedules", "delete", sid).exit_code == 0
    assert cli("schedules", "show", sid).exit_code == 2


def test_tokens_through_the_api_first_one_without_a_token(api: TestClient) -> None:
    made = cli("token", "create", "--name", f"ci-{uuid.uuid4().hex[:6]}", "--role", "admin",
               "--json")  # fmt: skip
    assert made.exit_code == 0, made.output
    secret = json.loads(made.stdout)["token"]
    assert secret.startswith("vlab_")
    # the loopback is closed now: without the token, a refusal (401) in one summary line
    denied = cli("token", "list")
    assert denied.exit_code == 2 and "(401)" in denied.output
    os.environ["VLAB_TOKEN"] = secret
    try:
        listed = json.loads(cli("token", "list", "--json").stdout)
        assert [t["role"] for t in listed] == ["admin"] and "token" not in listed[0]
        table = cli("token", "list").output  # the key id whole, within 100 columns
        assert listed[0]["key_id"] in table, table
        assert max(len(ln) for ln in table.splitlines()) <= 100, table
        gone = cli("token", "revoke", listed[0]["name"])
        assert gone.exit_code == 0 and "revoked" in gone.output
    finally:
        del os.environ["VLAB_TOKEN"]


def test_export_mlflow_goes_through_the_api(api: TestClient, demo: str, tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = cli("export", "mlflow", demo, "--tracking-uri", uri, "--max-points", "2", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["experiment_id"] == demo and report["counts"] == {"created": 4}
    again = cli("export", "mlflow", demo, "--tracking-uri", uri, "--max-points", "2")
    assert again.exit_code == 0 and "4 unchanged" in again.output
    missing = cli("export", "mlflow", "no-such-id", "--tracking-uri", uri)
    assert missing.exit_code == 2 and len(lines_of(missing.output)) == 1
    assert "no-such-id" in missing.output


def test_token_create_database_bootstraps_a_service_not_running(
    database_url: str,
    session_factory: sessionmaker[Session],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The one path to the database, only when asked (``--database``): the first token of
    a service that refuses to start without one; without it, the unreachable service's
    line says so."""
    monkeypatch.setenv("DATABASE_URL", database_url)
    monkeypatch.setenv("VLAB_HOME", str(tmp_path / "home"))
    get_settings.cache_clear()
    try:
        name = f"boot-{uuid.uuid4().hex[:6]}"
        down = CliRunner().invoke(
            app,
            ["token", "create", "--name", name, "--role", "admin", "--api", "http://127.0.0.1:9"],
        )
        assert down.exit_code == 4, down.output
        assert "cannot reach the API" in down.output and "--database" in down.output
        made = CliRunner().invoke(
            app, ["token", "create", "--database", "--name", name, "--role", "admin", "--json"]
        )
        assert made.exit_code == 0, made.output
        doc = json.loads(made.stdout)
        assert doc["name"] == name and doc["role"] == "admin"
        assert doc["token"].startswith(f"vlab_{doc['key_id']}_")
    finally:
        get_settings.cache_clear()
        with unit_of_work(session_factory) as session:  # the shared database: open again
            if TokenRepository(session).active_by_name(name) is not None:
                auth.revoke_token(session, name, by="test")


def test_submit_json_and_its_wait_timeout(api: TestClient) -> None:
    spec = Path(__file__).resolve().parents[3] / "examples" / "quick-tiny.yaml"
    made = cli("submit", str(spec), "--no-watch", "--json")
    assert made.exit_code == 0, made.output
    created = json.loads(made.stdout)  # the POST /experiments answer alone on stdout
    assert created["id"] and created["runs"] and "experiment " in made.stderr
    waited = cli("submit", str(spec), "--wait-timeout", "0.2", "--interval", "0.05")
    assert waited.exit_code == 3, waited.output  # queued: nothing runs them here
    assert [ln for ln in lines_of(waited.stderr) if ln.startswith("error:")][0].count(
        "--wait-timeout"
    ) == 1
    as_json = cli("submit", str(spec), "--wait-timeout", "0.2", "--interval", "0.05", "--json")
    assert as_json.exit_code == 3, as_json.output
    doc = json.loads(as_json.stdout)  # the experiment as it stands, for `jq -r .id`
    assert doc["id"] and {r["status"] for r in doc["runs"]} == {"queued"}


def test_links_printed_are_the_dashboards_pages(api: TestClient, demo: str) -> None:
    """submit, runs show and experiments show print the page a person opens (``/runs/<id>``,
    ``/experiments/<id>``), not the API's JSON; --json keeps the API's shapes."""
    spec = Path(__file__).resolve().parents[3] / "examples" / "quick-tiny.yaml"
    made = cli("submit", str(spec), "--no-watch")
    assert made.exit_code == 0, made.output
    assert "/api/v1/" not in made.output, made.output
    exp_id = re.search(rf"{API}/experiments/([0-9a-f-]{{36}})", made.output)
    assert exp_id is not None, made.output
    exp = api.get(f"/api/v1/experiments/{exp_id.group(1)}").json()
    assert all(f"{API}/runs/{r['id']}" in made.output for r in exp["runs"]), made.output
    run = exp["runs"][0]
    shown = cli("runs", "show", run["id"])
    assert f"  {API}/runs/{run['id']}" in shown.output and "/api/v1/" not in shown.output
    assert json.loads(cli("runs", "show", run["id"], "--json").stdout)["url"] == run["url"]
    assert run["url"] == f"{API}/api/v1/runs/{run['id']}"  # the API's own, unchanged
    results = cli("experiments", "show", demo).output
    assert "/api/v1/runs/" not in results and f"{API}/runs/" in results, results


def test_pages_follow_a_next_link_a_cursor_or_the_offset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Keyset pages (a ``next`` link, a ``next_cursor``; null on the last page, whatever
    ``offset`` and ``total`` say) and offset pages are followed alike."""
    asked: list[tuple[str, dict[str, Any]]] = []
    keyset = [
        {"items": [1, 2], "total": 5, "limit": 2, "offset": 0, "next": "/api/v1/runs?c=a"},
        {"items": [3, 4], "total": 5, "limit": 2, "offset": 0, "next_cursor": "b"},
        {"items": [5], "total": 9, "limit": 2, "offset": 0, "next": None},
    ]
    offsets = [
        {"items": [1, 2], "total": 3, "limit": 2, "offset": 0},
        {"items": [3], "total": 3, "limit": 2, "offset": 2},
    ]
    pages: list[dict[str, Any]] = []

    def request(method: str, url: str, **kw: Any) -> httpx.Response:
        asked.append((url, dict(kw.get("params") or {})))
        return httpx.Response(200, json=pages.pop(0))

    monkeypatch.setattr(
        cli_client, "httpx", SimpleNamespace(request=request, HTTPError=httpx.HTTPError)
    )
    pages[:] = keyset
    assert list(cli_client.Api(API).pages("/api/v1/runs", {"status": "failed"}, None)) == [
        1, 2, 3, 4, 5,
    ]  # fmt: skip
    assert asked[1][0] == f"{API}/api/v1/runs?c=a" and asked[2][1]["cursor"] == "b"
    asked.clear()
    pages[:] = offsets
    assert list(cli_client.Api(API).pages("/api/v1/runs", {}, None)) == [1, 2, 3]
    assert [q.get("offset") for _, q in asked] == [None, 2]
