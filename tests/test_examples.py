"""Every spec in examples/ is valid against the real vLLM argument list."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.cli import load_spec_file
from orchestrator.service import validate_spec
from orchestrator.spec import ExperimentSpec
from tests.factories import real_catalog

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.*"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_spec_is_valid(path: Path) -> None:
    spec = ExperimentSpec.model_validate(load_spec_file(path))
    runs, errors = validate_spec(spec, real_catalog())
    assert errors == []
    assert len(runs) == 1 + len(spec.variants)


def test_there_are_examples() -> None:
    assert {p.name for p in EXAMPLES} >= {"demo.json", "quick-tiny.yaml"}
