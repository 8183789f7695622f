"""web.capacity without a browser: the result in words for every search status (never a
capacity figure unless found), the binding SLO's names, the Pareto points and frontier."""

from __future__ import annotations

from typing import Any

import pytest

from tests.web.seed import capacity_documents
from web import capacity as view


def _doc(status: str, **extra: Any) -> dict[str, Any]:
    base = capacity_documents()["baseline"]
    return {**base, "status": status, "capacity": None, "binding_slo": None, **extra}


def test_found_names_the_figure_bracket_and_binding_slo() -> None:
    s = view.summary(capacity_documents()["baseline"])
    assert s["found"] and s["headline"] == "2.1 req/s"
    assert s["sentence"].startswith("2.1 req/s (bracket 2.1–2.2 req/s), bound by TTFT p99 ≤ 500 ms")


@pytest.mark.parametrize(
    ("status", "headline", "words"),
    [
        ("below_min", "below 1.0 req/s", "the lowest load tried failed"),
        ("at_least_max", "at least 8.0 req/s", "the highest load tried met every SLO"),
        ("steps_exhausted", "unknown", "steps exhausted"),
        ("uncertain", "unknown", "Unknown: uncertain"),
    ],
)
def test_no_capacity_figure_unless_found(status: str, headline: str, words: str) -> None:
    s = view.summary(_doc(status, capacity=2.1))
    assert not s["found"] and s["capacity"] is None
    assert s["headline"] == headline
    assert words in s["sentence"]
    assert view.curves(_doc(status, capacity=2.1))["capacity"] is None


@pytest.mark.parametrize("name", ["ttft_ms:p99", "ttft_ms p99", "ttft_ms.p99"])
def test_binding_slo_names(name: str) -> None:
    assert view.binding_text(_doc("found", binding_slo=name)) == "TTFT p99 ≤ 500 ms"


def test_binding_slo_saturated_and_unknown_names() -> None:
    assert view.binding_text(_doc("found", binding_slo="saturated")).startswith("saturation")
    assert view.binding_text(_doc("found", binding_slo="weird")) == "weird"
    assert view.binding_text(_doc("found")) is None


def test_objective_text_goodput_and_concurrency_loads() -> None:
    assert view.objective_text("goodput", None, 0.9) == "goodput ≥ 90 %"
    assert view.objective_text("e2el_ms", "p99.9", 2000) == "E2EL p99.9 ≤ 2000 ms"
    assert view.fmt_load(16.0, "concurrency") == "16"
    assert view.fmt_load(4.0, "request_rate") == "4.0"
    assert view.fmt_load(4.25, "request_rate") == "4.25"


def test_pareto_frontier_is_the_non_dominated_set() -> None:
    assert view.non_dominated([(1, 5), (2, 4), (1.5, 3), (2, 4), (0.5, 5)]) == [
        True,
        True,
        False,
        True,
        False,
    ]
    docs = capacity_documents()
    doc = view.pareto(
        [
            {"run_id": "a", "variant": "baseline", "repeat_index": 0, "devices": 2,
             "metrics": {"output_throughput": 1.0, "mean_tpot_ms": 1.0},
             "capacity": docs["baseline"]},
            {"run_id": "b", "variant": "tp2", "repeat_index": 0, "devices": 2,
             "metrics": {"output_throughput": 380.0, "mean_tpot_ms": 40.0},
             "capacity": docs["tp2"]},
            {"run_id": "c", "variant": "x", "repeat_index": 1, "devices": 1, "metrics": {},
             "capacity": None},
        ]
    )  # fmt: skip
    pts = {p["label"]: (p["x"], p["y"], p["source"]) for p in doc["points"]}
    assert pts["baseline #1"][:2] == (40.0, 105.0)  # the boundary step wins over the metrics
    assert pts["tp2 #1"][:2] == (25.0, 190.0)
    assert pts["tp2 #1"][2].startswith("run metrics")
    assert doc["missing"] == ["x #2"]
    assert doc["frontier"] == ["tp2 #1", "baseline #1"]  # by tokens/s per user
