"""A campaign's final configuration as a ``vllm serve`` line and a re-run spec
(orchestrator.tuning.final_config), and both in a finished campaign's result.

The campaign is driven with **fake recorded results** (the test double of
``test_campaign_service``: each queued run's objective written from a known surface)."""

from __future__ import annotations

import shlex

from sqlalchemy.orm import Session, sessionmaker

from orchestrator.core.settings import Settings
from orchestrator.experiments.planner import plan_experiment
from orchestrator.experiments.spec import ExperimentSpec
from orchestrator.tuning.campaign_request import CampaignRequest
from orchestrator.tuning.final_config import (
    final_result,
    final_spec,
    serve_command,
)
from tests.api.conftest import settings as settings  # noqa: F401 - fixture
from tests.factories import real_catalog
from tests.orchestrator.tuning.test_campaign_service import (
    campaign_doc,
    create,
    database,  # noqa: F401 - fixture
    drive,
    factory,  # noqa: F401 - fixture
)

FINAL = {"engine_args.enable_prefix_caching": True, "engine_args.max_num_seqs": 128}


def test_the_serve_command_holds_the_final_levels_and_the_layout() -> None:
    request = CampaignRequest.model_validate(campaign_doc())
    line = serve_command(request, FINAL)
    argv = shlex.split(line)
    assert argv[:3] == ["vllm", "serve", "tiny"]
    assert "--enable-prefix-caching" in argv and "--no-enable-prefix-caching" not in argv
    assert argv[argv.index("--max-num-seqs") + 1] == "128"
    assert argv[argv.index("--max-model-len") + 1] == "1024"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "1"
    assert argv[argv.index("--load-format") + 1] == "dummy"  # a generated model
    start = shlex.split(
        serve_command(request, {**FINAL, "engine_args.enable_prefix_caching": False})
    )
    assert "--no-enable-prefix-caching" in start


def test_a_revision_is_on_the_line() -> None:
    request = CampaignRequest.model_validate(campaign_doc(model="org/m", revision="v1"))
    argv = shlex.split(serve_command(request, FINAL))
    assert argv[2:5] == ["org/m", "--revision", "v1"]
    assert "--load-format" not in argv


def test_the_rerun_spec_is_a_valid_experiment_at_the_final_configuration() -> None:
    request = CampaignRequest.model_validate(campaign_doc())
    doc = final_spec(request, FINAL, request.name)
    spec = ExperimentSpec.model_validate(doc)
    assert spec.baseline.engine_args["enable_prefix_caching"] is True
    assert spec.baseline.engine_args["max_num_seqs"] == 128
    assert spec.variants == [] and spec.repeats == 3
    plan = plan_experiment(
        spec, real_catalog(), model_dir="unused", model_digest="0" * 64, generated_model=True
    )
    assert plan.errors == []


def test_no_final_result_before_every_variable_has_a_level() -> None:
    request = CampaignRequest.model_validate(campaign_doc())
    assert final_result(request, {}) == {}
    assert final_result(request, {"engine_args.max_num_seqs": 128}) == {}


def test_a_finished_campaigns_result_has_the_serve_line_and_the_spec(
    factory: sessionmaker[Session],  # noqa: F811
    settings: Settings,  # noqa: F811
) -> None:
    cid = create(factory, settings)
    row = drive(factory, settings, cid)
    assert row.status == "succeeded", row.status_reason
    assert row.result["incumbent"] == FINAL
    argv = shlex.split(row.result["serve_command"])
    assert "--enable-prefix-caching" in argv and argv[argv.index("--max-num-seqs") + 1] == "128"
    spec = ExperimentSpec.model_validate(row.result["spec"])
    assert spec.baseline.engine_args["enable_prefix_caching"] is True
