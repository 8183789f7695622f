"""Which numbers give no verdict: the one table of what each flag on a run taints.

A number a finding flags for a run is kept (shown greyed, with the reason) but gives
no verdict anywhere: not in a comparison row (:func:`orchestrator.analysis.compare.
compare_variant`), a ladder cell, a CLI table, a chart or a scheduled regression check.
Every consumer asks this module; none keeps its own list.

Flags of a run (:func:`run_trust`) and of a capacity step (:func:`step_untrusted`):

- ``token_bursts``: at least :data:`BURSTY` of the run's inter-token gaps were under
  :data:`BURST_GAP_S` (``itl_burst_fraction``, :func:`jobs.run.segment.itl_burst_fraction`,
  or the same share computed from the requests' ``itl_s`` when the metric is absent):
  the chunks queued in the API server and were flushed together, so the client's TPOT
  and ITL do not measure decoding (the advisor's ``token_bursts`` finding). Taints
  TPOT, ITL and what is computed from them: output tokens/s per user (1000 / TPOT,
  or output tokens / (E2EL - TTFT) at a capacity step), goodput whose objectives
  include TPOT, a capacity search that checked TPOT or ITL.
- ``client_ttft_lag``: token bursts and the client's mean TTFT more than
  :data:`TTFT_LAG_MS` above the server's (``mean_ttft_client_minus_server_ms``, the
  same finding says so): TTFT and what is computed from it.
- ``warm_cache``: the run's warm-cache check (:mod:`jobs.signals.cachecheck`) says its measured
  requests began on a warm prefix cache (``cache_contamination == "contaminated"``):
  every number of the run (latencies and the prefix cache hit rate first, and through
  them throughput, goodput, queueing and capacity).
- ``client_limited`` (a capacity step's verdict): the load generator could not deliver
  the step's load, so none of that step's numbers decides anything.
- ``client_stalled``: the load generator's event loop stalled (:mod:`jobs.load.stalls`: a
  wake-up at least 0.1 s late; a request is *moved* when its first token or last chunk was
  timed at the end of a stall of a tenth of that latency or more), the loop lost
  :data:`LOST_S` or more in all, and the stalls took :data:`STALLED_TIME` of the measured
  phase, or moved :data:`STALLED_REQUESTS` of the
  measured requests and at least :data:`MIN_STALLED_REQUESTS`, or one lasted
  :data:`LONG_STALL_S` and moved a request: the client could not keep up, so its clocks
  and its pace measured itself. Every number the client times or paces (latencies,
  throughputs, goodput, the load the server saw: queue, KV cache, energy); not the
  prefix cache hit rate, which counts the server's cache lookups whatever the pace.

Not applicable is not a taint and never 0: :data:`NOT_APPLICABLE` names what a run
cannot have (the prefix cache hit rate of a run with prefix caching off); such a
metric compares as ``n/a (off)``, with no verdict and no interval.

Metric names: the comparison's (``median_tpot_ms``, ``p99_itl_ms``, ``mean_tpot_ms``,
``prefix_cache_hit_rate`` ...), the capacity documents' (``tpot_ms``, ``itl_ms``,
``output_tokens_per_s_per_user``) and ``capacity`` (a run's capacity search).

Pure: no database, no HTTP.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

#: Inter-token gaps shorter than this (s) arrived in one burst (``jobs.run.segment.BURST_GAP_S``).
BURST_GAP_S = 1e-4
#: At or above this share of inter-token gaps under :data:`BURST_GAP_S`, tokens came in bursts.
BURSTY = 0.5
#: With token bursts, a client TTFT this much (ms) above the server's flags TTFT too.
TTFT_LAG_MS = 20.0
#: Client stalls adding up to this share of the measured phase flag the run (no request
#: went out meanwhile: the throughputs lose up to as much). The rule and its thresholds
#: are ``jobs.load.stalls.stall_reason``'s (a capacity step's); analysis imports no jobs.
STALLED_TIME = 0.05
#: Stalls that moved this share of the measured requests, and at least
#: :data:`MIN_STALLED_REQUESTS`, flag the run (a mean or a central percentile can move).
STALLED_REQUESTS = 0.05
MIN_STALLED_REQUESTS = 2
#: A stall this long (s) that moved a request flags the run (a tail off by a second).
LONG_STALL_S = 1.0
#: Stalls adding up to less than this (s) never flag a run: a shared machine takes a
#: tenth of a second from a process here and there (the numbers stay stored and shown).
LOST_S = 1.0
#: The stored run metrics :func:`run_trust` reads.
TRUST_METRICS = (
    "itl_burst_fraction",
    "mean_ttft_client_minus_server_ms",
    "client_stall_s",
    "max_client_stall_ms",
    "client_stalled_requests",
    "client_stalled_request_fraction",
    "duration",
)

#: Every number of the run (or step).
ALL = "*"
#: The latency quantities (per request: TTFT, TPOT, ITL, E2EL).
LATENCY = frozenset({"ttft", "tpot", "itl", "e2el"})

#: What each flag taints, as quantities (:func:`quantities` maps a metric to its own).
TAINTS: dict[str, frozenset[str]] = {
    "token_bursts": frozenset({"tpot", "itl"}),
    "client_ttft_lag": frozenset({"ttft"}),
    "warm_cache": frozenset({ALL}),
    "client_limited": frozenset({ALL}),
    # every quantity but the prefix cache hit rate (quantities() names a metric's own)
    "client_stalled": LATENCY
    | {
        "output_throughput",
        "request_throughput",
        "total_token_throughput",
        "request_goodput",
        "goodput_fraction",
        "kv_cache_usage_peak",
        "num_requests_waiting_peak",
        "server_mean_queue_ms",
        "server_mean_prefill_ms",
        "server_mean_decode_ms",
        "energy_per_output_token_j",
        "gpu_mean_power_w",
        "gpu_mean_utilization_pct",
        "output_tokens_per_s_per_user",
    },
}

#: Metrics computed from others, by the quantities they are computed from.
DERIVED: dict[str, frozenset[str]] = {
    "ttft_ms": frozenset({"ttft"}),  # capacity objectives and step percentiles
    "tpot_ms": frozenset({"tpot"}),
    "itl_ms": frozenset({"itl"}),
    "e2el_ms": frozenset({"e2el"}),
    # the Pareto chart's x: 1000 / mean TPOT, or output tokens / (E2EL - TTFT) at a step
    "output_tokens_per_s_per_user": frozenset({"tpot", "ttft", "e2el"}),
}
#: Metrics computed from the goodput objectives of the run (all latencies when unknown).
GOODPUT = frozenset({"request_goodput", "goodput_fraction"})
#: A run's capacity search: computed from the objectives it checked.
CAPACITY = "capacity"

#: What a run cannot have, by metric: (engine argument that must not be False, why).
NOT_APPLICABLE: dict[str, tuple[str, str]] = {
    "prefix_cache_hit_rate": ("enable_prefix_caching", "off"),
}

_STAT = re.compile(r"(?:mean|median|std|p\d+(?:\.\d+)?)_(ttft|tpot|itl|e2el)_ms")


def quantities(
    metric: str,
    goodput_objectives: Collection[str] | None = None,
    capacity_objectives: Collection[str] | None = None,
) -> frozenset[str]:
    """The quantities ``metric`` is computed from (``median_tpot_ms`` -> ``{"tpot"}``;
    goodput and capacity: their objectives, all latencies when unknown; else the
    metric itself)."""
    m = _STAT.fullmatch(metric)
    if m:
        return frozenset({m.group(1)})
    if metric in DERIVED:
        return DERIVED[metric]
    if metric in GOODPUT or metric == CAPACITY:
        objs = goodput_objectives if metric in GOODPUT else capacity_objectives
        if objs is None:
            return LATENCY | {metric}
        return frozenset(_objective_quantity(o) for o in objs) | {metric}
    return frozenset({metric})


def _objective_quantity(name: str) -> str:
    """``tpot_ms`` / ``tpot`` -> ``tpot``; ``goodput`` -> the latencies' stand-in."""
    base = name.removesuffix("_ms")
    return base if base in LATENCY else name


