"""The run history's experiment filter (a case-insensitive substring of the name, or the
exact id) and the trigram index that serves it where the server has ``pg_trgm``
(migration 0014)."""

from __future__ import annotations

import os
from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.core.models import Run
from orchestrator.core.repositories import HistoryRepository
from orchestrator.core.repositories.history import NAME_TRIGRAM_INDEX, _Explain
from tests.factories import make_experiment

NAMES = ("Sweep_A 100%", "sweepXa 1000", "MY-SWEEP", "back\\slash", "other")


@pytest.fixture(scope="module")
def ids(factory: sessionmaker[Session]) -> dict[str, str]:
    """Experiment id by name, two runs each (the module's own database)."""
    out = {}
    with factory.begin() as s:
        for name in NAMES:
            exp = make_experiment(s, n_runs=2)
            exp.name = name
            out[name] = exp.id
    return out


def _matching(factory: sessionmaker[Session], needle: str) -> dict[str, int]:
    """Runs per experiment name of the history filtered by ``needle``."""
    with factory() as s:
        page = HistoryRepository(s).page(
            {"experiment": needle}, sort="submitted", descending=True, limit=100
        )
    out: dict[str, int] = {}
    for _, name, _ in page.rows:
        out[name] = out.get(name, 0) + 1
    assert page.total == sum(out.values()) and not page.estimated
    return out


@pytest.mark.parametrize(
    ("needle", "names"),
    [
        ("sweep", {"Sweep_A 100%", "sweepXa 1000", "MY-SWEEP"}),  # any case
        ("SWEEPxA", {"sweepXa 1000"}),
        ("p_a", {"Sweep_A 100%"}),  # "_" is a character, not a wildcard ("pXa" no)
        ("100%", {"Sweep_A 100%"}),  # "%" too ("1000" no)
        ("k\\s", {"back\\slash"}),  # and the escape character itself
        ("%", {"Sweep_A 100%"}),
        ("nowhere", set()),
    ],
)
def test_the_filter_is_a_case_insensitive_substring_of_the_name(
    factory: sessionmaker[Session], ids: dict[str, str], needle: str, names: set[str]
) -> None:
    assert _matching(factory, needle) == dict.fromkeys(names, 2)


def test_the_filter_takes_an_experiment_id(
    factory: sessionmaker[Session], ids: dict[str, str]
) -> None:
    assert _matching(factory, ids["other"]) == {"other": 2}
    assert _matching(factory, ids["other"].upper()) == {}  # an id is exact


def _has_trigrams(s: Session) -> bool:
    return bool(
        s.scalar(text("SELECT count(*) FROM pg_available_extensions WHERE name = 'pg_trgm'"))
    )


def _plan_nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [node, *(n for child in node.get("Plans", []) for n in _plan_nodes(child))]


def test_the_trigram_index_serves_the_filter_where_the_server_has_pg_trgm(
    factory: sessionmaker[Session], ids: dict[str, str]
) -> None:
    with factory() as s:
        if not _has_trigrams(s):
            assert not os.environ.get("CI"), "CI's PostgreSQL (Debian's) ships pg_trgm"
            pytest.skip("this PostgreSQL server has no pg_trgm (e.g. the embedded one)")
        index = s.scalar(
            text("SELECT indexdef FROM pg_indexes WHERE indexname = :n"), {"n": NAME_TRIGRAM_INDEX}
        )
        assert index is not None and "gin (name gin_trgm_ops)" in index, index
        # a few rows: the planner rightly prefers reading the table (or a whole b-tree)
        # to a bitmap of the trigram index; whether it can use that is the question
        for scan in ("seqscan", "indexscan", "indexonlyscan"):
            s.execute(text(f"SET LOCAL enable_{scan} = off"))
        query = select(Run.experiment_id).where(
            *HistoryRepository._conditions(experiment="eep_a 100%")
        )
        plan = s.execute(_Explain(query)).scalar_one()
        used = {n.get("Index Name") for n in _plan_nodes(plan[0]["Plan"])}
        assert NAME_TRIGRAM_INDEX in used, plan
        assert set(s.scalars(query)) == {ids["Sweep_A 100%"]}
