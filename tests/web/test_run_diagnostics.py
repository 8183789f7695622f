"""The run page's findings and diagnostics (KV cache estimate vs engine, prompt-prefix
analysis), computed by the real estimator and analyser on the real demo run."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, expect
from sqlalchemy import delete
from sqlalchemy.orm import Session, sessionmaker

from jobs.load.workload import build_requests
from jobs.modelgen.generator import generate_model, load_tokenizer
from jobs.schemas import WorkloadSpec
from orchestrator.analysis.kvcache import check_against_engine
from orchestrator.analysis.prefix import analyze_prefix, summarize
from orchestrator.core.models import Experiment, Run, RunMetric
from tests.web.conftest import screenshot
from tests.web.seed import DATA, load_export

SMALL = {  # config.json of the demo's generated "small" model
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "hidden_size": 512,
    "dtype": "bfloat16",
}


@pytest.fixture(scope="module")
def diagnosed(
    web_db: sessionmaker[Session], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """A copy of the demo experiment whose apc-on#0 run carries a real KV check and a
    real prefix analysis of its own request list (rendered with a generated model)."""
    model = generate_model(tmp_path_factory.mktemp("diag-models") / "tiny", "tiny", seed=0)
    with web_db.begin() as s:
        ids = load_export(s, DATA / "demo_experiment.json", name=f"diag-{uuid.uuid4().hex[:6]}")
        run = s.get(Run, ids["runs"]["apc-on#0"])
        assert run is not None
        spec = WorkloadSpec.model_validate(run.workload)
        requests = build_requests(spec, load_tokenizer(Path(model)))
        analysis = summarize(
            analyze_prefix(requests, model, block_size=run.engine_args["block_size"])
        )
        facts = run.engine_info["startup_facts"]
        run.engine_info = {
            **run.engine_info,
            "kv_cache_check": check_against_engine(SMALL, run.engine_args, facts),
            "prefix_analysis": analysis,
        }
    yield {"ids": ids, "analysis": analysis}
    with web_db.begin() as s:
        s.execute(delete(Run).where(Run.experiment_id == ids["experiment_id"]))
        s.execute(delete(Experiment).where(Experiment.id == ids["experiment_id"]))


def test_diagnostics_of_a_healthy_run(page: Page, live_server: str, diagnosed: dict) -> None:
    rid = diagnosed["ids"]["runs"]["apc-on#0"]
    page.goto(f"{live_server}/runs/{rid}")
    expect(page.locator("#no-findings")).to_contain_text("No findings")
    table = page.locator("#kv-check-table")
    # 1 GiB of KV cache at 8 KiB per token: 131,072 tokens, as vLLM printed
    expect(table).to_contain_text("131,072")
    expect(table).to_contain_text("8,192")
    expect(page.locator("#kv-verdict")).to_contain_text("Agrees")
    predicted = diagnosed["analysis"]["predicted_hit_rate"]
    expect(page.locator("#predicted-hit-rate")).to_contain_text(f"{predicted * 100:.1f} %")
    # the headline's hits, split as the per-request predictions are (they add up)
    a = diagnosed["analysis"]
    parts = ("hits_shared_prefix_tokens", "hits_prompt_tokens", "hits_generated_tokens")
    assert sum(a[k] for k in parts) == a["hits_tokens"] > 0
    expect(page.locator("#predicted-hits")).to_contain_text(
        f"{a['hits_tokens']:,} of {a['queries_tokens']:,} prompt tokens: "
        f"{a['hits_shared_prefix_tokens']:,} in the prefix all requests share"
    )


def test_a_finding_appears_when_the_hit_rate_collapses(
    page: Page, live_server: str, diagnosed: dict, web_db: sessionmaker[Session]
) -> None:
    rid = diagnosed["ids"]["runs"]["apc-on#0"]
    with web_db.begin() as s:
        metric = s.get(RunMetric, (rid, "prefix_cache_hit_rate"))
        assert metric is not None
        old = metric.value
        metric.value = 0.02
    try:
        page.goto(f"{live_server}/runs/{rid}")
        item = page.locator("#findings-list li")
        expect(item).to_have_count(1)
        expect(item).to_have_attribute("data-code", "hit_rate_below_prediction")
        expect(item).to_contain_text("2.0%")
        page.locator("#findings").scroll_into_view_if_needed()
        screenshot(page, "run-findings")
    finally:
        with web_db.begin() as s:
            s.get(RunMetric, (rid, "prefix_cache_hit_rate")).value = old  # type: ignore[union-attr]
