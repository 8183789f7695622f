"""No verdict from an untrustworthy number (orchestrator.analysis.trust): the one table of
what each flag taints, and the comparison that reads it, on burst-token streams from the
stub (issue #22: APC-on TPOT p50 0.0 ms read "ratio 0.00 [0.00, 0.78] better") and on
the hit rate of a run without prefix caching (n/a, never 0: it read "better [0.90, 0.90]").
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from rich.console import Console

from orchestrator.analysis.compare import METRICS, RunData, VariantRef, compare_variant
from orchestrator.analysis.findings import findings
from orchestrator.analysis.trust import (
    BURSTY,
    LONG_STALL_S,
    LOST_S,
    MIN_STALLED_REQUESTS,
    STALLED_REQUESTS,
    STALLED_TIME,
    TAINTS,
    burst_fraction,
    objectives_of_capacity,
    quantities,
    run_trust,
    step_untrusted,
)
from orchestrator.cli.report import comparison_table
from tests.orchestrator.analysis.stub_bursts import stub_run
from tests.orchestrator.analysis.test_compare import N_BOOT, req, run
from tests.orchestrator.analysis.test_warm_cache import APC

TPOT_ITL = [m.name for m in METRICS if "_tpot_" in m.name or "_itl_" in m.name]


def _stub_runs(variant: str, kind: str, repeats: int = 2, **kw: Any) -> list[RunData]:
    """``repeats`` runs of ``variant`` from the stub's ``kind`` stream; ``metrics``: the
    summary only when ``with_metrics`` (else the flag must come from the requests)."""
    out = []
    for i in range(repeats):
        requests, metrics = stub_run(kind)
        out.append(
            RunData(
                run_id=f"{variant}-{i}",
                variant=variant,
                repeat_index=i,
                requests=requests,
                metrics=metrics if kw.get("with_metrics") else {},
                not_applicable=kw.get("not_applicable", {}),
            )
        )
    return out


def test_the_table_of_what_each_flag_taints() -> None:
    assert quantities("median_tpot_ms") == {"tpot"} and quantities("p99_itl_ms") == {"itl"}
    assert quantities("mean_tpot_ms") == {"tpot"} and quantities("tpot_ms") == {"tpot"}
    assert "tpot" in quantities("output_tokens_per_s_per_user")  # 1000 / TPOT
    assert quantities("output_throughput") == {"output_throughput"}
    # goodput and capacity: computed from their objectives (all latencies when unknown)
    assert "tpot" in quantities("request_goodput")
    assert "tpot" not in quantities("request_goodput", goodput_objectives={"ttft", "e2el"})
    assert "tpot" in quantities("capacity", capacity_objectives={"tpot"})
    assert TAINTS["token_bursts"] == {"tpot", "itl"}
    flags = run_trust("r", {"itl_burst_fraction": BURSTY}, goodput_objectives=["e2el"])
    for metric in TPOT_ITL + ["output_tokens_per_s_per_user"]:
        assert flags.reason(metric) is not None, metric
    for metric in ("median_ttft_ms", "median_e2el_ms", "output_throughput", "request_goodput"):
        assert flags.reason(metric) is None, metric
    # just under the advisor's threshold: not flagged
    assert not run_trust("r", {"itl_burst_fraction": BURSTY - 0.01}).flags
    # a warm cache taints every number of the run
    warm = run_trust("r", {}, cache_contamination="contaminated")
    assert all(warm.reason(m.name) for m in METRICS) and warm.reason("capacity")
    assert run_trust("r", {}, cache_contamination="clean").reason("median_ttft_ms") is None


def test_capacity_objectives_and_client_limited_steps() -> None:
    doc = {"steps": [{"checks": [{"metric": "ttft_ms"}, {"metric": "goodput"}]}]}
    assert objectives_of_capacity(doc) == {"ttft", "tpot", "itl", "e2el"}  # goodput: all
    assert objectives_of_capacity({"steps": [{"checks": [{"metric": "ttft_ms"}]}]}) == {"ttft"}
    assert objectives_of_capacity(None) is None
    bursts = run_trust("r", {"itl_burst_fraction": 0.9}, capacity_objectives={"ttft"})
    assert bursts.reason("capacity") is None  # TTFT objective only: bursts do not touch it
    assert run_trust("r", {"itl_burst_fraction": 0.9}, capacity_objectives={"tpot"}).reason(
        "capacity"
    )
    assert step_untrusted({"verdict": "fail"}) is None
    assert step_untrusted({"verdict": "client_limited"}) == (
        "client-limited: the load generator could not deliver this load"
    )


def test_burst_fraction_from_request_dicts_whose_gaps_are_zero() -> None:
    bursty = [req(0.05, itl=(0.02, 1e-6, 2e-6, 0.0)), req(0.05, itl=(1e-6,), warmup=True)]
    assert burst_fraction(bursty) == pytest.approx(0.75)
    assert burst_fraction([req(0.05)]) == 0.0
    assert burst_fraction([req(0.05, itl=())]) is None


def test_burst_stream_from_the_stub_gives_no_tpot_or_itl_verdict() -> None:
    ref = _stub_runs("baseline", "paced")
    var = _stub_runs("apc-on", "burst")
    comps = {c.metric: c for c in compare_variant(var, ref, n_boot=N_BOOT)}
    # the demo's numbers: TPOT p50 0.0 ms against ~4 ms
    tpot = comps["median_tpot_ms"]
    assert tpot.variant is not None and tpot.reference is not None
    assert tpot.variant < 0.1 * tpot.reference
    for metric in TPOT_ITL:
        c = comps[metric]
        assert c.verdict == "untrusted" and not c.trustworthy, metric
        assert (c.ratio, c.difference, c.ci_low, c.ci_high, c.ci_of) == (None,) * 5, metric
        assert c.untrusted_reason is not None
        assert c.untrusted_reason.startswith("variant run apc-on-0: token bursts: ")
        assert "of inter-token gaps under 0.1 ms" in c.untrusted_reason
    # TTFT and E2EL are not flagged (the client's TTFT lag is not known here): verdicts stay
    for metric in ("median_ttft_ms", "median_e2el_ms"):
        assert comps[metric].trustworthy and comps[metric].verdict != "untrusted"
    json.dumps([c.model_dump(mode="json") for c in comps.values()], allow_nan=False)
    # bursts on the reference side taint the comparison the same way
    back = {c.metric: c for c in compare_variant(ref, var, n_boot=N_BOOT)}
    assert back["median_tpot_ms"].verdict == "untrusted"
    assert "reference run apc-on-0" in str(back["median_tpot_ms"].untrusted_reason)


def test_the_cli_table_shows_no_verdict_for_a_burst_tpot() -> None:
    ref = _stub_runs("baseline", "paced", with_metrics=True)
    var = _stub_runs("apc-on", "burst", with_metrics=True)
    comps = [c.model_dump(mode="json") for c in compare_variant(var, ref, n_boot=N_BOOT)]
    doc = {
        "chain": [{"variant": "apc-on", "reference_value": False, "variant_value": True}],
        "variants": [
            {"variant": "apc-on", "reference": "baseline", "variable": "apc", "metrics": comps}
        ],
    }
    console = Console(record=True, width=400, color_system=None)
    console.print(comparison_table(doc))
    text = console.export_text()
    line = next(ln for ln in text.splitlines() if "median_tpot_ms" in ln)
    cells = [c.strip() for c in line.split("│")]
    metric = cells.index("median_tpot_ms")
    reference, value, ratio, interval, verdict = cells[metric + 1 : metric + 6]
    assert float(value) < 0.1 * float(reference)  # the values are shown (dimmed in a terminal)
    assert (ratio, interval) == ("-", "-")  # no ratio, no interval
    assert verdict.startswith("untrusted: variant run apc-on-0: token bursts")
    assert "better" not in line


def test_a_client_ttft_lag_with_bursts_taints_ttft_and_goodput_follows_its_objectives() -> None:
    flagged = {"itl_burst_fraction": 0.9, "mean_ttft_client_minus_server_ms": 45.0}
    ref = [
        run("b", i, [req(0.1 + 0.01 * k) for k in range(8)], {"request_goodput": 5.0})
        for i in range(2)
    ]
    var = [
        run("v", i, [req(0.05 + 0.01 * k) for k in range(8)], {**flagged, "request_goodput": 9.0})
        for i in range(2)
    ]
    comps = {c.metric: c for c in compare_variant(var, ref, n_boot=N_BOOT)}
    assert comps["median_ttft_ms"].verdict == "untrusted"
    assert "TTFT is 45 ms above the server's" in str(comps["median_ttft_ms"].untrusted_reason)
    assert comps["median_e2el_ms"].verdict != "untrusted"
    assert comps["request_goodput"].verdict == "untrusted"  # objectives unknown: all count

    def goodput(objectives: list[str]) -> str:
        runs = [r.model_copy(update={"goodput_objectives": objectives}) for r in var]
        refs = [r.model_copy(update={"goodput_objectives": objectives}) for r in ref]
        return next(
            c.verdict
            for c in compare_variant(runs, refs, n_boot=N_BOOT)
            if c.metric == "request_goodput"
        )

    assert goodput(["e2el"]) != "untrusted"
    assert goodput(["tpot"]) == "untrusted"


def test_hit_rate_without_prefix_caching_is_not_applicable_never_zero() -> None:
    off = {"prefix_cache_hit_rate": "off"}
    ref = [
        run("baseline", i, [req(0.1)] * 4).model_copy(update={"not_applicable": off})
        for i in range(2)
    ]
    # same latencies on both sides: E2EL flat, so the finding below fires
    var = [run("apc-on", i, [req(0.1)] * 4, {"prefix_cache_hit_rate": 0.9}) for i in range(2)]
    (hit,) = [
        c for c in compare_variant(var, ref, n_boot=N_BOOT) if c.metric == "prefix_cache_hit_rate"
    ]
    assert hit.verdict == "not applicable" and hit.not_applicable == {"reference": "off"}
    assert hit.reference is None and hit.variant == pytest.approx(0.9)
    assert (hit.ratio, hit.difference, hit.ci_low, hit.ci_high) == (None,) * 4  # never [0.90, 0.90]
    json.dumps(hit.model_dump(mode="json"), allow_nan=False)
    # the finding still says the hit rate rose from prefix caching off
    by_variant = {"apc-on": compare_variant(var, ref, n_boot=N_BOOT)}
    refs = {"apc-on": VariantRef(variant="apc-on", reference="baseline", changed=APC)}
    found = findings(by_variant, {"baseline": ref, "apc-on": var}, refs, n_boot=N_BOOT)
    (flat,) = [f for f in found if f.code == "hit_rate_up_e2e_flat"]
    assert flat.message.startswith("prefix cache hit rate rose from n/a (off) to 0.90")


def _stalls(moved: int, measured: int, total_s: float, longest_s: float) -> dict[str, float]:
    return {
        "duration": 40.0,
        "client_stall_s": total_s,
        "max_client_stall_ms": longest_s * 1000.0,
        "client_stalled_requests": float(moved),
        "client_stalled_request_fraction": moved / measured,
    }


def test_a_stalled_client_gives_no_verdict_on_what_it_timed_or_paced() -> None:
    """The load generator lost a second or more in all and its stalls took 5 % of the
    phase, or moved 5 % of the requests and two or more, or one of a second moved a
    request: every number the client timed or paced is untrusted, not the prefix cache hit
    rate. A 0.1 s hiccup that moved 1 of 16 requests (the README demo's run), 0.9 s of
    hiccups that moved most of a stub run's requests, or runs stored before the watch,
    flag nothing."""
    by_time = run_trust("r", _stalls(0, 60, STALLED_TIME * 40.0, 0.3))
    by_requests = run_trust("r", _stalls(MIN_STALLED_REQUESTS, 40, LOST_S, 0.2))
    by_length = run_trust("r", _stalls(1, 60, LONG_STALL_S, LONG_STALL_S))
    for flags in (by_time, by_requests, by_length):
        for m in METRICS:
            tainted = flags.reason(m.name) is not None
            assert tainted == (m.name != "prefix_cache_hit_rate"), m.name
        assert flags.reason("capacity")
        assert "the load generator stalled" in str(flags.reason("output_throughput"))
    assert "5.0% of the measured phase" in str(by_time.reason("median_e2el_ms"))
    # it moved no request: said so, never "0 measured requests (0.0%)"
    assert "no measured request was timed at the end of one" in str(by_time.reason("mean_itl_ms"))
    assert "0 measured" not in str(by_time.reason("median_e2el_ms"))
    assert "2 of 40 measured requests (5.0%)" in str(by_requests.reason("median_e2el_ms"))
    assert STALLED_REQUESTS == 0.05
    for quiet in (
        _stalls(1, 16, 0.2, 0.1),  # one request, short
        _stalls(MIN_STALLED_REQUESTS, 41, LOST_S, 0.2),  # 4.9 %
        _stalls(20, 24, 0.9, 0.3),  # 83 % moved, under a second lost in all
        _stalls(0, 60, 1.5, 1.5),  # a long stall (3.8 % of the phase) that moved nothing
    ):
        assert not run_trust("r", quiet).flags, quiet
    assert not run_trust("r", {"duration": 40.0}).flags

    ref = [
        run("b", i, [req(0.1 + 0.01 * k) for k in range(8)], _stalls(0, 8, 0, 0)) for i in (0, 1)
    ]
    var = [run("v", i, [req(0.05 + 0.01 * k) for k in range(8)]) for i in (0, 1)]
    clean = {c.metric: c for c in compare_variant(var, ref, n_boot=N_BOOT)}
    assert clean["median_ttft_ms"].verdict == "better"
    var[1] = var[1].model_copy(update={"metrics": _stalls(1, 8, 11.1, 11.1)})
    comps = {c.metric: c for c in compare_variant(var, ref, n_boot=N_BOOT)}
    ttft = comps["median_ttft_ms"]
    assert ttft.verdict == "untrusted" and ttft.ratio is None
    assert str(ttft.untrusted_reason).startswith("variant run v-1: the load generator stalled")
