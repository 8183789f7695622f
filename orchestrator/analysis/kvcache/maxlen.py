"""The model's maximum length as vLLM 0.32.0 derives it, and its ``max_model_len`` check.

One function, :func:`derive_max_model_len`, following
``vllm/transformers_utils/model_arch_config_convertor.py`` L394-L427
(``derive_max_model_len_and_key``) and ``vllm/config/model.py`` L2527-L2667
(``_get_and_verify_max_len``), read from the text model's config (``hf_text_config``):

- the SMALLEST of ``max_position_embeddings``, ``n_positions``, ``max_seq_len``,
  ``seq_length``, ``model_max_length``, ``max_target_positions``,
  ``max_sequence_length``, ``max_seq_length``, ``seq_len`` (L396-L419); a truthy
  ``model_max_length`` then overrides that minimum (L422-L425);
- ``disable_sliding_window`` caps it at ``sliding_window`` (model.py L2542-L2550);
- none of the keys: 2048 with a warning, or the given ``max_model_len`` (L2559-L2575);
- RoPE scaling (L2577-L2616): unless ``model_type`` contains ``gemma3``, the length is
  multiplied by the last ``factor`` of the rope parameters whose ``rope_type`` is not
  ``su``/``longrope``/``llama3``/``yarn``/``deepseek_yarn``/``deepseek_llama_scaling``
  (a null factor counts 1.0); legacy ``type`` is ``rope_type``
  (``transformers_utils/config.py`` L563-L619: ``su`` -> ``longrope``, ``mrope`` ->
  ``default``, ``telechat3-yarn`` -> ``yarn``);
- the default when ``max_model_len`` is not given: ``original_max_position_embeddings``
  for ``longrope`` (L2624-L2631), else the derived length;
- a given ``max_model_len`` above the derived length is refused ("... To allow
  overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1") unless it
  is at most the config's ``model_max_length`` (L2636-L2666).

Not modelled: the tokenizer config's ``model_max_length`` (read only for pooling
runners with absolute position embeddings, L2131-L2141), an encoder config's
``max_seq_length`` (sentence-transformers), model types with their own derivation
(``MossAudio``, Gemma 4 language configs); a ``rope_type`` outside the list below is
*unknown* (:class:`~.shapes.KVCacheUnknown` naming the field), never a number.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from orchestrator.analysis.kvcache.shapes import (
    KVCacheUnknown,
    KVConfigError,
    merge_config,
    text_config,
)

__all__ = ["LENGTH_KEYS", "ROPE_KEYS", "derive_max_model_len"]

#: ``possible_keys`` of ``derive_max_model_len_and_key`` (L396-L414), in vLLM's order.
LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
#: Config keys carrying RoPE parameters (HF ``rope_scaling``, Transformers v5
#: ``rope_parameters``) and LongRoPE's default length.
ROPE_KEYS = ("rope_scaling", "rope_parameters", "original_max_position_embeddings")
#: ``rope_type`` values whose ``factor`` vLLM does NOT apply (model.py L2594-L2601).
_FACTOR_NOT_APPLIED = frozenset(
    {"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"}
)
#: ``rope_type`` values whose ``factor`` vLLM applies (Transformers' rope types).
_FACTOR_APPLIED = frozenset({"default", "linear", "dynamic"})
_LEGACY = {"su": "longrope", "mrope": "default", "telechat3-yarn": "yarn"}
#: vLLM's length when the config has none of :data:`LENGTH_KEYS` (model.py L2568).
DEFAULT_MAX_LEN = 2048


def _number(cfg: Mapping[str, Any], key: str, loc: tuple[str, ...]) -> float | None:
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise KVConfigError((*loc, key), f"must be a number, got {value!r}")
    if value < 1:
        raise KVConfigError((*loc, key), f"must be >= 1, got {value!r}")
    return value


def _rope_sets(cfg: Mapping[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """The rope parameter dicts (one per layer type when nested), as
    ``iter_rope_parameters`` (``transformers_utils/config.py`` L644-L653) yields them."""
    key = "rope_parameters" if cfg.get("rope_parameters") is not None else "rope_scaling"
    value = cfg.get(key)
    if value is None:
        return key, []
    if not isinstance(value, Mapping):
        raise KVCacheUnknown(("model", key), f"a {type(value).__name__} is not modelled")
    if value and all(isinstance(v, Mapping) or v is None for v in value.values()):
        return key, [dict(v) for v in value.values() if v]  # nested: per layer type
    return key, [dict(value)] if value else []


def _scaling(cfg: Mapping[str, Any], notes: list[str]) -> tuple[float, bool]:
    """vLLM's RoPE scaling factor for the length, and whether a rope type is longrope."""
    key, sets = _rope_sets(cfg)
    loc = ("model", key)
    factor: Any = 1.0
    longrope = False
    for rp in sets:
        rope_type = rp.get("rope_type", rp.get("type", "default"))
        if not isinstance(rope_type, str):
            raise KVCacheUnknown((*loc, "rope_type"), f"{rope_type!r} is not modelled")
        rope_type = _LEGACY.get(rope_type, rope_type)
        if rope_type not in _FACTOR_APPLIED | _FACTOR_NOT_APPLIED:
            raise KVCacheUnknown(
                (*loc, "rope_type"),
                f"rope type {rope_type!r}: its effect on the model's maximum length is not "
                "modelled; give engine.max_model_len",
            )
        longrope = longrope or rope_type == "longrope"
        if rope_type in _FACTOR_APPLIED:
            factor = rp.get("factor", factor)
    if factor is None:
        notes.append(f"{key} has a null factor: vLLM falls back to 1.0 (model.py L2606-L2614)")
        factor = 1.0
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
        raise KVConfigError((*loc, "factor"), f"must be a positive number, got {factor!r}")
    return float(factor), longrope


