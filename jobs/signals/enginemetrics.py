"""Server-side numbers from a vLLM server's Prometheus ``/metrics`` endpoint.

:func:`scrape` reads ``/metrics`` once, :func:`parse_metrics` turns the text
into a flat ``{key: float}`` (keys in :data:`SAMPLE_KEYS`), and
:func:`summarize_samples` turns the scrapes of one run (before / during /
after) into run-level numbers. Following the design rule, server-side numbers
over a run come from counter *deltas* between the scrape before and the scrape
after the run, never from the engine log's rolling window.

Metric names and units are vLLM's (V1 engine, ``vllm/v1/metrics/loggers.py``;
V0 engine, ``vllm/engine/metrics.py``); the text is parsed by
``prometheus_client.parser.text_string_to_metric_families``, which strips the
``_total`` suffix from counter *family* names (``vllm:prefix_cache_hits``), while
sample names keep it; lookups here use the sample name without ``_total``.

Several vintages of names exist:

- ``vllm:kv_cache_usage_perc`` (>= 0.10) and ``vllm:gpu_cache_usage_perc``
  (older, deprecated in 0.10): both a 0-1 fraction despite the name; the new
  name wins when both are present.
- ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total``
  (>= 0.10, tokens); ``vllm:gpu_prefix_cache_queries_total`` /
  ``_hits_total`` (older V1, deprecated in 0.10): counted *blocks* in early V1
  and *tokens* later; the HELP text says which ("... number of queried
  blocks/tokens"). Token counts from the old name are used only when the new
  name is absent (never added: 0.10 exports both, double counting). Block
  counts go to separate ``*_blocks`` keys and are never mixed with tokens; an
  old-name counter without HELP text is taken as blocks (the safe side).
- ``vllm:gpu_prefix_cache_hit_rate`` (V0 engine, a gauge 0-1 over a window):
  kept as ``gpu_prefix_cache_hit_rate_v0_fraction`` for information only.
- ``vllm:inter_token_latency_seconds`` (>= 0.11) and
  ``vllm:time_per_output_token_seconds`` (older; deprecated in 0.11, hidden in
  0.12, removed later): the same per-output gap under two names, exported
  side by side during the deprecation; the new name wins. Not to be confused
  with ``vllm:request_time_per_output_token_seconds`` (>= 0.11, one
  per-request mean per request), which is not read here.

Server-side latency histograms (:data:`HISTOGRAMS`): :func:`parse_histograms`
reads them as :class:`Histogram` (buckets summed over label sets);
:func:`parse_metrics` also puts each one's ``_sum`` / ``_count`` into every
scrape (``<key>_seconds_sum`` / ``<key>_seconds_count``), so per-interval means
come from deltas; :func:`summarize_histograms` turns the ``before`` and
``after`` histograms of a run into ``server_*`` numbers, with percentiles by
Prometheus' ``histogram_quantile`` interpolation (:func:`histogram_quantile`)
and a note for every percentile the buckets cannot support; a mean only when the
``_sum`` is consistent with ``_count`` and the buckets (no mean, with a note, when it
stays 0 while the count grows, as in vllm-project/vllm#6337).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import httpx
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from jobs.schemas import MetricSample

__all__ = [
    "HISTOGRAMS",
    "METRICS_PATH",
    "SAMPLE_KEYS",
    "Histogram",
    "histogram_delta",
    "histogram_quantile",
    "parse_histograms",
    "parse_metrics",
    "scrape",
    "summarize_histograms",
    "summarize_samples",
]

METRICS_PATH = "/metrics"
"""Path of the Prometheus endpoint, appended to ``base_url``."""

HISTOGRAMS: dict[str, tuple[tuple[str, ...], str]] = {
    "ttft": (
        ("vllm:time_to_first_token_seconds",),
        "time to first token, from the request's arrival at the API server to its first token",
    ),
    "e2el": (
        ("vllm:e2e_request_latency_seconds",),
        "end-to-end request latency, from arrival at the API server to the request's finish",
    ),
    "queue": (
        ("vllm:request_queue_time_seconds",),
        "time in the scheduler's WAITING queue, from queued to first scheduled",
    ),
    "prefill": (
        ("vllm:request_prefill_time_seconds",),
        "time in the PREFILL phase, from first scheduled to the first token",
    ),
    "decode": (
        ("vllm:request_decode_time_seconds",),
        "time in the DECODE phase, from the first token to the last",
    ),
    "itl": (
        ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
        "inter-token latency, the gap between successive outputs of a request, one per "
        "engine step: a step can emit several tokens with speculative decoding",
    ),
    "inference": (
        ("vllm:request_inference_time_seconds",),
        "time in the RUNNING phase, from first scheduled to the last token: prefill + decode",
    ),
}
"""Server-side latency histograms: key -> (candidate vLLM metric names, newest first;
what one observation is). All are in seconds. Names and meanings are vLLM V1's
(``vllm/v1/metrics/loggers.py``, ``docs/design/metrics.md``); the first candidate
present (and well formed) in a text is used, never several added."""

SAMPLE_KEYS: dict[str, str] = {
    "num_requests_running": (
        "gauge, requests in the running batch; vllm:num_requests_running, summed over engines"
    ),
    "num_requests_waiting": (
        "gauge, requests queued; vllm:num_requests_waiting, summed over engines"
    ),
    "kv_cache_usage": (
        "gauge, 0-1 fraction of KV cache blocks in use; vllm:kv_cache_usage_perc "
        "(or older vllm:gpu_cache_usage_perc), max over engines"
    ),
    "prefix_cache_queries": (
        "counter, tokens looked up in the prefix cache; vllm:prefix_cache_queries_total "
        "(or token-counted vllm:gpu_prefix_cache_queries_total), summed"
    ),
    "prefix_cache_hits": (
        "counter, tokens found in the prefix cache; vllm:prefix_cache_hits_total "
        "(or token-counted vllm:gpu_prefix_cache_hits_total), summed"
    ),
    "prefix_cache_queries_blocks": (
        "counter, blocks looked up; early-V1 block-counted vllm:gpu_prefix_cache_queries_total"
    ),
    "prefix_cache_hits_blocks": (
        "counter, blocks hit; early-V1 block-counted vllm:gpu_prefix_cache_hits_total"
    ),
    "gpu_prefix_cache_hit_rate_v0_fraction": (
        "gauge, 0-1 rolling hit rate of the V0 engine; vllm:gpu_prefix_cache_hit_rate, max"
    ),
    "num_preemptions": "counter, preempted requests; vllm:num_preemptions_total, summed",
    "prompt_tokens": "counter, prefill tokens processed; vllm:prompt_tokens_total, summed",
    "generation_tokens": "counter, tokens generated; vllm:generation_tokens_total, summed",
    "request_success": (
        "counter, finished requests; vllm:request_success_total, summed over finished_reason "
        "(in vLLM 0.32 that includes the 'abort' and 'error' reasons)"
    ),
    "gpu_utilization_pct": (
        "gauge, percent (0-100) of time a kernel ran, mean over the run's GPUs; "
        "NVML nvmlDeviceGetUtilizationRates or nvidia-smi utilization.gpu (jobs.signals.gpus)"
    ),
    "gpu_memory_used_mib": (
        "gauge, MiB of device memory in use, summed over the run's GPUs; "
        "NVML nvmlDeviceGetMemoryInfo or nvidia-smi memory.used (jobs.signals.gpus)"
    ),
    "gpu_power_w": (
        "gauge, W of power draw, summed over the run's GPUs; "
        "NVML nvmlDeviceGetPowerUsage or nvidia-smi power.draw (jobs.signals.gpus)"
    ),
    "gpu_energy_j": (
        "counter, J consumed since the driver was loaded, summed over the run's GPUs; "
        "NVML nvmlDeviceGetTotalEnergyConsumption (mJ), absent with nvidia-smi (jobs.signals.gpus)"
    ),
    **{
        f"{key}_seconds_{part}": (
            f"counter, {unit} of the {key} histogram: {desc}; "
            + " (or ".join(f"{name}_{part}" for name in names)
            + ")" * (len(names) - 1)
            + ", summed over engines"
        )
        for key, (names, desc) in HISTOGRAMS.items()
        for part, unit in (("sum", "seconds, sum of observations"), ("count", "observations"))
    },
}
"""Keys :func:`parse_metrics` may return, with kind, unit and source metric.

