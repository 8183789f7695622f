"""The advisor's rules: each fires on its evidence, stays quiet without it, and the
findings come in rollback order."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from orchestrator.analysis.advisor import more_devices_slower, ordered, run_findings
from orchestrator.analysis.kvcache import check_against_engine

DEMO = Path(__file__).resolve().parents[2] / "web" / "data" / "demo_experiment.json"
SMALL = {
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "hidden_size": 512,
    "dtype": "bfloat16",
}
# vLLM's refusal when the cap does not fit (vllm issue 10517, also in ../shared/cases/kvcache)
CAP_ERROR = (
    "ERROR 11-20 10:01:02 [core.py:700] ValueError: The model's max seq len (29000) is larger "
    "than the maximum number of tokens that can be stored in KV cache (23648). Try increasing "
    "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine."
)


def _demo_runs() -> list[dict[str, Any]]:
    doc = json.loads(DEMO.read_text())
    return [
        {**r, "metrics": doc["runs"][r["id"]]["metrics"]["metrics"]}
        for r in doc["experiment"]["runs"]
    ]


def _run(**kw: Any) -> dict[str, Any]:
    base = _demo_runs()[1]  # apc-on, repeat 0: succeeded, hit rate ~0.9
    return {**base, **kw}


def test_a_healthy_real_run_has_no_findings() -> None:
    for r in _demo_runs():
        assert run_findings(r, r["metrics"]) == []


def test_a_cap_that_does_not_fit_comes_first_with_the_estimators_values() -> None:
    r = _run(status="failed", error="engine exited with code 1")
    facts = r["engine_info"]["startup_facts"]
    check = check_against_engine(SMALL, r["engine_args"], facts)
    assert check is not None
    r["engine_info"] = {**r["engine_info"], "kv_cache_check": check}
    r["engine_args"] = {**r["engine_args"], "max_num_seqs": 256}
    found = run_findings(r, {}, log_text="INFO starting\n" + CAP_ERROR + "\n")
    assert found[0].code == "out_of_memory" and found[0].rank == 1
    assert "larger than the maximum number of tokens" in found[0].evidence["log_line"]
    # 131,072 tokens of KV cache at a 2,048-token cap: 64 full-length requests
    assert "max_model_len to at most 2,048" in found[0].action
    assert "max_num_seqs to 64" in found[0].action


def test_kv_estimate_mismatch() -> None:
    r = _run()
    facts = {**r["engine_info"]["startup_facts"], "kv_cache_size_tokens": 262144}
    check = check_against_engine(SMALL, r["engine_args"], facts)
    r["engine_info"] = {**r["engine_info"], "kv_cache_check": check}
    (f,) = run_findings(r, r["metrics"])
    assert f.code == "kv_estimate_mismatch" and f.evidence["difference_tokens"] == 131072


def test_prefix_caching_without_effect_and_against_the_prediction() -> None:
    r = _run()
    (f,) = run_findings(r, {**r["metrics"], "prefix_cache_hit_rate": 0.01})
    assert f.code == "prefix_caching_no_effect" and "analyze/prefix" in f.action
    analysis = {
        "predicted_hit_rate": 0.02,
        "cause": "timestamp",
        "advice": "move the clock to the end of the prompt",
    }
    r["engine_info"] = {**r["engine_info"], "prefix_analysis": analysis}
    (f,) = run_findings(r, {**r["metrics"], "prefix_cache_hit_rate": 0.01})
    assert f.code == "prefix_caching_no_effect" and f.action == analysis["advice"]
    analysis = {**analysis, "predicted_hit_rate": 0.85}
    r["engine_info"] = {**r["engine_info"], "prefix_analysis": analysis}
    (f,) = run_findings(r, {**r["metrics"], "prefix_cache_hit_rate": 0.30})
    assert f.code == "hit_rate_below_prediction"
    analysis = {**analysis, "predicted_hit_rate": 0.30}
    r["engine_info"] = {**r["engine_info"], "prefix_analysis": analysis}
    (f,) = run_findings(r, {**r["metrics"], "prefix_cache_hit_rate": 0.90})
    # vLLM 0.32 books preempted requests' recomputed tokens apart (vllm-project/vllm#25787):
    # no preemption explains the excess, so the advice is about the prompts and the reset
    assert f.code == "hit_rate_above_prediction" and f.evidence["explanation"] == "not_preemption"
    assert "reset" in f.action
    # a version that counted recomputed tokens as hits (vllm-project/vllm#25780), with
    # preemptions measured: the excess may be recompute, and the advice says so
    old = {**r, "engine_info": {**r["engine_info"], "vllm_version": "0.10.1"}}
    m = {**r["metrics"], "prefix_cache_hit_rate": 0.90, "num_preemptions_delta": 40.0}
    (f,) = run_findings(old, m)
    assert f.code == "hit_rate_above_prediction" and "preempt" in f.action
    assert f.evidence["explanation"] in ("preemption_recompute", "preemption_recompute_possible")
    assert run_findings(r, {**r["metrics"], "prefix_cache_hit_rate": 0.35}) == []
    # prefix caching off: no prefix findings at all
    off = _demo_runs()[0]
    assert run_findings(off, {**off["metrics"], "prefix_cache_hit_rate": 0.0}) == []


def _cmp(verdict: str) -> dict[str, Any]:
    return {
        "variant": "tp2",
        "reference": "tp1",
        "metrics": [
            {
                "metric": "median_ttft_ms",
                "reference": 40.0,
                "variant": 60.0,
                "ratio": 1.5,
                "ci_low": 1.3,
                "ci_high": 1.7,
                "verdict": verdict,
            }
        ],
    }


def test_more_devices_slower() -> None:
    (f,) = more_devices_slower([_cmp("worse")], {"tp1": 1, "tp2": 2})
    assert f.code == "more_devices_slower" and f.variant == "tp2"
    assert "communication" in f.action and f.evidence["devices"] == {"variant": 2, "reference": 1}
    assert more_devices_slower([_cmp("no clear difference")], {"tp1": 1, "tp2": 2}) == []
    assert more_devices_slower([_cmp("worse")], {"tp1": 2, "tp2": 2}) == []


def test_rollback_order() -> None:
    r = _run(status="failed", error=CAP_ERROR)
    run_level = run_findings(r, {})
    exp_level = more_devices_slower([_cmp("worse")], {"tp1": 1, "tp2": 2})
    codes = [a.code for a in ordered(exp_level + run_level)]
    assert codes == ["out_of_memory", "more_devices_slower"]


def _apc_level(hit: float, ttft_verdict: str) -> dict[str, Any]:
    return {
        "variant": "apc-on",
        "reference": "baseline",
        "variable": "enable_prefix_caching",
        "metrics": [
            {"metric": "prefix_cache_hit_rate", "reference": 0.0, "variant": hit},
            {
                "metric": "median_ttft_ms",
                "reference": 107.8,
                "variant": 25.8,
                "ratio": 0.24,
                "ci_low": 0.07,
                "ci_high": 0.44,
                "verdict": ttft_verdict,
            },
        ],
    }


def test_a_gain_without_prefix_hits_is_not_credited() -> None:
    """A new-user trial's run: APC on, 0 % hit rate, TTFT "better" 0.24x [0.07, 0.44]."""
    from orchestrator.analysis.advisor import gain_without_hits

    (f,) = gain_without_hits([_apc_level(0.0, "better")])
    assert f.code == "gain_without_prefix_hits" and f.variant == "apc-on"
    assert "not from prefix caching" in f.message
    assert f.evidence["better"]["median_ttft_ms"]["ci"] == [0.07, 0.44]
    assert gain_without_hits([_apc_level(0.6, "better")]) == []  # hits explain it
    assert gain_without_hits([_apc_level(0.0, "no clear difference")]) == []
    other = {**_apc_level(0.0, "better"), "variable": "max_num_seqs"}
    assert gain_without_hits([other]) == []


