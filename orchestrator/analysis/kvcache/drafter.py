"""Speculative decoding: the drafter layers that share vLLM's KV cache pool.

vLLM 0.32.0 registers a drafter's attention layers in the same static forward context
as the target's, so ``get_kv_cache_spec`` (``v1/worker/gpu_model_runner.py`` L7146)
lists them and one block pool serves both (``v1/core/kv_cache_utils.py``
``get_kv_cache_configs``). Sources (``vllm/config/speculative.py`` unless named):
``method`` inference (L1130-L1171, L1302-L1340), the MTP module count
``num_nextn_predict_layers`` / ``mtp_num_hidden_layers`` (``hf_config_override``
L661-L1074; ``model_executor/models/deepseek_mtp.py`` L152; ``model_arch_config_convertor.py``
L704-L733), EAGLE heads' ``num_hidden_layers`` (``model_executor/models/llama_eagle3.py``
L206, ``llama_eagle.py`` L107), draft TP 1 or the target's (L1712-L1743), the draft KV
dtype override (L382), methods without a KV cache (``uses_draft_kv_cache`` L1966), the
``--spec-*`` shorthands (``engine/arg_utils.py`` L2069-L2087); the drafter lives on the
last PP rank (``v1/worker/gpu_model_runner.py`` L590).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from orchestrator.analysis.kvcache import keys
from orchestrator.analysis.kvcache.shapes import (
    KVCacheUnknown,
    KVConfigError,
    LayerSpec,
    check_structure,
    head_dim_of,
    int_field,
    is_mla,
    kv_cache_dtype_bytes,
    kv_heads,
    layer_kinds,
    positive_field,
    text_config,
)

__all__ = ["Target", "drafter", "speculative_config"]

#: vLLM's deprecated MTP method names, all mapped to ``mtp`` (speculative.py L1141).
_MTP_METHODS = frozenset(
    {
        "mtp",
        "deepseek_mtp",
        "mimo_mtp",
        "glm4_moe_mtp",
        "ernie_mtp",
        "qwen3_next_mtp",
        "qwen3_5_mtp",
        "longcat_flash_mtp",
        "pangu_ultra_moe_mtp",
        "step3p5_mtp",
        "exaone_moe_mtp",
        "nemotron_h_mtp",
    }
)
_NO_KV_METHODS = frozenset(
    {"ngram", "[ngram]", "ngram_gpu", "suffix", "medusa", "mlp_speculator", "custom_class"}
)
_UNMODELLED_METHODS = frozenset({"dflash", "dspark", "extract_hidden_states"})
#: Target model types whose MTP module count vLLM fixes in code (mimo_v2_mtp.py).
_MTP_FIXED = frozenset({"mimo_v2", "mimo_v2_flash", "mimo_v2_omni", "minimax_m3_vl"})


def speculative_config(engine: Mapping[str, Any]) -> dict[str, Any] | None:
    """The engine's ``speculative_config`` with ``--spec-method/--spec-model/--spec-tokens``
    merged in (``engine/arg_utils.py`` L2069-L2087); None without speculative decoding."""
    raw = engine.get("speculative_config")
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else None
        except ValueError:
            raise KVConfigError(("engine", "speculative_config"), "is not JSON") from None
    if raw is not None and not isinstance(raw, Mapping):
        raise KVConfigError(("engine", "speculative_config"), "must be a JSON object")
    spec = {str(k).replace("-", "_"): v for k, v in (raw or {}).items()}
    for flag, key in (
        ("spec_method", "method"),
        ("spec_model", "model"),
        ("spec_tokens", "num_speculative_tokens"),
    ):
        value = engine.get(flag)
        if value is None:
            continue
        if key in spec:
            raise KVConfigError(
                ("engine", flag), f"and speculative_config['{key}'] are mutually exclusive"
            )
        spec[key] = value
    return spec or None


def _draft_text(draft: Mapping[str, Any]) -> dict[str, Any]:
    """The attention config of a drafter checkpoint: speculators' ``transformer_layer_config``,
    an EAGLE config's wrapped ``model``, or the config itself."""
    if isinstance(draft.get("transformer_layer_config"), Mapping):
        return dict(draft["transformer_layer_config"])
    if draft.get("num_hidden_layers") is None and isinstance(draft.get("model"), Mapping):
        return dict(draft["model"])
    return text_config(draft)


