"""A run measured on a warm prefix cache, in comparisons, findings and the advisor.

The run's flag is the warm-cache check of :mod:`jobs.signals.cachecheck`
(``engine_info["cache_contamination"]``), here computed by the real rule on the records
a reset that kept its blocks gives (the first measured request reports cached prompt
tokens: vLLM's block pool refuses a reset while blocks are held, vllm/v1/core/
block_pool.py ``reset_prefix_cache``, and older API servers answered 200 anyway). Such a
run reads faster than it is: 49x lower mean TTFT and 2.32x throughput on one cell of
vllm-project/vllm#54227, so a ratio against it is not to be believed.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from jobs.schemas import RequestRecord
from jobs.signals.cachecheck import check
from orchestrator.analysis.advisor import (
    RANK,
    WARM_CACHE_ACTION,
    from_compare,
    ordered,
    run_findings,
)
from orchestrator.analysis.compare import ChangedVariable, RunData, VariantRef, compare_variant
from orchestrator.analysis.findings import findings
from tests.orchestrator.analysis.test_compare import BASE_TTFT, N_BOOT, req, run

APC = ChangedVariable(
    name="enable_prefix_caching",
    paths=["engine_args.enable_prefix_caching"],
    reference_value=False,
    variant_value=True,
)


def _check(first_cached: int) -> dict[str, Any]:
    """The warm-cache check of a concurrency-1 run whose first request found
    ``first_cached`` tokens cached (0: clean)."""
    records = [
        RequestRecord(
            index=i,
            success=True,
            start_s=1.0 + 0.2 * i,
            ttft_s=0.05,
            e2el_s=0.15,
            prompt_tokens=300,
            cached_tokens=first_cached if i == 0 else 256,
        )
        for i in range(5)
    ]
    return check(records, None, [], reports_cached_tokens=True, reset_ok=True)


def _runs(variant: str, scale: float, statuses: list[str | None]) -> list[RunData]:
    out = []
    for i, status in enumerate(statuses):
        r = run(variant, i, [req(t * scale) for t in BASE_TTFT], {"output_throughput": 100 / scale})
        out.append(r.model_copy(update={"cache_contamination": status}))
    return out


def test_the_flag_comes_from_the_real_rule() -> None:
    assert _check(256)["status"] == "contaminated"
    assert _check(0)["status"] == "clean"


def test_a_warm_run_gives_no_verdict_on_any_metric() -> None:
    ref = _runs("baseline", 1.0, ["clean", "clean", "clean"])
    warm = _runs("apc-on", 0.5, ["clean", "contaminated", "clean"])
    comps = compare_variant(warm, ref, n_boot=N_BOOT)
    assert comps and all(not c.trustworthy for c in comps)
    reason = comps[0].untrusted_reason
    assert reason is not None and reason.startswith(
        "variant run apc-on-1: measured on a warm prefix cache"
    )
    # the values are kept (shown greyed); no ratio, difference, interval or verdict
    ttft = next(c for c in comps if c.metric == "median_ttft_ms")
    assert ttft.variant is not None and ttft.reference is not None
    assert np.isclose(ttft.variant / ttft.reference, 0.5)
    for c in comps:
        assert c.verdict == "untrusted"
        assert (c.ratio, c.difference, c.ci_low, c.ci_high, c.ci_of) == (None,) * 5
    json.dumps([c.model_dump(mode="json") for c in comps], allow_nan=False)
    # the reference side counts too
    comps = compare_variant(ref, warm, n_boot=N_BOOT)
    assert all(
        c.untrusted_reason is not None and "reference run apc-on-1" in c.untrusted_reason
        for c in comps
    )


def test_clean_unknown_and_unchecked_runs_are_trusted() -> None:
    ref = _runs("baseline", 1.0, ["clean", None, "unknown"])
    var = _runs("apc-on", 0.5, ["unknown", "clean", None])
    comps = compare_variant(var, ref, n_boot=N_BOOT)
    assert comps and all(c.trustworthy and c.untrusted_reason is None for c in comps)
    # a failed run is not compared, so its flag does not count either
    failed = [r.model_copy(update={"status": "failed"}) for r in _runs("x", 1.0, ["contaminated"])]
    comps = compare_variant(var + failed, ref, n_boot=N_BOOT)
    assert all(c.trustworthy for c in comps)


def test_finding_names_the_warm_runs_first() -> None:
    runs = {
        "baseline": _runs("baseline", 1.0, ["contaminated", "clean"]),
        "apc-on": _runs("apc-on", 0.5, ["clean", "clean"]),
    }
    refs = {"apc-on": VariantRef(variant="apc-on", reference="baseline", changed=APC)}
    comps = {"apc-on": compare_variant(runs["apc-on"], runs["baseline"], n_boot=N_BOOT)}
    found = findings(comps, runs, refs, n_boot=N_BOOT)
    assert found[0].code == "warm_cache_contamination"
    assert found[0].severity == "warning" and found[0].variant == "apc-on"
    assert found[0].evidence == {
        "reference": "baseline",
        "variant_runs": [],
        "reference_runs": ["baseline-0"],
    }
    assert "the comparison with 'baseline' is not trustworthy" in found[0].message
    # the advisor turns it into advice with the fix, ahead of everything else
    advice = ordered(from_compare([f.model_dump(mode="json") for f in found]))
    assert advice[0].code == "warm_cache_contamination" and advice[0].rank == 0
    assert advice[0].action == WARM_CACHE_ACTION
    # clean runs: no such finding
    runs["baseline"] = _runs("baseline", 1.0, ["clean", "clean"])
    comps = {"apc-on": compare_variant(runs["apc-on"], runs["baseline"], n_boot=N_BOOT)}
    assert all(f.code != "warm_cache_contamination" for f in findings(comps, runs, refs))


def _run_doc(check_doc: dict[str, Any] | None) -> dict[str, Any]:
    info = {"cache_contamination": check_doc} if check_doc is not None else {}
    return {"id": "r1", "status": "succeeded", "engine_args": {}, "engine_info": info}


def test_advisor_warns_about_a_warm_run_with_cause_and_fix() -> None:
    found = run_findings(_run_doc(_check(256)), {"itl_burst_fraction": 0.9})
    assert [a.code for a in found] == ["warm_cache", "token_bursts"]
    warm = found[0]
    assert warm.severity == "warning" and warm.rank == RANK["warm_cache"] == 0
    assert "found 256 or more prompt tokens already cached" in warm.message
    for fix in ("a restart per run", "VLLM_SERVER_DEV_MODE=1", "block_pool.py"):
        assert fix in warm.action
    assert warm.evidence["cached_tokens_first_request"] == 256
    assert "note" not in warm.evidence
    json.dumps(warm.model_dump(mode="json"), allow_nan=False)


def test_advisor_is_quiet_for_clean_unknown_and_old_runs() -> None:
    unknown = check(
        [RequestRecord(index=0, success=True, start_s=1.0, ttft_s=0.05, e2el_s=0.1)], None, []
    )
    assert unknown["status"] == "unknown"
    for doc in (_check(0), unknown, None):
        assert run_findings(_run_doc(doc), {}) == []
