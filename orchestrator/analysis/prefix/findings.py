"""Prefix findings on a run: the measured hit rate against the predicted one, and the
summary of an analysis a run keeps (``engine_info.prefix_analysis``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from orchestrator.analysis.prefix.schemas import PrefixAnalysis, PrefixFinding

#: KV cache usage (0-1) at or above which the cache counts as full (the scheduler preempts
#: or evicts when it cannot allocate blocks).
KV_FULL = 0.95
#: First vLLM version whose ``vllm:prefix_cache_hits`` / ``_queries`` leave re-scheduled
#: (preempted) requests out: vllm-project/vllm#25787 (merged 2025-09-26, fixing
#: vllm-project/vllm#25780 "vLLM counts re-computation tokens as prefix match"). 0.11.0
#: was cut the same week, so it is treated as unknown; 0.10.x and earlier count them.
FIXED_IN = (0, 11, 1)
_UNSURE = (0, 11, 0)


def _version(v: str | None) -> tuple[int, int, int] | None:
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", v or "")
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) if m else None


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float) or math.isnan(x):
        return None
    return float(x)


def _counts_preempted(version: str | None) -> bool | None:
    """Whether this vLLM counts preempted requests' recomputed lookups in the prefix cache
    counters: True before vllm-project/vllm#25787, False after (vLLM 0.32
    ``vllm/v1/metrics/stats.py`` ``PrefixCacheStats.record`` books them in
    ``preempted_queries`` / ``preempted_hits``, which ``vllm/v1/metrics/loggers.py`` does not
    add to ``vllm:prefix_cache_hits``), None when unknown."""
    v = _version(version)
    if v is None or v == _UNSURE:
        return None
    return v < FIXED_IN


def hit_rate_finding(
    predicted: float,
    measured: float,
    *,
    tolerance: float = 0.1,
    metrics: Mapping[str, Any] | None = None,
    summary: Mapping[str, Any] | None = None,
    vllm_version: str | None = None,
) -> PrefixFinding | None:
    """Compare a run's measured prefix cache hit rate with the analyser's prediction.

    Both are fractions in [0, 1]; ``measured`` is delta ``vllm:prefix_cache_hits`` / delta
    ``vllm:prefix_cache_queries`` over the run (tokens). A gap larger than ``tolerance``
    (absolute) is a finding, weighed against the run's server signals when given:

    - ``metrics``: the run's summary metrics
      (:func:`jobs.signals.enginemetrics.summarize_samples` keys): ``num_preemptions_delta``,
      ``kv_cache_usage_peak`` (0-1), ``num_requests_waiting_peak``,
      ``prefix_cache_queries_delta`` / ``prefix_cache_hits_delta`` (tokens);
    - ``summary``: the analysis a run keeps (:func:`summarize`): ``queries_tokens`` /
      ``hits_tokens`` predicted for the request list;
    - ``vllm_version``: the engine's version (``engine_info.vllm_version``).

    ``hit_rate_above_prediction``: the counters include work the prompts do not explain.
    vLLM before vllm-project/vllm#25787 counts a preempted request's recomputed prompt
    lookups as queries *and hits* (vllm-project/vllm#25780: 30 % "hit rate" on a random
    dataset with no shared prefix, 0.2 % after the fix). So with preemptions (or, when the
    counter is missing, a full KV cache or a waiting queue) the excess is *explained* by
    preemption recompute when this version counts them and the tokens queried beyond the
    prompts cover the excess hits, *possibly* explained when the version is unknown, and
    *not* when it does not count them or nothing was preempted: then blocks cached before
    the run (warm-up, an earlier run) or generated tokens reused by later turns.
    ``hit_rate_below_prediction``: the cache evicted shared blocks (``eviction_likely`` when
    the KV cache was full), requests were admitted together before their shared prefix was
    cached, or the prefix cache was off / reset during the run.

    The token counts assume the run sent the analysed request list once: when the server
    counted twice its tokens or more (capacity steps, other traffic) they are kept as
    evidence but not interpreted.

    Returns None when the two agree within ``tolerance``; the evidence holds every signal
    that was measured (absent ones are left out, never guessed).
    """
    diff = measured - predicted
    if abs(diff) <= tolerance:
        return None
    sm = summary or {}
    values = _signals(metrics or {}, sm)
    preempt, kv_peak, waiting, q_meas, h_meas, q_pred, h_pred = values
    evidence: dict[str, Any] = {
        "predicted_hit_rate": predicted,
        "measured_hit_rate": measured,
        "difference": diff,
        "tolerance": tolerance,
    }
    evidence.update({k: v for k, v in zip(_SIGNALS, values, strict=True) if v is not None})
    if vllm_version is not None:
        evidence["vllm_version"] = vllm_version
    extra_q, excess_h = _beyond(q_meas, h_meas, q_pred, h_pred, evidence)
    left_out = sm.get("generated_tokens_not_counted")
    if isinstance(left_out, list) and left_out:
        evidence["generated_tokens_not_counted"] = list(left_out)
    pressure = _pressure(preempt, kv_peak, waiting)
    if diff < 0:
        return _below(predicted, measured, evidence, preempt, kv_peak, pressure)
    return _above(
        predicted, measured, evidence, preempt, kv_peak, waiting, extra_q, excess_h, vllm_version
    )


#: The evidence keys of :func:`_signals`, in its order.
_SIGNALS = (
    "num_preemptions",
    "kv_cache_usage_peak",
    "num_requests_waiting_peak",
    "measured_queries_tokens",
    "measured_hits_tokens",
    "predicted_queries_tokens",
    "predicted_hits_tokens",
)


def _signals(m: Mapping[str, Any], sm: Mapping[str, Any]) -> tuple[float | None, ...]:
    """The run's server signals (``metrics``) and the prediction's token counts
    (``summary``), in :data:`_SIGNALS` order; None where not measured."""
    return (
        _num(m.get("num_preemptions_delta")),
        _num(m.get("kv_cache_usage_peak")),
        _num(m.get("num_requests_waiting_peak")),
        _num(m.get("prefix_cache_queries_delta")),
        _num(m.get("prefix_cache_hits_delta")),
        _num(sm.get("queries_tokens")),
        _num(sm.get("hits_tokens")),
    )


def _beyond(
    q_meas: float | None,
    h_meas: float | None,
    q_pred: float | None,
    h_pred: float | None,
    evidence: dict[str, Any],
) -> tuple[float | None, float | None]:
    """``(tokens queried beyond the prompts, tokens hit beyond the prediction)``, into
    ``evidence`` too; both None when the server counted the list twice or more."""
    extra_q = q_meas - q_pred if q_meas is not None and q_pred is not None else None
    excess_h = h_meas - h_pred if h_meas is not None and h_pred is not None else None
    if extra_q is not None:
        evidence["queries_beyond_prompts_tokens"] = extra_q
    if excess_h is not None:
        evidence["hits_beyond_prediction_tokens"] = excess_h
    if extra_q is not None and q_pred is not None and extra_q >= q_pred:
        # twice the prompts or more: the list was sent more than once (capacity steps) or
        # other traffic reached the server; the token counts say nothing about preemption
        evidence["token_counts_not_compared"] = (
            "the server counted at least twice the tokens the request list holds"
        )
        return None, None
    return extra_q, excess_h


def _pressure(preempt: float | None, kv_peak: float | None, waiting: float | None) -> str:
    """The server signals in words (only the measured ones)."""
    parts = []
    if preempt is not None:
        parts.append(f"{preempt:.0f} preemption(s)")
    if kv_peak is not None:
        parts.append(f"KV cache usage peaked at {kv_peak:.0%}")
    if waiting is not None:
        parts.append(f"up to {waiting:.0f} request(s) waited")
    return ", ".join(parts)


def _below(
    predicted: float,
    measured: float,
    evidence: dict[str, Any],
    preempt: float | None,
    kv_peak: float | None,
    pressure: str,
) -> PrefixFinding:
    full = kv_peak is not None and kv_peak >= KV_FULL
    message = (
        f"Measured prefix cache hit rate {measured:.1%} is far below the {predicted:.1%} the "
        "prompts allow: "
    )
    if full:
        message += (
            f"the KV cache was full ({pressure}), so shared blocks were likely evicted before "
            "the requests that share them arrived."
        )
    else:
        message += (
            "shared blocks were evicted (KV cache too small for the concurrency) or requests "
            "arrived before their shared prefix was cached"
            + (f" ({pressure})." if pressure else ".")
        )
    return PrefixFinding(
        code="hit_rate_below_prediction",
        severity="warning",
        evidence=evidence,
        message=message,
        explanation="eviction_likely" if full else None,
        action=(
            "give the KV cache room for the shared prefix and the running requests: lower "
            "max_num_seqs or raise the KV cache memory (POST /api/v1/analyze/kv-cache gives "
            "what fits)"
            if full
            else None
        ),
    )


#: What to do when preemption recompute may explain a hit rate above the prediction.
_RECOMPUTE_ACTION = (
    "do not credit prefix caching with the excess: lower max_num_seqs (or give the KV "
    "cache more memory) until vllm:num_preemptions stays at 0, or use a vLLM with "
    "vllm-project/vllm#25787, and measure again"
)
#: What to do when it does not.
_OTHER_ACTION = (
    "check that the prefix cache is reset before the measured requests and whether later "
    "turns resend generated answers; the excess is not reuse the prompts have"
)


def _other_causes(left_out: Sequence[Any]) -> str:
    """What else raises the hit rate above the prediction."""
    return (
        "blocks cached before the run (warm-up, an earlier run: was the prefix cache reset?) "
        + (
            f"or the answers of {len(left_out)} request(s) that later turns resend: the "
            "prediction leaves them out (their generated token ids were not given)"
            if left_out
            else "or generated tokens reused by later turns"
        )
    )


def _may_preempt(preempt: float | None, kv_peak: float | None, waiting: float | None) -> bool:
    """Whether requests were (or, the counter missing, may have been) preempted: a full
    KV cache, or without its peak a waiting queue."""
    full = kv_peak is not None and kv_peak >= KV_FULL
    return (preempt or 0) > 0 or (
        preempt is None and (full or (kv_peak is None and (waiting or 0) > 0))
    )


def _above(
    predicted: float,
    measured: float,
    evidence: dict[str, Any],
    preempt: float | None,
    kv_peak: float | None,
    waiting: float | None,
    extra_q: float | None,
    excess_h: float | None,
    vllm_version: str | None,
) -> PrefixFinding:
    head = (
        f"Measured prefix cache hit rate {measured:.1%} is far above the {predicted:.1%} the "
        "prompts allow"
    )
    counts = _counts_preempted(vllm_version)
    version = f"vLLM {vllm_version}" if vllm_version else "this vLLM (version unknown)"
    pressure = _pressure(preempt, kv_peak, waiting)
    numbers = (
        f"; the counters queried {extra_q:,.0f} tokens beyond the prompts and hit "
        f"{excess_h:,.0f} more than predicted"
        if extra_q is not None and excess_h is not None
        else ""
    )
    covered = extra_q is not None and excess_h is not None and extra_q >= excess_h > 0
    may_preempt = _may_preempt(preempt, kv_peak, waiting)
    other = _other_causes(evidence.get("generated_tokens_not_counted") or [])
    if not may_preempt:
        if preempt == 0:
            msg = (
                f"{head}: no request was preempted ({pressure}), so preemption recompute "
                f"does not explain it{numbers}: {other}."
            )
            return _found(evidence, msg, "not_preemption", _OTHER_ACTION)
        tail = f" ({pressure})" if pressure else ""
        msg = (
            f"{head}{tail}: the counters include preempted requests' re-computed tokens (vLLM "
            f"before vllm-project/vllm#25787), or {other}{numbers}."
        )
        return _found(evidence, msg, None, None)
    if counts is None and (preempt or 0) > 0 and extra_q is not None and extra_q <= 0:
        msg = (
            f"{head} ({pressure}). The counters queried no more tokens than the prompts hold "
            f"({extra_q:,.0f} beyond them), so preempted requests' re-scheduled lookups were not "
            f"counted (as in vLLM with vllm-project/vllm#25787) and do not explain it: {other}."
        )
        return _found(evidence, msg, "not_preemption", _OTHER_ACTION)
    if counts is False:
        msg = (
            f"{head} ({pressure}). {version} does not count preempted requests' recomputed "
            "tokens in vllm:prefix_cache_hits (vllm-project/vllm#25787), so preemption does "
            f"not explain it{numbers}: {other}."
        )
        return _found(evidence, msg, "not_preemption", _OTHER_ACTION)
    why = (
        f"{version} counts a preempted request's recomputed prompt lookups as hits "
        "(vllm-project/vllm#25780, fixed by #25787)"
        if counts
        else "vLLM before vllm-project/vllm#25787 counts a preempted request's recomputed "
        "prompt lookups as hits (vllm-project/vllm#25780)"
    )
    if covered and (preempt or 0) > 0 and counts is not False:
        msg = (
            f"{head}: the excess is explained by preemption recompute, not by reuse the "
            f"prompts have ({pressure}); {why}{numbers}, enough for the whole excess."
        )
        return _found(evidence, msg, "preemption_recompute", _RECOMPUTE_ACTION)
    if extra_q is not None and excess_h is not None and excess_h > 0 and not covered:
        msg = (
            f"{head} ({pressure}): {why}, but the tokens queried beyond the prompts cover "
            f"only part of the excess{numbers}; the rest: {other}."
        )
        return _found(evidence, msg, "preemption_recompute_possible", _RECOMPUTE_ACTION)
    not_counted = "; preemptions were not counted" if preempt is None else ""
    msg = (
        f"{head}: the excess may be preemption recompute rather than reuse the prompts have "
        f"({pressure}{not_counted}); {why}{numbers}. Otherwise: {other}."
    )
    return _found(evidence, msg, "preemption_recompute_possible", _RECOMPUTE_ACTION)


def _found(
    evidence: dict[str, Any], message: str, explanation: Any, action: str | None
) -> PrefixFinding:
    return PrefixFinding(
        code="hit_rate_above_prediction",
        severity="warning",
        evidence=evidence,
        message=message,
        explanation=explanation,
        action=action,
    )


def summarize(analysis: PrefixAnalysis) -> dict[str, Any]:
    """The part of an analysis a run keeps (``engine_info.prefix_analysis``), JSON-safe:
    ``predicted_hit_rate`` (0-1), ``queries_tokens``/``hits_tokens`` (predicted), and
    ``hits_tokens`` split by where the hit blocks come from, the sums of the per-request
    figures (they add up to ``hits_tokens``): ``hits_shared_prefix_tokens`` (the prefix every
    request shares), ``hits_prompt_tokens`` (earlier prompts only some requests share),
    ``hits_generated_tokens`` (tokens earlier requests generated, where given);
    ``generated_tokens_not_counted`` (the requests whose answer a later one builds on
    without its generated ids: what the prediction leaves out),
    ``shared_prefix_tokens``/``shared_prefix_blocks``/``reusable_prefix_tokens``,
    ``block_size``, ``num_requests``, ``cause`` (the cause of the plan's last change, else
    the first actionable cause), ``causes`` (every cause found, prompt order),
    ``divergence`` (the first actionable divergence, else the first), ``advice`` (in words,
    the plan: the change, or the changes to make together, that raise the predicted hit
    rate; None when no change does; the advisor shows it as the change to make first),
    ``advice_all`` (every change with its cumulative predicted hit rate and
    ``raises_hit_rate``), ``predicted_hit_rate_after_plan`` (with the changes ``advice``
    names: the figure to show beside it), ``predicted_hit_rate_after_advice`` (with every
    simulated change), ``notes``,
    ``prediction_counts_generated_tokens``, ``not_compared`` (requests left out) and
    ``resends``: ``{"count", "retokenized", "reusable_tokens",
    "reusable_tokens_in_prediction", "lost_tokens", "first"}`` over the multi-turn resends
    (sums of the :class:`Resend` figures; ``retokenized``: those whose tokens differ from the
    cached ones while the text is the same; ``reusable_tokens_in_prediction``: the part the
    predicted hit rate counts, the rest assumes answers the tokenizer's way;
    ``lost_tokens``: summed where known;
    ``first``: the first re-tokenized one), None without resends."""
    first = analysis.causes[0] if analysis.causes else analysis.divergence
    plan = [a for a in analysis.advice if a.raises_hit_rate]
    best = plan[-1] if plan else None
    text: str | None = None
    if len(plan) == 1:
        text = plan[0].change
    elif plan:
        text = (
            f"Make these {len(plan)} changes together (the predicted hit rate assumes all): "
            + " ".join(f"({i}) {a.change}" for i, a in enumerate(plan, 1))
        )
    cause = (
        best.cause if best is not None else (first.cause if first and first.actionable else None)
    )
    return {
        "predicted_hit_rate": analysis.prediction.hit_rate,
        "queries_tokens": analysis.prediction.queries_tokens,
        "hits_tokens": analysis.prediction.hits_tokens,
        "hits_shared_prefix_tokens": analysis.prediction.hits_shared_prefix_tokens,
        "hits_prompt_tokens": analysis.prediction.hits_prompt_tokens,
        "hits_generated_tokens": analysis.prediction.hits_generated_tokens,
        "generated_tokens_not_counted": list(analysis.generated_tokens_not_counted),
        "shared_prefix_tokens": analysis.shared_prefix_tokens,
        "shared_prefix_blocks": analysis.shared_prefix_blocks,
        "reusable_prefix_tokens": analysis.reusable_prefix_tokens,
        "block_size": analysis.block_size,
        "num_requests": analysis.num_requests,
        "cause": cause,
        "causes": [c.cause for c in analysis.causes],
        "divergence": first.model_dump(mode="json") if first else None,
        "advice": text,
        "advice_all": [a.model_dump(mode="json") for a in analysis.advice],
        "predicted_hit_rate_after_plan": analysis.predicted_hit_rate_after_plan,
        "predicted_hit_rate_after_advice": analysis.predicted_hit_rate_after_advice,
        "notes": list(analysis.notes),
        "prediction_counts_generated_tokens": analysis.prediction_counts_generated_tokens,
        "not_compared": [x.model_dump(mode="json") for x in analysis.not_compared],
        "resends": _resend_summary(analysis),
    }


def _resend_summary(analysis: PrefixAnalysis) -> dict[str, Any] | None:
    if not analysis.resends:
        return None
    retok = [
        r
        for r in analysis.resends
        if r.divergence is not None and r.divergence.cause.startswith("retokenization")
    ]
    return {
        "count": len(analysis.resends),
        "retokenized": len(retok),
        "reusable_tokens": sum(r.reusable_tokens for r in analysis.resends),
        "reusable_tokens_in_prediction": sum(
            r.reusable_tokens_in_prediction for r in analysis.resends
        ),
        "lost_tokens": sum(r.lost_tokens or 0 for r in analysis.resends),
        "first": retok[0].model_dump(mode="json") if retok else None,
    }
