"""Capacity under SLOs: the highest load one server sustains while every objective holds.

The search drives load steps on one running server (the runner owns the server and
the load; this module only decides). For each step the runner replays the same
request list (same order, prefix cache reset before the step's measured requests)
at one load level, and hands the step's per-request values and server signals to
:meth:`CapacitySearch.record`. The search:

- decides each step **pass / fail / uncertain** from the step's own percentile and
  its bootstrap interval: an objective passes when the interval's upper end is at or
  under it, fails when the lower end is over it; a straddling interval is measured
  again (once, by default) and stays ``uncertain`` if it still straddles: the
  search then stops and reports ``uncertain`` rather than guess;
- narrows to the boundary: ``min`` first (a failure there: capacity below ``min``),
  then ``max`` (a pass there: capacity at least ``max``), then bisects between the
  highest passing and the lowest failing load (geometric midpoint for request
  rates, integer midpoint for concurrency) until the bracket's relative width is
  within ``tolerance`` or ``max_steps`` is spent;
- stops early when the server is saturated (waiting requests growing through the
  step, client dispatch lag, failed requests): that step fails as ``saturated``
  and nothing above it is tried.

The result (:class:`CapacityResult`) is the highest passing load with the bracket
``[highest pass, lowest fail]`` as its interval, the SLO that binds first (the one
that failed at the lowest load), and every step.

Pure: no I/O, no clock, no randomness except the seeded bootstrap.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

CapacityVariable = Literal["request_rate", "concurrency"]
SLOMetric = Literal["ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"]
Verdict = Literal["pass", "fail", "uncertain"]
SearchStatus = Literal["found", "below_min", "at_least_max", "uncertain", "steps_exhausted"]


class CapacitySpec(BaseModel):
    """What to search: objectives, the load variable and its range.

    ``slos``: per metric (``ttft_ms``, ``tpot_ms``, ``itl_ms``, ``e2el_ms``) a map of
    percentile name (``p50``, ``p90``, ``p99``, ``p99.9``) to the objective in ms, e.g.
    ``{"ttft_ms": {"p99": 500}, "tpot_ms": {"p99": 50}}``. ``goodput``: optionally the
    least fraction of a step's requests that meet every per-request objective (the
    objectives' values, as ``vllm bench serve --goodput`` counts them).
    """

    slos: dict[SLOMetric, dict[str, float]] = Field(default_factory=dict)
    goodput: float | None = Field(None, gt=0.0, le=1.0)
    variable: CapacityVariable = "request_rate"
    min: float = Field(gt=0.0)
    max: float = Field(gt=0.0)
    tolerance: float = Field(0.05, gt=0.0, le=1.0, description="relative bracket width")
    max_steps: int = Field(12, ge=2, le=64)
    requests_per_step: int | None = Field(None, ge=10, le=100_000)
    confidence: float = Field(0.95, gt=0.5, lt=1.0)
    remeasure: int = Field(1, ge=0, le=3, description="extra measurements of a straddling step")


class StepSignals(BaseModel):
    """Server and client signals of one step (``None``: not observed)."""

    waiting_first: float | None = None
    waiting_last: float | None = None
    waiting_max: float | None = None
    kv_cache_usage_max: float | None = None
    dispatch_lag_p99_ms: float | None = None


class SLOCheck(BaseModel):
    """One objective at one step: the percentile, its interval and the verdict."""

    metric: SLOMetric | Literal["goodput"]
    percentile: str | None = None
    objective: float
    value: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    verdict: Verdict


class CapacityStep(BaseModel):
    """One load step as measured (re-measurements are steps of their own)."""

    index: int
    load: float
    requests: int
    failed: int
    duration_s: float | None = None
    percentiles: dict[str, dict[str, float]] = Field(default_factory=dict)
    goodput: float | None = None
    output_tokens_per_s: float | None = Field(None, description="the step's output tokens / s")
    output_tokens_per_s_per_user: float | None = Field(
        None, description="mean over requests of output tokens / (E2EL - TTFT): tokens/s/user"
    )
    signals: StepSignals = Field(default_factory=StepSignals)
    checks: list[SLOCheck] = Field(default_factory=list)
    saturated: str | None = None
    verdict: Verdict


class CapacityResult(BaseModel):
    """The boundary: ``capacity`` (highest passing load) and its bracket."""

    variable: CapacityVariable
    status: SearchStatus
    capacity: float | None = None
    interval: tuple[float | None, float | None] = (None, None)
    binding_slo: str | None = None
    steps: list[CapacityStep] = Field(default_factory=list)
    note: str | None = None
