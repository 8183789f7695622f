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

Server-side latency histograms (:data:`jobs.signals.histograms.HISTOGRAMS`):
:func:`parse_metrics` also puts each one's ``_sum`` / ``_count`` into every scrape
(``<key>_seconds_sum`` / ``<key>_seconds_count``), so per-interval means come from
deltas; the histograms themselves: :mod:`jobs.signals.histograms`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from jobs.schemas import MetricSample
from jobs.signals.histograms import HISTOGRAMS, histograms_from

__all__ = [
    "METRICS_PATH",
    "SAMPLE_KEYS",
    "parse_metrics",
    "scrape",
    "summarize_samples",
]

METRICS_PATH = "/metrics"
"""Path of the Prometheus endpoint, appended to ``base_url``."""

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


def parse_metrics(text: str) -> dict[str, float]:
    """Parse Prometheus exposition text from vLLM into ``{key: float}`` (see :data:`SAMPLE_KEYS`).

    Values of one metric are summed over its label sets (several engines,
    models, ``finished_reason``...), except 0-1 gauges (KV cache usage, V0 hit
    rate) which take the max over label sets. ``*_created`` timestamp samples
    and histogram/summary sub-samples are ignored; NaN samples are skipped; a
    metric that is missing gives no key (no zeros are invented). For each
    histogram of :data:`HISTOGRAMS` that :func:`jobs.signals.histograms.parse_histograms` finds, its
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
    for key, hist in histograms_from(families).items():
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
