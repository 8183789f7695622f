"""Reading a model config the way vLLM 0.32.0 does: KV heads, head size, MLA, KV dtype,
sliding-window layers; the errors the estimator raises; the per-layer KV cache spec.

Sources (vLLM 0.32.0, ``vllm/``):

- heads per rank ``max(1, total_num_kv_heads // tensor_parallel_size)``
  (``config/model.py`` L1670); MLA layers store one latent per token on every rank
  (``model_executor/layers/attention/mla_attention.py`` L1356 ``num_kv_heads=1``), of
  ``kv_lora_rank + qk_rope_head_dim`` elements
  (``transformers_utils/model_arch_config_convertor.py`` L96), or the packed 656 / 352
  bytes of ``fp8_ds_mla`` / ``nvfp4_ds_mla`` (``mla_attention.py`` L1365); the KV head
  aliases and ``head_dim`` fallbacks of ``get_total_num_kv_heads`` (L150) and
  ``get_head_size`` (L89-L116); the model types sized as MLA (``is_deepseek_mla`` L314);
- KV dtype ``auto``: the model dtype, a float32 config downcast to 16 bits
  (``config/model.py`` L2423); a modelopt checkpoint's ``kv_cache_quant_algo`` FP8 means
  ``fp8_e4m3`` (``utils/torch_utils.py`` L69, L525); a compressed-tensors
  ``kv_cache_scheme`` means ``fp8`` (``model_executor/layers/attention/attention.py``
  L287-L291);
- sliding window layers: ``layer_types`` (``model_executor/models/llama.py`` L186-L204);
  without ``layer_types`` the model-level window applies to every layer
  (``engine/arg_utils.py`` L2250-L2254, ``attention.py`` L271); transformers 5.19 derives
  ``layer_types`` for some model types, reproduced in :data:`_DERIVED_LAYER_TYPES`.

What cannot be modelled raises :class:`KVCacheUnknown` naming the field; a config vLLM
refuses raises :class:`KVConfigError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CONFIG_INTS",
    "KV_CACHE_DTYPE_BYTES",
    "KVCacheUnknown",
    "KVConfigError",
    "KVLayout",
    "Layer",
    "LayerSpec",
    "check_structure",
    "dtype_bytes",
    "engine_int",
    "head_dim_of",
    "int_field",
    "is_mla",
    "kv_cache_dtype_bytes",
    "kv_heads",
    "layer_kinds",
    "layers_per_pp_rank",
    "merge_config",
    "model_type_of",
    "positive_field",
    "resolve_kv_dtype",
    "text_config",
]


class KVConfigError(ValueError):
    """A configuration vLLM refuses, or a field that is not a sane number.

    ``loc`` is the path of the field (``("model", "num_key_value_heads")``,
    ``("engine", "tensor_parallel_size")``)."""

    def __init__(self, loc: tuple[str, ...], msg: str) -> None:
        super().__init__(f"{'.'.join(loc)}: {msg}")
        self.loc = loc
        self.msg = msg


class KVCacheUnknown(ValueError):
    """The KV cache of this configuration cannot be modelled (``loc``: what, ``msg``: why).

    An estimate would be a guess; give ``kv_bytes_per_token`` instead."""

    def __init__(self, loc: tuple[str, ...], msg: str) -> None:
        super().__init__(f"{'.'.join(loc)}: {msg}")
        self.loc = loc
        self.msg = msg


#: Bytes per element of vLLM's ``--kv-cache-dtype`` choices (``config/cache.py``
#: ``CacheDType``) whose page is plain K and V (``utils/torch_utils.py``
#: ``STR_DTYPE_TO_TORCH_DTYPE``). ``auto`` is resolved first.
KV_CACHE_DTYPE_BYTES: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
}
#: MLA-only packed layouts: bytes per token per layer (``mla_attention.py`` L1365).
_MLA_PACKED = {"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}
#: Valid vLLM 0.32.0 cache dtypes whose page carries scales or packed values laid out by
#: the attention backend: not modelled.
_PACKED_KV_DTYPES = frozenset(
    {
        "turboquant_k8v4",
        "turboquant_4bit_nc",
        "turboquant_k3v4_nc",
        "turboquant_3bit_nc",
        "ultraquant_4bit",
        "int4_per_token_head",
        "int8_per_token_head",
        "fp8_per_token_head",
        "nvfp4",
        "nvfp4_4over6",
    }
)
#: Model dtype names (``--dtype`` and config ``torch_dtype``) and their bytes.
_MODEL_DTYPE_BYTES = {
    "half": 2,
    "float16": 2,
    "bfloat16": 2,
    "float": 4,
    "float32": 4,
}

#: Model types vLLM sizes as MLA when ``kv_lora_rank`` is set
#: (``model_arch_config_convertor.py`` ``is_deepseek_mla``), and that have no second
#: cache (indexer, compressor, linear attention) the estimator would miss.
_MLA_TYPES = frozenset(
    {"deepseek_v2", "deepseek_v3", "deepseek_mtp", "kimi_k2", "pangu_ultra_moe", "glm4_moe_lite"}
)
#: MLA model types with caches beside the latent (DeepSeek-V3.2 / GLM-5 indexer,
#: DeepSeek-V4 compressor, linear attention, two attentions per layer): not modelled.
_MLA_UNMODELLED = frozenset(
    {
        "axk1",
        "bailing_hybrid",
        "bailing_hybrid_mtp",
        "bailing_hybrid_v3_mtp",
        "deepseek_v32",
        "deepseek_v4",
        "deepseek_v41",
        "dots3_note",
        "glm5_next",
        "glm5_next_text",
        "glm_moe_dsa",
        "glm4_moe_lite_mtp",
        "hy_v4",
        "hy_v4_mtp",
        "k3_dspark",
        "kimi_linear",
        "longcat_flash",
        "pangu_ultra_moe_mtp",
    }
)
#: Model types whose KV heads vLLM reads through a model-specific convertor.
_HEADS_UNMODELLED = frozenset({"falcon", "dbrx", "nemotron-nas", "deci", "cohere_asr"})

#: Structural keys of models whose KV cache is not plain attention layers: a present,
#: non-neutral value makes the estimate unknown.
_STRUCTURE_UNMODELLED: dict[str, str] = {
    "layers_block_type": "Mamba/SSM layers keep a state, not a KV cache (hybrid model)",
    "attn_type_list": "linear-attention layers keep a state (MiniMax hybrid)",
    "hybrid_override_pattern": "Mamba layers keep a state (Nemotron-H hybrid)",
    "block_configs": "per-layer attention shapes and no-op layers (Nemotron-NAS)",
    "linear_attn_config": "linear-attention layers keep a state",
    "full_attention_interval": "linear-attention layers keep a state (Qwen3-Next hybrid)",
    "cross_attention_layers": "cross-attention layers hold encoder KV (Mllama)",
    "index_topk": "the sparse-attention indexer keeps its own K cache (DeepSeek-V3.2)",
    "index_head_dim": "the sparse-attention indexer keeps its own K cache",
    "compress_ratios": "compressed KV layers (DeepSeek-V4)",
    "ssm_cfg": "Mamba layers keep a state",
    "mamba_d_state": "Mamba layers keep a state",
    "state_size": "SSM layers keep a state",
    "global_attn_every_n_layers": "interleaved local attention: which layers slide is model code",
    "interleaved_sliding_window": "interleaved sliding windows: which layers slide is model code",
}

#: ``layer_types`` that transformers 5.19 derives when ``config.json`` has none and a
#: sliding window is set (``models/<type>/configuration_<type>.py``): model type ->
#: function (layer index, config) -> is sliding.
_DERIVED_LAYER_TYPES = {
    # gemma2 L96, gpt_oss L84: every other layer, starting with a sliding one
    "gemma2": lambda i, c: bool((i + 1) % 2),
    "gpt_oss": lambda i, c: bool((i + 1) % 2),
    # gemma3 L112 (sliding_window_pattern, default 6), cohere2 L99 (default 4)
    "gemma3": lambda i, c: bool((i + 1) % _pattern(c, "sliding_window_pattern", 6)),
    "gemma3_text": lambda i, c: bool((i + 1) % _pattern(c, "sliding_window_pattern", 6)),
    "cohere2": lambda i, c: bool((i + 1) % _pattern(c, "sliding_window_pattern", 4)),
    # qwen2 L89, qwen3 L92: layers from max_window_layers on
    "qwen2": lambda i, c: i >= _pattern(c, "max_window_layers", 28),
    "qwen3": lambda i, c: i >= _pattern(c, "max_window_layers", 28),
    # ministral L93: all layers
    "ministral": lambda i, c: True,
}


def _pattern(cfg: Mapping[str, Any], key: str, default: int) -> int:
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 20:
        raise KVConfigError(("model", key), f"must be a whole number >= 1, got {value!r}")
    return value


#: Model types that build every layer with vLLM's model-level window when the config
#: has ``sliding_window`` and no ``layer_types`` (no derivation in transformers; vLLM's
#: ``Attention`` falls back to ``cache_config.sliding_window``, ``attention.py`` L271).
_ALL_LAYERS_SLIDE = frozenset({"mistral", "mixtral", "llama", "phi3", "starcoder2"})
_ATTENTION_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}

#: Config integers the estimate reads, with their largest sane value.
CONFIG_INTS = {
    "num_hidden_layers": 10_000,
    "num_attention_heads": 100_000,
    "num_key_value_heads": 100_000,
    "head_dim": 65_536,
    "hidden_size": 10_000_000,
    "kv_lora_rank": 65_536,
    "qk_rope_head_dim": 65_536,
    "max_position_embeddings": 1 << 40,
    "sliding_window": 1 << 40,
    "num_nextn_predict_layers": 1_000,
    "mtp_num_hidden_layers": 1_000,
    "hidden_size_per_head": 65_536,
    "extra_kv_layers": 10_000,
    "num_draft_layers": 10_000,
    "num_mtp_layers": 10_000,
}
_KV_HEAD_KEYS = ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num",
                 "num_attention_groups")  # fmt: skip


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer's KV cache on one rank (vLLM ``AttentionSpec``).

    ``bytes_per_token`` = ``num_kv_heads * (head_size + head_size_v) * dtype_bytes``, or
    ``num_kv_heads * state_bytes`` for packed layouts; ``page_size(block_size)`` =
    ``block_size * bytes_per_token`` (``kv_cache_interface.py`` L545-L553)."""

    kind: str  # "full" | "sliding"
    num_kv_heads: int
    head_size: int
    head_size_v: int
    dtype_bytes: int
    state_bytes: int | None = None
    sliding_window: int | None = None

    @property
    def bytes_per_token(self) -> int:
        if self.state_bytes is not None:
            return self.num_kv_heads * self.state_bytes
        return self.num_kv_heads * (self.head_size + self.head_size_v) * self.dtype_bytes

    def page_size(self, block_size: int) -> int:
        return block_size * self.bytes_per_token


