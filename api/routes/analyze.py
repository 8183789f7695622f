"""``/api/v1/analyze/*``: what-if diagnostics that need no GPU.

``POST /api/v1/analyze/kv-cache`` answers "what context cap and concurrency fit
on 2 x 80 GB at TP=2?" from the model's ``config.json`` and the memory figures
(:mod:`orchestrator.analysis.kvcache`, formulas and sources in its docstring).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from api.deps import SessionDep, SettingsDep
from orchestrator.analysis import kvcache
from orchestrator.analysis.prefix import analyze_prefix as run_analysis
from orchestrator.analysis.service import experiment_advice, run_advice
from orchestrator.core.errors import AnalyzeRequestInvalidError, SpecInvalidError
from orchestrator.core.settings import Settings
from orchestrator.experiments.model_resolution import resolve_model
from orchestrator.experiments.pathpolicy import MAX_MODEL_CHARS

router = APIRouter(prefix="/api/v1/analyze", tags=["analyze"])

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
#: A model named by name or path: length-checked before the file system sees it.
ModelName = Annotated[str, Field(min_length=1, max_length=MAX_MODEL_CHARS)]
#: Upper bound of any memory figure (GiB per device): far above any device, keeps
#: the arithmetic finite.
MAX_GIB = 1_000_000.0
#: Largest ``kv_bytes_per_token`` accepted (bytes per token per device).
MAX_KV_BYTES_PER_TOKEN = 1 << 40


class KVEngine(BaseModel):
    """vLLM engine arguments (vLLM names). Those below shape the KV cache; any other vLLM
    argument is accepted too: known ones that do not change the KV cache are used as
    they are, ones the estimator does not know are listed in ``ignored_keys``, ones that
    change it in ways not modelled (``decode_context_parallel_size`` > 1,
    ``kv_cache_dtype_skip_layers``, ...) make the answer a 422 naming them."""

    model_config = ConfigDict(extra="allow")

    tensor_parallel_size: int = Field(1, ge=1, le=1024)
    pipeline_parallel_size: int = Field(1, ge=1, le=1024)
    block_size: int = Field(16, ge=1, le=4096, description="tokens per KV block")
    kv_cache_dtype: str = Field(
        "auto", description="auto (the model's dtype), fp8, fp8_e4m3, fp8_e5m2, bfloat16…"
    )
    dtype: str = Field("auto", description="the model dtype (vLLM --dtype)")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    max_model_len: int | None = Field(
        None, ge=1, description="the context cap to check (tokens); omitted: the model's maximum"
    )
    speculative_config: dict[str, Any] | None = Field(
        None,
        description="vLLM's speculative_config: method (mtp, eagle, eagle3, draft_model, "
        "ngram...), model, num_speculative_tokens, draft_tensor_parallel_size, kv_cache_dtype",
    )
    max_num_batched_tokens: int | None = Field(
        None, ge=1, le=1 << 30, description="read for sliding-window models (tokens in flight)"
    )
    async_scheduling: bool | None = Field(
        None, description="read for sliding-window models; omitted: vLLM 0.32's default"
    )
    disable_hybrid_kv_cache_manager: bool | None = None
    disable_sliding_window: bool = False
    num_gpu_blocks_override: int | None = Field(None, ge=1)
    kv_cache_memory_bytes: int | None = Field(
        None, ge=1, description="KV cache memory per device (bytes); replaces the memory figures"
    )


class KVMemory(BaseModel):
    """Memory per device, in GiB (2**30 bytes).

    Either ``available_kv_cache_gib`` (what vLLM printed as "Available KV cache
    memory") or the profile: ``device_memory_gib`` with ``weights_gib`` (default:
    the model's weight files divided over TP x PP), ``activation_gib`` (peak
    activation, measured; default 0) and ``non_torch_gib`` (CUDA context, NCCL
    buffers; default 0).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    device_memory_gib: float | None = Field(None, gt=0, le=MAX_GIB)
    weights_gib: float | None = Field(None, ge=0, le=MAX_GIB)
    activation_gib: float = Field(0.0, ge=0, le=MAX_GIB)
    non_torch_gib: float = Field(0.0, ge=0, le=MAX_GIB)
    available_kv_cache_gib: float | None = Field(None, ge=0, le=MAX_GIB)