def objectives_of_capacity(doc: Mapping[str, Any] | None) -> frozenset[str] | None:
    """The latency quantities a capacity search checked (``goodput``: all of them);
    None without a document or checks."""
    names: set[str] = set()
    for step in (doc or {}).get("steps") or []:
        for c in (step.get("checks") or []) if isinstance(step, Mapping) else []:
            if isinstance(c, Mapping) and isinstance(c.get("metric"), str):
                names.add(c["metric"])
    if not names:
        return None
    out = {_objective_quantity(n) for n in names}
    return frozenset((out - {"goodput"}) | (LATENCY if "goodput" in out else set()))


def objectives_of_slos(slos: Mapping[str, Any] | None) -> frozenset[str]:
    """The latency quantities of an experiment's goodput ``slos`` (``{"tpot_ms": 50}``)."""
    return frozenset(_objective_quantity(k) for k, v in (slos or {}).items() if v is not None)


def finite_number(x: Any) -> float | None:
    """``x`` as a float when it is a finite int or float (``True`` is not a number here),
    else None."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    f = float(x)
    return f if math.isfinite(f) else None


def burst_fraction(requests: Iterable[Mapping[str, Any]]) -> float | None:
    """Share of the inter-token gaps under :data:`BURST_GAP_S` over successful measured
    requests (as :func:`jobs.run.segment.itl_burst_fraction`); None without any gap."""
    gaps = [
        g
        for q in requests
        if q.get("success") and not q.get("warmup")
        for g in (finite_number(x) for x in (q.get("itl_s") or []))
        if g is not None
    ]
    if not gaps:
        return None
    return sum(1 for g in gaps if g < BURST_GAP_S) / len(gaps)


@dataclass(frozen=True)
class RunTrust:
    """One run's flags (flag -> evidence), what it cannot have (metric -> why) and the
    objectives its goodput and capacity search are computed from."""

    run_id: str
    flags: Mapping[str, str] = field(default_factory=dict)
    not_applicable: Mapping[str, str] = field(default_factory=dict)
    goodput_objectives: frozenset[str] | None = None
    capacity_objectives: frozenset[str] | None = None

    def taints(self, metric: str) -> dict[str, str]:
        """The flags that taint ``metric`` of this run: flag -> its evidence."""
        q = quantities(metric, self.goodput_objectives, self.capacity_objectives)
        return {
            flag: text
            for flag, text in self.flags.items()
            if ALL in TAINTS[flag] or TAINTS[flag] & q
        }

    def reason(self, metric: str) -> str | None:
        """Why ``metric`` of this run gives no verdict (the flags that taint it), or None."""
        return "; ".join(self.taints(metric).values()) or None


def run_trust(
    run_id: str,
    metrics: Mapping[str, Any],
    *,
    requests: Sequence[Mapping[str, Any]] | None = None,
    cache_contamination: str | None = None,
    not_applicable: Mapping[str, str] | None = None,
    goodput_objectives: Collection[str] | None = None,
    capacity_objectives: Collection[str] | None = None,
) -> RunTrust:
    """A run's flags from its summary ``metrics`` (``itl_burst_fraction``,
    ``mean_ttft_client_minus_server_ms``; the burst share from ``requests`` when the
    metric is absent), its warm-cache status and what it cannot have
    (:func:`not_applicable_of`)."""
    flags: dict[str, str] = {}
    burst = finite_number(metrics.get("itl_burst_fraction"))
    if burst is None and requests:
        burst = burst_fraction(requests)
    if burst is not None and burst >= BURSTY:
        flags["token_bursts"] = (
            f"token bursts: {burst:.0%} of inter-token gaps under 0.1 ms, so the client's "
            "TPOT and ITL do not measure decoding"
        )
        lag = finite_number(metrics.get("mean_ttft_client_minus_server_ms"))
        if lag is not None and lag > TTFT_LAG_MS:
            flags["client_ttft_lag"] = (
                f"token bursts: the client's TTFT is {lag:.0f} ms above the server's"
            )
    stalled = client_stalled(metrics)
    if stalled is not None:
        flags["client_stalled"] = stalled
    if cache_contamination == "contaminated":
        flags["warm_cache"] = (
            "measured on a warm prefix cache: the reset before its measured requests left "
            "blocks, so its numbers include cache hits the other side may not have had"
        )
    return RunTrust(
        run_id=run_id,
        flags=flags,
        not_applicable=dict(not_applicable or {}),
        goodput_objectives=None if goodput_objectives is None else frozenset(goodput_objectives),
        capacity_objectives=(
            None if capacity_objectives is None else frozenset(capacity_objectives)
        ),
    )


def client_stalled(metrics: Mapping[str, Any]) -> str | None:
    """Why the run's client could not keep up (the ``client_stalled`` flag's evidence), or
    None (the rule in the module docstring, as ``jobs.load.stalls.stall_reason``). None
    for a run without the stall metrics (stored before the runner watched its client, or
    a capacity search's: its steps are judged instead)."""
    total = finite_number(metrics.get("client_stall_s"))
    longest_ms = finite_number(metrics.get("max_client_stall_ms"))
    moved = finite_number(metrics.get("client_stalled_requests"))
    share = finite_number(metrics.get("client_stalled_request_fraction"))
    if total is None or longest_ms is None or moved is None or share is None:
        return None
    duration = finite_number(metrics.get("duration"))
    of_time = total / duration if duration else None
    longest = longest_ms / 1000.0
    if total < LOST_S or not (
        (of_time is not None and of_time >= STALLED_TIME)
        or (share >= STALLED_REQUESTS and moved >= MIN_STALLED_REQUESTS)
        or (longest >= LONG_STALL_S and moved >= 1)
    ):
        return None
    time_part = f"; {of_time:.1%} of the measured phase" if of_time is not None else ""
    if moved >= 1:
        measured = round(moved / share) if share > 0 else None
        of_measured = f" of {measured}" if measured is not None else ""
        timed = (
            f"{moved:.0f}{of_measured} measured requests ({share:.1%}) had their first "
            "token or last chunk timed at the end of a stall of a tenth of that latency or "
            "more"
        )
    else:
        timed = (
            "no measured request was timed at the end of one, but no request goes out "
            "while the loop cannot run"
        )
    return (
        f"the load generator stalled: its event loop could not run for {total:.2f} s in "
        f"all (longest {longest:.2f} s{time_part}), and {timed}, so its timings and its "
        "pace measured the client, not the server"
    )


def not_applicable_of(engine_args: Mapping[str, Any] | None) -> dict[str, str]:
    """What a run with these engine arguments cannot have: ``{"prefix_cache_hit_rate":
    "off"}`` when ``enable_prefix_caching`` is False (:data:`NOT_APPLICABLE`)."""
    args = engine_args or {}
    return {m: why for m, (arg, why) in NOT_APPLICABLE.items() if args.get(arg) is False}


class RunLike(Protocol):
    """What :func:`trust_of` reads of a run (:class:`orchestrator.analysis.compare.RunData`)."""

    @property
    def run_id(self) -> str: ...
    @property
    def status(self) -> str: ...
    @property
    def metrics(self) -> Mapping[str, float]: ...
    @property
    def requests(self) -> Sequence[Mapping[str, Any]]: ...
    @property
    def cache_contamination(self) -> str | None: ...
    @property
    def not_applicable(self) -> Mapping[str, str]: ...
    @property
    def goodput_objectives(self) -> Collection[str] | None: ...


#: Run statuses whose data is compared; other runs are ignored.
USABLE_STATUSES = frozenset({"succeeded"})


def level_trust(runs: Iterable[RunLike]) -> list[RunTrust]:
    """The flags of a level's compared runs (status in :data:`USABLE_STATUSES`)."""
    return [trust_of(r) for r in runs if r.status in USABLE_STATUSES]


def sides_trust(variant: Iterable[RunLike], reference: Iterable[RunLike]) -> SidesTrust:
    """The flags of both sides' compared runs (:func:`level_trust`)."""
    return SidesTrust(level_trust(variant), level_trust(reference))


def warm_cache_runs(runs: Iterable[RunLike]) -> list[str]:
    """Ids of the compared runs whose warm-cache check found a warm prefix cache."""
    return [
        r.run_id
        for r in runs
        if r.status in USABLE_STATUSES and r.cache_contamination == "contaminated"
    ]


def warm_cache_reason(
    variant_runs: Iterable[RunLike], reference_runs: Iterable[RunLike]
) -> str | None:
    """Why a comparison of these runs is not trustworthy (a warm prefix cache), or None."""
    var, ref = warm_cache_runs(variant_runs), warm_cache_runs(reference_runs)
    sides = [
        f"{side} run(s) {', '.join(ids)}"
        for side, ids in (("variant", var), ("reference", ref))
        if ids
    ]
    if not sides:
        return None
    return (
        "measured on a warm prefix cache (" + "; ".join(sides) + "): the prefix cache reset "
        "before their measured requests left blocks, so their numbers include cache hits "
        "the other side may not have had"
    )


def trust_of(run: RunLike, capacity_objectives: Collection[str] | None = None) -> RunTrust:
    """:func:`run_trust` of a :class:`orchestrator.analysis.compare.RunData`."""
    return run_trust(
        run.run_id,
        run.metrics,
        requests=run.requests,
        cache_contamination=run.cache_contamination,
        not_applicable=run.not_applicable,
        goodput_objectives=run.goodput_objectives,
        capacity_objectives=capacity_objectives,
    )


def trust_of_doc(run: Mapping[str, Any], slos: Mapping[str, Any] | None = None) -> RunTrust:
    """:func:`run_trust` of a run as the API gives it (``GET /api/v1/experiments/{id}``'s
    ``runs``: ``id``, ``metrics``, ``engine_info``, ``engine_args``, ``capacity``);
    ``slos``: the experiment spec's goodput objectives."""
    info = run.get("engine_info") or {}
    warm = info.get("cache_contamination") if isinstance(info, Mapping) else None
    return run_trust(
        str(run.get("id")),
        run.get("metrics") or {},
        cache_contamination=warm.get("status") if isinstance(warm, Mapping) else None,
        not_applicable=not_applicable_of(run.get("engine_args")),
        goodput_objectives=objectives_of_slos(slos),
        capacity_objectives=objectives_of_capacity(run.get("capacity")),
    )


@dataclass(frozen=True)
class SidesTrust:
    """The compared runs of both sides of a comparison (usable runs only)."""

    variant: Sequence[RunTrust]
    reference: Sequence[RunTrust]

    def reason(self, metric: str) -> str | None:
        """Why a comparison of ``metric`` gives no verdict: each flagged run, by side."""
        parts = [
            why
            for side, runs in (("variant", self.variant), ("reference", self.reference))
            if (why := runs_reason(runs, metric, f"{side} "))
        ]
        return "; ".join(parts) if parts else None

    def not_applicable(self, metric: str) -> dict[str, str]:
        """``{"reference": "off"}``: the sides where a run cannot have ``metric``."""
        out = {}
        for side, runs in (("variant", self.variant), ("reference", self.reference)):
            why = runs_not_applicable(runs, metric)
            if why is not None:
                out[side] = why
        return out


def runs_reason(runs: Iterable[RunTrust], metric: str, label: str = "") -> str | None:
    """Why ``metric`` of these runs gives no verdict (``run <id>: <why>`` each), or None."""
    parts = [f"{label}run {r.run_id}: {why}" for r in runs if (why := r.reason(metric))]
    return "; ".join(parts) if parts else None


def runs_not_applicable(runs: Iterable[RunTrust], metric: str) -> str | None:
    """Why these runs cannot have ``metric`` (``off``), or None."""
    return next((r.not_applicable[metric] for r in runs if metric in r.not_applicable), None)


def na_text(why: str) -> str:
    """How a not-applicable value reads: ``n/a (off)``."""
    return f"n/a ({why})"


def step_untrusted(step: Mapping[str, Any], unit: str = "req/s") -> str | None:
    """Why a capacity step's numbers decide nothing (a ``client_limited`` step: the load
    generator could not deliver its load), or None."""
    if step.get("verdict") != "client_limited":
        return None
    sig = step.get("signals")
    sig = sig if isinstance(sig, Mapping) else {}
    asked, arrived = finite_number(sig.get("asked_rate")), finite_number(sig.get("arrived_rate"))
    text = "client-limited: the load generator could not deliver this load"
    if asked is not None and arrived is not None:
        text += f" ({arrived:.3g} of the {asked:.3g} {unit} asked arrived)"
    return text
