"""orchestrator.analysis.kvcache: real-world cases within tolerance, TP/PP, dtypes, log lines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchestrator.analysis.kvcache import (
    GIB,
    dtype_bytes,
    estimate_kv_cache,
    kv_bytes_per_token,
    layers_per_pp_rank,
    max_fitting_context,
    parse_kv_cache_log,
)

DATA = Path(__file__).parent / "data" / "kvcache"


def _load(name: str) -> dict[str, Any]:
    return json.loads((DATA / name).read_text())


def _sub_cases() -> list[tuple[str, int]]:
    case = _load("llama31_8b_24gib.json")
    return [("llama31_8b_24gib.json", i) for i in range(len(case["cases"]))]


@pytest.mark.parametrize(("name", "index"), _sub_cases())
def test_memory_profile_case(name: str, index: int) -> None:
    case = _load(name)
    sub = case["cases"][index]
    exp = sub["expected"]
    memory = {**case["memory_profile_gib"], **sub.get("memory_profile_gib_override", {})}
    est = estimate_kv_cache(case["model"], case["engine"], memory, sub["max_model_len"])
    block = est["block_size"]
    tol_blocks = exp["blocks_tolerance"]
    if "kv_bytes_per_token" in exp:
        assert est["kv_bytes_per_token"] == exp["kv_bytes_per_token"]
    # printed GiB figures carry two decimals
    assert est["available_kv_gib"] == pytest.approx(exp["available_kv_gib"], abs=0.005)
    printed = sub["vllm_printed"]
    assert abs(est["gpu_blocks"] - printed["gpu_blocks"]) <= tol_blocks
    if "gpu_blocks_approx" in exp:
        assert abs(est["gpu_blocks"] - exp["gpu_blocks_approx"]) <= tol_blocks
    assert abs(est["kv_cache_tokens"] - exp["kv_cache_tokens_approx"]) <= tol_blocks * block
    want_conc = exp.get("maximum_concurrency", float(printed["maximum_concurrency"].rstrip("x")))
    conc_tol = tol_blocks * block / sub["max_model_len"] + 0.005
    assert est["maximum_concurrency"] == pytest.approx(want_conc, abs=conc_tol)
    assert est["fits"] is exp["fits"]
    if exp["fits"]:
        assert est["advice"] is None
    else:
        assert est["advice"] == exp["advice"]
        assert est["max_fitting_model_len"] < sub["max_model_len"]
        assert abs(est["max_fitting_model_len"] - exp["kv_cache_tokens_approx"]) <= (
            tol_blocks * block
        )


def test_v1_log_case_exact() -> None:
    case = _load("qwen3_14b_v1.json")
    exp = case["expected"]
    parsed = parse_kv_cache_log(case["log_lines"])
    assert parsed == pytest.approx(exp["parsed_from_log"])
    est = estimate_kv_cache(
        case["model"],
        case["engine"],
        {"available_kv_cache": parsed["available_kv_cache_gib"]},
        case["engine"]["max_model_len"],
    )
    assert est["kv_bytes_per_token"] == exp["kv_bytes_per_token"]
    assert est["kv_cache_tokens"] == exp["kv_cache_tokens"]
    assert round(est["maximum_concurrency"], 2) == exp["maximum_concurrency"]
    assert est["fits"] is True


def test_log_parser_v0_wording_and_prefixes() -> None:
    lines = [
        "(VllmWorker rank=0 pid=77) INFO 11-20 09:00:01 worker.py:232] Memory profiling takes "
        "3.1 seconds ... the rest of the memory reserved for KV Cache is 3.81GiB.",
        "vllm-1  | INFO 11-20 09:00:02 executor_base.py:110] "
        "# cuda blocks: 1,952, # CPU blocks: 2048",
        "vllm-1  | INFO 11-20 09:00:02 executor_base.py:115] Maximum concurrency for 20000 tokens "
        "per request: 1.56x",
        "INFO GET /health HTTP/1.1 200 OK",
    ]
    assert parse_kv_cache_log(lines) == {
        "available_kv_cache_gib": pytest.approx(3.81),
        "gpu_blocks": 1952,
        "max_concurrency_tokens_per_request": 20000,
        "maximum_concurrency": 1.56,
    }


LLAMA = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
         "hidden_size": 4096}  # fmt: skip


@pytest.mark.parametrize(
    ("dtype", "nbytes"),
    [("fp8", 1), ("fp8_e5m2", 1), ("bf16", 2), ("bfloat16", 2), ("float16", 2), ("fp32", 4)],
)
def test_dtype_sizes(dtype: str, nbytes: int) -> None:
    assert dtype_bytes(dtype) == nbytes
    shape = kv_bytes_per_token({**LLAMA, "kv_cache_dtype": dtype})
    assert shape["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * nbytes  # head_dim = 4096 / 32


def test_auto_dtype_follows_model_and_unknown_raises() -> None:
    assert dtype_bytes("auto", "float32") == 4
    assert dtype_bytes(None) == 2
    with pytest.raises(ValueError):
        dtype_bytes("fp6")


def test_tp_divides_kv_heads_and_replicates_beyond() -> None:
    base = kv_bytes_per_token(LLAMA)["kv_bytes_per_token"]
    assert kv_bytes_per_token(LLAMA, {"tensor_parallel_size": 2})["kv_bytes_per_token"] == base // 2
    tp8 = kv_bytes_per_token(LLAMA, {"tensor_parallel_size": 8})
    assert tp8["kv_heads_per_rank"] == 1 and tp8["kv_bytes_per_token"] == base // 8
    tp16 = kv_bytes_per_token(LLAMA, {"tensor_parallel_size": 16})
    assert tp16["kv_heads_per_rank"] == 1  # replicated: no further saving
    assert tp16["kv_bytes_per_token"] == tp8["kv_bytes_per_token"]
    assert tp16["kv_bytes_per_token_model"] == base


def test_pp_divides_layers_binding_rank() -> None:
    assert layers_per_pp_rank(32, 4) == [8, 8, 8, 8]
    assert layers_per_pp_rank(30, 4) == [7, 8, 8, 7]  # vLLM get_pp_indices
    shape = kv_bytes_per_token({**LLAMA, "num_hidden_layers": 30}, {"pipeline_parallel_size": 4})
    assert shape["layers_per_rank"] == 8
    assert shape["kv_bytes_per_token"] == 2 * 8 * 8 * 128 * 2
    extra = kv_bytes_per_token({**LLAMA, "extra_kv_layers": 2}, {"pipeline_parallel_size": 4})
    assert extra["layers_per_rank"] == 10  # draft/MTP layers on the last rank


def test_tp_doubles_capacity_per_gpu() -> None:
    mem = {"available_kv_cache": 4.0}
    one = estimate_kv_cache(LLAMA, {"block_size": 16}, mem, 40000)
    two = estimate_kv_cache(LLAMA, {"block_size": 16, "tensor_parallel_size": 2}, mem, 40000)
    assert one["gpu_blocks"] == 4 * GIB // (2 * 16 * 8 * 128 * 2 * 32)
    assert two["gpu_blocks"] == 2 * one["gpu_blocks"]
    assert not one["fits"] and two["fits"]


def test_weights_plus_activation_profile() -> None:
    mem = {"total_gpu_memory": 80.0, "weights_memory": 14.0, "peak_activation_memory": 2.0,
           "non_torch_memory": 1.0}  # fmt: skip
    est = estimate_kv_cache(LLAMA, {"gpu_memory_utilization": 0.5}, mem, 4096)
    assert est["available_kv_gib"] == pytest.approx(23.0, abs=1e-6)


def test_max_fitting_context() -> None:
    mem = {"available_kv_cache": 2.0}  # 1024 blocks of 2 MiB
    got = max_fitting_context(LLAMA, {"block_size": 16}, mem, concurrency=4)
    assert got == {"kv_cache_tokens": 16384, "concurrency": 4, "max_model_len": 4096}
    est = estimate_kv_cache(LLAMA, {"block_size": 16}, mem, got["max_model_len"])
    assert est["fits"] and est["maximum_concurrency"] == 4.0


def test_mla_latent_not_divided_by_tp() -> None:
    mla = {"num_hidden_layers": 61, "num_attention_heads": 128, "kv_lora_rank": 512,
           "qk_rope_head_dim": 64, "kv_cache_dtype": "fp8"}  # fmt: skip
    one = kv_bytes_per_token(mla)
    eight = kv_bytes_per_token(mla, {"tensor_parallel_size": 8})
    assert one["kv_bytes_per_token"] == eight["kv_bytes_per_token"] == 61 * 576


# --- the per-run check: estimate next to the engine's own start-up figures

_DEMO = Path(__file__).resolve().parents[2] / "web" / "data" / "demo_experiment.json"


def _demo_run() -> dict:
    return json.loads(_DEMO.read_text())["experiment"]["runs"][1]


# config.json of the generated "small" demo model (jobs/modelgen.py)
_SMALL = {
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "hidden_size": 512,
    "dtype": "bfloat16",
}


def test_check_against_a_real_engine_start_agrees() -> None:
    from orchestrator.analysis.kvcache import check_against_engine

    run = _demo_run()
    facts = run["engine_info"]["startup_facts"]  # vLLM 0.32 CPU: 1 GiB, 131,072 tokens, 64x
    check = check_against_engine(_SMALL, run["engine_args"], facts)
    assert check is not None
    # 2 (K,V) * 8 layers * 4 KV heads * 64 * 2 bytes = 8 KiB per token; 1 GiB / 8 KiB
    assert check["estimate"]["kv_bytes_per_token"] == 8192
    assert check["estimate"]["kv_cache_tokens"] == facts["kv_cache_size_tokens"] == 131072
    assert check["estimate"]["maximum_concurrency"] == facts["max_concurrency"] == 64.0
    assert check["difference_tokens"] == 0 and check["agrees"] is True


def test_check_flags_a_figure_beyond_rounding() -> None:
    from orchestrator.analysis.kvcache import check_against_engine

    run = _demo_run()
    facts = dict(run["engine_info"]["startup_facts"])
    # an engine that reports twice the tokens for the same memory (e.g. per-rank
    # memory counted for all ranks) disagrees; a 0.004 GiB print rounding does not
    doubled = check_against_engine(
        _SMALL, run["engine_args"], {**facts, "kv_cache_size_tokens": 262144}
    )
    assert doubled is not None and doubled["agrees"] is False
    assert doubled["difference_tokens"] == 131072
    rounded = check_against_engine(
        _SMALL, run["engine_args"], {**facts, "available_kv_cache_memory_gib": 1.004}
    )
    assert rounded is not None and rounded["agrees"] is True
    assert check_against_engine(_SMALL, run["engine_args"], {}) is None
