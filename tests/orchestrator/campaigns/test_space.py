"""The space: variables, levels, one-variable neighbours and the grid."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from orchestrator.campaigns.space import (
    Candidate,
    Level,
    Space,
    Variable,
    config_key,
    grid,
    grid_size,
    neighbours,
)

SEQS = Variable(name="engine_args.max_num_seqs", levels=(32, 64, 128, 256))
APC = Variable.boolean("engine_args.enable_prefix_caching")
RATE = Variable(name="workload.request_rate", levels=(1.0, 2.0), client_side=True)
SPACE = Space(variables=(APC, SEQS, RATE))


def _moves(found: list[Candidate]) -> list[str]:
    return [c.describe() for c in found]


def test_neighbours_step_one_level_each_way_and_flip_booleans() -> None:
    config: dict[str, Level] = {APC.name: False, SEQS.name: 128, RATE.name: 1.0, "model": "m"}
    assert _moves(neighbours(config, SPACE)) == [
        "engine_args.enable_prefix_caching: false -> true",
        "engine_args.max_num_seqs: 128 -> 64",
        "engine_args.max_num_seqs: 128 -> 256",
        "workload.request_rate: 1.0 -> 2.0",
    ]


def test_neighbours_at_the_ends_of_the_levels() -> None:
    config = {APC.name: True, SEQS.name: 32, RATE.name: 2.0}
    assert _moves(neighbours(config, SPACE)) == [
        "engine_args.enable_prefix_caching: true -> false",
        "engine_args.max_num_seqs: 32 -> 64",
        "workload.request_rate: 2.0 -> 1.0",
    ]


def test_neighbours_refuse_a_configuration_outside_the_space() -> None:
    with pytest.raises(ValueError, match="does not set"):
        neighbours({APC.name: True}, SPACE)
    with pytest.raises(ValueError, match="not one of its levels"):
        neighbours({APC.name: True, SEQS.name: 100, RATE.name: 1.0}, SPACE)
    # a flag is not the integer 1
    with pytest.raises(ValueError, match="not one of its levels"):
        neighbours({APC.name: 1, SEQS.name: 32, RATE.name: 1.0}, SPACE)


def test_candidate_applies_one_change() -> None:
    cand = Candidate(variable=SEQS.name, from_level=128, to_level=64)
    config = {APC.name: True, SEQS.name: 128, RATE.name: 1.0}
    assert cand.apply(config) == {**config, SEQS.name: 64}
    assert cand.label == "engine_args.max_num_seqs=64"
    with pytest.raises(ValueError, match="does not start from"):
        cand.apply({**config, SEQS.name: 256})


def test_grid() -> None:
    assert grid_size(SPACE) == 2 * 4 * 2
    configs = grid(SPACE, fixed={"model": "m"})
    assert len(configs) == 16
    assert len({config_key(c) for c in configs}) == 16
    assert configs[0] == {"model": "m", APC.name: False, SEQS.name: 32, RATE.name: 1.0}


def test_config_key_keeps_types_apart() -> None:
    assert config_key({"x": True}) != config_key({"x": 1})
    assert config_key({"a": 1, "b": 2}) == config_key({"b": 2, "a": 1})


def test_server_key_ignores_client_side_variables() -> None:
    a = {APC.name: True, SEQS.name: 32, RATE.name: 1.0}
    assert SPACE.server_key(a) == SPACE.server_key({**a, RATE.name: 2.0})
    assert SPACE.server_key(a) != SPACE.server_key({**a, SEQS.name: 64})


@pytest.mark.parametrize(
    ("levels", "message"),
    [((1,), "at least 2"), ((1, 2, 1), "listed twice"), ((1.0, float("inf")), "not finite")],
)
def test_variable_levels_are_validated(levels: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Variable(name="engine_args.x", levels=levels)


def test_space_refuses_a_variable_twice() -> None:
    with pytest.raises(ValidationError, match="named twice"):
        Space(variables=(SEQS, SEQS))
    assert SPACE.variable(SEQS.name) == SEQS
    with pytest.raises(KeyError):
        SPACE.variable("nope")
