"""From a model config and engine arguments to the KV cache layers vLLM 0.32.0 builds.

:func:`kv_layout` returns one :class:`~.shapes.Layer` per attention layer that holds a
KV cache: the target model's layers and the drafter's (MTP modules, an EAGLE head, a
draft model, :mod:`.drafter`), with heads per TP rank, head size, KV dtype, full or
sliding window (:mod:`.shapes`), and the PP rank it lives on (``get_pp_indices``,
``vllm/distributed/utils.py`` L153-L158; the drafter on the last rank).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from orchestrator.analysis.kvcache import keys
from orchestrator.analysis.kvcache.drafter import Target, drafter, speculative_config
from orchestrator.analysis.kvcache.shapes import (
    CONFIG_INTS,
    KVCacheUnknown,
    KVConfigError,
    KVLayout,
    Layer,
    LayerSpec,
    check_structure,
    engine_int,
    head_dim_of,
    int_field,
    is_mla,
    kv_cache_dtype_bytes,
    kv_heads,
    layer_kinds,
    layers_per_pp_rank,
    merge_config,
    positive_field,
    resolve_kv_dtype,
    text_config,
)

__all__ = ["kv_layout"]


def kv_layout(
    model: Mapping[str, Any],
    engine: Mapping[str, Any] | None = None,
    *,
    draft_config: Mapping[str, Any] | None = None,
) -> KVLayout:
    """The KV cache layers vLLM 0.32.0 builds for ``model`` under ``engine``.

    Args:
        model: the model's ``config.json`` (HF names; a multimodal config's
            ``text_config`` is the text model's). This product's own keys:
            ``kv_cache_dtype`` (overridden by the engine's), ``use_mla`` (for configs
            without ``model_type``), ``extra_kv_layers`` (aliases ``num_draft_layers``,
            ``num_mtp_layers``: full-attention layers of the target's shape on the last
            PP rank; prefer ``speculative_config``).
        engine: vLLM engine arguments (``tensor_parallel_size``,
            ``pipeline_parallel_size``, ``block_size`` (default 16), ``kv_cache_dtype``,
            ``dtype``, ``speculative_config``, ``disable_sliding_window``,
            ``hf_overrides`` (a dict, merged into the config), ...).
        draft_config: the drafter's ``config.json`` for EAGLE and draft-model methods.

    Raises:
        KVConfigError: a configuration vLLM refuses, or a field that is no sane number.
        KVCacheUnknown: a layout the estimator does not model.
    """
    engine = {str(k).replace("-", "_"): v for k, v in (engine or {}).items()}
    notes: list[str] = []
    ignored: list[dict[str, Any]] = []
    cfg = _text_config(model, engine, ignored)
    loc = ("model",)
    layers, tp, pp, block_size = _stack(cfg, engine, loc)
    mla = is_mla(cfg, loc, notes)
    heads = _attention_heads(cfg, loc, tp, mla)
    requested = engine.get("kv_cache_dtype")
    if requested in (None, "auto"):  # the config's own kv_cache_dtype (this product's key)
        requested = cfg.get("kv_cache_dtype") or requested
    kv_dtype, model_bytes = resolve_kv_dtype(requested, cfg, engine, notes)
    head_dim, head_v, total_kv, kv_rank = _head_shape(cfg, loc, heads, tp, mla, notes)
    if kv_dtype == "auto":
        dtype_bytes, packed = model_bytes, None
    else:
        dtype_bytes, packed = kv_cache_dtype_bytes(kv_dtype, mla=mla)
    window = _window(cfg, engine, loc, notes)
    kinds = layer_kinds(cfg, layers, window, loc, notes)
    target = LayerSpec("full", kv_rank, head_dim, head_v, dtype_bytes, packed)
    specs = [
        target
        if kind == "full"
        else LayerSpec("sliding", kv_rank, head_dim, head_v, dtype_bytes, packed, window)
        for kind in kinds
    ]
    parts = layers_per_pp_rank(layers, pp)
    ranks = [r for r, count in enumerate(parts) for _ in range(count)]
    per_head = packed if packed is not None else (head_dim + head_v) * dtype_bytes
    whole = total_kv * per_head
    out = [Layer(s, r, "target", whole) for s, r in zip(specs, ranks, strict=True)]
    out.extend(_extra_layers(cfg, loc, target, pp, whole, notes))
    tgt = Target(cfg, target, kinds, total_kv, mla, kv_dtype, model_bytes)
    draft_layers, summary, retained = _draft_layers(
        engine, tgt, draft_config, tp, pp, notes, ignored
    )
    out.extend(draft_layers)
    return KVLayout(
        layers=out,
        block_size=block_size,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        num_hidden_layers=layers,
        total_kv_heads=total_kv,
        kv_heads_per_rank=kv_rank,
        head_dim=head_dim,
        dtype_bytes=dtype_bytes,
        kv_cache_dtype=kv_dtype,
        mla=mla,
        target_spec=target,
        speculative=summary,
        extra_retained_tokens=retained,
        ignored_keys=ignored,
        notes=notes,
    )


def _text_config(
    model: Mapping[str, Any], engine: Mapping[str, Any], ignored: list[dict[str, Any]]
) -> dict[str, Any]:
    """The text model's config with ``hf_overrides`` merged, its integers checked; the keys
    the estimate ignores appended to ``ignored``."""
    overrides = engine.get("hf_overrides")
    if overrides and not isinstance(overrides, Mapping):
        raise KVCacheUnknown(
            ("engine", "hf_overrides"), "only a JSON object of overrides is modelled"
        )
    raw = merge_config(model, overrides) if overrides else dict(model)
    ignored.extend(keys.ignored_model_keys(raw))
    ignored.extend(keys.ignored_engine_keys(engine))
    for key, why in keys.unmodelled_engine_keys(engine):
        raise KVCacheUnknown(("engine", key), f"{why}; not modelled (value {engine[key]!r})")
    cfg = text_config(raw)
    loc = ("model",)
    check_structure(cfg, loc)
    for key in CONFIG_INTS:
        int_field(cfg, key, loc)
    return cfg


def _attention_heads(
    cfg: Mapping[str, Any], loc: tuple[str, ...], tp: int, mla: bool
) -> int | None:
    """``num_attention_heads``, checked against tensor parallelism (None for MLA without it)."""
    heads = cfg.get("num_attention_heads")
    if heads is not None and (isinstance(heads, bool) or not isinstance(heads, int) or heads < 1):
        raise KVConfigError(
            (*loc, "num_attention_heads"), f"must be a whole number >= 1, got {heads!r}"
        )
    if not mla and heads is None:
        raise KVConfigError((*loc, "num_attention_heads"), "the model config lacks it")
    if heads is not None and heads % tp:
        raise KVConfigError(
            ("engine", "tensor_parallel_size"),
            f"{tp} does not divide num_attention_heads ({heads}); vLLM refuses this layout",
        )
    return heads


def _head_shape(
    cfg: Mapping[str, Any],
    loc: tuple[str, ...],
    heads: int | None,
    tp: int,
    mla: bool,
    notes: list[str],
) -> tuple[int, int, int, int]:
    """``(head_dim, value head_dim, total KV heads, KV heads per TP rank)``; MLA keeps one
    latent head of ``kv_lora_rank + qk_rope_head_dim`` and no value head."""
    if mla:
        rank = positive_field(cfg, "kv_lora_rank", loc) or 0
        rope = int_field(cfg, "qk_rope_head_dim", loc) or 0
        return rank + rope, 0, 1, 1
    total_kv = kv_heads(cfg, loc)
    if heads is not None and (total_kv > heads or heads % total_kv):
        raise KVConfigError(
            (*loc, "num_key_value_heads"),
            f"{total_kv} KV heads must divide the {heads} attention heads "
            "(grouped-query attention)",
        )
    if total_kv % tp and tp % total_kv:
        raise KVConfigError(
            ("engine", "tensor_parallel_size"),
            f"{tp} neither divides num_key_value_heads ({total_kv}) nor is a multiple of it",
        )
    head_dim = head_dim_of(cfg, loc)
    if cfg.get("head_dim") == 0:
        # model_arch_config_convertor.py L102-L107: a head_dim of 0 counts as missing
        notes.append(
            f"head_dim 0: vLLM reads it as missing and uses hidden_size // "
            f"num_attention_heads = {head_dim}"
        )
    v_head = cfg.get("v_head_dim")
    if v_head is not None and v_head != head_dim:
        # e.g. mimo_v2.py L251-L313: head_size_v = v_head_dim, set by model code
        raise KVCacheUnknown(
            (*loc, "v_head_dim"),
            f"v_head_dim {v_head!r} differs from head_dim {head_dim} outside MLA: the value "
            "head size is model code (vLLM Attention head_size_v); not modelled",
        )
    return head_dim, head_dim, total_kv, max(1, total_kv // tp)


def _window(
    cfg: Mapping[str, Any], engine: Mapping[str, Any], loc: tuple[str, ...], notes: list[str]
) -> int | None:
    """The sliding window in tokens, None when every layer is full attention."""
    use_sw = cfg.get("use_sliding_window", True) is not False
    window = int_field(cfg, "sliding_window", loc) if use_sw else None
    if engine.get("disable_sliding_window") and window:
        notes.append(
            f"disable_sliding_window: the {window}-token window is off; every layer is full"
        )
        max_len = engine.get("max_model_len")
        if isinstance(max_len, int) and max_len > window:
            raise KVConfigError(
                ("engine", "max_model_len"),
                f"{max_len} is above sliding_window ({window}), the cap vLLM sets with "
                "disable_sliding_window",
            )
        window = None
    if cfg.get("attention_chunk_size"):
        notes.append(
            "attention_chunk_size: vLLM turns the hybrid KV cache manager off for chunked local "
            "attention (config/vllm.py L2149-L2168) and sizes every layer as full attention"
        )
    return window


def _stack(
    cfg: Mapping[str, Any], engine: Mapping[str, Any], loc: tuple[str, ...]
) -> tuple[int, int, int, int]:
    """``(num_hidden_layers, tensor_parallel_size, pipeline_parallel_size, block_size)``,
    checked."""
    layers = positive_field(cfg, "num_hidden_layers", loc)
    if layers is None:
        raise KVConfigError((*loc, "num_hidden_layers"), "the model config lacks it")
    tp = engine_int(engine, "tensor_parallel_size", 1)
    pp = engine_int(engine, "pipeline_parallel_size", 1)
    block_size = engine_int(engine, "block_size", 16)
    if block_size > 4096:
        raise KVConfigError(("engine", "block_size"), "must be at most 4096 tokens")
    if pp > layers:
        raise KVConfigError(
            ("engine", "pipeline_parallel_size"), f"{pp} stages for {layers} layers"
        )
    return layers, tp, pp, block_size


def _extra_layers(
    cfg: Mapping[str, Any],
    loc: tuple[str, ...],
    target: LayerSpec,
    pp: int,
    whole: int,
    notes: list[str],
) -> list[Layer]:
    """The product key's extra full-attention layers of the target's shape, last PP rank."""
    extra = 0
    for key in ("extra_kv_layers", "num_draft_layers", "num_mtp_layers"):
        extra = extra or (int_field(cfg, key, loc) or 0)
    if extra:
        notes.append(
            f"{extra} extra KV layers of the target's shape (product key) on the last PP rank"
        )
    return [Layer(target, pp - 1, "extra", whole) for _ in range(extra)]


def _draft_layers(
    engine: Mapping[str, Any],
    tgt: Target,
    draft_config: Mapping[str, Any] | None,
    tp: int,
    pp: int,
    notes: list[str],
    ignored: list[dict[str, Any]],
) -> tuple[list[Layer], dict[str, Any] | None, int]:
    """The drafter's layers on the last PP rank, its summary and the tokens it retains
    beyond the target's (``([], None, 0)`` without ``speculative_config``)."""
    spec = speculative_config(engine)
    if spec is None:
        if draft_config is not None:
            notes.append("draft_model given without speculative_config: not used")
        return [], None, 0
    draft_layers, summary, retained = drafter(spec, tgt, draft_config, tp, notes, ignored)
    origin = {"mtp": "mtp", "eagle": "eagle", "eagle3": "eagle"}.get(summary["method"], "draft")
    return [Layer(s, pp - 1, origin, b) for s, b in draft_layers], summary, retained
