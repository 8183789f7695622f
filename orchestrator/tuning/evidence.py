"""Order a round's candidates by evidence: the ``order`` hook the tuning service passes to
the campaign core (issue 25, "order them by evidence").

:func:`triage` is pure given its inputs (:class:`Evidence`: the campaign's fixed spec
part, the workload's request list or spec, the model's facts, the cluster's devices, the
incumbent's finished runs with the advisor's findings);
:mod:`orchestrator.tuning.evidence_inputs` is the service's side, which reads those inputs
from the database, the model directory and the live cluster. The rules, in the order they
rank a candidate (a skipped candidate ends ``skipped`` with its reason in the campaign's
candidates table):

1. **Memory first.** The incumbent's runs ran out of memory or their context cap did not
   fit the KV cache (the advisor's ``out_of_memory`` / ``context_cap_does_not_fit``), or
   the KV cache estimator says the incumbent's ``max_model_len`` cannot reach the
   workload's target concurrency (``workload.concurrency``): lowering ``max_model_len``
   (and, for memory, ``max_num_seqs``) comes first, as the advisor's rollback order says.
2. **Context caps that cannot reach the target are skipped**: a ``max_model_len`` level at
   which the estimator's maximum concurrency (full-length requests, vLLM's "Maximum
   concurrency for N tokens per request") is below the target, or that does not fit the
   KV cache at all.
3. **A waiting queue points at the batch limits.** When requests waited in the
   incumbent's runs (the median of their ``num_requests_waiting_peak`` is at least
   :data:`WAITING_MIN`), ``max_num_seqs`` and ``max_num_batched_tokens`` come next,
   raising before lowering.
4. **Prefix caching only where the prompts share something.** Turning
   ``enable_prefix_caching`` on is skipped when the prefix analyser
   (:func:`orchestrator.analysis.prefix.analyze_prefix` on the workload's request list)
   predicts a hit rate below the advisor's :data:`~orchestrator.analysis.advisor.LOW_HIT_RATE`.
5. **TP and PP only when needed.** Raising a tensor or pipeline parallel size is skipped
   unless the model does not fit one device or the objective is a latency (``*_ms``);
   a size the cluster has not the devices for is skipped always.
6. Otherwise the seeds' experiment order (:data:`SEED_ORDER`: the ladder's prefix caching,
   then TP, PP, the long requests' share), then the space's order.

The skips of rules 4 and 5 are advice, not impossibility: when a round would have no other
candidate to measure, they are measured after all (the space lists nothing else). Within a
rank, candidates keep the space's order (each variable's level below, then above).

The core replays a campaign from its recorded runs and needs the hook's answer for a round
to stay the same on every replay; the service keeps each round's answer with the campaign
(:class:`~orchestrator.tuning.evidence_inputs.RoundOrders`), so live facts that change
later (the cluster's devices) never reorder a round already opened.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from jobs.load.workload import build_requests
from jobs.modelgen.generator import load_tokenizer as load_build_tokenizer
from jobs.schemas import WorkloadSpec
from orchestrator.analysis.advisor import LOW_HIT_RATE, Advice
from orchestrator.analysis.kvcache import KVCacheUnknown, KVConfigError, estimate_kv_cache
from orchestrator.analysis.prefix import analyze_prefix, load_tokenizer, predict_hit_rate
from orchestrator.campaigns.outcomes import OrderHook, Triage
from orchestrator.campaigns.space import Candidate, Config, ConfigKey, Level, config_key
from orchestrator.experiments.engine_catalog import parse_human_int

log = logging.getLogger(__name__)

PREFIX_CACHING = "engine_args.enable_prefix_caching"
MAX_MODEL_LEN = "engine_args.max_model_len"
MAX_NUM_SEQS = "engine_args.max_num_seqs"
BATCH_LIMITS = (MAX_NUM_SEQS, "engine_args.max_num_batched_tokens")
PARALLEL_SIZES = (
    "layout.tensor_parallel_size",
    "engine_args.tensor_parallel_size",
    "layout.pipeline_parallel_size",
    "engine_args.pipeline_parallel_size",
)
#: The seeds' experiment order (the ladder: prefix caching on, then TP at the same device
#: count, then long and short requests apart); variables not listed follow in space order.
SEED_ORDER = (PREFIX_CACHING, *PARALLEL_SIZES, "workload.long_fraction")

#: Requests waiting (median over the incumbent's runs of their peak) that point at the
#: batch limits.
WAITING_MIN = 1.0
#: The advisor's findings that put lowering the context cap (and max_num_seqs) first.
MEMORY_FINDINGS = ("out_of_memory", "context_cap_does_not_fit")
#: Measured requests the prefix analyser reads at most (the first ones sent).
PREFIX_SAMPLE = 512
#: The share of a device's memory the weights may take and still "fit one device"
#: (vLLM's default ``gpu_memory_utilization``).
FIT_SHARE = 0.9

# ranks (lower first)
_MEMORY, _CAP_DOWN, _BATCH_UP, _BATCH_DOWN, _SEED = 0, 1, 2, 3, 4


@dataclass(frozen=True)
class Devices:
    """The cluster's devices as far as they are known (None: unknown).

    ``kind`` ``GPU`` or ``CPU``; ``count`` devices in the cluster; ``memory_gib`` one
    device's memory (on a GPU cluster the smallest GPU the newest GPU run recorded),
    ``memory_from`` where that figure comes from; ``kv_cache_gib`` the KV cache memory one
    device gives an engine (on CPU hosts ``VLLM_CPU_KVCACHE_SPACE``); ``per_node`` the most
    devices one live node has.
    """

    kind: str | None = None
    count: int | None = None
    memory_gib: float | None = None
    memory_from: str | None = None
    kv_cache_gib: float | None = None
    per_node: int | None = None


@dataclass(frozen=True)
class ModelFacts:
    """The model: its directory (tokenizer, chat template), ``config.json`` and the size of
    its weights (GiB in all; None: unknown, e.g. a dummy-weights model)."""

    model_dir: Path | None = None
    config: Mapping[str, Any] | None = None
    weights_gib: float | None = None


@dataclass(frozen=True)
class RunFacts:
    """One finished run of a configuration: its summary metrics, the advisor's findings
    (:func:`orchestrator.analysis.advisor.run_findings`) and the KV cache memory the engine
    printed (GiB per device; None when it did not)."""

    metrics: Mapping[str, float] = field(default_factory=dict)
    findings: tuple[Advice, ...] = ()
    kv_cache_gib: float | None = None


@dataclass(frozen=True)
class Evidence:
    """Everything the hook reads (see the module docstring).

    ``baseline`` the campaign's fixed spec part (``engine_args``, ``layout``,
    ``workload``); ``requests`` the workload's request list when given (else built from
    the workload at the incumbent); ``runs`` the finished runs by configuration
    (:func:`~orchestrator.campaigns.space.config_key` of their space variables).
    """

    baseline: Mapping[str, Any]
    latency_objective: bool = False
    model: ModelFacts = ModelFacts()
    devices: Devices = Devices()
    requests: Sequence[Any] | None = None
    runs: Mapping[ConfigKey, Sequence[RunFacts]] = field(default_factory=dict)


# ----------------------------------------------------------------- the pure hook


@dataclass(frozen=True)
class _Call:
    rank: int
    skip: str | None = None
    soft: bool = False


def order_by_evidence(evidence: Evidence) -> OrderHook:
    """The ``order`` hook over ``evidence``: :func:`triage`."""

    def hook(incumbent: Config, candidates: Sequence[Candidate]) -> list[Triage]:
        return triage(evidence, incumbent, candidates)

    return hook


def triage(
    evidence: Evidence,
    incumbent: Config,
    candidates: Sequence[Candidate],
) -> list[Triage]:
    """The round's candidates in the order to measure them, the skipped ones after them
    with their reasons (module docstring). Every candidate once; deterministic."""
    spec = spec_at(evidence.baseline, incumbent)
    calls = [_call(evidence, spec, incumbent, c) for c in candidates]
    if all(call.skip is not None for call in calls):  # nothing else: advice gives way
        calls = [_Call(call.rank) if call.soft else call for call in calls]
    order = sorted(range(len(candidates)), key=lambda i: (calls[i].skip is not None, calls[i].rank))
    return [Triage(candidates[i], calls[i].skip) for i in order]


def spec_at(baseline: Mapping[str, Any], config: Config) -> dict[str, Any]:
    """``baseline`` with each dotted path of ``config`` set to its level."""
    spec = copy.deepcopy(dict(baseline))
    for path, level in config.items():
        section, _, name = path.partition(".")
        node = spec.setdefault(section, {})
        if isinstance(node, dict) and name:
            node[name] = level
    return spec


def _call(
    evidence: Evidence,
    spec: Mapping[str, Any],
    incumbent: Config,
    cand: Candidate,
) -> _Call:
    runs = evidence.runs.get(config_key(incumbent), ())
    seed = _SEED + (
        SEED_ORDER.index(cand.variable) if cand.variable in SEED_ORDER else len(SEED_ORDER)
    )
    lowers = _number(cand.to_level) < _number(cand.from_level)
    if cand.variable == MAX_MODEL_LEN:
        return _context_cap(evidence, spec, runs, cand, lowers, seed)
    if cand.variable in BATCH_LIMITS:
        if cand.variable == MAX_NUM_SEQS and lowers and _memory_pressure(runs):
            return _Call(_MEMORY)
        if _waiting(runs) is not None:
            return _Call(_BATCH_DOWN if lowers else _BATCH_UP)
        return _Call(seed)
    if cand.variable == PREFIX_CACHING and cand.to_level is True:
        no_hits = no_prefix_hits(evidence, spec)
        return _Call(seed, no_hits, soft=True) if no_hits else _Call(seed)
    if cand.variable in PARALLEL_SIZES:
        return _parallel(evidence, spec, cand, lowers, seed)
    return _Call(seed)


def _number(level: Level) -> float:
    """A level as a number (``"4K"`` as vLLM reads it); NaN when it is none."""
    if isinstance(level, bool):
        return float(level)
    if isinstance(level, int | float):
        return float(level)
    parsed = parse_human_int(level)
    return math.nan if parsed is None else float(parsed)


# ----------------------------------------------------------------- memory and context caps


def _memory_pressure(runs: Sequence[RunFacts]) -> list[str]:
    return sorted({a.code for r in runs for a in r.findings if a.code in MEMORY_FINDINGS})


def _context_cap(
    evidence: Evidence,
    spec: Mapping[str, Any],
    runs: Sequence[RunFacts],
    cand: Candidate,
    lowers: bool,
    seed: int,
) -> _Call:
    target = target_concurrency(spec)
    reach = _kv_reach(evidence, spec, runs, _number(cand.to_level))
    if reach is not None:
        concurrency, fits = reach
        if not fits:
            return _Call(
                seed,
                f"the KV cache estimator says max_model_len {cand.to_level} does not fit the "
                "KV cache: the engine would not start",
            )
        if concurrency < target:
            return _Call(
                seed,
                f"the KV cache estimator gives a maximum concurrency of {concurrency:.2f} "
                f"full-length requests at max_model_len {cand.to_level}, below the "
                f"workload's target concurrency {target}",
            )
    if lowers:
        here = _kv_reach(evidence, spec, runs, _number(cand.from_level))
        if _memory_pressure(runs) or (here is not None and (not here[1] or here[0] < target)):
            return _Call(_CAP_DOWN)
    return _Call(seed)


def target_concurrency(spec: Mapping[str, Any]) -> int:
    value = (spec.get("workload") or {}).get("concurrency", 1)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 1


def _kv_gib(evidence: Evidence, runs: Sequence[RunFacts]) -> float | None:
    printed = [r.kv_cache_gib for r in runs if r.kv_cache_gib is not None]
    return statistics.median(printed) if printed else evidence.devices.kv_cache_gib


def _engine(evidence: Evidence, spec: Mapping[str, Any]) -> dict[str, Any]:
    engine = dict(spec.get("engine_args") or {})
    layout = spec.get("layout") or {}
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        if key in layout and key not in engine:
            engine[key] = layout[key]
    if engine.get("block_size") is None:
        engine["block_size"] = 128 if (evidence.devices.kind or "").upper() == "CPU" else 16
    return engine


def _kv_reach(
    evidence: Evidence, spec: Mapping[str, Any], runs: Sequence[RunFacts], level: float
) -> tuple[float, bool] | None:
    """``(maximum concurrency, fits)`` at context cap ``level``, None when unknown."""
    gib = _kv_gib(evidence, runs)
    if evidence.model.config is None or gib is None or not level >= 1:  # NaN: not a number
        return None
    cap = int(level)
    engine = {**_engine(evidence, spec), "max_model_len": cap}
    try:
        est = estimate_kv_cache(evidence.model.config, engine, {"available_kv_cache": gib}, cap)
    except (KVConfigError, KVCacheUnknown, ValueError, TypeError, KeyError):
        return None
    return float(est["maximum_concurrency"]), bool(est["fits"])


# ----------------------------------------------------------------- waiting queue


def _waiting(runs: Sequence[RunFacts]) -> float | None:
    """The median waiting-queue peak of the runs when it reaches :data:`WAITING_MIN`."""
    peaks = [
        r.metrics["num_requests_waiting_peak"]
        for r in runs
        if "num_requests_waiting_peak" in r.metrics
    ]
    if not peaks:
        return None
    median = statistics.median(peaks)
    return median if median >= WAITING_MIN else None


# ----------------------------------------------------------------- prefix caching


def no_prefix_hits(evidence: Evidence, spec: Mapping[str, Any]) -> str | None:
    """The reason to skip prefix caching for this workload, or None."""
    block_size = int(_engine(evidence, spec)["block_size"])
    model_dir = evidence.model.model_dir
    if evidence.requests is not None:
        return _predict_no_hits(list(evidence.requests), model_dir, block_size)
    workload = json.dumps(spec.get("workload") or {}, sort_keys=True, default=str)
    return _workload_no_hits(str(model_dir or ""), _stamp(model_dir), workload, block_size)


def _stamp(model_dir: Path | None) -> float:
    try:
        return (Path(model_dir) / "tokenizer.json").stat().st_mtime if model_dir else 0.0
    except OSError:
        return 0.0


@lru_cache(maxsize=64)
def _workload_no_hits(model_dir: str, stamp: float, workload: str, block_size: int) -> str | None:
    """:func:`_predict_no_hits` over the request list of ``workload`` (JSON), kept per
    model directory (and its tokenizer's ``stamp``), workload and block size: a request
    list of thousands takes seconds to build and analyse, and every round of a campaign
    over one workload asks the same."""
    directory = Path(model_dir) if model_dir else None
    try:
        spec = WorkloadSpec.model_validate(json.loads(workload))
        tokenizer = None
        if directory is not None and (directory / "tokenizer.json").is_file():
            tokenizer = load_build_tokenizer(directory)
        requests = [r.model_dump() for r in build_requests(spec, tokenizer)]
    except ValueError:
        return None  # the experiment checks say what is wrong with the workload
    return _predict_no_hits(requests, directory, block_size)


def _predict_no_hits(requests: list[Any], model_dir: Path | None, block_size: int) -> str | None:
    measured = [r for r in requests if not _get(r, "warmup")][:PREFIX_SAMPLE]
    if len(measured) < 2:
        return None
    approximate = ""
    try:
        tok = _tokenizer(model_dir)
        prediction = analyze_prefix(measured, tokenizer=tok, block_size=block_size).prediction
    except (OSError, ValueError):
        prediction = predict_hit_rate(_approximate_tokens(measured), block_size)
        approximate = ", approximate: without the model's tokenizer, 4 characters a token"
    if prediction.hit_rate >= LOW_HIT_RATE:
        return None
    return (
        "the prefix analyser predicts no hits for this workload: a prefix cache hit rate of "
        f"{prediction.hit_rate:.1%} ({prediction.hits_tokens:,} of "
        f"{prediction.queries_tokens:,} prompt tokens over {len(measured)} requests; the "
        f"prompts share {prediction.shared_prefix_tokens} tokens, blocks of {block_size}"
        f"{approximate})"
    )


def _tokenizer(model_dir: Path | None) -> Any:
    """The model's tokenizer and chat template; ``OSError`` when there is none to load."""
    if model_dir is None:
        raise FileNotFoundError("no model directory")
    try:
        return load_tokenizer(model_dir)
    except OSError:
        raise
    except Exception as exc:  # transformers' own errors for a directory it cannot read
        raise OSError(f"cannot load the tokenizer of {model_dir}: {exc}") from exc


def _get(request: Any, key: str) -> Any:
    return request.get(key) if isinstance(request, Mapping) else getattr(request, key, None)


def _approximate_tokens(requests: Sequence[Any]) -> list[list[int]]:
    """Token ids stood in for by 4-character pieces of each request's text (messages as
    ``role: content`` lines, or the prompt), the same piece the same id."""
    ids: dict[str, int] = {}
    out = []
    for r in requests:
        prompt = _get(r, "prompt")
        if isinstance(prompt, str):
            text = prompt
        else:
            text = "".join(
                f"{m.get('role')}: {m.get('content')}\n"
                for m in (_get(r, "messages") or [])
                if isinstance(m, Mapping)
            )
        out.append([ids.setdefault(text[i : i + 4], len(ids)) for i in range(0, len(text), 4)])
    return out


# ----------------------------------------------------------------- tensor and pipeline parallel


def one_device_fit(evidence: Evidence) -> tuple[bool | None, str]:
    """Whether the model's weights fit one device (within :data:`FIT_SHARE` of its
    memory; None when the weights' size or the device memory is unknown), and why in words
    (naming where the device memory comes from, or what is unknown)."""
    weights, memory = evidence.model.weights_gib, evidence.devices.memory_gib
    if weights is None or memory is None:
        unknown = [
            what
            for what, value in (("its weights' size", weights), ("the device memory", memory))
            if value is None
        ]
        return None, (
            f"nothing shows the model does not fit one device ({' and '.join(unknown)} unknown)"
        )
    source = f" ({evidence.devices.memory_from})" if evidence.devices.memory_from else ""
    if weights <= memory * FIT_SHARE:
        return (
            True,
            f"the model fits one device (weights {weights:.1f} GiB of {memory:.1f} GiB{source})",
        )
    return False, (
        f"the model's weights ({weights:.1f} GiB) do not fit one device of {memory:.1f} GiB{source}"
    )


def _devices_of(spec: Mapping[str, Any], variable: str, level: Level) -> int:
    layout = dict(spec.get("layout") or {})
    engine = spec.get("engine_args") or {}
    sizes = []
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        value = layout.get(name, engine.get(name, 1))
        if variable.endswith(name):
            value = level
        sizes.append(int(value) if isinstance(value, int) and not isinstance(value, bool) else 1)
    return sizes[0] * sizes[1]


def _parallel(
    evidence: Evidence, spec: Mapping[str, Any], cand: Candidate, lowers: bool, seed: int
) -> _Call:
    name = cand.variable.split(".", 1)[1]
    devices = _devices_of(spec, cand.variable, cand.to_level)
    if evidence.devices.count is not None and devices > evidence.devices.count:
        return _Call(
            seed,
            f"{name} {cand.to_level} needs {devices} devices; the cluster has "
            f"{evidence.devices.count}",
        )
    weights, memory = evidence.model.weights_gib, evidence.devices.memory_gib
    fits_one, why = one_device_fit(evidence)
    if lowers:
        if weights is not None and memory is not None and weights > devices * memory * FIT_SHARE:
            return _Call(
                seed,
                f"the model's weights ({weights:.1f} GiB) do not fit {devices} device(s) of "
                f"{memory:.1f} GiB",
            )
        return _Call(seed)
    if fits_one is False or evidence.latency_objective:
        return _Call(seed)
    return _Call(
        seed,
        f"{why} and the objective is not a latency: the seeds' operators raise {name} "
        "only for a model that does not fit one device or for latency",
        soft=True,
    )
