"""Fixtures for the ``jobs`` tests: one generated tiny model per session, and its tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from jobs.modelgen.generator import generate_model, load_tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``tiny`` model directory generated once per session (seed 0). Do not modify it."""
    return generate_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path) -> Tokenizer:
    """The tokenizer of :func:`tiny_model_dir`."""
    return load_tokenizer(tiny_model_dir)