The ``<key>_seconds_sum`` / ``<key>_seconds_count`` keys (one pair per
:data:`HISTOGRAMS` key present) are the histogram's cumulative ``_sum`` and
``_count``: the mean over an interval between two scrapes is
``delta(_sum) / delta(_count)`` (seconds; undefined when the count delta is 0,
and invalid across a server restart, where the counts go down)."""

_Agg = Callable[[Iterable[float]], float]

# key -> (candidate vLLM base names in order of preference, aggregation over label sets)
_SIMPLE: dict[str, tuple[tuple[str, ...], _Agg]] = {
    "num_requests_running": (("vllm:num_requests_running",), sum),
    "num_requests_waiting": (("vllm:num_requests_waiting",), sum),
    "kv_cache_usage": (("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), max),
    "gpu_prefix_cache_hit_rate_v0_fraction": (("vllm:gpu_prefix_cache_hit_rate",), max),
    "num_preemptions": (("vllm:num_preemptions",), sum),
    "prompt_tokens": (("vllm:prompt_tokens",), sum),
    "generation_tokens": (("vllm:generation_tokens",), sum),
    "request_success": (("vllm:request_success",), sum),
}

# key -> (new token-counted name, old name of vintage-dependent unit)
_PREFIX: dict[str, tuple[str, str]] = {
    "prefix_cache_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
}

_SKIP_SUFFIXES = ("_created", "_bucket", "_count", "_sum", "_gcount", "_gsum")


def _base_name(name: str) -> str:
    return name.removesuffix("_total")


@dataclass(frozen=True)
class Histogram:
    """One Prometheus histogram, summed over its label sets (engines, models).

    Attributes:
        bounds: the buckets' upper bounds (``le``), in seconds for
            :data:`HISTOGRAMS`; strictly ascending, the last one ``math.inf``.
        counts: cumulative observation counts, one per bound (as Prometheus:
            ``counts[i]`` observations were ``<= bounds[i]``); same length as
            ``bounds``. ``counts[-1]`` is the +Inf bucket, i.e. all observations.
        sum: the ``_sum`` sample, sum of all observed values (seconds).
        count: the ``_count`` sample, number of observations.

    Raises:
        ValueError: ``bounds`` empty, of another length than ``counts``, not
            strictly ascending, NaN, or not ending in ``+inf``.
    """

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    sum: float
    count: float

    def __post_init__(self) -> None:
        if not self.bounds or len(self.bounds) != len(self.counts):
            raise ValueError(
                f"a histogram needs as many counts as bounds (>= 1), got "
                f"{len(self.bounds)} bounds and {len(self.counts)} counts"
            )
        if any(math.isnan(b) for b in self.bounds) or any(
            lo >= hi for lo, hi in zip(self.bounds, self.bounds[1:], strict=False)
        ):
            raise ValueError(f"histogram bounds must be strictly ascending: {self.bounds}")
        if self.bounds[-1] != math.inf:
            raise ValueError(f"the last histogram bound must be +Inf, got {self.bounds[-1]}")


@dataclass
class _LabelSet:
    """The samples of one histogram label set (``le`` excluded) while parsing."""

    buckets: dict[float, float] = field(default_factory=dict)
    sum: float | None = None
    count: float | None = None


def _histograms_from(families: Iterable[Metric]) -> dict[str, Histogram]:
    """:data:`HISTOGRAMS` found in parsed ``families``; see :func:`parse_histograms`."""
    wanted = {name for names, _ in HISTOGRAMS.values() for name in names}
    parts: dict[str, dict[tuple[tuple[str, str], ...], _LabelSet]] = defaultdict(dict)
    broken: set[str] = set()
    for family in families:
        for sample in family.samples:
            base, _, part = sample.name.rpartition("_")
            if base not in wanted or part not in ("bucket", "sum", "count"):
                continue  # also skips ``_created``
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
            entry = parts[base].setdefault(labels, _LabelSet())
            value = float(sample.value)
            if math.isnan(value):
                broken.add(base)
            elif part == "sum":
                entry.sum = value
            elif part == "count":
                entry.count = value
            else:
                try:
                    entry.buckets[float(sample.labels["le"])] = value
                except (KeyError, ValueError):
                    broken.add(base)

    out: dict[str, Histogram] = {}
    for key, (names, _) in HISTOGRAMS.items():
        for name in names:
            if name in broken or name not in parts:
                continue
            merged = _merge_label_sets(list(parts[name].values()))
            if merged is not None:
                out[key] = merged
                break
    return out


def _merge_label_sets(label_sets: list[_LabelSet]) -> Histogram | None:
    """Bucket-by-bucket sum over label sets; None if any is incomplete or bounds differ."""
    bounds = sorted(label_sets[0].buckets)
    for ls in label_sets:
        if ls.sum is None or ls.count is None or sorted(ls.buckets) != bounds:
            return None
    if not bounds or bounds[-1] != math.inf:
        return None
    return Histogram(
        bounds=tuple(bounds),
        counts=tuple(float(sum(ls.buckets[b] for ls in label_sets)) for b in bounds),
        sum=float(sum(ls.sum or 0.0 for ls in label_sets)),
        count=float(sum(ls.count or 0.0 for ls in label_sets)),
    )


def parse_histograms(text: str) -> dict[str, Histogram]:
    """The :data:`HISTOGRAMS` in vLLM's Prometheus exposition ``text``, by key.

    Each histogram is summed over its label sets (``model_name``, ``engine``
    when there are several engines, ...): bucket counts with the same ``le``
    are added, as are ``_sum`` and ``_count`` (what PromQL's
    ``sum by (le) (...)`` does). ``*_created`` samples are ignored. Of several
    candidate names the first (newest) that is present and well formed is
    used; e.g. ``vllm:inter_token_latency_seconds`` over the older
    ``vllm:time_per_output_token_seconds`` when vLLM 0.11 exports both.

    A histogram is left out (no key) when it is missing, or when it is not
    usable: a NaN sample, a bucket without a numeric ``le``, a label set
    without its +Inf bucket, ``_sum`` or ``_count``, or label sets that
    disagree on the bucket bounds (their counts could not be added).

    Raises:
        ValueError: the text is not valid Prometheus exposition format
            (raised by ``prometheus_client``'s parser).
    """
    return _histograms_from(text_string_to_metric_families(text))


def parse_metrics(text: str) -> dict[str, float]:
    """Parse Prometheus exposition text from vLLM into ``{key: float}`` (see :data:`SAMPLE_KEYS`).

    Values of one metric are summed over its label sets (several engines,
    models, ``finished_reason``...), except 0-1 gauges (KV cache usage, V0 hit
    rate) which take the max over label sets. ``*_created`` timestamp samples
    and histogram/summary sub-samples are ignored; NaN samples are skipped; a
    metric that is missing gives no key (no zeros are invented). For each
    histogram of :data:`HISTOGRAMS` that :func:`parse_histograms` finds, its
    ``_sum`` (seconds) and ``_count`` come as ``<key>_seconds_sum`` and
    ``<key>_seconds_count`` (cumulative counters).

    Raises:
        ValueError: the text is not valid Prometheus exposition format
            (raised by ``prometheus_client``'s parser).
    """
    families = list(text_string_to_metric_families(text))
    values: dict[str, list[float]] = defaultdict(list)
    help_text: dict[str, str] = {}
    for family in families:
        if family.documentation:
            help_text.setdefault(_base_name(family.name), family.documentation)
        for sample in family.samples:
            if sample.name.endswith(_SKIP_SUFFIXES) or math.isnan(sample.value):
                continue
            values[_base_name(sample.name)].append(float(sample.value))

    out: dict[str, float] = {}
    for key, (names, agg) in _SIMPLE.items():
        for name in names:
            if values.get(name):
                out[key] = float(agg(values[name]))
                break
    for key, (new, old) in _PREFIX.items():
        if values.get(new):
            out[key] = float(sum(values[new]))
        if values.get(old):
            if "token" in help_text.get(old, "").lower():
                out.setdefault(key, float(sum(values[old])))
            else:
                out[f"{key}_blocks"] = float(sum(values[old]))
    for key, hist in _histograms_from(families).items():
        out[f"{key}_seconds_sum"] = hist.sum
        out[f"{key}_seconds_count"] = hist.count
    return out


async def scrape(client: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    """GET ``{base_url}/metrics`` with ``client`` and :func:`parse_metrics` the body.

    Raises:
        httpx.HTTPError: connection failure, timeout (the client's), or a
            non-2xx status (``httpx.HTTPStatusError``).
        ValueError: the body is not Prometheus text.
    """
    resp = await client.get(base_url.rstrip("/") + METRICS_PATH)
    resp.raise_for_status()
    return parse_metrics(resp.text)


def _delta(first: dict[str, float], last: dict[str, float], key: str) -> float | None:
    """``last[key] - first[key]`` for a counter, or None if missing or reset (negative)."""
    if key not in first or key not in last:
        return None
    d = last[key] - first[key]
    return d if d >= 0 else None


def summarize_samples(
    samples: list[MetricSample], notes: list[str] | None = None
) -> dict[str, float]:
    """Run-level server-side numbers from the scrapes of one run.

    ``samples`` is in time order: phase ``"before"`` first (scraped just
    before the measured requests), ``"during"`` scrapes, ``"after"`` last
    (scraped after the last measured request). Counter deltas are
    ``last sample - first sample``; a counter missing from either, or going
    down (server restart), gives no delta key, except as stated below.

    Returns (all floats, never NaN):

    - ``prefix_cache_queries_delta``, ``prefix_cache_hits_delta`` (tokens): absent
      when the counters are missing or went down (a restart between the scrapes:
      unknown, never 0), with a line in ``notes`` when it is given;
    - ``prefix_cache_hit_rate`` (0-1) = hits delta / queries delta, in tokens,
      only when the queries delta is > 0 (the DESIGN rule; vLLM's own
      ``vllm bench serve`` computes its spec-decode rates from /metrics
      deltas the same way);
    - ``prefix_cache_queries_blocks_delta``, ``prefix_cache_hits_blocks_delta``,
      ``prefix_cache_hit_rate_blocks``: the same from block-counted early-V1
      counters, when those exist (a different unit: never compare with tokens);
    - ``num_preemptions_delta``, ``prompt_tokens_delta``,
      ``generation_tokens_delta``, ``request_success_delta`` when available;
    - ``kv_cache_usage_peak`` (0-1, max over all samples) and
      ``kv_cache_usage_mean`` (0-1, mean over ``"during"`` samples only;
      absent without them);
    - ``num_requests_running_peak``, ``num_requests_waiting_peak`` (max over
      all samples).

    Empty ``samples`` gives ``{}``.
    """
    out: dict[str, float] = {}
    if not samples:
        return out
    first, last = samples[0].values, samples[-1].values

    for unit_suffix in ("", "_blocks"):
        deltas: list[float | None] = []
        for key in (f"prefix_cache_queries{unit_suffix}", f"prefix_cache_hits{unit_suffix}"):
            d = _delta(first, last, key)
            deltas.append(d)
            if d is not None:
                out[f"{key}_delta"] = d
            elif notes is not None and key in first and key in last:  # it went down
                notes.append(
                    f"{key} went down from {first[key]:g} to {last[key]:g} between the "
                    "first and last scrapes (a server restart?): no delta, no hit rate"
                )
        queries, hits = deltas
        if queries and hits is not None:
            rate_key = "prefix_cache_hit_rate" + unit_suffix
            out[rate_key] = hits / queries

    for key in ("num_preemptions", "prompt_tokens", "generation_tokens", "request_success"):
        d = _delta(first, last, key)
        if d is not None:
            out[f"{key}_delta"] = d

    for key in ("kv_cache_usage", "num_requests_running", "num_requests_waiting"):
        seen = [s.values[key] for s in samples if key in s.values]
        if seen:
            out[f"{key}_peak"] = max(seen)
    during = [
        s.values["kv_cache_usage"]
        for s in samples
        if s.phase == "during" and "kv_cache_usage" in s.values
    ]
    if during:
        out["kv_cache_usage_mean"] = sum(during) / len(during)
    return out


def histogram_delta(before: Histogram, after: Histogram) -> Histogram | None:
    """The observations made between two scrapes: ``after - before``, bucket by bucket.

    ``counts``, ``sum`` and ``count`` are each ``after`` minus ``before``
    (Prometheus' ``increase`` without extrapolation). Returns None when the
    bucket bounds differ, or when any bucket count, the count or the sum goes
    down (the counters were reset: a server restart; latencies are >= 0, so
    the sum cannot go down either). A restart followed by more observations
    than before is not detectable from the counts, as with any counter.
    """
    if before.bounds != after.bounds:
        return None
    counts = tuple(a - b for a, b in zip(after.counts, before.counts, strict=True))
    count = after.count - before.count
    total = after.sum - before.sum
    if count < 0 or total < 0 or any(c < 0 for c in counts):
        return None
    return Histogram(bounds=after.bounds, counts=counts, sum=total, count=count)


def _fmt(x: float) -> str:
    """A count or bound for a message: 16.0 -> "16", 0.04 -> "0.04", inf -> "+Inf"."""
    if x == math.inf:
        return "+Inf"
    return str(int(x)) if x.is_integer() else f"{x:g}"


def histogram_quantile(q: float, h: Histogram) -> tuple[float | None, str | None]:
    """The ``q``-quantile (0 < q <= 1) of ``h``, as Prometheus' ``histogram_quantile``.

    The formula is Prometheus' (docs: "Functions", ``histogram_quantile``;
    code: ``bucketQuantile`` in ``promql/quantile.go``): with ``n =
    counts[-1]`` observations and rank ``r = q * n``, take the first bucket
    ``b`` with ``counts[b] >= r`` and interpolate linearly inside it,
    ``lower + (upper - lower) * (r - counts[b-1]) / (counts[b] - counts[b-1])``,
    where ``lower`` is the previous bound, or 0 for the first bucket (if the
    first bound is <= 0, that bound is returned instead, as Prometheus does).

    Returns:
        ``(value_seconds, None)``, in the unit of ``h.bounds``; or ``(None,
        reason)`` where Prometheus would return NaN or a bare bucket bound,
        i.e. where the buckets cannot support a number:

        - no observations (``counts[-1] == 0``);
        - counts that are not cumulative (decrease at some bound; Prometheus
          would silently force them monotonic);
        - the quantile falls in the +Inf bucket (Prometheus returns the
          largest finite bound, a floor, not an estimate);
        - all observations in one bucket (every quantile would be a linear
          interpolation of the bucket's bounds alone, whatever the data).

    Raises:
        ValueError: ``q`` is not in (0, 1].
    """
    if not 0 < q <= 1:
        raise ValueError(f"quantile must be in (0, 1], got {q}")
    bounds, counts = h.bounds, h.counts
    total = counts[-1]
    if total <= 0:
        return None, "no observations"
    for i in range(1, len(counts)):
        if counts[i] < counts[i - 1]:
            return None, (
                f"bucket counts are not cumulative (they go down at le={_fmt(bounds[i])})"
            )
    rank = q * total
    b = next((i for i in range(len(counts) - 1) if counts[i] >= rank), len(counts) - 1)
    if b == len(counts) - 1:
        if len(bounds) == 1:
            return None, "falls in the +Inf bucket: the histogram has no finite bucket bound"
        return None, (
            f"falls in the +Inf bucket: {_fmt(total - counts[-2])} of {_fmt(total)} observations "
            f"are above the largest finite bound {_fmt(bounds[-2])} s"
        )
    per_bucket = [c - p for c, p in zip(counts, (0.0, *counts[:-1]), strict=True)]
    occupied = [i for i, c in enumerate(per_bucket) if c > 0]
    if len(occupied) == 1:
        i = occupied[0]
        low = _fmt(bounds[i - 1]) if i > 0 else "0"
        return None, (
            f"all {_fmt(total)} observations in one bucket ({low}, {_fmt(bounds[i])}] s: "
            "quantiles would only echo the bucket bounds"
        )
    if b == 0 and bounds[0] <= 0:
        return bounds[0], None
    lower = bounds[b - 1] if b > 0 else 0.0
    below = counts[b - 1] if b > 0 else 0.0
    return lower + (bounds[b] - lower) * (rank - below) / (counts[b] - below), None


#: Histograms whose observations can be exactly 0 s: decode time is the last token's
#: time minus the first's, 0 for a request with one output token
#: (``vllm/v1/metrics/stats.py`` ``update_from_finished_request``, vLLM 0.32 line 601).
#: Every other one times something that takes time, so a ``_sum`` that does not grow
#: while ``_count`` does is a broken histogram, not a mean of 0.
MAY_BE_ZERO = frozenset({"decode"})


def _mean_problem(key: str, before: Histogram, after: Histogram, delta: Histogram) -> str | None:
    """Why ``delta.sum / delta.count`` is no mean, or None when ``_sum`` is consistent.

    ``_sum`` must be finite and not negative (in either scrape and in the delta), the
    delta's ``_count`` must equal its +Inf bucket (Prometheus' rule), ``_sum`` must not
    stay 0 while ``_count`` grows (unless ``key`` is in :data:`MAY_BE_ZERO`; vLLM 0.5.1
    observed every TTFT as 0 s: vllm-project/vllm#6337, fixed by vllm-project/vllm#6686,
    bisected in vllm-project/vllm#8819), and it must lie within what the buckets allow:
    at least ``sum(per-bucket count x the bucket's lower bound)`` (an observation in
    ``(lo, hi]`` is above ``lo``; 0 for the first bucket: these are durations) and, when
    no observation is in the +Inf bucket, at most ``sum(per-bucket count x upper
    bound)``; with a tolerance for float rounding of the cumulative sums.
    """
    n = _fmt(delta.count)
    if not all(math.isfinite(x) for x in (before.sum, after.sum, delta.sum)):
        return "_sum is not finite"
    if min(before.sum, after.sum) < 0:
        return f"_sum is negative ({min(before.sum, after.sum):g} s)"
    if abs(delta.count - delta.counts[-1]) > 1e-9 * max(1.0, delta.count):
        return f"_count grew by {n} but the +Inf bucket by {_fmt(delta.counts[-1])}"
    if delta.sum == 0 and key not in MAY_BE_ZERO:
        return (
            f"_sum did not grow while _count grew by {n}: every observation would be 0 s "
            "(a broken histogram, as vLLM 0.5.1's TTFT: vllm-project/vllm#6337)"
        )
    cum = delta.counts
    if any(b < a for a, b in zip(cum, cum[1:], strict=False)) or cum[0] < 0:
        return None  # not cumulative: the percentiles say so; no bound to check against
    per = [c - p for c, p in zip(cum, (0.0, *cum[:-1]), strict=True)]
    tol = 1e-9 * max(abs(before.sum), abs(after.sum), 1.0)
    lows = (0.0, *delta.bounds[:-1])
    least = sum(c * max(lo, 0.0) for c, lo in zip(per, lows, strict=True))
    if delta.sum < least - tol:
        return (
            f"_sum grew by {delta.sum:g} s, less than the {n} observations in their buckets "
            f"add up to at least ({least:g} s)"
        )
    if per[-1] == 0:
        most = sum(c * hi for c, hi in zip(per[:-1], delta.bounds[:-1], strict=True))
        if delta.sum > most + tol:
            return (
                f"_sum grew by {delta.sum:g} s, more than the {n} observations in their "
                f"buckets add up to at most ({most:g} s)"
            )
    return None


def _percentile_word(p: float) -> str:
    """Key spelling of a percentile, as :mod:`jobs.load.loadgen`: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def summarize_histograms(
    before: dict[str, Histogram],
    after: dict[str, Histogram],
    percentiles: Sequence[float] = (50, 90, 99),
) -> tuple[dict[str, float], list[str]]:
    """Server-side latency numbers of one run from the histograms scraped before and after it.

    ``before`` / ``after`` are :func:`parse_histograms` of the scrapes just
    before the measured requests and after the last one. For each
    :data:`HISTOGRAMS` key whose :func:`histogram_delta` is valid and has
    ``count > 0``:

    - ``server_mean_<key>_ms`` = delta ``_sum`` / delta ``_count`` * 1000
      (milliseconds; exact, not from buckets), unless ``_sum`` is inconsistent
      (:func:`_mean_problem`: not finite, negative, 0 while the count grew, outside
      what the buckets allow): then no mean and a note;
    - ``server_count_<key>``: observations in the run (delta ``_count``);
    - ``server_p<NN>_<key>_ms`` for each of ``percentiles`` (0-100) that
      :func:`histogram_quantile` supports (milliseconds; ``p99.9`` keeps its
      decimal), e.g. ``server_p99_e2el_ms``.

    Returns:
        ``(numbers, notes)``. ``notes`` holds one human-readable string per
        key that lost something: every omitted percentile is named with its
        reason (e.g. ``"server ttft: p50, p90, p99 omitted: all 16 observations
        in one bucket (0.04, 0.06] s: ..."``); a key in only one of the two
        dicts (missing, or left out as unusable by :func:`parse_histograms`), an
        invalid delta (bucket bounds changed, or a count went down: server
        restart; ``_sum`` went down while the counts did not), an omitted mean or
        no observations in the run gets a note too. A key in neither dict gives
        nothing (an older vLLM without it).

    Raises:
        ValueError: a percentile outside (0, 100].
    """
    if any(not 0 < p <= 100 for p in percentiles):
        raise ValueError(f"percentiles must be within (0, 100], got {list(percentiles)}")
    out: dict[str, float] = {}
    notes: list[str] = []
    for key in HISTOGRAMS:
        if key not in before and key not in after:
            continue
        if key not in before or key not in after:
            missing = "before" if key not in before else "after"
            notes.append(
                f"server {key}: omitted: the histogram is missing or unusable (a NaN sample, "
                f"an incomplete label set) in the {missing!r} scrape"
            )
            continue
        b, a = before[key], after[key]
        delta = histogram_delta(b, a)
        if delta is None:
            grew = b.bounds == a.bounds and a.count >= b.count
            grew = grew and all(y >= x for x, y in zip(b.counts, a.counts, strict=True))
            if not grew:
                why = "bucket bounds changed or a count went down between the scrapes (server "
                why += "restart?)"
            elif min(b.sum, a.sum) < 0:
                why = f"_sum is negative ({min(b.sum, a.sum):g} s)"
            else:
                why = f"_sum went down by {b.sum - a.sum:g} s while the counts did not: an "
                why += "inconsistent _sum"
            notes.append(f"server {key}: omitted: {why}")
            continue
        if delta.count <= 0:
            notes.append(f"server {key}: omitted: no observations between the scrapes")
            continue
        problem = _mean_problem(key, b, a, delta)
        if problem is None:
            out[f"server_mean_{key}_ms"] = delta.sum / delta.count * 1000.0
        else:
            notes.append(f"server {key}: mean omitted: {problem}")
        out[f"server_count_{key}"] = delta.count
        omitted: dict[str, list[str]] = {}
        for p in percentiles:
            value, reason = histogram_quantile(p / 100.0, delta)
            word = _percentile_word(p)
            if value is None:
                omitted.setdefault(reason or "unsupported", []).append(f"p{word}")
            else:
                out[f"server_p{word}_{key}_ms"] = value * 1000.0
        if omitted:
            parts = [f"{', '.join(ps)} omitted: {reason}" for reason, ps in omitted.items()]
            notes.append(f"server {key}: " + "; ".join(parts))
    return out, notes