class KVCacheQuery(BaseModel):
    """``POST /api/v1/analyze/kv-cache``.

    ``model``: a model name the service knows (generated ``tiny``/``small``, a
    directory with ``config.json``, or a name under a model root), or the
    ``config.json`` content itself (HF names: ``num_hidden_layers``,
    ``num_key_value_heads``, ``head_dim``/``hidden_size``, ``num_attention_heads``,
    MLA fields, ``layer_types``/``sliding_window``, ``num_nextn_predict_layers`` for
    MTP; a multimodal config's ``text_config``). ``draft_model``: the drafter's name or
    ``config.json`` (EAGLE, draft-model speculative decoding). ``kv_bytes_per_token``:
    bytes per token per device to use instead of the model's (for a model the estimator
    cannot model; ``model`` may then be omitted if ``engine.max_model_len`` is given).
    ``concurrency``: also give the largest context cap at which that many full-length
    requests fit.
    """

    model_config = ConfigDict(extra="forbid")

    model: ModelName | dict[str, Any] | None = None
    draft_model: ModelName | dict[str, Any] | None = None
    engine: KVEngine = Field(default_factory=KVEngine)
    memory: KVMemory = Field(default_factory=KVMemory)
    kv_bytes_per_token: int | None = Field(None, ge=1, le=MAX_KV_BYTES_PER_TOKEN)
    concurrency: int | None = Field(None, ge=1, le=1_000_000)


def _problem(loc: list[str], msg: str) -> AnalyzeRequestInvalidError:
    return AnalyzeRequestInvalidError(
        [{"loc": ["body", *loc], "msg": msg, "type": "value_error"}],
        detail=f"{'.'.join(loc)}: {msg}",
    )


def _model(settings: Settings, model: str | dict[str, Any]) -> tuple[dict[str, Any], Path | None]:
    if isinstance(model, dict):
        return model, None
    try:
        resolved = resolve_model(settings, model)
    except SpecInvalidError as exc:
        raise AnalyzeRequestInvalidError(exc.errors, detail=exc.errors[0]["msg"]) from None
    return json.loads((resolved.path / "config.json").read_text()), resolved.path


def _weights_gib(path: Path | None, devices: int) -> float | None:
    if path is None:
        return None
    total = sum(f.stat().st_size for f in path.iterdir() if f.name.endswith(WEIGHT_SUFFIXES))
    return total / kvcache.GIB / devices if total else None


def _memory(
    mem: KVMemory, eng: KVEngine, path: Path | None, devices: int, assumptions: list[str]
) -> dict[str, Any]:
    """The per-device memory figures the estimate uses (GiB)."""
    if mem.available_kv_cache_gib is not None and mem.device_memory_gib is not None:
        raise _problem(
            ["memory"],
            "give either available_kv_cache_gib (what vLLM printed) or the memory profile "
            "(device_memory_gib, weights_gib, ...), not both",
        )
    if eng.kv_cache_memory_bytes is not None:
        return {"available_kv_cache": eng.kv_cache_memory_bytes / kvcache.GIB}
    if mem.available_kv_cache_gib is not None:
        return {"available_kv_cache": mem.available_kv_cache_gib}
    if mem.device_memory_gib is None:
        raise _problem(
            ["memory"],
            "give device_memory_gib (per device), available_kv_cache_gib or "
            "engine.kv_cache_memory_bytes",
        )
    weights = mem.weights_gib
    if weights is None:
        weights = _weights_gib(path, devices)
        if weights is None:
            where = (
                "the model directory has no weight files to size"
                if path is not None
                else "an inline model config has no weight files to size"
            )
            raise _problem(
                ["memory", "weights_gib"],
                f"{where}; give weights_gib (per device, GiB: the 'Loading weights took … GiB' "
                "figure)",
            )
        assumptions.append(
            f"weights: the model's weight files over {devices} device(s) = {weights:.2f} GiB"
        )
    if mem.activation_gib == 0:
        assumptions.append(
            "peak activation memory 0 GiB: give activation_gib from a profiled start "
            "for a tighter figure"
        )
    return {
        "total_gpu_memory": mem.device_memory_gib,
        "weights_memory": weights,
        "peak_activation_memory": mem.activation_gib,
        "non_torch_memory": mem.non_torch_gib,
    }