@dataclass(frozen=True)
class Layer:
    """A KV layer of the engine: its spec on one rank, its PP rank, where it comes from
    (``target``, ``extra``, ``mtp``, ``eagle``, ``draft``) and its unsharded bytes per
    token (all KV heads)."""

    spec: LayerSpec
    pp_rank: int
    origin: str
    unsharded_bytes_per_token: int


@dataclass
class KVLayout:
    """What :func:`kv_layout` found: the layers, and how it read the configs."""

    layers: list[Layer]
    block_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    num_hidden_layers: int
    total_kv_heads: int
    kv_heads_per_rank: int
    head_dim: int
    dtype_bytes: int
    kv_cache_dtype: str
    mla: bool
    target_spec: LayerSpec
    speculative: dict[str, Any] | None = None
    extra_retained_tokens: int = 0
    ignored_keys: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def layers_per_pp_rank(num_layers: int, pp: int) -> list[int]:
    """Layers on each PP rank, as vLLM's ``get_pp_indices`` splits them.

    ``L // PP`` each; the ``L % PP`` leftover layers go one each to the ranks just
    before the last (``partitions[-i] += 1`` for ``i in 2..remaining+1``,
    ``vllm/distributed/utils.py`` L153-L158; ``VLLM_PP_LAYER_PARTITION`` not set).
    """
    if pp < 1 or num_layers < pp:
        raise ValueError(f"cannot split {num_layers} layers over PP={pp}")
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    return parts


