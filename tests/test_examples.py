"""Every spec in examples/ is valid against the real vLLM argument list; a campaign
document (``campaign-*``) is a valid campaign whose first round is a valid experiment."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.cli.main import load_spec_file
from orchestrator.experiments.planner import plan_experiment
from orchestrator.experiments.spec import ExperimentSpec
from orchestrator.tuning.campaign_request import CampaignRequest
from orchestrator.tuning.intake import first_round
from tests.factories import real_catalog

ALL = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.*"))
CAMPAIGNS = [p for p in ALL if p.name.startswith("campaign-")]
EXAMPLES = [p for p in ALL if p not in CAMPAIGNS]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_spec_is_valid(path: Path) -> None:
    spec = ExperimentSpec.model_validate(load_spec_file(path))
    plan = plan_experiment(
        spec, real_catalog(), model_dir="unused", model_digest="0" * 64, generated_model=True
    )
    assert plan.errors == []
    assert len(plan.runs) == len(plan.variants) * spec.repeats


def test_there_are_examples() -> None:
    assert {p.name for p in EXAMPLES} >= {"demo.json", "quick-tiny.yaml"}


@pytest.mark.parametrize("path", CAMPAIGNS, ids=lambda p: p.name)
def test_example_campaign_is_valid(path: Path) -> None:
    request = CampaignRequest.model_validate(load_spec_file(path))
    spec = ExperimentSpec.model_validate(first_round(request, real_catalog()))
    plan = plan_experiment(
        spec, real_catalog(), model_dir="unused", model_digest="0" * 64, generated_model=True
    )
    assert plan.errors == []
    assert len(plan.variants) >= 2  # the start and at least one candidate


def test_there_is_a_campaign_example() -> None:
    tiny = [p for p in CAMPAIGNS if p.name == "campaign-tiny.yaml"]
    assert tiny
    request = CampaignRequest.model_validate(load_spec_file(tiny[0]))
    assert request.model == "tiny" and request.baseline["workload"]["prefix_tokens"] > 0
    assert [v.name for v in request.space] == [
        "engine_args.enable_prefix_caching",
        "engine_args.max_num_seqs",
    ]
