"""The response-surface engine (a test double, :mod:`tests.campaigns_e2e.surface_engine`)
reads its engine arguments as ``vllm serve`` would and serves the known surface."""

from __future__ import annotations

import pytest

from jobs.engine.command import render_engine_args
from tests.campaigns_e2e.surface_engine import DEFAULTS, read_config, speed, timetable
from tests.orchestrator.campaigns.surface import APC, BATCHED, BLOCK, EAGER, SEQS


def _config(**args: object) -> dict[str, object]:
    """What the engine reads from the command line a run renders for ``args``."""
    return read_config(["/model", "--port", "1", *render_engine_args(dict(args))])


def test_it_reads_the_arguments_a_run_renders() -> None:
    got = _config(
        enable_prefix_caching=True,
        max_num_seqs=64,
        max_num_batched_tokens=8192,
        block_size=32,
        enforce_eager=True,
    )
    assert got == {APC: True, SEQS: 64, BATCHED: 8192, BLOCK: 32, EAGER: True}
    assert _config() == DEFAULTS
    assert _config(enable_prefix_caching=False)[APC] is False


def test_the_surface_has_its_known_effects() -> None:
    base = speed(_config())
    assert speed(_config(enable_prefix_caching=True)) / base == pytest.approx(1.30)
    assert speed(_config(block_size=32)) == base  # inert
    assert speed(_config(enforce_eager=True)) / base == pytest.approx(0.75)  # harmful
    seqs = [speed(_config(max_num_seqs=n)) for n in (64, 128, 256)]
    assert seqs[1] > seqs[0] and seqs[1] > seqs[2]  # concave, best at 128
    # the interaction: batched tokens pay only with prefix caching on
    assert speed(_config(max_num_batched_tokens=4096)) == base
    on = speed(_config(enable_prefix_caching=True))
    both = speed(_config(enable_prefix_caching=True, max_num_batched_tokens=4096))
    assert both / on == pytest.approx(1.10)
    # sharpened: the same optimum, the effects squared
    assert speed(_config(enable_prefix_caching=True), 2.0) / speed(_config(), 2.0) == (
        pytest.approx(1.69)
    )


def test_latency_is_inverse_to_the_surface() -> None:
    slow = timetable(_config(), 1.0, 1.0)
    fast = timetable(_config(enable_prefix_caching=True), 1.0, 1.0)
    assert slow[0] / fast[0] == pytest.approx(1.30) and slow[1] / fast[1] == pytest.approx(1.30)
    assert 0.001 < slow[1] < 0.01  # a few ms a token