def _resolve_method(spec: Mapping[str, Any], draft: Mapping[str, Any] | None) -> str:
    """vLLM's method inference (speculative.py L1130-L1171, L1302-L1340)."""
    method = spec.get("method")
    model = spec.get("model")
    if method is None:
        if model in ("ngram", "[ngram]"):
            return "ngram"
        if model is None:
            raise KVConfigError(("engine", "speculative_config"), "needs a method or a model")
        name = str(model).lower()
        dtype = str((draft or {}).get("model_type") or "")
        spec_type = str((draft or {}).get("speculators_model_type") or "")
        if "eagle-" in name or spec_type == "eagle":
            return "eagle"
        if "eagle3" in name or spec_type == "eagle3":
            return "eagle3"
        if "dflash" in name or spec_type == "dflash":
            return "dflash"
        if "dspark" in name:
            return "dspark"
        if dtype in ("medusa", "mlp_speculator"):
            return dtype
        if dtype.endswith("_mtp"):
            return "mtp"
        return "draft_model"
    method = str(method)
    if method in _MTP_METHODS:
        return "mtp"
    if method == "[ngram]":
        return "ngram"
    return method


def _mtp_layers(target: Mapping[str, Any], draft: Mapping[str, Any] | None) -> tuple[int, str]:
    source = draft if draft is not None else target
    model_type = str(source.get("model_type") or "")
    if model_type in _MTP_FIXED:
        raise KVCacheUnknown(
            ("model", "model_type"), f"vLLM fixes {model_type}'s MTP module count in model code"
        )
    order = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
    if model_type.startswith(("qwen3_5", "qwen4_exp")):
        order = ("mtp_num_hidden_layers", "num_nextn_predict_layers")
    for key in order:
        value = int_field(source, key, ("draft_model",) if draft is not None else ("model",))
        if value:
            return value, key
    raise KVCacheUnknown(
        ("model", "num_nextn_predict_layers"),
        "speculative method mtp, but the model config names no MTP modules "
        "(num_nextn_predict_layers / mtp_num_hidden_layers)",
    )


def _dtype_of(name: str, model_bytes: int, *, mla: bool) -> tuple[int, int | None]:
    """``(dtype_bytes, packed bytes)`` of a resolved KV dtype name (``auto``: the model's)."""
    if name == "auto":
        return model_bytes, None
    return kv_cache_dtype_bytes(name, mla=mla)


def _per_head(spec: LayerSpec) -> int:
    if spec.state_bytes is not None:
        return spec.state_bytes
    return (spec.head_size + spec.head_size_v) * spec.dtype_bytes


@dataclass
class Target:
    """The target model as the drafter needs it."""

    cfg: Mapping[str, Any]
    spec: LayerSpec
    kinds: list[str]
    total_kv: int
    mla: bool
    kv_dtype: str
    model_bytes: int


def drafter(
    spec: Mapping[str, Any],
    target: Target,
    draft_config: Mapping[str, Any] | None,
    tp: int,
    notes: list[str],
    ignored: list[dict[str, Any]],
) -> tuple[list[tuple[LayerSpec, int]], dict[str, Any], int]:
    """``([(layer spec on one rank, unsharded bytes per token)], summary,
    extra_retained_tokens)`` for ``speculative_config``."""
    sloc = ("engine", "speculative_config")
    for key, why in keys.unmodelled_spec_keys(spec):
        raise KVCacheUnknown(("engine", key), f"{why}; not modelled")
    ignored.extend(keys.ignored_spec_keys(spec))
    if spec.get("tensor_parallel_size") is not None:
        raise KVConfigError(
            (*sloc, "tensor_parallel_size"),
            "is not a valid argument; vLLM wants draft_tensor_parallel_size",
        )
    method = _resolve_method(spec, draft_config)
    summary: dict[str, Any] = {"method": method, "model": spec.get("model")}
    k = spec.get("num_speculative_tokens")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise KVConfigError((*sloc, "num_speculative_tokens"), "must be a whole number >= 1")
    summary["num_speculative_tokens"] = k
    if method in _NO_KV_METHODS:
        summary.update(drafter_kv_layers=0, source=f"method {method} keeps no KV cache")
        return [], summary, 0
    if method in _UNMODELLED_METHODS:
        raise KVCacheUnknown((*sloc, "method"), f"{method} drafters are not modelled")
    if method not in ("mtp", "eagle", "eagle3", "draft_model"):
        raise KVConfigError((*sloc, "method"), f"unknown speculative method {method!r}")
    draft_tp = _draft_tp(spec, tp, sloc)
    own_dtype = spec.get("kv_cache_dtype")
    draft_dtype = str(own_dtype).lower() if own_dtype else target.kv_dtype
    summary.update(draft_tensor_parallel_size=draft_tp, kv_cache_dtype=draft_dtype)
    if method == "mtp":
        return _mtp(target, draft_config, k, own_dtype, draft_dtype, draft_tp, summary)
    return _model_drafter(
        method, target, draft_config, k, draft_dtype, draft_tp, summary, notes, ignored
    )