# --------------------------------------------------------------------------- helpers


def int_field(cfg: Mapping[str, Any], key: str, loc: tuple[str, ...]) -> int | None:
    """``cfg[key]`` as a sane whole number, None when absent; KVConfigError otherwise."""
    value = cfg.get(key)
    if value is None:
        return None
    top = CONFIG_INTS.get(key, 1 << 40)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
        raise KVConfigError((*loc, key), f"must be a whole number from 0 to {top}, got {value!r}")
    return value


def positive_field(cfg: Mapping[str, Any], key: str, loc: tuple[str, ...]) -> int | None:
    value = int_field(cfg, key, loc)
    if value == 0:
        raise KVConfigError((*loc, key), f"must be a whole number from 1 to {CONFIG_INTS[key]}")
    return value


def engine_int(engine: Mapping[str, Any], key: str, default: int, low: int = 1) -> int:
    value = engine.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise KVConfigError(("engine", key), f"must be a whole number >= {low}, got {value!r}")
    return value


def text_config(model: Mapping[str, Any]) -> dict[str, Any]:
    """The text model's config: ``text_config`` of a multimodal config (vLLM
    ``get_hf_text_config``), with the top level's dtype and quantization as fallback."""
    text = model.get("text_config")
    if not isinstance(text, Mapping):
        return dict(model)
    merged = dict(text)
    for key in ("torch_dtype", "dtype", "quantization_config", "kv_cache_dtype"):
        if merged.get(key) is None and model.get(key) is not None:
            merged[key] = model[key]
    return merged


