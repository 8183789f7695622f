"""The advisor: findings over a run's or an experiment's stored data, in the order
operators roll changes back, each with the evidence behind it.

Rollback order (``rank``; lower comes first). Rank 0 is not a rollback but a
warning about the measurement itself (``token_bursts``: streamed tokens arrived in
bursts, so the client's ITL/TPOT, and TTFT when the first token comes with later
ones, do not measure the engine; use the server-side histograms; ``warm_cache``: the
run's measured requests began on a warm prefix cache, ``engine_info.cache_contamination``
of :mod:`jobs.signals.cachecheck`, and ``warm_cache_contamination``: a comparison includes
such a run, so its ratios are not trustworthy).

1. ``out_of_memory`` / ``context_cap_does_not_fit``: the engine ran out of memory
   or the context cap does not fit the KV cache. Action: lower ``max_model_len``
   and the concurrency limit (``max_num_seqs``) first, to the values the KV cache
   estimator gives (:mod:`orchestrator.analysis.kvcache`).
2. ``kv_estimate_mismatch``: the engine's printed KV cache size disagrees with the
   estimate beyond print rounding (``engine_info.kv_cache_check``).
3. ``prefix_caching_no_effect`` / ``hit_rate_below_prediction`` /
   ``hit_rate_above_prediction``: prefix caching is on but hits little, or the
   measured hit rate is far from what the prompt-prefix analyser predicts for the
   request list (``engine_info.prefix_analysis``); the analyser's divergence is
   the evidence. ``gain_without_prefix_hits``: a level that turned prefix caching on
   hit nothing yet got faster, so the gain is something else.
4. ``more_devices_slower`` / ``tp_up_throughput_per_device_down``: a level with
   more GPUs than its reference is slower; compare against the smaller baseline
   and look at communication (TP all-reduce, PP hand-offs).
5. ``long_requests_starve_short``: in mixed runs, the short requests' TTFT jumps.
6. ``hit_rate_up_e2e_flat``: the hit rate went up but end-to-end latency did not
   move: decode or queueing dominates.

Experiment findings 4-6 come from :func:`orchestrator.analysis.findings.findings` (bootstrap
CIs) plus :func:`more_devices_slower`; run findings from :func:`run_findings`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field

from orchestrator.analysis.prefix import hit_rate_finding
from orchestrator.analysis.trust import BURSTY, TTFT_LAG_MS, client_stalled

#: Rollback order of every finding code (lower first).
RANK: dict[str, int] = {
    "warm_cache": 0,
    "warm_cache_contamination": 0,
    "token_bursts": 0,
    "client_stalled": 0,
    "out_of_memory": 1,
    "context_cap_does_not_fit": 1,
    "kv_estimate_mismatch": 2,
    "prefix_caching_no_effect": 3,
    "hit_rate_below_prediction": 3,
    "hit_rate_above_prediction": 3,
    "gain_without_prefix_hits": 3,
    "more_devices_slower": 4,
    "tp_up_throughput_per_device_down": 4,
    "long_requests_starve_short": 5,
    "hit_rate_up_e2e_flat": 6,
}

#: Rank of a code missing from :data:`RANK`.
UNRANKED = 9

#: Engine log / error wordings of running out of memory or of a cap that does not fit.
OOM_PATTERNS = re.compile(
    r"out of memory|OutOfMemoryError|No available memory for the cache blocks|"
    r"larger than the maximum number of tokens that can be stored in KV cache|"
    r"insufficient (?:KV cache|memory)|not enough KV cache|Cannot allocate memory",
    re.IGNORECASE,
)

#: Below this measured hit rate (0-1), prefix caching "has no effect".
LOW_HIT_RATE = 0.05
#: Measured below ``predicted - FAR`` or above ``predicted + FAR`` is "far" (absolute, 0-1;
#: :func:`orchestrator.analysis.prefix.hit_rate_finding`).
FAR = 0.2


class Advice(BaseModel):
    """One finding: what is wrong, what to change first, and the numbers behind it.

    ``rank``: position in the rollback order (module docstring), from :data:`RANK` by
    ``code``. ``scope``: a run
    or an experiment level (``variant``). ``evidence``: JSON-safe figures (units in
    their key names: ``_ms``, ``_tokens``, ``_gib``; rates 0-1).
    """

    code: str
    severity: Literal["info", "warning", "error"]
    rank: int = Field(default_factory=lambda data: RANK.get(data["code"], UNRANKED))
    scope: Literal["run", "experiment"]
    run_id: str | None = None
    variant: str | None = None
    message: str
    action: str
    evidence: dict[str, Any] = Field(default_factory=dict)


def _fit_action(check: Mapping[str, Any] | None, engine_args: Mapping[str, Any]) -> str:
    if not check or not check.get("estimate"):
        return (
            "lower max_model_len and max_num_seqs first; POST /api/v1/analyze/kv-cache gives "
            "the values that fit"
        )
    est = check["estimate"]
    tokens = int(est["kv_cache_tokens"])
    block = int(est["block_size"])
    cap = int(engine_args.get("max_model_len") or est["max_model_len"])
    seqs = engine_args.get("max_num_seqs")
    fit_cap = min(cap, tokens // block * block)
    concurrency = max(1, tokens // max(1, fit_cap))
    text = f"lower max_model_len to at most {fit_cap:,} tokens (the KV cache holds {tokens:,})"
    if seqs:
        text += f" and max_num_seqs to {min(int(seqs), concurrency)}"
    text += f"; at that cap {concurrency} full-length requests fit at once"
    return text


def run_findings(
    run: Mapping[str, Any], metrics: Mapping[str, float], log_text: str | None = None
) -> list[Advice]:
    """Findings for one run, in rollback order.

    Args:
        run: the run's stored fields: ``id``, ``status``, ``error``,
            ``engine_args``, ``engine_info`` (``kv_cache_check``,
            ``prefix_analysis``, ``startup_facts``).
        metrics: its summary metrics (``prefix_cache_hit_rate`` 0-1, ...).
        log_text: the engine log, searched for out-of-memory wordings when the run failed.
    """
    rid = str(run.get("id"))
    args: Mapping[str, Any] = run.get("engine_args") or {}
    info: Mapping[str, Any] = run.get("engine_info") or {}
    out = _memory_findings(rid, run, args, info.get("kv_cache_check"), log_text)
    out += _measurement_findings(rid, run, info, metrics)
    if run.get("status") == "succeeded" and args.get("enable_prefix_caching"):
        out += _prefix_findings(rid, metrics, info.get("prefix_analysis"), info.get("vllm_version"))
    return sorted(out, key=lambda a: a.rank)


def _memory_findings(
    rid: str,
    run: Mapping[str, Any],
    args: Mapping[str, Any],
    check: Mapping[str, Any] | None,
    log_text: str | None,
) -> list[Advice]:
    """Out of memory in the log, a context cap that does not fit, a KV estimate that
    disagrees with the engine."""
    out: list[Advice] = []
    if run.get("status") in ("failed", "blocked"):
        text = "\n".join(filter(None, [run.get("error") or "", log_text or ""]))
        m = OOM_PATTERNS.search(text)
        if m:
            line = next((ln for ln in text.splitlines() if OOM_PATTERNS.search(ln)), m.group(0))
            out.append(
                Advice(
                    code="out_of_memory",
                    severity="error",
                    scope="run",
                    run_id=rid,
                    message="the engine ran out of memory or its context cap does not fit",
                    action=_fit_action(check, args),
                    evidence={"log_line": line.strip()[:500]},
                )
            )
    if check and check.get("estimate") and not check["estimate"].get("fits", True):
        out.append(
            Advice(
                code="context_cap_does_not_fit",
                severity="error",
                scope="run",
                run_id=rid,
                message=(
                    f"max_model_len {check['estimate']['max_model_len']:,} does not fit the KV "
                    f"cache ({check['estimate']['kv_cache_tokens']:,} tokens)"
                ),
                action=_fit_action(check, args),
                evidence={"estimate": check["estimate"]},
            )
        )
    if check and check.get("difference_tokens") is not None and not check.get("agrees"):
        out.append(
            Advice(
                code="kv_estimate_mismatch",
                severity="warning",
                scope="run",
                run_id=rid,
                message=(
                    f"the engine printed a KV cache of {check['engine']['kv_cache_tokens']:,} "
                    f"tokens; the estimate for the same memory is "
                    f"{check['estimate']['kv_cache_tokens']:,} (tolerance "
                    f"{check['tolerance_tokens']:,})"
                ),
                action=(
                    "check the attention backend, kv_cache_dtype and the per-rank memory the "
                    "engine reports before trusting capacity plans for this engine"
                ),
                evidence={
                    "engine": check["engine"],
                    "estimate_kv_cache_tokens": check["estimate"]["kv_cache_tokens"],
                    "kv_bytes_per_token": check["estimate"]["kv_bytes_per_token"],
                    "difference_tokens": check["difference_tokens"],
                    "tolerance_tokens": check["tolerance_tokens"],
                },
            )
        )
    return out


def _measurement_findings(
    rid: str, run: Mapping[str, Any], info: Mapping[str, Any], metrics: Mapping[str, float]
) -> list[Advice]:
    """Measurements that mislead: a warm prefix cache, streamed tokens in bursts, a load
    generator that stalled."""
    out: list[Advice] = []
    warm = info.get("cache_contamination") or {}
    if warm.get("status") == "contaminated":
        out.append(
            Advice(
                code="warm_cache",
                severity="warning",
                scope="run",
                run_id=rid,
                message=(
                    "the measured requests began on a warm prefix cache: "
                    + str(warm.get("note") or "the warm-cache check found cached blocks")
                ),
                action=WARM_CACHE_ACTION,
                evidence={k: v for k, v in warm.items() if k != "note"},
            )
        )
    burst = metrics.get("itl_burst_fraction")
    if run.get("status") == "succeeded" and burst is not None and burst >= BURSTY:
        gap = metrics.get("mean_ttft_client_minus_server_ms")
        out.append(
            Advice(
                code="token_bursts",
                severity="warning",
                scope="run",
                run_id=rid,
                message=(
                    f"{burst:.0%} of inter-token gaps were under 0.1 ms: streamed tokens "
                    "arrived in bursts, so the client's ITL and TPOT understate decode time"
                    + (
                        f" and its TTFT is {gap:.0f} ms above the server's"
                        if gap is not None and gap > TTFT_LAG_MS
                        else ""
                    )
                ),
                action=(
                    "read TTFT, ITL and TPOT from the server-side histograms "
                    "(server_mean_ttft_ms, server_p50_itl_ms, ...) for this run, and give the "
                    "API server its own core (the engine's threads starve it)"
                ),
                evidence={
                    "itl_burst_fraction": burst,
                    "mean_ttft_client_minus_server_ms": gap,
                    "median_ttft_ms": metrics.get("median_ttft_ms"),
                    "median_e2el_ms": metrics.get("median_e2el_ms"),
                    "server_mean_ttft_ms": metrics.get("server_mean_ttft_ms"),
                },
            )
        )
    if run.get("status") == "succeeded":
        out += _stall_findings(rid, metrics)
    return out


def _stall_findings(rid: str, metrics: Mapping[str, float]) -> list[Advice]:
    """A load generator that stalled (:func:`orchestrator.analysis.trust.client_stalled`)."""
    stalled = client_stalled(metrics)
    out: list[Advice] = []
    if stalled is not None:
        out.append(
            Advice(
                code="client_stalled",
                severity="warning",
                scope="run",
                run_id=rid,
                message=stalled,
                action=(
                    "measure again with the load generator on cores the engine does not use "
                    "(VLLM_CPU_OMP_THREADS_BIND) or on another node, and nothing else "
                    "competing for its CPU; nothing its client timed gives a verdict"
                ),
                evidence={
                    k: metrics.get(k)
                    for k in (
                        "client_stall_s",
                        "max_client_stall_ms",
                        "client_stalled_requests",
                        "client_stalled_request_fraction",
                        "duration",
                    )
                },
            )
        )
    return out


def _prefix_findings(
    rid: str,
    metrics: Mapping[str, float],
    analysis: Mapping[str, Any] | None,
    vllm_version: str | None = None,
) -> list[Advice]:
    measured = metrics.get("prefix_cache_hit_rate")
    predicted = (analysis or {}).get("predicted_hit_rate")  # None also when it errored
    evidence: dict[str, Any] = {"measured_hit_rate": measured}
    if analysis:
        evidence["prediction"] = {
            k: analysis.get(k)
            for k in (
                "predicted_hit_rate",
                "shared_prefix_tokens",
                "shared_prefix_blocks",
                "divergence",
                "cause",
                "advice",
            )
            if analysis.get(k) is not None
        }
    cause = (analysis or {}).get("cause")
    advice = (analysis or {}).get("advice")
    if predicted is not None and measured is not None:
        found = hit_rate_finding(
            float(predicted),
            float(measured),
            tolerance=FAR,
            metrics=metrics,
            summary=analysis,
            vllm_version=vllm_version,
        )
        if found is not None:
            return [
                Advice(
                    code=found.code,
                    severity=found.severity,
                    scope="run",
                    run_id=rid,
                    message=found.message,
                    action=found.action or _PREDICTION_ACTIONS[found.code],
                    evidence={**evidence, **found.evidence, "explanation": found.explanation},
                )
            ]
    if measured is None or measured < LOW_HIT_RATE:
        where = f" ({cause}: {advice})" if cause and advice else ""
        return [
            Advice(
                code="prefix_caching_no_effect",
                severity="warning",
                scope="run",
                run_id=rid,
                message=(
                    "prefix caching is on but the prefix cache hit rate is "
                    + ("unknown" if measured is None else f"{measured:.1%}")
                    + where
                ),
                action=(
                    advice
                    or "run the prompt-prefix analyser (POST /api/v1/analyze/prefix) on the "
                    "requests to see where they diverge"
                ),
                evidence=evidence,
            )
        ]
    return []


#: What to do about a warm prefix cache (run and comparison findings).
WARM_CACHE_ACTION = (
    "do not compare this run's numbers: rerun it on a cache that is really empty: on a "
    "vLLM server of its own (a restart per run), or with a reset that works: "
    "POST /reset_prefix_cache with VLLM_SERVER_DEV_MODE=1, no request still "
    "running when it is called (vLLM refuses to reset while blocks are held: 'Failed to "
    "reset prefix cache because some blocks are not freed yet', "
    "vllm/v1/core/block_pool.py), a vLLM whose endpoint reports the result "
    '({"success": false}), and ?reset_external=true with a KV connector (LMCache)'
)

_PREDICTION_ACTIONS = {
    "hit_rate_below_prediction": (
        "the cache evicts or misses what the prompts share: check KV cache usage (a full "
        "cache evicts prefixes), max_num_seqs and the order requests arrive in"
    ),
    "hit_rate_above_prediction": (
        "vLLM's counters can count recomputed (preempted) tokens as hits; look at "
        "num_preemptions and blocks left from earlier runs before crediting prefix caching"
    ),
}


def more_devices_slower(
    variants: Sequence[Mapping[str, Any]], devices: Mapping[str, int]
) -> list[Advice]:
    """Levels that reserve more devices than their reference and got slower.

    Args:
        variants: ``comparison()["variants"]`` entries (``variant``, ``reference``,
            ``metrics``: MetricComparison dicts).
        devices: devices reserved per variant name (TP x PP).

    A finding when a level has more devices than its reference and its median TTFT,
    median E2EL or output throughput verdict is ``worse`` (95 % bootstrap CI on the
    bad side; :mod:`orchestrator.analysis.compare`).
    """
    out = []
    for v in variants:
        name, ref = v.get("variant"), v.get("reference")
        if name is None or ref is None or devices.get(name, 0) <= devices.get(ref, 0):
            continue
        worse = {
            m["metric"]: m
            for m in v.get("metrics", [])
            if m["metric"] in ("median_ttft_ms", "median_e2el_ms", "output_throughput")
            and m.get("verdict") == "worse"
        }
        if not worse:
            continue
        parts = [
            f"{k} {m['ratio']:.2f}x" if m.get("ratio") is not None else k for k, m in worse.items()
        ]
        out.append(
            Advice(
                code="more_devices_slower",
                severity="warning",
                scope="experiment",
                variant=str(name),
                message=(
                    f"{name!r} uses {devices[name]} devices against {devices[ref]} for "
                    f"{ref!r} and is slower: " + ", ".join(parts)
                ),
                action=(
                    f"keep {ref!r}'s layout: the extra devices cost more in communication "
                    "(TP all-reduce per layer, PP stage hand-offs) than they add in compute "
                    "for this model and traffic; check the interconnect (NVLink vs PCIe, "
                    "NCCL settings) before scaling out"
                ),
                evidence={
                    "devices": {"variant": devices[name], "reference": devices[ref]},
                    "worse": {
                        k: {
                            "reference": m["reference"],
                            "variant": m["variant"],
                            "ratio": m.get("ratio"),
                            "ci": [m.get("ci_low"), m.get("ci_high")],
                        }
                        for k, m in worse.items()
                    },
                },
            )
        )
    return out


def gain_without_hits(variants: Sequence[Mapping[str, Any]]) -> list[Advice]:
    """Levels that turned prefix caching on, hit (almost) nothing, and still got a
    ``better`` TTFT or E2EL verdict: the gain cannot come from prefix caching.

    Args:
        variants: ``comparison()["variants"]`` entries (``variant``, ``variable``,
            ``metrics``: MetricComparison dicts, ``prefix_cache_hit_rate`` among them).
    """
    out = []
    for v in variants:
        if v.get("variable") != "enable_prefix_caching":
            continue
        by = {m["metric"]: m for m in v.get("metrics", [])}
        hit = by.get("prefix_cache_hit_rate")
        if hit is None or hit.get("variant") is None or hit["variant"] >= LOW_HIT_RATE:
            continue
        gains = {
            k: by[k]
            for k in ("median_ttft_ms", "median_e2el_ms")
            if k in by and by[k].get("verdict") == "better"
        }
        if not gains:
            continue
        out.append(
            Advice(
                code="gain_without_prefix_hits",
                severity="warning",
                scope="experiment",
                variant=str(v.get("variant")),
                message=(
                    f"{', '.join(gains)} got better with prefix caching on, but the prefix "
                    f"cache hit rate is {hit['variant']:.1%}: the gain is not from prefix "
                    "caching"
                ),
                action=(
                    "do not credit prefix caching: the difference comes from something else "
                    "(run order, a busy machine, compile or cache warm-up); repeat with more "
                    "interleaved repeats and check the prompts share a prefix (POST "
                    "/api/v1/analyze/prefix)"
                ),
                evidence={
                    "prefix_cache_hit_rate": hit["variant"],
                    "better": {
                        k: {"ratio": m.get("ratio"), "ci": [m.get("ci_low"), m.get("ci_high")]}
                        for k, m in gains.items()
                    },
                },
            )
        )
    return out


def from_compare(found: Sequence[Mapping[str, Any]]) -> list[Advice]:
    """:class:`orchestrator.analysis.findings.Finding` dicts as advice (their message already
    carries the suggested change)."""
    out = []
    for f in found:
        code = str(f["code"])
        out.append(
            Advice(
                code=code,
                severity=f.get("severity", "info"),
                scope="experiment",
                variant=f.get("variant"),
                message=str(f["message"]),
                action=_COMPARE_ACTIONS.get(code, str(f["message"])),
                evidence=dict(f.get("evidence") or {}),
            )
        )
    return out


_COMPARE_ACTIONS = {
    "warm_cache_contamination": WARM_CACHE_ACTION,
    "hit_rate_up_e2e_flat": (
        "prefill is no longer the bottleneck: decode or queueing dominates end-to-end "
        "latency; look at TPOT, max_num_seqs and max_num_batched_tokens next"
    ),
    "tp_up_throughput_per_device_down": (
        "compare against the smaller-TP level at the same total GPU count (replicas "
        "instead of TP) and check the interconnect"
    ),
    "long_requests_starve_short": (
        "route long requests to a vLLM server of their own (a second endpoint); if one "
        "server must serve both, turn on chunked prefill with a lower "
        "max_num_batched_tokens so a long prefill is split between decode steps"
    ),
}


def ordered(advice: Sequence[Advice]) -> list[Advice]:
    """Advice sorted by rollback order, then scope (runs first), keeping input order."""
    return sorted(advice, key=lambda a: (a.rank, a.scope != "run"))