def _draft_tp(spec: Mapping[str, Any], tp: int, sloc: tuple[str, ...]) -> int:
    """The drafter's tensor parallelism: 1 or the target's (the default)."""
    draft_tp = spec.get("draft_tensor_parallel_size")
    if draft_tp is None:
        return tp
    if isinstance(draft_tp, bool) or not isinstance(draft_tp, int) or draft_tp not in (1, tp):
        raise KVConfigError(
            (*sloc, "draft_tensor_parallel_size"),
            f"{draft_tp} can only be 1 or the target's tensor_parallel_size ({tp})",
        )
    return draft_tp


def _mtp(
    target: Target,
    draft_config: Mapping[str, Any] | None,
    k: int | None,
    own_dtype: Any,
    draft_dtype: str,
    draft_tp: int,
    summary: dict[str, Any],
) -> tuple[list[tuple[LayerSpec, int]], dict[str, Any], int]:
    """MTP modules: full-attention layers of the target's shape, one per module."""
    sloc = ("engine", "speculative_config")
    n, key = _mtp_layers(target.cfg, draft_config)
    if k is None:
        k = n
    elif k > n and k % n:
        raise KVConfigError(
            (*sloc, "num_speculative_tokens"),
            f"{k} must be divisible by the {n} MTP modules ({key})",
        )
    if "sliding" in target.kinds:
        raise KVCacheUnknown(
            (*sloc, "method"),
            "MTP on a sliding-window model: the MTP layers' attention type is model code",
        )
    nbytes, packed = (
        (target.spec.dtype_bytes, target.spec.state_bytes)
        if not own_dtype
        else _dtype_of(draft_dtype, target.model_bytes, mla=target.mla)
    )
    heads = 1 if target.mla else max(1, target.total_kv // draft_tp)
    layer = LayerSpec("full", heads, target.spec.head_size, target.spec.head_size_v, nbytes, packed)
    # multi-module MTP keeps num_speculative_tokens - 1 more tokens in sliding
    # windows (config/vllm.py L644-L662; kv_cache_utils.py get_kv_cache_configs)
    retained = k - 1 if min(n, k) > 1 else 0
    summary.update(
        num_speculative_tokens=k, drafter_kv_layers=n, source=f"model config {key} = {n}"
    )
    whole = (1 if target.mla else target.total_kv) * _per_head(layer)
    return [(layer, whole)] * n, summary, retained


def _model_drafter(
    method: str,
    target: Target,
    draft_config: Mapping[str, Any] | None,
    k: int | None,
    draft_dtype: str,
    draft_tp: int,
    summary: dict[str, Any],
    notes: list[str],
    ignored: list[dict[str, Any]],
) -> tuple[list[tuple[LayerSpec, int]], dict[str, Any], int]:
    """An EAGLE head or a draft model: the layers its own ``config.json`` describes."""
    sloc = ("engine", "speculative_config")
    if draft_config is None:
        raise KVCacheUnknown(
            ("draft_model",),
            f"speculative method {method}: the drafter's config.json is needed (draft_model) "
            "to size its KV cache",
        )
    if k is None:
        raise KVConfigError(
            (*sloc, "num_speculative_tokens"),
            "a speculative model was given without num_speculative_tokens",
        )
    dcfg = _draft_text(draft_config)
    dloc = ("draft_model",)
    check_structure(dcfg, dloc)
    dn = positive_field(dcfg, "num_hidden_layers", dloc)
    if dn is None:
        raise KVConfigError((*dloc, "num_hidden_layers"), "the draft config lacks it")
    dmla = is_mla(dcfg, dloc, notes)
    nbytes, packed = _dtype_of(draft_dtype, target.model_bytes, mla=dmla)
    if dmla:
        rank = int_field(dcfg, "kv_lora_rank", dloc) or 0
        rope = int_field(dcfg, "qk_rope_head_dim", dloc) or 0
        heads, head, head_v = 1, rank + rope, 0
        total = 1
    else:
        total = kv_heads(dcfg, dloc)
        heads = max(1, total // draft_tp)
        head = head_v = head_dim_of(dcfg, dloc)
    use_sw = dcfg.get("use_sliding_window", True) is not False
    window = int_field(dcfg, "sliding_window", dloc) if use_sw else None
    kinds = layer_kinds(dcfg, dn, window, dloc, notes)
    layers = []
    for kind in kinds:
        one = LayerSpec(
            kind, heads, head, head_v, nbytes, packed, window if kind == "sliding" else None
        )
        layers.append((one, total * _per_head(one)))
    # eagle-family drafters read one token ahead: no extra retained tokens
    # (config/vllm.py L663-L664: num_prefill_lookahead_tokens = 1)
    summary.update(drafter_kv_layers=dn, source=f"draft config num_hidden_layers = {dn}")
    ignored.extend(
        {**e, "key": f"draft_model.{e['key']}"} for e in keys.ignored_model_keys(draft_config)
    )
    return layers, summary, 0