def merge_config(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge_config(out[key], value)
        else:
            out[key] = value
    return out


def neutral(value: Any) -> bool:
    return value is None or value is False or value == 0 or value in ([], {}, "")


def _model_dtype_bytes(cfg: Mapping[str, Any], engine: Mapping[str, Any]) -> int:
    """Bytes per element of the model dtype vLLM runs (``--dtype``, else the config's,
    a float32 config downcast to 16 bits: ``config/model.py`` L2423)."""
    name = str(engine.get("dtype") or "auto").lower().removeprefix("torch.")
    if name != "auto":
        if name not in _MODEL_DTYPE_BYTES:
            raise KVConfigError(
                ("engine", "dtype"),
                f"unknown dtype {name!r}; vLLM accepts {sorted(_MODEL_DTYPE_BYTES)}",
            )
        return _MODEL_DTYPE_BYTES[name]
    return 2


def _quant_kv_dtype(quant: Any) -> str | None:
    """The KV dtype a checkpoint's ``quantization_config`` selects under ``auto``."""
    if not isinstance(quant, Mapping):
        return None
    method = str(quant.get("quant_method") or "")
    nested = quant.get("quantization")
    inner: Mapping[str, Any] = nested if isinstance(nested, Mapping) else quant
    if method.startswith("modelopt"):
        algo = (
            inner.get("kv_cache_scheme")
            or quant.get("kv_cache_scheme")
            or inner.get("kv_cache_quant_algo")
            or quant.get("kv_cache_quant_algo")
        )
        if isinstance(algo, Mapping):
            if (
                algo.get("dynamic") is False
                and algo.get("num_bits") == 8
                and algo.get("type") == "float"
            ):
                return "fp8_e4m3"
            if algo.get("num_bits") == 4 and algo.get("type") == "float":
                return "nvfp4"
            return None
        if isinstance(algo, str):
            return {"fp8": "fp8_e4m3", "nvfp4": "nvfp4"}.get(algo.lower())
        return None
    if quant.get("kv_cache_scheme") is not None:
        return "fp8"
    return None


def kv_cache_dtype_bytes(name: str, *, mla: bool) -> tuple[int, int | None]:
    """``(dtype_bytes, packed_bytes_per_token_layer or None)`` of a resolved KV dtype.

    Raises:
        KVConfigError: not a vLLM ``--kv-cache-dtype`` choice.
        KVCacheUnknown: a packed layout this estimator does not model.
    """
    if name in KV_CACHE_DTYPE_BYTES:
        return KV_CACHE_DTYPE_BYTES[name], None
    if name in _MLA_PACKED:
        if not mla:
            raise KVConfigError(("engine", "kv_cache_dtype"), f"{name} is for MLA models only")
        return 1, _MLA_PACKED[name]
    if name in _PACKED_KV_DTYPES:
        raise KVCacheUnknown(
            ("engine", "kv_cache_dtype"),
            f"{name} packs scales or sub-byte values in a layout the attention backend "
            "chooses; not modelled",
        )
    known = sorted(["auto", *KV_CACHE_DTYPE_BYTES, *_MLA_PACKED, *_PACKED_KV_DTYPES])
    raise KVConfigError(
        ("engine", "kv_cache_dtype"), f"unknown KV cache dtype {name!r}; vLLM accepts {known}"
    )


def dtype_bytes(dtype: str | None, model_dtype: str | None = None) -> int:
    """Bytes per element of a ``--kv-cache-dtype`` choice; ``auto``/None: the model's
    (``model_dtype`` is the config's ``torch_dtype``: vLLM downcasts float32 to 16 bits,
    ``config/model.py`` L2423, so ``auto`` is 2 bytes unless ``--dtype float32``).

    Raises:
        KVConfigError: not a vLLM cache dtype; KVCacheUnknown: a packed layout.
    """
    name = str(dtype or "auto").lower()
    if name == "auto":
        del model_dtype  # every model dtype vLLM runs under auto is 16-bit
        return 2
    return kv_cache_dtype_bytes(name, mla=name in _MLA_PACKED)[0]


def resolve_kv_dtype(
    requested: str | None, cfg: Mapping[str, Any], engine: Mapping[str, Any], notes: list[str]
) -> tuple[str, int]:
    """``(name, model dtype bytes)``: ``auto`` resolved to the checkpoint's KV scheme or
    the model dtype (the name is then ``auto``)."""
    name = str(requested or "auto").lower()
    model_bytes = _model_dtype_bytes(cfg, engine)
    if name == "auto":
        quant = _quant_kv_dtype(cfg.get("quantization_config"))
        if quant is not None:
            notes.append(
                f"kv_cache_dtype auto: the checkpoint's quantization_config selects {quant}"
            )
            return quant, model_bytes
        if engine.get("dtype") in (None, "auto") and not (
            cfg.get("torch_dtype") or cfg.get("dtype")
        ):
            notes.append("kv_cache_dtype auto and no torch_dtype in the config: 16 bits assumed")
    return name, model_bytes


def kv_heads(cfg: Mapping[str, Any], loc: tuple[str, ...]) -> int:
    for key in _KV_HEAD_KEYS:
        value = cfg.get(key)
        if value is None:
            continue
        if isinstance(value, list):
            raise KVCacheUnknown((*loc, key), "per-layer KV head counts are not modelled")
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100_000:
            raise KVConfigError(
                (*loc, key), f"must be a whole number from 1 to 100000, got {value!r}"
            )
        return value
    heads = positive_field(cfg, "num_attention_heads", loc)
    if heads is None:
        raise KVConfigError((*loc, "num_attention_heads"), "the model config lacks it")
    return heads


def head_dim_of(cfg: Mapping[str, Any], loc: tuple[str, ...]) -> int:
    head = cfg.get("head_dim")
    if isinstance(head, list):
        raise KVCacheUnknown((*loc, "head_dim"), "per-layer head sizes are not modelled")
    head = int_field(cfg, "head_dim", loc)
    if head:
        return head
    if cfg.get("hidden_size_per_head") is not None:
        per_head = int_field(cfg, "hidden_size_per_head", loc)
        if per_head:
            return per_head
    heads = positive_field(cfg, "num_attention_heads", loc)
    hidden = positive_field(cfg, "hidden_size", loc)
    if heads is None or hidden is None:
        raise KVConfigError((*loc, "head_dim"), "the model config lacks head_dim and hidden_size")
    return hidden // heads


def model_type_of(cfg: Mapping[str, Any]) -> str:
    """The config's ``model_type`` ('' when absent or not a string)."""
    value = cfg.get("model_type")
    return value if isinstance(value, str) else ""


def is_mla(cfg: Mapping[str, Any], loc: tuple[str, ...], notes: list[str]) -> bool:
    model_type = model_type_of(cfg) or None
    rank = cfg.get("kv_lora_rank")
    if "use_mla" in cfg:  # this product's own switch, for configs without model_type
        if bool(cfg["use_mla"]) and rank is None:
            raise KVConfigError((*loc, "kv_lora_rank"), "use_mla needs kv_lora_rank")
        return bool(cfg["use_mla"])
    if model_type in _MLA_UNMODELLED:
        raise KVCacheUnknown(
            (*loc, "model_type"),
            f"{model_type} keeps caches beside the MLA latent (indexer, compressor or linear "
            "attention); not modelled",
        )
    if rank is None:
        return False
    if model_type is None:  # is_deepseek_mla (model_arch_config_convertor.py L314-L316)
        raise KVCacheUnknown(
            (*loc, "model_type"),
            "kv_lora_rank without model_type: vLLM decides MLA by model_type "
            "(is_deepseek_mla); give model_type (e.g. deepseek_v3) or use_mla",
        )
    if model_type in _MLA_TYPES:
        return cfg.get("is_causal", True) is not False
    raise KVCacheUnknown(
        (*loc, "kv_lora_rank"),
        f"model_type {model_type!r} has kv_lora_rank but is not one vLLM sizes as MLA; its "
        "attention layout is model code",
    )


def layer_kinds(
    cfg: Mapping[str, Any], n: int, window: int | None, loc: tuple[str, ...], notes: list[str]
) -> list[str]:
    """ "full" or "sliding" per target layer."""
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != n:
            raise KVConfigError((*loc, "layer_types"), f"must list {n} layer types")
        kinds = []
        for t in types:
            if not isinstance(t, str) or t not in _ATTENTION_TYPES:
                raise KVCacheUnknown(
                    (*loc, "layer_types"),
                    f"layer type {t!r} (only full_attention and sliding_attention are modelled)",
                )
            kinds.append(_ATTENTION_TYPES[t] if window else "full")
        return kinds
    if not window:
        return ["full"] * n
    model_type = model_type_of(cfg)
    if model_type in _DERIVED_LAYER_TYPES:
        rule = _DERIVED_LAYER_TYPES[model_type]
        notes.append(f"layer_types derived as transformers does for {model_type}")
        return ["sliding" if rule(i, cfg) else "full" for i in range(n)]
    if model_type in _ALL_LAYERS_SLIDE:
        notes.append(f"sliding_window {window} without layer_types: every layer slides (vLLM)")
        return ["sliding"] * n
    raise KVCacheUnknown(
        (*loc, "sliding_window"),
        f"sliding_window {window} without layer_types for model_type {model_type or '(none)'}: "
        "which layers slide is decided by the model's config class and vLLM model code; give "
        "layer_types",
    )


def check_structure(cfg: Mapping[str, Any], loc: tuple[str, ...]) -> None:
    for key, why in _STRUCTURE_UNMODELLED.items():
        if key in cfg and not neutral(cfg[key]):
            raise KVCacheUnknown((*loc, key), f"{why}; not modelled")
    if cfg.get("is_encoder_decoder") is True:
        raise KVCacheUnknown(
            (*loc, "is_encoder_decoder"), "encoder-decoder caches are not modelled"
        )
    if not neutral(cfg.get("num_kv_shared_layers")):
        raise KVCacheUnknown(
            (*loc, "num_kv_shared_layers"), "layers that share another layer's KV cache"
        )
    if model_type_of(cfg) in _HEADS_UNMODELLED:
        raise KVCacheUnknown(
            (*loc, "model_type"),
            f"{cfg['model_type']} reads its KV heads with model-specific rules",
        )
    for key in cfg:
        if key.startswith(("mamba_", "ssm_", "linear_")) and not neutral(cfg[key]):
            raise KVCacheUnknown(
                (*loc, key), "state-space or linear-attention layers; not modelled"
            )
