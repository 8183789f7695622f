"""Every spec in examples/ is valid against the real vLLM argument list."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.cli.main import load_spec_file
from orchestrator.experiments.planner import plan_experiment
from orchestrator.experiments.spec import ExperimentSpec
from tests.factories import real_catalog

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.*"))


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
