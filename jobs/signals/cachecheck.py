"""Warm-cache check: did a measured phase start on an empty prefix cache?

The runner resets vLLM's prefix cache (``POST /reset_prefix_cache``) before every
measured phase, so that neither the warm-up's blocks nor an earlier run's (a server
shared by a batch, an earlier capacity step) make the measured requests look faster.
A reset can "succeed" and leave blocks: vLLM's block pool refuses to reset while any
block is held (``vllm/v1/core/block_pool.py`` ``BlockPool.reset_prefix_cache``, vLLM 0.32
line 837: "Failed to reset prefix cache because some blocks (%d) are not freed yet",
returns False), and older API servers answered HTTP 200 whatever the engine returned
("Note that we currently do not check if the prefix cache is successfully reset in the
API server", older ``vllm/entrypoints/openai/api_server.py``; vLLM 0.32 answers
``{"success": bool}``, ``vllm/entrypoints/serve/dev/cache/api_router.py``); an external
KV cache (a KV connector, LMCache) is not reset without ``?reset_external=true``.
Public reports measured what a warm cache does to a benchmark: 2.32x throughput and 49x
lower mean TTFT on one cell (vllm-project/vllm#54227), up to 86 % more throughput
(vllm-project/vllm#52884).

:func:`check` decides, from what the phase measured, whether the **first measured
request the engine scheduled** found anything in the prefix cache. That request's
lookup can only hit blocks cached before the phase (no other request of the phase had
been scheduled yet), so any hit of it is contamination. Which request that was is not
visible from the client when several were sent at once; the rules below only say what
follows from the timings.

**Signal 1, per-request cached tokens** (``usage.prompt_tokens_details.cached_tokens``,
:attr:`~jobs.schemas.RequestRecord.cached_tokens`; vLLM sets it from the request's first
scheduling, ``PrefillStats.num_cached_tokens`` = local + external cached tokens,
``vllm/v1/core/sched/scheduler.py``, and reports it only with
``--enable-prompt-tokens-details``). The *first wave* is every measured request sent
before the earliest first token of the phase (``start_s <= min(start_s + ttft_s)``).
The request scheduled first was sent before it was scheduled, which is before any
request of the phase produced a token, so it is in the first wave. Hence:

- every first-wave request reports cached tokens > 0: the first-scheduled one did too
  -> ``contaminated`` (its hit is at least the smallest of them);
- every first-wave request reports 0 -> ``clean`` (it found nothing);
- some 0, some > 0 -> ``inconclusive``: a later-scheduled request may have hit the
  blocks the first one had just put there (with concurrency 1 the first wave is one
  request, so this cannot happen).

A missing value counts as 0 only when the server is known to report cached tokens (the
launch sets ``enable_prompt_tokens_details``, or another request of the run reported a
value): older vLLM omitted ``prompt_tokens_details`` when the count was 0
(``if self.enable_prompt_tokens_details and num_cached_tokens:`` in
``vllm/entrypoints/openai/serving_chat.py``; vLLM 0.32 reports 0). Otherwise it is
unknown.

**Signal 2, the ``/metrics`` counters** (``prefix_cache_hits`` / ``prefix_cache_queries``
of :func:`jobs.signals.enginemetrics.parse_metrics`: ``vllm:prefix_cache_hits_total`` or the older
token- or block-counted ``vllm:gpu_prefix_cache_*``). For every scrape ``S`` of the phase
after ``before``, ``H`` and ``Q`` are the counters' growth since ``before``, and the
requests *possibly looked up* by ``S`` are those sent before ``S``'s response came back.
A request cannot hit more than ``prompt_tokens - 1`` tokens (vLLM always computes the
last one: ``max_cache_hit_length = request.num_tokens - 1``,
``vllm/v1/core/kv_cache_manager.py``), and the first one looked up hits nothing of the
run, so the requests of the run can explain at most ``sum(p - 1) - min(p - 1)`` hit
tokens among themselves (0 when one request was sent). Hence:

- ``H`` above that bound -> ``contaminated`` (in tokens; block-counted counters only
  with one request sent; not when preemptions grew: some vLLM versions count a
  preempted request's recomputed blocks as hits);
- one request sent, ``Q > 0``, ``H == 0`` -> ``clean``: it was looked up and found
  nothing; the ``after`` scrape with ``Q > 0`` and ``H == 0`` -> ``clean``: no request of
  the phase found anything;
- otherwise ``inconclusive`` (the usual case with short requests: by the next scrape
  several requests were sent), ``unavailable`` without the counters.

The counters assume the server serves only this run's requests (vlab starts it for
the batch).

**Status**: ``contaminated`` when either signal proves it; else ``clean`` when either
shows the first request found nothing (or prefix caching is off: nothing can be
cached); else ``unknown`` (never ``clean`` by default). A capacity search checks every
step (:func:`combine`). Pure functions, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from jobs.schemas import MetricSample, RequestRecord

__all__ = ["Scrape", "cached_tokens_signal", "check", "combine", "counter_signal", "first_wave"]

Status = Literal["clean", "contaminated", "unknown"]
Signal = Literal["clean", "contaminated", "inconclusive", "unavailable"]

#: The fix, said wherever a contaminated run is flagged.
FIX = (
    "restart the vLLM server for each run (runs that do not share a server), or make the "
    "reset work: VLLM_SERVER_DEV_MODE=1 for POST /reset_prefix_cache, no request still "
    "running when it is called (vLLM refuses while blocks are held), an API server that "
    "reports the reset's result, and ?reset_external=true with a KV connector"
)

_MAX_LISTED = 20


@dataclass(frozen=True)
class Scrape:
    """One ``/metrics`` scrape of the phase and when its response came back (``end_s``,
    seconds on the same clock as :attr:`MetricSample.t_s` and ``RequestRecord.start_s``)."""

    sample: MetricSample
    end_s: float


def first_wave(records: Sequence[RequestRecord]) -> list[RequestRecord]:
    """The measured requests sent no later than the phase's earliest first token.

    The first request the engine scheduled is among them (module docstring). Without
    any first token (every request failed before one), every measured request.
    """
    measured = [r for r in records if not r.warmup]
    firsts = [
        r.start_s + r.ttft_s
        for r in measured
        if r.ttft_s is not None and math.isfinite(r.ttft_s) and r.ttft_s >= 0
    ]
    t_first = min(firsts, default=math.inf)
    return [r for r in measured if r.start_s <= t_first]


def cached_tokens_signal(
    records: Sequence[RequestRecord], reports_cached_tokens: bool
) -> tuple[Signal, dict[str, Any]]:
    """Signal 1 (module docstring) over the phase's ``records``.

    ``reports_cached_tokens``: the server is known to report cached tokens (a missing
    value on a successful request then means 0; a failed request's stays unknown).
    Returns ``(signal, evidence)``; evidence keys:
    ``first_wave`` (requests), ``first_wave_cached_tokens`` (their values in send
    order, None where unknown; at most 20), ``cached_tokens_first_request`` (the
    first-scheduled request's cached tokens when the first wave is one request, or the
    proven lower bound when every first-wave request hit; else None).
    """
    wave = sorted(first_wave(records), key=lambda r: r.start_s)
    # A missing value means 0 only on a successful request: vLLM's usage (and so
    # prompt_tokens_details) comes with the final chunk, which a failed request lacks.
    values: list[int | None] = [
        r.cached_tokens
        if r.cached_tokens is not None
        else (0 if reports_cached_tokens and r.success else None)
        for r in wave
    ]
    evidence: dict[str, Any] = {
        "first_wave": len(wave),
        "first_wave_cached_tokens": values[:_MAX_LISTED],
        "cached_tokens_first_request": None,
    }
    if not wave:
        return "unavailable", evidence
    known = [v for v in values if v is not None]
    if not known:
        return "unavailable", evidence
    if len(known) < len(values):
        return "inconclusive", evidence
    if all(v > 0 for v in known):
        evidence["cached_tokens_first_request"] = min(known)
        return "contaminated", evidence
    if all(v == 0 for v in known):
        evidence["cached_tokens_first_request"] = 0
        return "clean", evidence
    return "inconclusive", evidence


def _growth(before: MetricSample, after: MetricSample, key: str) -> float | None:
    if key not in before.values or key not in after.values:
        return None
    d = after.values[key] - before.values[key]
    return d if d >= 0 and math.isfinite(d) else None


def _self_hit_bound(sent: Sequence[RequestRecord], unit: str) -> float | None:
    """Most hits the ``sent`` requests can have found among themselves (module docstring)."""
    if len(sent) <= 1:
        return 0.0
    if unit != "tokens":
        return None
    prompts = [r.prompt_tokens for r in sent]
    if any(p is None for p in prompts):
        return None
    most = [max(0, int(p) - 1) for p in prompts if p is not None]
    return float(sum(most) - min(most))


def counter_signal(
    before: MetricSample | None, scrapes: Sequence[Scrape], records: Sequence[RequestRecord]
) -> tuple[Signal, dict[str, Any]]:
    """Signal 2 (module docstring): the prefix-cache counters at each scrape after ``before``.

    Returns ``(signal, evidence)``; evidence: ``unit`` (``"tokens"``, ``"blocks"`` or
    None), and for the deciding scrape ``scrape_t_s``, ``phase``, ``requests_sent``,
    ``hits``, ``queries`` (growth since ``before``) and ``self_hit_bound``.
    """
    evidence: dict[str, Any] = {"unit": None}
    if before is None:
        return "unavailable", evidence
    unit, suffix = None, ""
    for name, end in (("tokens", ""), ("blocks", "_blocks")):
        keys = (f"prefix_cache_hits{end}", f"prefix_cache_queries{end}")
        if all(k in before.values for k in keys):
            unit, suffix = name, end
            break
    if unit is None:
        return "unavailable", evidence
    evidence["unit"] = unit
    measured = [r for r in records if not r.warmup]
    clean: dict[str, Any] | None = None
    seen = False
    for scrape in scrapes:
        s = scrape.sample
        hits = _growth(before, s, f"prefix_cache_hits{suffix}")
        queries = _growth(before, s, f"prefix_cache_queries{suffix}")
        if hits is None or queries is None:
            continue
        sent = [r for r in measured if r.start_s <= scrape.end_s]
        if not sent:
            continue  # nothing of the run could have been looked up yet
        seen = True
        bound = _self_hit_bound(sent, unit)
        at = {
            "scrape_t_s": s.t_s,
            "phase": s.phase,
            "requests_sent": len(sent),
            "hits": hits,
            "queries": queries,
            "self_hit_bound": bound,
        }
        preempted = _growth(before, s, "num_preemptions")
        if bound is not None and hits > bound and not preempted:
            return "contaminated", {**evidence, **at}
        if clean is None and queries > 0 and hits == 0 and (len(sent) == 1 or s.phase == "after"):
            clean = at
    if clean is not None:
        return "clean", {**evidence, **clean}
    return ("inconclusive" if seen else "unavailable"), evidence


def check(
    records: Sequence[RequestRecord],
    before: MetricSample | None,
    scrapes: Sequence[Scrape],
    *,
    prefix_caching_off: bool = False,
    reports_cached_tokens: bool = False,
    reset_ok: bool | None = None,
) -> dict[str, Any]:
    """The warm-cache check of one measured phase (module docstring); JSON-safe.

    Args:
        records: the phase's request records (warm-ups are ignored).
        before: the phase's ``before`` scrape (after the reset); None if it failed.
        scrapes: its later scrapes (``during``..., ``after``) in time order.
        prefix_caching_off: the launch turned prefix caching off.
        reports_cached_tokens: the server is known to report cached tokens.
        reset_ok: what ``POST /reset_prefix_cache`` answered (None: not called).

    Returns:
        ``{"status", "note", "cached_tokens_first_request", "counter_hits",
        "cached_tokens": {signal + evidence}, "counters": {signal + evidence},
        "prefix_cache_reset_ok"}``; ``counter_hits``: the counters' hit growth at the
        deciding scrape (None without one).
    """
    tok_signal, tok = cached_tokens_signal(records, reports_cached_tokens)
    cnt_signal, cnt = counter_signal(before, scrapes, records)
    signals = (tok_signal, cnt_signal)
    status: Status
    if "contaminated" in signals:
        status = "contaminated"
    elif "clean" in signals or prefix_caching_off:
        status = "clean"
    else:
        status = "unknown"
    out: dict[str, Any] = {
        "status": status,
        "note": _note(status, tok_signal, tok, cnt_signal, cnt, prefix_caching_off, reset_ok),
        "cached_tokens_first_request": tok.get("cached_tokens_first_request"),
        "counter_hits": cnt.get("hits"),
        "cached_tokens": {"signal": tok_signal, **tok},
        "counters": {"signal": cnt_signal, **cnt},
        "prefix_cache_reset_ok": reset_ok,
    }
    return out


def _note(
    status: Status,
    tok_signal: Signal,
    tok: dict[str, Any],
    cnt_signal: Signal,
    cnt: dict[str, Any],
    off: bool,
    reset_ok: bool | None,
) -> str:
    reset = (
        "POST /reset_prefix_cache answered success"
        if reset_ok
        else "POST /reset_prefix_cache failed"
        if reset_ok is False
        else "no prefix cache reset was made"
    )
    if status == "contaminated":
        parts = []
        if tok_signal == "contaminated":
            n = tok["first_wave"]
            who = "the first measured request" if n == 1 else f"each of the {n} first requests"
            parts.append(
                f"{who} found {tok['cached_tokens_first_request']:,} or more prompt tokens "
                "already cached"
            )
        if cnt_signal == "contaminated":
            parts.append(
                f"the prefix cache hit counter grew by {cnt['hits']:,.0f} {cnt['unit']} once "
                f"{cnt['requests_sent']} measured request(s) had been sent, more than they can "
                f"hit among themselves ({cnt['self_hit_bound']:,.0f})"
            )
        return (
            "warm cache: "
            + "; ".join(parts)
            + f" ({reset}, yet the cache kept blocks from before the measured requests); "
            "the measured numbers include a warm prefix cache and are not comparable. Fix: " + FIX
        )
    if status == "clean":
        if tok_signal == "clean":
            return "clean: the first measured request found no prompt token in the prefix cache"
        if cnt_signal == "clean":
            return (
                "clean: the prefix cache counters show no hit while only the first measured "
                "request could have been looked up"
                if cnt.get("requests_sent") == 1
                else "clean: no measured request found anything in the prefix cache"
            )
        return "clean: prefix caching is off, nothing can be cached"
    why = []
    if tok_signal == "unavailable":
        why.append(
            "the server does not report per-request cached tokens (vLLM reports them with "
            "--enable-prompt-tokens-details)"
        )
    elif tok_signal == "inconclusive":
        why.append(
            f"the {tok['first_wave']} requests sent at once disagree on cached tokens and the "
            "one the engine scheduled first cannot be told from the client"
        )
    if cnt_signal == "unavailable":
        why.append("no prefix cache counters in /metrics")
    else:
        why.append("no /metrics scrape isolated the first requests' prefix cache lookups")
    return "unknown: " + "; ".join(why) + f" ({reset})"


def combine(checks: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One run's check from its phases' (a capacity search measures several steps).

    ``contaminated`` if any phase is, ``clean`` only if every phase is, else
    ``unknown``; the deciding phase's fields are kept (the first contaminated one, else
    the first unknown one, else the first), with ``phases`` (each phase's status) when
    there are several. Empty ``checks``: ``{}`` (nothing was measured).
    """
    if not checks:
        return {}
    statuses = [c["status"] for c in checks]
    for wanted in ("contaminated", "unknown", "clean"):
        if wanted in statuses:
            out = dict(checks[statuses.index(wanted)])
            break
    if len(checks) > 1:
        out["phases"] = statuses
        if out["status"] == "contaminated":
            out["note"] = f"phase {statuses.index('contaminated') + 1}: " + out["note"]
    return out
