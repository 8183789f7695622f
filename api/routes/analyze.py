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
from orchestrator.experiments.models import resolve_model
from orchestrator.experiments.pathpolicy import MAX_MODEL_CHARS

router = APIRouter(prefix="/api/v1/analyze", tags=["analyze"])

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
#: A model named by name or path: length-checked before the file system sees it.
ModelName = Annotated[str, Field(min_length=1, max_length=MAX_MODEL_CHARS)]
#: Upper bound of any memory figure (GiB per device): far above any device, keeps
#: the arithmetic finite.
MAX_GIB = 1_000_000.0
#: Model config integers the estimate reads, with their largest sane value.
CONFIG_INTS = {
    "num_hidden_layers": 10_000,
    "num_attention_heads": 100_000,
    "num_key_value_heads": 100_000,
    "head_dim": 65_536,
    "hidden_size": 10_000_000,
    "kv_lora_rank": 65_536,
    "qk_rope_head_dim": 65_536,
    "max_position_embeddings": 1 << 40,
    "extra_kv_layers": 10_000,
    "num_draft_layers": 10_000,
    "num_mtp_layers": 10_000,
}


class KVEngine(BaseModel):
    """Engine arguments that shape the KV cache (vLLM names)."""

    model_config = ConfigDict(extra="forbid")

    tensor_parallel_size: int = Field(1, ge=1, le=1024)
    pipeline_parallel_size: int = Field(1, ge=1, le=1024)
    block_size: int = Field(16, ge=1, le=4096, description="tokens per KV block")
    kv_cache_dtype: str = Field("auto", description="auto (the model's dtype), fp8, bfloat16…")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    max_model_len: int | None = Field(
        None, ge=1, description="the context cap to check (tokens); omitted: the model's maximum"
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
    MLA fields, ``extra_kv_layers`` for draft/MTP layers). ``concurrency``: also
    give the largest context cap at which that many full-length requests fit.
    """

    model_config = ConfigDict(extra="forbid")

    model: ModelName | dict[str, Any]
    engine: KVEngine = Field(default_factory=KVEngine)
    memory: KVMemory
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


def _check_config(config: dict[str, Any], eng: KVEngine) -> None:
    """422 for a config vLLM would refuse or that is not numbers (field named).

    Integers must be JSON integers within sane bounds (:data:`CONFIG_INTS`); TP must
    divide the attention heads (vLLM: "Total number of attention heads must be
    divisible by tensor parallel size"), and the KV heads must split over TP
    (``kv % tp == 0``) or be replicated evenly (``tp % kv == 0``); PP may not exceed
    the layer count.
    """
    for key, top in CONFIG_INTS.items():
        if key not in config or config[key] is None:
            continue
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
            raise _problem(["model", key], f"must be a whole number from 1 to {top}, got {value!r}")
    if "num_hidden_layers" not in config:
        raise _problem(["model", "num_hidden_layers"], "the model config lacks it")
    mla = bool(config.get("use_mla", config.get("kv_lora_rank") is not None))
    heads = config.get("num_attention_heads")
    if not mla and heads is None:
        raise _problem(["model", "num_attention_heads"], "the model config lacks it")
    tp = eng.tensor_parallel_size
    if heads is not None and heads % tp:
        raise _problem(
            ["engine", "tensor_parallel_size"],
            f"{tp} does not divide num_attention_heads ({heads}); vLLM refuses this layout",
        )
    kv = config.get("num_key_value_heads") or heads
    if not mla and heads is not None and kv is not None and (kv > heads or heads % kv):
        raise _problem(
            ["model", "num_key_value_heads"],
            f"{kv} KV heads must divide the {heads} attention heads (grouped-query attention)",
        )
    if not mla and kv is not None and kv % tp and tp % kv:
        raise _problem(
            ["engine", "tensor_parallel_size"],
            f"{tp} neither divides num_key_value_heads ({kv}) nor is a multiple of it",
        )
    if not mla and config.get("head_dim") is None and config.get("hidden_size") is None:
        raise _problem(["model", "head_dim"], "the model config lacks head_dim and hidden_size")
    if eng.pipeline_parallel_size > config["num_hidden_layers"]:
        raise _problem(
            ["engine", "pipeline_parallel_size"],
            f"{eng.pipeline_parallel_size} stages for {config['num_hidden_layers']} layers",
        )


def _weights_gib(path: Path | None, devices: int) -> float | None:
    if path is None:
        return None
    total = sum(f.stat().st_size for f in path.iterdir() if f.name.endswith(WEIGHT_SUFFIXES))
    return total / kvcache.GIB / devices if total else None


@router.post("/kv-cache")
def analyze_kv_cache(query: KVCacheQuery, settings: SettingsDep) -> dict[str, Any]:
    """KV cache bytes per token, KV cache size in tokens, maximum concurrency at the
    context cap, whether the cap fits at all, and a table of caps.

    Returns ``{"estimate": estimate_kv_cache(...) per device (bytes, tokens),
    "devices": TP x PP, "memory_gib": the per-device figures used,
    "max_model_len_for_concurrency": {...} when ``concurrency`` is given,
    "context_caps": [{"max_model_len", "maximum_concurrency", "fits"}] for powers
    of two up to the model's maximum, "assumptions": [str]}``. Errors: 422
    problem+json naming the field (unknown model, a config without layer or head
    counts, PP larger than the layer count, no memory figures, no weight size).
    """
    config, path = _model(settings, query.model)
    eng = query.engine
    _check_config(config, eng)
    devices = eng.tensor_parallel_size * eng.pipeline_parallel_size
    assumptions: list[str] = []
    if config.get("sliding_window") and not config.get("use_mla"):
        assumptions.append(
            f"sliding_window {config['sliding_window']} ignored: every layer is counted as "
            "full attention, so the KV need is an upper bound"
        )
    mem = query.memory
    if mem.available_kv_cache_gib is not None and mem.device_memory_gib is not None:
        raise _problem(
            ["memory"],
            "give either available_kv_cache_gib (what vLLM printed) or the memory profile "
            "(device_memory_gib, weights_gib, ...), not both",
        )
    if mem.available_kv_cache_gib is not None:
        memory = {"available_kv_cache": mem.available_kv_cache_gib}
    else:
        if mem.device_memory_gib is None:
            raise _problem(
                ["memory"], "give device_memory_gib (per device) or available_kv_cache_gib"
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
                    f"{where}; give weights_gib "
                    "(per device, GiB: the 'Loading weights took … GiB' figure)",
                )
            assumptions.append(
                f"weights: the model's weight files over {devices} device(s) = {weights:.2f} GiB"
            )
        if mem.activation_gib == 0:
            assumptions.append(
                "peak activation memory 0 GiB: give activation_gib from a profiled start "
                "for a tighter figure"
            )
        memory = {
            "total_gpu_memory": mem.device_memory_gib,
            "weights_memory": weights,
            "peak_activation_memory": mem.activation_gib,
            "non_torch_memory": mem.non_torch_gib,
        }
    max_pos = config.get("max_position_embeddings")
    cap = eng.max_model_len or (int(max_pos) if isinstance(max_pos, int) else None)
    if cap is None:
        raise _problem(
            ["engine", "max_model_len"],
            "the model config has no max_position_embeddings; give max_model_len",
        )
    if isinstance(max_pos, int) and cap > max_pos:
        raise _problem(
            ["engine", "max_model_len"],
            f"{cap} is above the model's max_position_embeddings ({max_pos}); vLLM refuses "
            "it unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (and the model then degrades)",
        )
    engine = eng.model_dump()
    try:
        est = kvcache.estimate_kv_cache(config, engine, memory, cap)
    except KeyError as exc:
        raise _problem(["model", str(exc.args[0])], "the model config lacks it") from None
    except ValueError as exc:
        field = "kv_cache_dtype" if "KV cache dtype" in str(exc) else None
        raise _problem(["engine", field] if field else ["engine"], str(exc)) from None
    if est["gpu_blocks"] == 0 and "available_kv_cache" not in memory:
        assumptions.append(
            "no memory is left for the KV cache: weights + activation + non-torch memory "
            f"exceed device_memory_gib x gpu_memory_utilization "
            f"({mem.device_memory_gib} x {eng.gpu_memory_utilization}); use more devices "
            "(TP/PP split the weights) or a smaller model"
        )
    est["available_kv_gib"] = round(est["available_kv_gib"], 4)
    out: dict[str, Any] = {
        "estimate": est,
        "devices": devices,
        "memory_gib": {k: v for k, v in memory.items()},
        "assumptions": assumptions,
    }
    if query.concurrency:
        out["max_model_len_for_concurrency"] = kvcache.max_fitting_context(
            config, engine, memory, query.concurrency
        )
    caps = []
    top = int(max_pos) if isinstance(max_pos, int) else cap
    length = 2 ** max(9, int(math.log2(max(1, eng.block_size))))
    while length <= top:
        row = kvcache.estimate_kv_cache(config, engine, memory, length)
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
    (``messages``, optional ``tools``) or a completions body (``prompt``); other body
    fields are ignored. ``model``: as for the KV cache endpoint (its tokenizer and chat
    template render the prompts). ``block_size``: the engine's KV block size in tokens
    (vLLM's default 16 on GPUs; the CPU build uses 128).
    """

    model_config = ConfigDict(extra="forbid")

    model: ModelName
    requests: list[dict[str, Any]] = Field(min_length=1, max_length=5000)
    block_size: int = Field(16, ge=1, le=4096)
    add_generation_prompt: bool = True


@router.post("/prefix")
def analyze_prefix(query: PrefixQuery, settings: SettingsDep) -> dict[str, Any]:
    """Render every request with the model's tokenizer and chat template and compare
    TOKENS: the prefix all requests share (tokens and whole KV blocks), clusters, the
    first divergence (token position and source location: message, field, characters),
    its cause (timestamp, uuid, request id, random id, user name, JSON key order,
    whitespace, reordered messages or tools), the best hit rate vLLM's prefix cache can
    reach for this list, and the change that would raise it
    (:func:`orchestrator.analysis.prefix.analyze_prefix`; shape: ``PrefixAnalysis``).
    422 problem+json: unknown model, a malformed request (named by index), a chat
    template that fails on a request."""
    try:
        resolved = resolve_model(settings, query.model)
    except SpecInvalidError as exc:
        raise AnalyzeRequestInvalidError(exc.errors, detail=exc.errors[0]["msg"]) from None
    try:
        analysis = run_analysis(
            query.requests,
            resolved.path,
            block_size=query.block_size,
            add_generation_prompt=query.add_generation_prompt,
        )
    except ValueError as exc:
        raise _problem(["requests"], str(exc)) from None
    return analysis.model_dump(mode="json")