def test_token_bursts_warn_about_the_measurement_first() -> None:
    """A new-user trial's run: every gap under 0.1 ms, client TTFT 65 ms above the server's."""
    r = _run()
    m = {
        **r["metrics"],
        "itl_burst_fraction": 1.0,
        "mean_ttft_client_minus_server_ms": 65.2,
        "prefix_cache_hit_rate": 0.01,
    }
    found = run_findings(r, m)
    assert [f.code for f in found] == ["token_bursts", "prefix_caching_no_effect"]
    assert "TTFT is 65 ms above the server's" in found[0].message
    assert "server_mean_ttft_ms" in found[0].action
    assert run_findings(r, {**r["metrics"], "itl_burst_fraction": 0.2}) == []


def test_a_stalled_load_generator_is_said_first_with_its_evidence() -> None:
    """The trial's supervisor SIGSTOPped for 11 s in a 38.6 s run: a finding, ranked with
    the other measurement warnings; a run whose client kept up has none."""
    r = _run()
    stalled = {
        **r["metrics"],
        "duration": 38.6,
        "client_stall_s": 11.1,
        "max_client_stall_ms": 11090.0,
        "client_stalled_requests": 1.0,
        "client_stalled_request_fraction": 0.02,
    }
    found = run_findings(r, stalled)
    assert [f.code for f in found] == ["client_stalled"]
    assert "11.09 s" in found[0].message and "28.8% of the measured phase" in found[0].message
    assert "1 of 50 measured requests (2.0%)" in found[0].message
    assert found[0].evidence["client_stall_s"] == 11.1
    assert "VLLM_CPU_OMP_THREADS_BIND" in str(found[0].action)
    kept_up = {
        **stalled,
        "client_stall_s": 0.2,
        "max_client_stall_ms": 101.0,
        "client_stalled_requests": 1.0,
        "client_stalled_request_fraction": 1 / 16,
    }
    assert run_findings(r, kept_up) == []
