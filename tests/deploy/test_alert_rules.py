"""The Prometheus alert rules (deploy/prometheus/alerts.yml) load, do what their unit tests
say, and watch series the service really exports.

- ``promtool check rules`` and ``promtool test rules alerts_test.yml`` pass (promtool:
  Debian's, unpacked into .venv/bin by ``make promtool``). Without promtool the two
  tests fail when ``CI`` is set (``make test`` installs it, so a missing one is a broken
  set-up, never a silent skip) and are skipped, with the reason, elsewhere.
- Every alert is unit-tested where it fires and where it does not, carries a severity,
  a ``for`` (or an ``increase`` window), a summary, a description and a runbook link to
  its section of docs/OPERATIONS.md.
- Every series of the service's that a rule names (``vlab_*``, ``process_*``), and every
  label value it matches, is in a real scrape of ``GET /metrics`` (real Postgres, a
  dispatcher in this process), so renaming a metric or a label value breaks this test,
  not the alerts in production.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from jobs.schemas import RunResult
from orchestrator.core import telemetry
from orchestrator.core.db import make_engine, make_session_factory, unit_of_work, upgrade_to_head
from orchestrator.core.repositories import RunRepository
from orchestrator.core.settings import EngineSettings, Settings
from orchestrator.runs.service import record_result
from tests.conftest import fresh_database
from tests.factories import DATA

ROOT = Path(__file__).resolve().parents[2]
RULES_DIR = ROOT / "deploy" / "prometheus"
RULES = RULES_DIR / "alerts.yml"
RULE_TESTS = RULES_DIR / "alerts_test.yml"
OPERATIONS = ROOT / "docs" / "OPERATIONS.md"
SELECTOR = re.compile(r"\b((?:vlab|process)_[a-z0-9_]+)\b(?:\{([^}]*)\})?")
MATCHER = re.compile(r'([a-z_]+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
#: Series of Prometheus itself the rules may use besides the service's (``vlab_*`` and
#: prometheus_client's ``process_*``).
PROMETHEUS_SERIES = {"up"}


def promtool() -> str:
    """The promtool to run: ``VLAB_PROMTOOL``, the one beside this interpreter
    (``make promtool``), or one on ``PATH``. Missing: a failure in CI, else a skip."""
    for candidate in (
        os.environ.get("VLAB_PROMTOOL"),
        str(Path(sys.executable).parent / "promtool"),
        shutil.which("promtool"),
    ):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    message = "promtool not found: run `make promtool` (Debian's promtool into .venv/bin)"
    if os.environ.get("CI"):  # as the engine tests (tests/conftest.py)
        pytest.fail(message + "; CI is set, so this is a broken set-up, not a skip")
    pytest.skip(message)


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *args], cwd=RULES_DIR, capture_output=True, text=True, timeout=120
    )


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def alerts() -> list[dict[str, Any]]:
    return [rule for rule in rules() if "alert" in rule]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def test_promtool_checks_the_rules() -> None:
    result = run_promtool("check", "rules", RULES.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout, result.stdout


def test_promtool_unit_tests_pass() -> None:
    result = run_promtool("test", "rules", RULE_TESTS.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout, result.stdout


def test_every_alert_is_unit_tested_firing_and_not_firing() -> None:
    doc = yaml.safe_load(RULE_TESTS.read_text())
    assert doc["rule_files"] == [RULES.name]
    firing: set[str] = set()
    silent: set[str] = set()
    for case in doc["tests"]:
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else silent).add(check["alertname"])
    names = {rule["alert"] for rule in alerts()}
    assert len(names) == len(alerts()), "an alert name is used twice"
    assert names - firing == set(), "never tested where it fires"
    assert names - silent == set(), "never tested where it must not fire"
    assert (firing | silent) - names == set(), "tests of alerts that do not exist"


def test_every_alert_has_severity_summary_and_a_runbook_section() -> None:
    headings = {
        github_anchor(h) for h in re.findall(r"^#{2,4} (.+)$", OPERATIONS.read_text(), re.M)
    }
    for rule in alerts():
        name = rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert "for" in rule or "increase(" in rule["expr"], f"{name}: no for and no window"
        notes = rule["annotations"]
        assert notes["summary"] and notes["description"], name
        path, _, anchor = notes["runbook"].partition("#")
        assert path == "docs/OPERATIONS.md", name
        assert anchor == name.lower() and anchor in headings, f"{name}: no section {anchor}"


# ---- the series the rules name are the service's


def selectors() -> list[tuple[str, str, list[tuple[str, str, str]]]]:
    """``(alert, series, [(label, op, value)])`` of every selector of the service's series
    in the rules."""
    out = []
    for rule in alerts():
        for name, matchers in SELECTOR.findall(rule["expr"]):
            out.append((rule["alert"], name, MATCHER.findall(matchers)))
    return out


def test_the_rules_name_only_vlab_series_and_prometheus_own() -> None:
    assert selectors()
    for rule in alerts():
        # without strings, matchers, ranges and groupings (`by (job)`), a name not
        # followed by `(` is a series or an operator
        bare = re.sub(r'"[^"]*"|\{[^}]*\}|\[[^]]*\]', "", rule["expr"])
        bare = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", bare)
        words = set(re.findall(r"\b[a-z_][a-z0-9_]*\b(?!\s*\()", bare))
        others = {w for w in words if not SELECTOR.fullmatch(w)} - {"and", "or", "unless", "bool"}
        assert others <= PROMETHEUS_SERIES, f"{rule['alert']}: {others}"


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    python = tmp_path / "engine-python-placeholder"
    s = Settings(
        home=tmp_path / "home", engine=EngineSettings(python=python, resolve_configs=False)
    )
    s.home.mkdir()
    doc = json.loads((DATA / "engine_args_vllm032cpu.json").read_text())
    doc["engine_python"] = str(python)
    s.engine_args_cache.write_text(json.dumps(doc))
    return s


@pytest.fixture
def own_database(server_url: str) -> Iterator[sessionmaker[Session]]:
    with fresh_database(server_url) as url:
        upgrade_to_head(url)
        engine = make_engine(url)
        try:
            yield make_session_factory(engine)
        finally:
            engine.dispose()


SPEC: dict[str, Any] = {
    "name": "alert-series",
    "model": "tiny",
    "baseline": {
        "engine_args": {"max_model_len": 1024},
        "workload": {"num_requests": 2, "prefix_tokens": 16, "seed": 1},
    },
    "variants": [{"name": "b", "changes": {"engine_args.max_model_len": 512}}],
}


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (s.name, s.labels, float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def test_every_series_and_label_value_the_rules_match_is_scraped(
    own_database: sessionmaker[Session], settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    running = threading.Event()
    running.set()  # as in `vlab up`: this process runs the dispatcher, its series are out
    monkeypatch.setattr(telemetry, "_dispatcher_running", running)
    with TestClient(create_app(settings, own_database)) as client:
        created = client.post("/api/v1/experiments", json=SPEC)  # queued runs: a queue age
        assert created.status_code == 201, created.text
        before = client.get("/metrics")
        # a run's engine never answered /health: the failed start is counted
        with unit_of_work(own_database) as s:
            run = RunRepository(s).claim_next_queued("test-alert-rules")
            assert run is not None
            failed = RunResult(
                run_id=run.id,
                status="failed",
                error="the engine exited before /health answered",
                engine_info={"server_reused": False},
            )
            record_result(s, run, failed)
        resp = client.get("/metrics")
    assert resp.status_code == 200, resp.text
    scraped = samples(resp.text)

    def value(name: str, text: str) -> float:
        return sum(v for n, _, v in samples(text) if n == name)

    assert value("vlab_engine_start_failures_total", resp.text) == (
        value("vlab_engine_start_failures_total", before.text) + 1
    )
    for alert, name, matchers in selectors():
        found = [labels for n, labels, _ in scraped if n == name]
        assert found, f"{alert}: {name} is not in the scrape"
        for label, op, pattern in matchers:
            values = {labels.get(label) for labels in found}
            assert values - {None}, f"{alert}: {name} has no label {label}"
            if op == "=":
                assert pattern in values, f"{alert}: {name}{{{label}={pattern!r}}} not scraped"
            elif op in ("=~", "!~"):  # each alternative of a|b|c is a value of the label
                for alternative in pattern.split("|"):
                    assert alternative in values, f"{alert}: {name} {label}={alternative!r}"
            elif op == "!=":
                assert values - {pattern}, f"{alert}: {name}{{{label}!={pattern!r}}} matches none"


# ---- the two counters the rules added to the service


def counted(name: str, **labels: str) -> float:
    return telemetry.PROCESS_REGISTRY.get_sample_value(name, labels) or 0.0


def test_only_a_failed_first_run_without_startup_counts_a_failed_engine_start() -> None:
    def delta(**kw: Any) -> tuple[float, float]:
        fails = counted("vlab_engine_start_failures_total")
        starts = counted("vlab_engine_startup_seconds_sum")
        telemetry.observe_engine_startup(**kw)
        return (
            counted("vlab_engine_start_failures_total") - fails,
            counted("vlab_engine_startup_seconds_sum") - starts,
        )

    started = {"server_reused": False}
    assert delta(timings={}, status="failed", engine_info=started) == (1, 0)
    # it answered /health, then the run failed: a start-up, not a failed start
    assert delta(timings={"startup_s": 7.0}, status="failed", engine_info=started) == (0, 7.0)
    # a run on a server another run started; a cancelled start; no server at all
    assert delta(timings={}, status="failed", engine_info={"server_reused": True}) == (0, 0)
    assert delta(timings={}, status="cancelled", engine_info=started) == (0, 0)
    assert delta(timings={}, status="failed", engine_info={}) == (0, 0)


def test_503_answers_are_counted_by_code_and_nothing_else(settings: Settings) -> None:
    def total() -> float:
        return sum(
            s.value
            for m in telemetry.REQUESTS_REFUSED.collect()
            for s in m.samples
            if s.name == "vlab_requests_refused_total"
        )

    before, before_all = (
        counted("vlab_requests_refused_total", code="database_unavailable"),
        total(),
    )
    engine = make_engine("postgresql://postgres@127.0.0.1:1/nothing", connect_timeout_s=1)
    try:
        with TestClient(create_app(settings, make_session_factory(engine))) as client:
            assert client.get("/api/v1/experiments").status_code == 503
            assert client.get("/api/v1/nothing-here").status_code == 404
    finally:
        engine.dispose()
    assert counted("vlab_requests_refused_total", code="database_unavailable") == before + 1
    assert total() == before_all + 1  # the 404 is no refusal
