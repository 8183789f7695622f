"""The estimate next to what an engine printed: log figures and the per-run check."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from orchestrator.analysis.kvcache.estimate import GIB, estimate_kv_cache
from orchestrator.analysis.kvcache.shapes import KVCacheUnknown, KVConfigError

__all__ = ["check_against_engine", "parse_kv_cache_log"]

_NUM = r"([0-9][0-9,]*(?:\.[0-9]+)?)"
_UNIT = {"gib": 1.0, "gb": 1e9 / GIB, "mib": 1 / 1024, "mb": 1e6 / GIB}
_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    # V1: "Available KV cache memory: 6.51 GiB"
    (
        "available_kv_cache_gib",
        re.compile(rf"Available KV cache memory:\s*{_NUM}\s*(GiB|GB|MiB|MB)"),
    ),
    # V0: "... the rest of the memory reserved for KV Cache is 3.81GiB."
    (
        "available_kv_cache_gib",
        re.compile(rf"reserved for KV Cache is\s*{_NUM}\s*(GiB|GB|MiB|MB)", re.IGNORECASE),
    ),
    # V1: "GPU KV cache size: 42,656 tokens"
    ("kv_cache_tokens", re.compile(rf"KV cache size:\s*{_NUM}\s*tokens")),
    # V0: "# GPU blocks: 1952, # CPU blocks: 2048" (older: "# cuda blocks: 1952")
    ("gpu_blocks", re.compile(rf"#\s*(?:GPU|cuda|gpu)\s+blocks:\s*{_NUM}")),
)
_CONCURRENCY = re.compile(
    rf"Maximum concurrency for\s*{_NUM}\s*tokens per request:\s*{_NUM}\s*x", re.IGNORECASE
)


def _num(text: str) -> float:
    return float(text.replace(",", ""))


def parse_kv_cache_log(lines: Iterable[str]) -> dict[str, Any]:
    """Pick vLLM's KV cache figures out of engine log lines (last occurrence wins).

    Understands V1 (``Available KV cache memory: X GiB``, ``GPU KV cache size: N
    tokens``) and V0 (``reserved for KV Cache is XGiB``, ``# GPU blocks: N``)
    wordings and ``Maximum concurrency for N tokens per request: X.XXx`` from both;
    any line prefix (timestamps, ``(VllmWorker rank=0 pid=1)``, container names)
    and thousands separators. Returns only the keys found, among
    ``available_kv_cache_gib`` (GiB), ``kv_cache_tokens``, ``gpu_blocks``,
    ``max_concurrency_tokens_per_request`` (tokens) and ``maximum_concurrency``.
    """
    out: dict[str, Any] = {}
    for line in lines:
        for key, pattern in _PATTERNS:
            m = pattern.search(line)
            if not m:
                continue
            if key == "available_kv_cache_gib":
                out[key] = _num(m.group(1)) * _UNIT[m.group(2).lower()]
            else:
                out[key] = int(_num(m.group(1)))
        m = _CONCURRENCY.search(line)
        if m:
            out["max_concurrency_tokens_per_request"] = int(_num(m.group(1)))
            out["maximum_concurrency"] = _num(m.group(2))
    return out


def _version(text: Any) -> tuple[int, ...] | None:
    m = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", str(text or ""))
    return tuple(int(x or 0) for x in m.groups()) if m else None


def _legacy_tokens(est: Mapping[str, Any]) -> int:
    groups = est["kv_cache_groups"]
    return int(est["gpu_blocks"]) // len(groups) * min(int(g["block_size"]) for g in groups)


def _tolerance(est: Mapping[str, Any], max_model_len: int) -> int:
    """Tokens the estimate may differ by because vLLM prints the GiB figure with two
    decimals: ±0.005 GiB as whole blocks (plus one for the floor), as printed tokens."""
    blocks = math.ceil(0.005 * GIB / max(1, int(est["block_bytes"]))) + 1
    per_block = max_model_len / max(1, int(est["blocks_per_request"]))
    return max(int(est["block_size"]), math.ceil(blocks * per_block))


def _block_size(engine: dict[str, Any], device: str, notes: list[str]) -> Any:
    """The engine's block size; vLLM's default for ``device`` (set in ``engine``, with a
    note) when the arguments have none."""
    if engine.get("block_size") is None:
        engine["block_size"] = 128 if device.upper() == "CPU" else 16
        notes.append(
            f"block_size not in the engine arguments: vLLM's {device} default "
            f"{engine['block_size']} assumed (an attention backend may pick another)"
        )
    return engine["block_size"]


def _difference(
    est: Mapping[str, Any],
    printed_tokens: Any,
    printed_blocks: Any,
    version: Any,
    notes: list[str],
) -> tuple[str | None, int | None]:
    """``(printed formula, engine - estimate in tokens)``: the printed token count against
    the formula of this version closest to it, else a V0 engine's GPU blocks; ``(None,
    None)`` when the engine printed neither."""
    if printed_tokens is not None:
        candidates = {"group-aware": int(est["kv_cache_tokens"])}
        parsed = _version(version)
        if parsed is None or parsed < (0, 32):
            candidates["blocks"] = _legacy_tokens(est)
        formula, value = min(candidates.items(), key=lambda kv: abs(int(printed_tokens) - kv[1]))
        return formula, int(printed_tokens) - value
    if printed_blocks is not None:
        notes.append("V0 engine: its '# GPU blocks' compared, in tokens")
        return "v0-blocks", (int(printed_blocks) - int(est["gpu_blocks"])) * int(est["block_size"])
    return None, None


def _not_modelled(
    exc: KVCacheUnknown | KVConfigError, engine_side: dict[str, Any], notes: list[str]
) -> dict[str, Any]:
    """The check without an estimate: the field that cannot be modelled, and why."""
    return {
        "estimate": None,
        "unknown": {"field": ".".join(exc.loc), "reason": exc.msg},
        "engine": engine_side,
        "tolerance_tokens": None,
        "difference_tokens": None,
        "agrees": None,
        "printed_formula": None,
        "ignored_keys": [],
        "notes": notes,
    }


def check_against_engine(
    model_config: Mapping[str, Any],
    engine_args: Mapping[str, Any],
    startup_facts: Mapping[str, Any],
    *,
    draft_config: Mapping[str, Any] | None = None,
) -> dict[str, Any] | None:
    """The estimate for a run, next to what its engine printed at start-up.

    Args:
        model_config: the model's ``config.json`` (HF names).
        engine_args: the run's resolved engine arguments (every key is classified: the
            estimate reads the KV-shaping ones, lists unknown ones in ``ignored_keys``).
        startup_facts: parsed start-up lines (``jobs.signals.enginelog.startup_facts``):
            ``available_kv_cache_memory_gib``, ``kv_cache_size_tokens``,
            ``max_concurrency``, ``max_concurrency_context_tokens``, ``max_model_len``,
            ``num_gpu_blocks`` (V0), ``kv_cache_device``, ``vllm_version``.
        draft_config: the drafter's ``config.json`` (EAGLE or draft-model runs).

    Returns:
        ``None`` when the engine printed no KV cache memory figure. Otherwise
        ``{"estimate": estimate_kv_cache(...) for the engine's own available memory, or
        None with "unknown": {"field", "reason"} when the configuration cannot be
        modelled, "engine": {"kv_cache_tokens", "maximum_concurrency",
        "available_kv_cache_gib", "num_gpu_blocks", "vllm_version"}, "tolerance_tokens",
        "difference_tokens": engine - estimate, "agrees": bool or None,
        "printed_formula": "group-aware" (vLLM 0.32: int(concurrency x max_model_len)) or
        "blocks" (older V1: num_blocks // groups x block_size) or "v0-blocks",
        "ignored_keys", "notes"}``. The tolerance is the rounding of the printed GiB
        figure in whole blocks: a bigger gap means the model of this engine is wrong
        (an attention backend with another layout, another block size, a per-rank figure
        reported for all ranks).
    """
    gib = startup_facts.get("available_kv_cache_memory_gib")
    if gib is None:
        return None
    notes: list[str] = []
    engine = {str(k).replace("-", "_"): v for k, v in engine_args.items()}
    block_size = _block_size(engine, str(startup_facts.get("kv_cache_device") or "GPU"), notes)
    max_model_len = int(
        startup_facts.get("max_concurrency_context_tokens")
        or engine.get("max_model_len")
        or startup_facts.get("max_model_len")
        or block_size
    )
    printed_tokens = startup_facts.get("kv_cache_size_tokens")
    printed_blocks = startup_facts.get("num_gpu_blocks")
    version = startup_facts.get("vllm_version")
    engine_side = {
        "kv_cache_tokens": printed_tokens,
        "maximum_concurrency": startup_facts.get("max_concurrency"),
        "available_kv_cache_gib": float(gib),
        "num_gpu_blocks": printed_blocks,
        "vllm_version": version,
    }
    try:
        est = estimate_kv_cache(
            model_config,
            engine,
            {"available_kv_cache": float(gib)},
            max_model_len,
            draft_config=draft_config,
        )
    except (KVCacheUnknown, KVConfigError) as exc:
        return _not_modelled(exc, engine_side, notes)
    tolerance = _tolerance(est, max_model_len)
    formula, diff = _difference(est, printed_tokens, printed_blocks, version, notes)
    return {
        "estimate": est,
        "engine": engine_side,
        "tolerance_tokens": tolerance,
        "difference_tokens": diff,
        "agrees": diff is not None and abs(diff) <= tolerance,
        "printed_formula": formula,
        "ignored_keys": est["ignored_keys"],
        "notes": [*notes, *est["notes"]],
    }