def _estimate(call: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """``call(*args, **kwargs)`` with the estimator's refusals as 422s naming the field."""
    try:
        result: dict[str, Any] = call(*args, **kwargs)
    except kvcache.KVCacheUnknown as exc:
        raise _problem(
            list(exc.loc),
            f"{exc.msg}; the estimator will not guess: give kv_bytes_per_token (bytes per "
            "token per device, e.g. from a start's 'Available KV cache memory' / 'KV cache "
            "size' lines)",
        ) from None
    except kvcache.KVConfigError as exc:
        raise _problem(list(exc.loc), exc.msg) from None
    except (TypeError, ValueError, KeyError) as exc:  # a value of a shape no rule expected
        raise _problem([], f"the configuration cannot be read: {exc}") from None
    return result


@router.post("/kv-cache")
def analyze_kv_cache(query: KVCacheQuery, settings: SettingsDep) -> dict[str, Any]:
    """KV cache bytes per token, KV cache size in tokens, maximum concurrency at the
    context cap, whether the cap fits at all, and a table of caps, as vLLM 0.32 computes
    them (speculative decoding's drafter layers, sliding-window layers, MLA, KV dtypes).

    Returns ``{"estimate": estimate_kv_cache(...) per device (bytes, tokens),
    "devices": TP x PP, "memory_gib": the per-device figures used,
    "kv_bytes_per_token_source": "model config" or "given", "ignored_keys": [{"key",
    "source", "value", "reason"}] (config or engine keys the estimator does not know),
    "max_model_len_for_concurrency": {...} when ``concurrency`` is given,
    "context_caps": [{"max_model_len", "maximum_concurrency", "fits"}] for powers
    of two up to the model's maximum, "assumptions": [str]}``. Errors: 422
    problem+json naming the field (unknown model, a config without layer or head
    counts, a layout vLLM refuses, a layout the estimator cannot model (give
    ``kv_bytes_per_token``), no memory figures, no weight size).
    """
    config: dict[str, Any] | None = None
    path: Path | None = None
    if query.model is not None:
        config, path = _model(settings, query.model)
    elif query.kv_bytes_per_token is None:
        raise _problem(["model"], "give the model (name or config.json) or kv_bytes_per_token")
    draft = None
    if query.draft_model is not None:
        draft, _ = _model(settings, query.draft_model)
    eng = query.engine
    engine = eng.model_dump(exclude_none=True)
    devices = eng.tensor_parallel_size * eng.pipeline_parallel_size
    assumptions: list[str] = []
    memory = _memory(query.memory, eng, path, devices, assumptions)
    lengths = _estimate(kvcache.derive_max_model_len, config, engine)
    cap = lengths["max_model_len"]
    assumptions.extend(lengths["notes"])
    extra = {"draft_config": draft, "kv_bytes_per_token": query.kv_bytes_per_token}
    est = _estimate(kvcache.estimate_kv_cache, config, engine, memory, cap, **extra)
    assumptions.extend(est["notes"])
    if est["gpu_blocks"] == 0 and "available_kv_cache" not in memory:
        assumptions.append(
            "no memory is left for the KV cache: weights + activation + non-torch memory "
            f"exceed device_memory_gib x gpu_memory_utilization "
            f"({query.memory.device_memory_gib} x {eng.gpu_memory_utilization}); use more "
            "devices (TP/PP split the weights) or a smaller model"
        )
    est["available_kv_gib"] = round(est["available_kv_gib"], 4)
    out: dict[str, Any] = {
        "estimate": est,
        "devices": devices,
        "memory_gib": dict(memory),
        "kv_bytes_per_token_source": est["kv_bytes_per_token_source"],
        "ignored_keys": est["ignored_keys"],
        "assumptions": assumptions,
    }
    if query.concurrency:
        out["max_model_len_for_concurrency"] = _estimate(
            kvcache.max_fitting_context, config, engine, memory, query.concurrency, **extra
        )
    caps = []
    derived = lengths["derived_max_model_len"]
    top = int(derived) if derived is not None else cap
    length = 2 ** max(9, int(math.log2(max(1, eng.block_size))))
    while length <= top:
        row = _estimate(kvcache.estimate_kv_cache, config, engine, memory, length, **extra)
        caps.append(
            {
                "max_model_len": length,
                "maximum_concurrency": round(row["maximum_concurrency"], 2),
                "fits": row["fits"],
            }
        )
        length *= 2
    out["context_caps"] = caps
    return out


findings_router = APIRouter(prefix="/api/v1", tags=["findings"])


@findings_router.get("/runs/{run_id}/findings")
def run_findings(run_id: str, session: SessionDep) -> dict[str, Any]:
    """The advisor's findings for a run, in the order operators roll changes back
    (:mod:`orchestrator.analysis.advisor`): ``{"run_id", "findings": [{code, severity, rank,
    scope, run_id, variant, message, action, evidence}]}``. 404 for an unknown run."""
    return {"run_id": run_id, "findings": run_advice(session, run_id)}


@findings_router.get("/experiments/{experiment_id}/findings")
def experiment_findings(experiment_id: str, session: SessionDep) -> dict[str, Any]:
    """The advisor's findings for an experiment: each run's and the comparison's
    (bootstrap CIs), in rollback order. Shape as for runs, ``experiment_id`` instead."""
    return {"experiment_id": experiment_id, "findings": experiment_advice(session, experiment_id)}


class PrefixQuery(BaseModel):
    """``POST /api/v1/analyze/prefix``.

    ``requests``: the workload in the order sent, each an OpenAI chat-completions body
    (``messages``, optional ``tools``) or a completions body (``prompt``: a string, a list
    of token ids, or a batch of either; vLLM's ``prompt_token_ids`` and
    ``/inference/v1/generate`` ``token_ids`` are token ids too); other body fields are
    ignored, except the answer's token ids (``generated_token_ids``, ``output_token_ids``
    or a vLLM ``response`` with ``return_token_ids``), used to check later turns that
    resend the answer. ``model``: as for the KV cache endpoint (its tokenizer and chat
    template render the prompts); omitted, only prompts given as token ids are compared
    and the others are listed in ``not_compared``. ``block_size``: the engine's KV block
    size in tokens (vLLM's default 16 on GPUs; the CPU build uses 128).
    """

    model_config = ConfigDict(extra="forbid")

    model: ModelName | None = None
    requests: list[dict[str, Any]] = Field(min_length=1, max_length=5000)
    block_size: int = Field(16, ge=1, le=4096)
    add_generation_prompt: bool = True


@router.post("/prefix")
def analyze_prefix(query: PrefixQuery, settings: SettingsDep) -> dict[str, Any]:
    """Render every request with the model's tokenizer and chat template and compare
    TOKENS: the prefix all requests share (tokens and whole KV blocks), clusters, the
    first divergence (token position and source location: message, field, characters),
    its cause (timestamp, uuid, request id, random id, user name, JSON key order,
    whitespace, reordered messages or tools, re-tokenization / whitespace merge), the
    best hit rate vLLM's prefix cache can reach for this list, the change that would
    raise it, and every later turn that resends an earlier answer, checked token by token
    (:func:`orchestrator.analysis.prefix.analyze_prefix`; shape: ``PrefixAnalysis``).
    422 problem+json: unknown model, a malformed request (named by index), a token id
    out of the model's vocabulary, a chat template that fails on a request, nothing
    comparable (text without a model)."""
    model_dir = None
    if query.model is not None:
        try:
            model_dir = resolve_model(settings, query.model).path
        except SpecInvalidError as exc:
            raise AnalyzeRequestInvalidError(exc.errors, detail=exc.errors[0]["msg"]) from None
    try:
        analysis = run_analysis(
            query.requests,
            model_dir,
            block_size=query.block_size,
            add_generation_prompt=query.add_generation_prompt,
        )
    except ValueError as exc:
        raise _problem(["requests"], str(exc)) from None
    return analysis.model_dump(mode="json")