def _given_only(given: Any, notes: list[str]) -> dict[str, Any]:
    """The answer when only the given ``max_model_len`` is known."""
    return {
        "max_model_len": int(given),
        "derived_max_model_len": None,
        "key": None,
        "model_max_length": None,
        "notes": notes,
    }


def _config_length(
    cfg: Mapping[str, Any], engine: Mapping[str, Any], loc: tuple[str, ...]
) -> tuple[str | None, float, float | None]:
    """``(key, the model's maximum before RoPE scaling (inf: none), model_max_length)``:
    the smallest length key, overridden by ``model_max_length``, capped by the sliding
    window when ``disable_sliding_window``."""
    derived = math.inf
    key: str | None = None
    for name in LENGTH_KEYS:  # convertor L415-L420: the smallest
        value = _number(cfg, name, loc)
        if value is not None:
            if value < derived:
                key = name
            derived = min(derived, value)
    model_max_length = _number(cfg, "model_max_length", loc)
    if model_max_length:  # convertor L422-L425: overrides the minimum
        key, derived = "model_max_length", model_max_length
    window = cfg.get("sliding_window")
    if (
        engine.get("disable_sliding_window")
        and isinstance(window, int)
        and not isinstance(window, bool)
        and window < derived
    ):
        key, derived = "sliding_window", window
    return key, derived, model_max_length


def derive_max_model_len(
    model: Mapping[str, Any] | None,
    engine: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The model's maximum length and the context cap vLLM 0.32.0 uses.

    Args:
        model: the model's ``config.json`` (a multimodal config's ``text_config`` is
            read), or None (only a given ``max_model_len`` then).
        engine: vLLM engine arguments: ``max_model_len``, ``disable_sliding_window``,
            ``hf_overrides`` (merged into the config).

    Returns:
        ``{"max_model_len": the cap vLLM runs with (the given one, or the default),
        "derived_max_model_len": the model's maximum (float, as vLLM keeps it; None when
        the config has no length key), "key": the config key it came from,
        "model_max_length": the config's, or None, "notes": [str]}``.

    Raises:
        KVConfigError: the given ``max_model_len`` is above the model's maximum (vLLM
            refuses it without ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``), or neither a model
            nor a ``max_model_len`` is given, or a length field is no sane number.
        KVCacheUnknown: RoPE parameters whose effect is not modelled.
    """
    engine = {str(k).replace("-", "_"): v for k, v in (engine or {}).items()}
    given = engine.get("max_model_len")
    notes: list[str] = []
    if model is None:
        if given is None:
            raise KVConfigError(("engine", "max_model_len"), "give it, or the model's config")
        return _given_only(given, notes)
    overrides = engine.get("hf_overrides")
    raw = merge_config(model, overrides) if isinstance(overrides, Mapping) else dict(model)
    cfg = text_config(raw)
    loc = ("model",)
    key, derived, model_max_length = _config_length(cfg, engine, loc)
    if derived == math.inf:
        if given is not None:
            return _given_only(given, notes)
        notes.append(
            "the model config has none of "
            f"{', '.join(LENGTH_KEYS)}: vLLM assumes {DEFAULT_MAX_LEN} (model.py L2567-L2575)"
        )
        derived = DEFAULT_MAX_LEN
    factor, longrope = _scaling(cfg, notes)
    model_type = f"{raw.get('model_type') or ''} {cfg.get('model_type') or ''}"
    if "gemma3" in model_type:  # model.py L2582-L2583: already scaled
        factor = 1.0
    if factor != 1.0:
        notes.append(f"model maximum {key}={derived} x RoPE factor {factor:g}")
    derived = derived * factor
    if given is None:
        original = _number(cfg, "original_max_position_embeddings", loc)
        cap = int(original) if longrope and original is not None else int(derived)
    elif given > derived and (model_max_length is None or given > model_max_length):
        raise KVConfigError(
            ("engine", "max_model_len"),
            f"User-specified max_model_len ({given}) is greater than the derived "
            f"max_model_len ({key}={derived:g} or model_max_length={model_max_length} in "
            "model's config.json); vLLM refuses it unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 "
            "(and the model then degrades)",
        )
    else:
        cap = int(given)
    return {
        "max_model_len": cap,
        "derived_max_model_len": derived,
        "key": key,
        "model_max_length": model_max_length,
        "notes": notes,
    }
