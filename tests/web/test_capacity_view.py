"""web.capacity_view without a browser: the result in words for every search status (never a
capacity figure unless found), the binding SLO's names, the Pareto points and frontier."""

from __future__ import annotations

from typing import Any

import pytest

from tests.web.seed import capacity_documents
from web import capacity_view as view
from web import experiment_capacity as experiment_view


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


def test_binding_slo_saturated_only_with_server_evidence() -> None:
    # an older document: a step flagged saturated with no server evidence stored (it may
    # have been the client's dispatch lag) is never "the server saturated"
    old = view.binding_text(_doc("found", binding_slo="saturated"))
    assert old is not None and "without server evidence" in old
    assert "the server saturated" not in old
    doc = _doc("found", binding_slo="saturated")
    for step in doc["steps"]:
        if step.get("saturated"):
            step["saturation_evidence"] = ["waiting queue grew 0 -> 41", "KV cache 97 % full"]
    text = view.binding_text(doc)
    assert text == (
        "saturation: the server saturated before any objective failed (waiting queue grew "
        "0 -> 41; KV cache 97 % full)"
    )
    assert view.summary(doc)["saturation_evidence"] == [
        "waiting queue grew 0 -> 41",
        "KV cache 97 % full",
    ]
    assert view.binding_text(_doc("found", binding_slo="weird")) == "weird"
    assert view.binding_text(_doc("found")) is None


def test_objective_text_goodput_and_concurrency_loads() -> None:
    assert view.objective_text("goodput", None, 0.9) == "goodput ≥ 90 %"
    assert view.objective_text("e2el_ms", "p99.9", 2000) == "E2EL p99.9 ≤ 2000 ms"
    assert view.fmt_load(16.0, "concurrency") == "16"
    assert view.fmt_load(4.0, "request_rate") == "4.0"
    assert view.fmt_load(4.25, "request_rate") == "4.25"


def test_pareto_frontier_is_the_non_dominated_set() -> None:
    assert experiment_view.non_dominated([(1, 5), (2, 4), (1.5, 3), (2, 4), (0.5, 5)]) == [
        True,
        True,
        False,
        True,
        False,
    ]
    docs = capacity_documents()
    doc = experiment_view.pareto(
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


def _client_limited_doc(ceiling: float | None = 45.0) -> dict[str, Any]:
    """A search that reached the load generator's limit at 60 req/s after 40 passed."""
    doc = _doc("client_limited", interval=[40.0, None], client_ceiling=ceiling)
    steps = [dict(s) for s in doc["steps"][:2]]
    steps[0].update(load=40.0, verdict="pass")
    steps[1].update(
        load=60.0,
        verdict="client_limited",
        saturated=None,
        signals={**steps[1]["signals"], "asked_rate": 60.0, "arrived_rate": 44.0},
    )
    doc["steps"] = steps
    return doc


def test_client_limited_reads_at_least_with_the_ceiling_and_the_way_out() -> None:
    s = view.summary(_client_limited_doc())
    assert not s["found"] and s["capacity"] is None
    assert s["headline"] == "at least 40.0 req/s"
    assert s["sentence"].startswith(
        "At least 40.0 req/s; the load generator's ceiling here is 45.0 req/s"
    )
    assert "Scale the load generator out" in s["sentence"]
    assert "saturated" not in s["sentence"]
    assert s["status_text"] == "at least the highest load the load generator delivered"
    older = view.summary(_client_limited_doc(ceiling=None))
    assert "ceiling here was not measured" in older["sentence"]


def test_a_client_limited_step_gives_no_verdict() -> None:
    doc = _client_limited_doc()
    rows = view.step_rows(doc)
    limited = rows[1]
    assert limited["verdict"] == "client_limited"
    assert limited["untrusted"] == (
        "client-limited: the load generator could not deliver this load (44 of the 60 "
        "req/s asked arrived)"
    )
    assert (limited["arrived_rate"], limited["asked_rate"]) == (44.0, 60.0)
    assert limited["goodput_check"] is None
    assert all(c.get("verdict") is None for c in limited["cells"].values())
    assert any(c.get("value") is not None for c in limited["cells"].values())  # kept
    assert rows[0]["untrusted"] is None and rows[0]["cells"][("ttft_ms", "p99")]["verdict"]
    points = [p for c in view.curves(doc)["charts"] for z in c["series"] for p in z["points"]]
    at60 = [p for p in points if p["x"] == 60.0 and p["verdict"] is not None]
    assert at60 and all(
        p["verdict"] == "client_limited" and p["lo"] is None and p["hi"] is None for p in at60
    )


def test_pareto_leaves_out_runs_whose_speed_is_flagged() -> None:
    runs = [
        {"run_id": "a", "variant": "base", "devices": 1,
         "metrics": {"output_throughput": 100.0, "mean_tpot_ms": 20.0}},
        {"run_id": "b", "variant": "apc-on", "devices": 1,
         "metrics": {"output_throughput": 120.0, "mean_tpot_ms": 1.6},
         "untrusted": "token bursts: 94% of inter-token gaps under 0.1 ms"},
    ]  # fmt: skip
    doc = experiment_view.pareto(runs)
    assert [p["run_id"] for p in doc["points"]] == ["a"]
    assert doc["frontier"] == ["base #1"]
    assert doc["untrusted"] == [
        {"run_id": "b", "label": "apc-on #1",
         "reason": "token bursts: 94% of inter-token gaps under 0.1 ms"}
    ]  # fmt: skip
    assert not any(p["x"] > 600 for p in doc["points"])  # never 1000 / a burst TPOT


def test_capacity_cell_reads_the_one_sided_fields_with_get() -> None:
    old = experiment_view.capacity_cell({"verdict": "unknown", "reason": "reference: uncertain"})
    assert old is not None and old["bounds"] == {} and old["statement"] is None
    assert old["trustworthy"] and old["untrusted_reason"] is None
    new = experiment_view.capacity_cell(
        {"verdict": "higher", "ci_low": 2.86, "ci_high": None,
         "statement": "higher: at least 2.86x",
         "bounds": {"variant": "at least 24", "reference": "found 8 [8, 8.4]"},
         "client_ceiling": {"variant": 30.0, "reference": None}}
    )  # fmt: skip
    assert new is not None and new["statement"] == "higher: at least 2.86x"
    assert new["ci_high"] is None and new["bounds"]["variant"] == "at least 24"
    assert new["client_ceiling"] == {"variant": 30.0, "reference": None}
