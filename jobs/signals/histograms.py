"""vLLM's server-side latency histograms from its Prometheus ``/metrics`` text.

The histograms of :data:`HISTOGRAMS`: :func:`parse_histograms` reads them as
:class:`Histogram` (buckets summed over label sets);
:func:`jobs.signals.enginemetrics.parse_metrics` also puts each one's ``_sum`` /
``_count`` into every scrape (``<key>_seconds_sum`` / ``<key>_seconds_count``), so
per-interval means come from deltas; :func:`summarize_histograms` turns the ``before``
and ``after`` histograms of a run into ``server_*`` numbers, with percentiles by
Prometheus' ``histogram_quantile`` interpolation (:func:`histogram_quantile`) and a note
for every percentile the buckets cannot support; a mean only when the ``_sum`` is
consistent with ``_count`` and the buckets (no mean, with a note, when it stays 0 while
the count grows, as in vllm-project/vllm#6337).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "HISTOGRAMS",
    "Histogram",
    "histogram_delta",
    "histogram_quantile",
    "histograms_from",
    "parse_histograms",
    "summarize_histograms",
]

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


def histograms_from(families: Iterable[Metric]) -> dict[str, Histogram]:
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
    return histograms_from(text_string_to_metric_families(text))


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
            notes.append(f"server {key}: omitted: {_invalid_delta(b, a)}")
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
        notes += _percentiles(key, delta, percentiles, out)
    return out, notes


def _invalid_delta(before: Histogram, after: Histogram) -> str:
    """Why :func:`histogram_delta` found no valid delta between two scrapes."""
    grew = before.bounds == after.bounds and after.count >= before.count
    grew = grew and all(y >= x for x, y in zip(before.counts, after.counts, strict=True))
    if not grew:
        return "bucket bounds changed or a count went down between the scrapes (server restart?)"
    if min(before.sum, after.sum) < 0:
        return f"_sum is negative ({min(before.sum, after.sum):g} s)"
    drop = before.sum - after.sum
    return f"_sum went down by {drop:g} s while the counts did not: an inconsistent _sum"


def _percentiles(
    key: str, delta: Histogram, percentiles: Sequence[float], out: dict[str, float]
) -> list[str]:
    """``server_p<NN>_<key>_ms`` of ``delta`` into ``out``; a note naming those omitted."""
    omitted: dict[str, list[str]] = {}
    for p in percentiles:
        value, reason = histogram_quantile(p / 100.0, delta)
        word = _percentile_word(p)
        if value is None:
            omitted.setdefault(reason or "unsupported", []).append(f"p{word}")
        else:
            out[f"server_p{word}_{key}_ms"] = value * 1000.0
    if not omitted:
        return []
    parts = [f"{', '.join(ps)} omitted: {reason}" for reason, ps in omitted.items()]
    return [f"server {key}: " + "; ".join(parts)]
