"""Prefix findings on a run: the measured hit rate against the predicted one, and the
summary of an analysis a run keeps (``engine_info.prefix_analysis``).
"""

from __future__ import annotations

from typing import Any

from orchestrator.analysis.prefix.schemas import PrefixAnalysis, PrefixFinding


def hit_rate_finding(
    predicted: float, measured: float, *, tolerance: float = 0.1
) -> PrefixFinding | None:
    """Compare a run's measured prefix cache hit rate with the analyser's prediction.

    Both are fractions in [0, 1]; ``measured`` is delta ``vllm:prefix_cache_hits`` / delta
    ``vllm:prefix_cache_queries`` over the run (tokens). A gap larger than ``tolerance``
    (absolute) is a finding:

    - ``hit_rate_below_prediction`` (warning): the cache evicted shared blocks (KV cache
      too small for the concurrency), requests were admitted together before their shared
      prefix was cached, or the prefix cache was off / reset during the run.
    - ``hit_rate_above_prediction`` (warning): the counters include work the prompts do
      not explain: preempted requests re-hitting their own blocks (counted as hits before
      vLLM split out ``preempted_hits``), warm-up or earlier runs' blocks left in the cache,
      or generated tokens reused by later turns.

    Returns None when the two agree within ``tolerance``.
    """
    diff = measured - predicted
    if abs(diff) <= tolerance:
        return None
    evidence = {
        "predicted_hit_rate": predicted,
        "measured_hit_rate": measured,
        "difference": diff,
        "tolerance": tolerance,
    }
    if diff < 0:
        return PrefixFinding(
            code="hit_rate_below_prediction",
            severity="warning",
            evidence=evidence,
            message=(
                f"Measured prefix cache hit rate {measured:.1%} is far below the "
                f"{predicted:.1%} the prompts allow: shared blocks were evicted (KV cache "
                "too small for the concurrency) or requests arrived before their shared "
                "prefix was cached."
            ),
        )
    return PrefixFinding(
        code="hit_rate_above_prediction",
        severity="warning",
        evidence=evidence,
        message=(
            f"Measured prefix cache hit rate {measured:.1%} is far above the "
            f"{predicted:.1%} the prompts allow: the counters include preempted "
            "requests' re-computed tokens, or blocks cached before the run (warm-up, "
            "an earlier run, generated tokens)."
        ),
    )


def summarize(analysis: PrefixAnalysis) -> dict[str, Any]:
    """The part of an analysis a run keeps (``engine_info.prefix_analysis``), JSON-safe:
    ``predicted_hit_rate`` (0-1), ``queries_tokens``/``hits_tokens`` (predicted),
    ``shared_prefix_tokens``/``shared_prefix_blocks``/``reusable_prefix_tokens``,
    ``block_size``, ``num_requests``, ``cause`` (the cause of the plan's last change, else
    the first actionable cause), ``causes`` (every cause found, prompt order),
    ``divergence`` (the first actionable divergence, else the first), ``advice`` (in words,
    the plan: the change, or the changes to make together, that raise the predicted hit
    rate; None when no change does; the advisor shows it as the change to make first),
    ``advice_all`` (every change with its cumulative predicted hit rate and
    ``raises_hit_rate``), ``predicted_hit_rate_after_advice`` and ``notes``."""
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
        "predicted_hit_rate_after_advice": analysis.predicted_hit_rate_after_advice,
        "notes": list(analysis.notes),
    }
