"""Bodies of ``/api/v1/analyze/*`` (what-if diagnostics that need no GPU) and of the
advisor's findings (``/api/v1/runs/{id}/findings``, ``/api/v1/experiments/{id}/findings``).

The answers hold the analysis' own models where it has them (the prefix analyser's
:class:`~orchestrator.analysis.prefix.schemas.PrefixAnalysis`, the advisor's
:class:`~orchestrator.analysis.advisor.Advice`); the KV cache answer, a dict of
:func:`orchestrator.analysis.kvcache.what_fits`, is described here field by field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.analysis.advisor import Advice
from orchestrator.analysis.prefix.schemas import PrefixAnalysis as PrefixAnalysis  # the answer
from orchestrator.experiments.pathpolicy import MAX_MODEL_CHARS

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


# ------------------------------------------------------------------ answers


class IgnoredKey(BaseModel):
    """A config or engine key the estimator does not know: listed, never dropped silently."""

    key: str
    source: Literal["model", "engine"]
    value: Any = Field(description="the value given (long values shortened)")
    reason: str


class KVCacheGroup(BaseModel):
    """One group of KV cache layers sharing a block table (hybrid models have several)."""

    kind: str = Field(description="full or sliding (window) attention")
    sliding_window: int | None
    layers: int
    block_size: int


class KVCacheEstimate(BaseModel):
    """:func:`orchestrator.analysis.kvcache.estimate_kv_cache` per device: what vLLM will
    print for the KV cache and whether the cap fits (bytes, tokens). The model's shape
    (``kv_bytes_per_token_model`` ... ``speculative``) is there when the model config gave
    it, ``kv_bytes_per_token_modelled`` when ``kv_bytes_per_token`` was given with a model."""

    kv_bytes_per_token: int = Field(
        description="bytes one more token of context costs on the binding rank"
    )
    kv_bytes_per_token_source: Literal["model config", "given"]
    block_bytes: int = Field(description="the pool's bytes per block on the binding rank")
    kv_cache_groups: list[KVCacheGroup]
    layers_per_rank: int
    kv_bytes_per_token_model: int | None = Field(
        None, description="unsharded bytes per token: every KV layer, all KV heads, no window"
    )
    kv_bytes_per_token_modelled: int | None = Field(
        None, description="the model's figure beside a given kv_bytes_per_token (null: none)"
    )
    page_size_bytes: int | None = Field(None, description="one target layer's page")
    kv_heads_per_rank: int | None = None
    head_dim: int | None = None
    dtype_bytes: int | None = None
    kv_cache_dtype: str | None = None
    mla: bool | None = None
    drafter_layers_per_rank: int | None = None
    speculative: dict[str, Any] | None = Field(
        None, description="the drafter: method, drafter_kv_layers, source, ... (null: none)"
    )
    ignored_keys: list[IgnoredKey]
    notes: list[str]
    block_size: int = Field(description="tokens per KV block")
    available_kv_bytes: int
    available_kv_gib: float
    gpu_blocks: int = Field(description="KV blocks per device")
    blocks_per_request: int = Field(description="blocks one request of max_model_len takes")
    kv_cache_needed_bytes: int = Field(
        description="one max_model_len request (vLLM's 'X GiB KV cache is needed')"
    )
    kv_cache_tokens: int = Field(description="the KV cache size vLLM prints, in tokens")
    max_model_len: int
    maximum_concurrency: float = Field(description="unrounded, as vLLM computes it")
    fits: bool = Field(description="vLLM's start-up check (null block reserved)")
    max_fitting_model_len: int | None = Field(
        description="the largest max_model_len that fits (null: every layer slides)"
    )
    advice: str | None = Field(description="what to change when it does not fit")
    vllm_version_modelled: str


class FittingContext(BaseModel):
    """The largest context cap at which ``concurrency`` full-length requests fit."""

    kv_cache_tokens: int = Field(description="the printed KV cache size at that cap")
    concurrency: int
    max_model_len: int | None = Field(
        description="0 when not one token fits; null when every layer slides (no cap)"
    )


class ContextCap(BaseModel):
    max_model_len: int
    maximum_concurrency: float = Field(description="2 decimals")
    fits: bool


class KVCacheAnalysis(BaseModel):
    """``POST /api/v1/analyze/kv-cache``: :func:`orchestrator.analysis.kvcache.what_fits`.

    ``memory_gib``: the per-device figures used (``available_kv_cache``, or
    ``total_gpu_memory``, ``weights_memory``, ``peak_activation_memory``,
    ``non_torch_memory``). ``max_model_len_for_concurrency`` only when ``concurrency``
    was given. ``context_caps``: powers of two up to the model's maximum."""

    estimate: KVCacheEstimate
    devices: int = Field(description="TP x PP")
    memory_gib: dict[str, float]
    kv_bytes_per_token_source: Literal["model config", "given"]
    ignored_keys: list[IgnoredKey]
    assumptions: list[str]
    max_model_len_for_concurrency: FittingContext | None = None
    context_caps: list[ContextCap]


class RunFindings(BaseModel):
    """``GET /api/v1/runs/{id}/findings``: the advisor's findings, in rollback order."""

    run_id: str
    findings: list[Advice]


class ExperimentFindings(BaseModel):
    """``GET /api/v1/experiments/{id}/findings``: each run's findings and the
    comparison's, in rollback order."""

    experiment_id: str
    findings: list[Advice]
