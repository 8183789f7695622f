"""orchestrator.analysis.kvcache: real cases within vLLM's rounding, TP/PP, KV dtypes, GQA,
MLA, sliding windows, speculative decoding, ignored keys, given bytes per token, log lines.

Every formula checked here is vLLM 0.32.0's (the CPU build in ``.engine-venv``; paths below
are under ``vllm/``); each test names the file and line. ``test_kvcache_vllm.py`` runs
vLLM's own ``kv_cache_utils`` on the same shapes (needs the engine venv).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from orchestrator.analysis.kvcache import (
    GIB,
    KVCacheUnknown,
    KVConfigError,
    check_against_engine,
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


# --- the handed cases (copies of /work/shared/cases/kvcache)


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


# --- KV dtypes

LLAMA = {
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
}


@pytest.mark.parametrize(
    ("dtype", "nbytes"),
    [("fp8", 1), ("fp8_e4m3", 1), ("fp8_e5m2", 1), ("fp8_inc", 1), ("bfloat16", 2), ("float16", 2)],
)
def test_kv_cache_dtypes_by_vllm_name(dtype: str, nbytes: int) -> None:
    """vLLM's ``--kv-cache-dtype`` choices (config/cache.py L39-L59) and their torch dtypes
    (utils/torch_utils.py L33-L56: fp8* are uint8, fp8_inc float8_e4m3fn); page =
    block_size x heads x (K + V head size) x dtype bytes (v1/kv_cache_interface.py
    L545-L553)."""
    assert dtype_bytes(dtype) == nbytes
    shape = kv_bytes_per_token(LLAMA, {"kv_cache_dtype": dtype})
    assert shape["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * nbytes  # head_dim = 4096 / 32


def test_auto_dtype_is_16_bit_and_bad_names_refused() -> None:
    """``auto`` is the model dtype; vLLM downcasts a float32 config to 16 bits
    (config/model.py L2423) unless ``--dtype float32`` asks for it (L2470-L2475). Names vLLM
    refuses (``fp32``, ``bf16``) are refused; packed layouts the backend lays out
    (``nvfp4``, ``int8_per_token_head``: v1/attention/backends/triton_attn.py L283-L295)
    are unknown, not guessed."""
    assert dtype_bytes("auto", "float32") == 2 and dtype_bytes(None) == 2
    f32 = {**LLAMA, "torch_dtype": "float32"}
    assert kv_bytes_per_token(f32)["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2
    assert (
        kv_bytes_per_token(f32, {"dtype": "float32"})["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 4
    )
    for name in ("fp32", "bf16", "fp6"):
        with pytest.raises(KVConfigError) as err:
            kv_bytes_per_token(LLAMA, {"kv_cache_dtype": name})
        assert err.value.loc == ("engine", "kv_cache_dtype")
    for name in ("nvfp4", "int8_per_token_head", "turboquant_k8v4"):
        with pytest.raises(KVCacheUnknown):
            kv_bytes_per_token(LLAMA, {"kv_cache_dtype": name})


def test_checkpoint_kv_scheme_under_auto() -> None:
    """``auto`` with a modelopt checkpoint's ``kv_cache_quant_algo: FP8`` is ``fp8_e4m3``
    (utils/torch_utils.py L69, L525); a compressed-tensors ``kv_cache_scheme`` is ``fp8``
    (model_executor/layers/attention/attention.py L287-L291); an explicit dtype wins."""
    modelopt = {
        **LLAMA,
        "quantization_config": {"quant_method": "modelopt", "kv_cache_quant_algo": "FP8"},
    }
    shape = kv_bytes_per_token(modelopt)
    assert shape["kv_cache_dtype"] == "fp8_e4m3" and shape["kv_bytes_per_token"] == 65536
    ct = {
        **LLAMA,
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "kv_cache_scheme": {"num_bits": 8, "type": "float"},
        },
    }
    assert kv_bytes_per_token(ct)["kv_bytes_per_token"] == 65536
    assert kv_bytes_per_token(ct, {"kv_cache_dtype": "bfloat16"})["kv_bytes_per_token"] == 131072


def test_fp8_case_from_a_public_issue() -> None:
    """vllm-project/vllm#25350 (fp8 KV, V1): "Available KV cache memory: 10.55 GiB / GPU KV
    cache size: 230,528 tokens / Maximum concurrency for 100,000 tokens per request: 2.31x";
    at 221,000 tokens "10.12 GiB KV cache is needed" and, with 5.59 GiB, "the estimated
    maximum model length is 122080". Those figures are 48 KiB per token in fp8: a 48-layer,
    4-KV-head, head_dim-128 model (Qwen3-30B-A3B's shape). Formulas: concurrency
    kv_cache_utils.py L1195-L1227, tokens L2300-L2308, needed = bytes per block x blocks
    per request (L2337-L2366), estimated length L2369-L2410."""
    model = {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "torch_dtype": "bfloat16",
    }
    eng = {"kv_cache_dtype": "fp8", "block_size": 16}
    est = estimate_kv_cache(model, eng, {"available_kv_cache": 10.55}, 100_000)
    assert est["kv_bytes_per_token"] == 2 * 48 * 4 * 128 == 49152
    # 0.005 GiB of print rounding is 6.8 blocks of 768 KiB
    assert abs(est["kv_cache_tokens"] - 230_528) <= 7 * 16
    # 230,528 tokens are 14,408 blocks: 14,408 / 6,250 = 2.305 printed "2.31"
    assert est["maximum_concurrency"] == pytest.approx(2.305, abs=7 / 6250)
    big = estimate_kv_cache(model, eng, {"available_kv_cache": 5.59}, 221_000)
    assert f"{big['kv_cache_needed_bytes'] / GIB:.2f}" == "10.12"
    assert big["fits"] is False and abs(big["max_fitting_model_len"] - 122_080) <= 7 * 16


def test_gqa_case_from_a_public_pr() -> None:
    """vllm-project/vllm#24577 (A100, FlashInfer, bf16): Qwen/Qwen3-0.6B (config: 28 layers,
    16 heads, 8 KV heads, head_dim 128) printed "Available KV cache memory: 69.66 GiB",
    "GPU KV cache size: 652,144 tokens", "Maximum concurrency for 4,096 tokens per request:
    159.21x". KV heads are num_key_value_heads, never num_attention_heads
    (transformers_utils/model_arch_config_convertor.py L150)."""
    qwen3 = {
        "model_type": "qwen3",
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_size": 1024,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": True,
        "rope_theta": 1000000,
        "max_window_layers": 28,
        "sliding_window": None,
        "use_sliding_window": False,
    }
    facts = {
        "available_kv_cache_memory_gib": 69.66,
        "kv_cache_size_tokens": 652_144,
        "max_concurrency": 159.21,
        "max_concurrency_context_tokens": 4096,
        "kv_cache_device": "GPU",
    }
    check = check_against_engine(qwen3, {"block_size": 16, "max_model_len": 4096}, facts)
    assert check is not None and check["agrees"] is True, check
    assert check["estimate"]["kv_bytes_per_token"] == 2 * 28 * 8 * 128 * 2
    assert abs(check["difference_tokens"]) <= check["tolerance_tokens"]
    assert check["ignored_keys"] == []


# --- TP, PP, memory


def test_tp_divides_kv_heads_and_replicates_beyond() -> None:
    """``max(1, total_num_kv_heads // tensor_parallel_size)`` (config/model.py L1670)."""
    base = kv_bytes_per_token(LLAMA)["kv_bytes_per_token"]
    assert kv_bytes_per_token(LLAMA, {"tensor_parallel_size": 2})["kv_bytes_per_token"] == base // 2
    tp8 = kv_bytes_per_token(LLAMA, {"tensor_parallel_size": 8})
    assert tp8["kv_heads_per_rank"] == 1 and tp8["kv_bytes_per_token"] == base // 8
    tp16 = kv_bytes_per_token(
        {**LLAMA, "num_attention_heads": 64, "head_dim": 128}, {"tensor_parallel_size": 16}
    )
    assert tp16["kv_heads_per_rank"] == 1  # replicated: no further saving
    assert tp16["kv_bytes_per_token"] == tp8["kv_bytes_per_token"]
    assert tp16["kv_bytes_per_token_model"] == base


def test_pp_divides_layers_binding_rank() -> None:
    """``get_pp_indices`` (distributed/utils.py L153-L158): leftover layers go to the ranks
    before the last; the rank with most bytes per block binds (kv_cache_utils.py L2665)."""
    assert layers_per_pp_rank(32, 4) == [8, 8, 8, 8]
    assert layers_per_pp_rank(30, 4) == [7, 8, 8, 7]
    shape = kv_bytes_per_token({**LLAMA, "num_hidden_layers": 30}, {"pipeline_parallel_size": 4})
    assert shape["layers_per_rank"] == 8
    assert shape["kv_bytes_per_token"] == 2 * 8 * 8 * 128 * 2
    extra = kv_bytes_per_token({**LLAMA, "extra_kv_layers": 2}, {"pipeline_parallel_size": 4})
    assert extra["layers_per_rank"] == 10  # extra layers on the last rank


def test_tp_doubles_capacity_per_gpu() -> None:
    mem = {"available_kv_cache": 4.0}
    one = estimate_kv_cache(LLAMA, {"block_size": 16}, mem, 40000)
    two = estimate_kv_cache(LLAMA, {"block_size": 16, "tensor_parallel_size": 2}, mem, 40000)
    assert one["gpu_blocks"] == 4 * GIB // (2 * 16 * 8 * 128 * 2 * 32)
    assert two["gpu_blocks"] == 2 * one["gpu_blocks"]
    assert not one["fits"] and two["fits"]


def test_weights_plus_activation_profile_and_explicit_memory() -> None:
    """``total x gpu_memory_utilization - peak torch - non-torch``; ``kv_cache_memory_bytes``
    replaces the profile (v1/worker/gpu_worker.py ``determine_available_memory``)."""
    mem = {
        "total_gpu_memory": 80.0,
        "weights_memory": 14.0,
        "peak_activation_memory": 2.0,
        "non_torch_memory": 1.0,
    }
    est = estimate_kv_cache(LLAMA, {"gpu_memory_utilization": 0.5}, mem, 4096)
    assert est["available_kv_gib"] == pytest.approx(23.0, abs=1e-6)
    fixed = estimate_kv_cache(LLAMA, {"kv_cache_memory_bytes": 2 * GIB}, mem, 4096)
    assert fixed["available_kv_bytes"] == 2 * GIB and fixed["gpu_blocks"] == 1024
    over = estimate_kv_cache(LLAMA, {"num_gpu_blocks_override": 100}, mem, 4096)
    assert over["gpu_blocks"] == 100  # kv_cache_utils.py L1230 may_override_num_blocks


def test_max_fitting_context_and_block_rounding() -> None:
    """Concurrency counts whole blocks per request: cdiv(max_model_len, block_size)
    (v1/kv_cache_interface.py L602-L607); vLLM prints int(concurrency x max_model_len)
    (kv_cache_utils.py L2308), so a cap off the block grid prints less than blocks x 16."""
    mem = {"available_kv_cache": 2.0}  # 1024 blocks of 2 MiB
    got = max_fitting_context(LLAMA, {"block_size": 16}, mem, concurrency=4)
    assert got == {"kv_cache_tokens": 16384, "concurrency": 4, "max_model_len": 4096}
    est = estimate_kv_cache(LLAMA, {"block_size": 16}, mem, got["max_model_len"])
    assert est["fits"] and est["maximum_concurrency"] == 4.0
    odd = estimate_kv_cache(LLAMA, {"block_size": 16}, mem, 4100)  # 257 blocks a request
    assert odd["blocks_per_request"] == 257
    assert odd["kv_cache_tokens"] == int(1024 / 257 * 4100) == 16336
    # the null block: one request fits while blocks_per_request + 1 <= blocks
    # (kv_cache_utils.py L2630-L2646)
    assert estimate_kv_cache(LLAMA, {}, mem, 1023 * 16)["fits"] is True
    assert estimate_kv_cache(LLAMA, {}, mem, 1024 * 16)["fits"] is False
    assert est["max_fitting_model_len"] == 1023 * 16


# --- MLA


DEEPSEEK_R1 = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "hidden_size": 7168,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "num_nextn_predict_layers": 1,
    "n_routed_experts": 256,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 163840,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
}


def test_mla_latent_on_every_rank() -> None:
    """MLA stores one latent of kv_lora_rank + qk_rope_head_dim per token per layer
    (model_arch_config_convertor.py L96) on every TP rank (mla_attention.py L1356
    ``num_kv_heads=1``); ``fp8_ds_mla`` packs 656 bytes (mla_attention.py L1365)."""
    one = kv_bytes_per_token(DEEPSEEK_R1, {"kv_cache_dtype": "fp8"})
    eight = kv_bytes_per_token(DEEPSEEK_R1, {"kv_cache_dtype": "fp8", "tensor_parallel_size": 8})
    assert one["mla"] and one["kv_bytes_per_token"] == eight["kv_bytes_per_token"] == 61 * 576
    assert kv_bytes_per_token(DEEPSEEK_R1)["kv_bytes_per_token"] == 61 * 576 * 2
    packed = kv_bytes_per_token(DEEPSEEK_R1, {"kv_cache_dtype": "fp8_ds_mla"})
    assert packed["kv_bytes_per_token"] == 61 * 656
    with pytest.raises(KVConfigError):
        kv_bytes_per_token(LLAMA, {"kv_cache_dtype": "fp8_ds_mla"})


def test_mla_only_for_model_types_vllm_sizes_as_mla() -> None:
    """``is_deepseek_mla`` (model_arch_config_convertor.py L314-L345): kv_lora_rank on a
    model type outside the list is model code (MiniCPM3); DeepSeek-V3.2 adds an indexer
    cache: both unknown, never sized as DeepSeek."""
    with pytest.raises(KVCacheUnknown) as err:
        kv_bytes_per_token({**DEEPSEEK_R1, "model_type": "minicpm3"})
    assert err.value.loc == ("model", "kv_lora_rank")
    with pytest.raises(KVCacheUnknown):
        kv_bytes_per_token({**DEEPSEEK_R1, "model_type": "deepseek_v32", "index_topk": 2048})


# --- speculative decoding


def test_mtp_counted_from_speculative_config_and_model_config() -> None:
    """A public recipe (HYGON-AI/inference-cookbook-das#224, DeepSeek-R1 on vLLM):
    ``--speculative_config '{"method": "deepseek_mtp", "num_speculative_tokens": 2,
    "quantization": "slimquant_marlin"}' --kv-cache-dtype fp8_e4m3``. vLLM maps the old
    method name to ``mtp`` (config/speculative.py L1141-L1145), builds
    ``num_nextn_predict_layers`` MTP layers (model_executor/models/deepseek_mtp.py L152)
    with the target's attention, registered with the target's (gpu_model_runner.py
    L7146-L7181: one pool); k = 2 > 1 module is allowed when divisible (speculative.py
    L1493-L1501)."""
    spec = {
        "method": "deepseek_mtp",
        "num_speculative_tokens": 2,
        "quantization": "slimquant_marlin",
    }
    eng = {"tensor_parallel_size": 8, "kv_cache_dtype": "fp8_e4m3", "speculative_config": spec}
    shape = kv_bytes_per_token(DEEPSEEK_R1, eng)
    assert shape["kv_bytes_per_token"] == (61 + 1) * 576
    assert shape["drafter_layers_per_rank"] == 1 and shape["ignored_keys"] == []
    assert shape["speculative"]["method"] == "mtp"
    assert shape["speculative"]["source"] == "model config num_nextn_predict_layers = 1"
    plain = kv_bytes_per_token(
        DEEPSEEK_R1, {"tensor_parallel_size": 8, "kv_cache_dtype": "fp8_e4m3"}
    )
    assert plain["kv_bytes_per_token"] == 61 * 576  # no speculative_config: no MTP layer
    # the JSON string vLLM's CLI takes, and the --spec-* shorthands (engine/arg_utils.py L2069)
    as_text = kv_bytes_per_token(DEEPSEEK_R1, {**eng, "speculative_config": json.dumps(spec)})
    flags = kv_bytes_per_token(
        DEEPSEEK_R1, {**eng, "speculative_config": None, "spec_method": "mtp", "spec_tokens": 2}
    )
    assert as_text["kv_bytes_per_token"] == flags["kv_bytes_per_token"] == (61 + 1) * 576
    with pytest.raises(KVConfigError):  # "mutually exclusive" (arg_utils.py L2077-L2080)
        kv_bytes_per_token(DEEPSEEK_R1, {**eng, "spec_method": "mtp"})
    with pytest.raises(KVConfigError):  # 3 tokens over 2 modules (speculative.py L1493)
        kv_bytes_per_token(
            {**DEEPSEEK_R1, "num_nextn_predict_layers": 2},
            {**eng, "speculative_config": {"method": "mtp", "num_speculative_tokens": 3}},
        )


def test_mtp_with_grouped_query_attention_glm45() -> None:
    """GLM-4.5-Air (zai-org/GLM-4.5-Air config: Glm4MoeForCausalLM, 46 layers, 96 heads,
    8 KV heads, head_dim 128, num_nextn_predict_layers 1): vLLM's Glm4MoeMTP builds one
    MTP layer (model_executor/models/glm4_moe_mtp.py L136) with 8 KV heads split over TP;
    draft_tensor_parallel_size 1 keeps all 8 on each rank (speculative.py L1712-L1743)."""
    glm = {
        "model_type": "glm4_moe",
        "architectures": ["Glm4MoeForCausalLM"],
        "num_hidden_layers": 46,
        "num_attention_heads": 96,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_size": 4096,
        "num_nextn_predict_layers": 1,
        "partial_rotary_factor": 0.5,
        "first_k_dense_replace": 1,
        "torch_dtype": "bfloat16",
        "use_qk_norm": False,
        "n_routed_experts": 128,
    }
    eng = {
        "tensor_parallel_size": 4,
        "speculative_config": {"method": "mtp", "num_speculative_tokens": 1},
    }
    per_layer = 2 * 2 * 128 * 2  # 8 // 4 heads, K and V, bf16
    assert kv_bytes_per_token(glm, eng)["kv_bytes_per_token"] == 47 * per_layer
    tp1 = {
        **eng,
        "speculative_config": {**eng["speculative_config"], "draft_tensor_parallel_size": 1},
    }
    assert kv_bytes_per_token(glm, tp1)["kv_bytes_per_token"] == 46 * per_layer + 4 * per_layer
    with pytest.raises(KVConfigError):
        kv_bytes_per_token(
            glm, {**eng, "speculative_config": {"method": "mtp", "draft_tensor_parallel_size": 2}}
        )
    with pytest.raises(KVCacheUnknown) as err:  # no MTP modules in the config
        kv_bytes_per_token({**glm, "num_nextn_predict_layers": 0}, eng)
    assert err.value.loc == ("model", "num_nextn_predict_layers")


LLAMA31_8B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
    "head_dim": 128,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
    "vocab_size": 128256,
}
#: yuhuili/EAGLE3-LLaMA3.1-Instruct-8B config.json: one decoder layer, the target's heads.
EAGLE3_HEAD = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama",
    "num_hidden_layers": 1,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "draft_vocab_size": 32000,
    "vocab_size": 128256,
    "torch_dtype": "float16",
}


def test_eagle3_head_from_its_own_config() -> None:
    """EAGLE-3 adds ``num_hidden_layers`` decoder layers of its own config
    (model_executor/models/llama_eagle3.py L206); the method is inferred from the model
    name when omitted (speculative.py L1336); without the drafter's config the KV cache
    is unknown, not a guess."""
    spec = {"model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 3}
    shape = kv_bytes_per_token(LLAMA31_8B, {"speculative_config": spec}, draft_config=EAGLE3_HEAD)
    assert shape["speculative"]["method"] == "eagle3"
    assert shape["kv_bytes_per_token"] == 33 * 2 * 8 * 128 * 2
    assert shape["ignored_keys"] == []
    with pytest.raises(KVCacheUnknown) as err:
        kv_bytes_per_token(LLAMA31_8B, {"speculative_config": spec})
    assert err.value.loc == ("draft_model",)


def test_draft_model_with_other_heads_shares_the_pool() -> None:
    """A separate draft model's layers are full attention of another shape: one group whose
    page is the sum of the layers' pages (``UniformTypeKVCacheSpecs``,
    v1/kv_cache_interface.py L1225-L1258). Llama-3.1-70B at TP 4 (80 layers, 8 KV heads)
    with meta-llama/Llama-3.2-1B (16 layers, 8 KV heads, head_dim 64) at draft TP 1."""
    l70 = {**LLAMA31_8B, "num_hidden_layers": 80, "num_attention_heads": 64, "hidden_size": 8192}
    l1b = {
        "model_type": "llama",
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "hidden_size": 2048,
    }
    spec = {
        "method": "draft_model",
        "model": "meta-llama/Llama-3.2-1B",
        "num_speculative_tokens": 4,
        "draft_tensor_parallel_size": 1,
    }
    eng = {"tensor_parallel_size": 4, "speculative_config": spec}
    shape = kv_bytes_per_token(l70, eng, draft_config=l1b)
    assert shape["kv_bytes_per_token"] == 80 * 2 * 2 * 128 * 2 + 16 * 2 * 8 * 64 * 2
    assert len(shape["kv_cache_groups"]) == 1 and shape["drafter_layers_per_rank"] == 16


@pytest.mark.parametrize(
    "spec",
    [
        {"model": "ngram", "num_speculative_tokens": 5},
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
        {"method": "suffix"},
        {
            "method": "medusa",
            "model": "FasterDecoding/medusa-vicuna-7b-v1.3",
            "num_speculative_tokens": 2,
        },
    ],
)
def test_proposers_without_kv_cache(spec: dict[str, Any]) -> None:
    """ngram, suffix, Medusa keep no KV cache (``uses_draft_kv_cache``, speculative.py
    L1966-L1971; ngram inferred from model "ngram", L1136)."""
    shape = kv_bytes_per_token(LLAMA, {"speculative_config": spec})
    assert shape["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2
    assert shape["speculative"]["drafter_kv_layers"] == 0


# --- keys the estimator does not know


def test_unknown_keys_are_listed_with_a_reason() -> None:
    """Known-irrelevant keys (RoPE, MoE, token ids, vLLM's scheduling arguments) pass
    silently; an unknown key is listed with the reason; an argument that changes the KV
    cache in a way not modelled (decode context parallelism, skipped KV dtype layers) makes
    the estimate unknown."""
    model = {**LLAMA31_8B, "n_shared_experts": 1, "attn_magic_ratio": 3}
    eng = {
        "max_num_seqs": 256,
        "enable_prefix_caching": True,
        "tensor_paralel_size": 2,
        "speculative_config": {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "lookahead_slots": 9,
        },
    }
    shape = kv_bytes_per_token(model, eng)
    keys = {(e["key"], e["source"]) for e in shape["ignored_keys"]}
    assert keys == {
        ("attn_magic_ratio", "model"),
        ("tensor_paralel_size", "engine"),
        ("speculative_config.lookahead_slots", "engine"),
    }
    assert all("not known to the estimator" in e["reason"] for e in shape["ignored_keys"])
    nested = kv_bytes_per_token({"text_config": {**LLAMA31_8B, "odd_flag": True}})
    assert [e["key"] for e in nested["ignored_keys"]] == ["text_config.odd_flag"]
    assert kv_bytes_per_token(LLAMA, {"decode_context_parallel_size": 1})["ignored_keys"] == []
    for key, value in (
        ("decode_context_parallel_size", 2),
        ("kv_cache_dtype_skip_layers", ["sliding_window"]),
        ("kv-sharing-fast-prefill", True),
    ):
        with pytest.raises(KVCacheUnknown) as err:
            kv_bytes_per_token(LLAMA, {key: value})
        assert err.value.loc == ("engine", key.replace("-", "_"))


def test_a_runs_resolved_engine_args_are_all_known() -> None:
    """The resolved engine arguments a vLLM 0.32 run stores (317 keys) are all classified."""
    run = _demo_run()
    shape = kv_bytes_per_token(_SMALL, run["engine_args"])
    assert shape["ignored_keys"] == []


def test_given_bytes_per_token_for_a_model_not_modelled() -> None:
    """A hybrid linear-attention model (mitchross/talos-argocd-proxmox#1995: Qwen3.8-27B,
    ``full_attention_interval: 4``, "16 layers x 4 kv-heads x 256 head-dim x 2 (K,V) x 1B fp8
    = 32 KiB/token") is unknown from its config; the caller's 32 KiB/token is used and the
    answer says so."""
    hybrid = {
        "model_type": "qwen3_5",
        "num_hidden_layers": 64,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "full_attention_interval": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    }
    with pytest.raises(KVCacheUnknown) as err:
        kv_bytes_per_token(hybrid)
    assert err.value.loc == ("model", "full_attention_interval")
    est = estimate_kv_cache(
        hybrid, {"block_size": 16}, {"available_kv_cache": 9.24}, 131072, kv_bytes_per_token=32768
    )
    assert est["kv_bytes_per_token_source"] == "given" and est["kv_bytes_per_token"] == 32768
    assert est["kv_bytes_per_token_modelled"] is None
    assert est["gpu_blocks"] == int(9.24 * GIB) // (32768 * 16)
    assert any("32768 given" in n for n in est["notes"])
    alone = estimate_kv_cache(None, {}, {"available_kv_cache": 1.0}, 4096, kv_bytes_per_token=8192)
    assert alone["kv_cache_tokens"] == 131072 and alone["maximum_concurrency"] == 32.0


# --- sliding windows and hybrid groups

GPT_OSS_20B = {
    "model_type": "gpt_oss",
    "architectures": ["GptOssForCausalLM"],
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "hidden_size": 2880,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "num_local_experts": 32,
    "experts_per_token": 4,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 131072,
}
SW_ENGINE = {"max_num_batched_tokens": 8192, "async_scheduling": True}


def _sw_blocks(window: int, length: int, in_flight: int, block: int = 16) -> int:
    """SlidingWindowSpec.max_admission_blocks_per_request (v1/kv_cache_interface.py
    L859-L885): cdiv(min(window - 1 + in_flight, max_model_len), block) + 1."""
    return math.ceil(min(window - 1 + in_flight, length) / block) + 1


def test_gpt_oss_hybrid_groups() -> None:
    """gpt-oss-20b (openai/gpt-oss-20b config: 24 layers alternating sliding (128) and full,
    8 KV heads, head_dim 64): two groups of 12 (kv_cache_utils.py L1362-L1502); a block
    spans 12 layers; a request takes cdiv(L, 16) full blocks plus the window's, with
    2 x max_num_batched_tokens in flight under async scheduling (config/vllm.py
    L577-L598)."""
    est = estimate_kv_cache(GPT_OSS_20B, SW_ENGINE, {"available_kv_cache": 4.0}, 32768)
    page = 16 * 8 * 64 * 2 * 2
    assert [g["layers"] for g in est["kv_cache_groups"]] == [12, 12]
    assert est["block_bytes"] == 12 * page and est["gpu_blocks"] == 4 * GIB // (12 * page)
    bpr = 2048 + _sw_blocks(128, 32768, 2 * 8192)
    assert est["blocks_per_request"] == bpr
    assert est["kv_cache_tokens"] == int(est["gpu_blocks"] / bpr * 32768)
    assert est["kv_bytes_per_token"] == 12 * page // 16  # one full group per block slot
    off = estimate_kv_cache(
        GPT_OSS_20B,
        {**SW_ENGINE, "disable_hybrid_kv_cache_manager": True},
        {"available_kv_cache": 4.0},
        32768,
    )
    assert len(off["kv_cache_groups"]) == 1 and off["blocks_per_request"] == 2048
    with pytest.raises(KVCacheUnknown) as err:  # the in-flight tokens depend on it
        estimate_kv_cache(GPT_OSS_20B, {}, {"available_kv_cache": 4.0}, 32768)
    assert err.value.loc == ("engine", "max_num_batched_tokens")


def test_gpt_oss_with_eagle_pads_to_thirteen() -> None:
    """vLLM's own example (kv_cache_utils.py L1464-L1470): "gpt-oss-20b + eagle, with 12 sw +
    13 full. We pad it to (13 sw, 13 full)": the EAGLE-3 head's full-attention layer joins
    the full group and a block spans 13 layers."""
    head = {
        "model_type": "llama",
        "num_hidden_layers": 1,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "hidden_size": 2880,
    }
    spec = {"method": "eagle3", "model": "nvidia/gpt-oss-20b-Eagle3", "num_speculative_tokens": 3}
    est = estimate_kv_cache(
        GPT_OSS_20B,
        {**SW_ENGINE, "speculative_config": spec},
        {"available_kv_cache": 4.0},
        32768,
        draft_config=head,
    )
    assert [g["layers"] for g in est["kv_cache_groups"]] == [12, 13]
    assert est["block_bytes"] == 13 * 16 * 8 * 64 * 2 * 2


def test_sliding_window_without_layer_types() -> None:
    """Without ``layer_types`` vLLM gives every layer the model-level window
    (engine/arg_utils.py L2250-L2254, attention.py L271): Mistral-7B-v0.1 (sliding_window
    4096) slides everywhere, so the KV cache sets no length cap. transformers derives
    ``layer_types`` for Gemma 3 (models/gemma3/configuration_gemma3.py L112, pattern 6);
    Qwen2's ``use_sliding_window: false`` means no window; for a model type the estimator
    does not know, which layers slide is model code: unknown."""
    mistral = {
        "model_type": "mistral",
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
        "sliding_window": 4096,
    }
    est = estimate_kv_cache(mistral, SW_ENGINE, {"available_kv_cache": 4.0}, 32768)
    assert est["kv_cache_groups"] == [
        {"kind": "sliding", "sliding_window": 4096, "layers": 32, "block_size": 16}
    ]
    assert est["blocks_per_request"] == _sw_blocks(4096, 32768, 16384)
    assert est["max_fitting_model_len"] is None
    gemma3 = {
        "model_type": "gemma3_text",
        "num_hidden_layers": 62,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 168,
    }
    groups = estimate_kv_cache(gemma3, SW_ENGINE, {"available_kv_cache": 8.0}, 8192)
    kinds = [(g["kind"], g["layers"]) for g in groups["kv_cache_groups"]]
    assert kinds == [
        ("sliding", 9),
        ("sliding", 9),
        ("sliding", 9),
        ("sliding", 9),
        ("sliding", 8),
        ("sliding", 8),
        ("full", 10),
    ]
    qwen = {**LLAMA, "model_type": "qwen2", "sliding_window": 131072, "use_sliding_window": False}
    assert kv_bytes_per_token(qwen)["kv_cache_groups"][0]["kind"] == "full"
    with pytest.raises(KVCacheUnknown) as err:
        kv_bytes_per_token({**LLAMA, "model_type": "starcoder3", "sliding_window": 4096})
    assert err.value.loc == ("model", "sliding_window")


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("layers_block_type", ["mamba", "attention"]),
        ("cross_attention_layers", [3, 8]),
        ("num_kv_shared_layers", 15),
        ("attn_type_list", [0, 1]),
    ],
)
def test_structures_not_modelled_are_unknown(key: str, value: Any) -> None:
    """Jamba's Mamba layers, Mllama's cross-attention, Gemma 3n's shared KV layers, MiniMax's
    linear attention keep caches this estimator does not size: unknown, named."""
    with pytest.raises(KVCacheUnknown) as err:
        kv_bytes_per_token({**LLAMA, key: value})
    assert err.value.loc == ("model", key)


def test_multimodal_text_config_and_chunked_attention() -> None:
    """A multimodal config's text model is ``text_config`` (vLLM ``get_hf_text_config``);
    the vision encoder keeps no KV cache. Llama 4's chunked local attention runs with the
    hybrid manager off, so every layer is sized as full attention (config/vllm.py
    L2149-L2168)."""
    scout = {
        "model_type": "llama4",
        "architectures": ["Llama4ForConditionalGeneration"],
        "text_config": {
            "model_type": "llama4_text",
            "num_hidden_layers": 48,
            "num_attention_heads": 40,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "hidden_size": 5120,
            "attention_chunk_size": 8192,
            "no_rope_layers": [1, 1, 1, 0] * 12,
            "interleave_moe_layer_step": 1,
            "num_local_experts": 16,
        },
        "vision_config": {"hidden_size": 1408},
        "torch_dtype": "bfloat16",
    }
    shape = kv_bytes_per_token(scout, {"tensor_parallel_size": 8})
    assert shape["kv_bytes_per_token"] == 48 * 2 * 1 * 128 * 2
    assert any("attention_chunk_size" in n for n in shape["notes"])
    assert shape["ignored_keys"] == []


def test_hf_overrides_are_applied() -> None:
    shape = kv_bytes_per_token(LLAMA, {"hf_overrides": {"num_hidden_layers": 16}})
    assert shape["kv_bytes_per_token"] == 16 * 2 * 8 * 128 * 2


# --- the per-run check: estimate next to the engine's own start-up figures

_DEMO = Path(__file__).resolve().parents[2] / "web" / "data" / "demo_experiment.json"


def _demo_run() -> dict:
    return json.loads(_DEMO.read_text())["experiment"]["runs"][1]


# config.json of the generated "small" demo model (jobs/modelgen/generator.py)
_SMALL = {
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "hidden_size": 512,
    "dtype": "bfloat16",
}


def test_check_against_a_real_engine_start_agrees() -> None:
    run = _demo_run()
    facts = run["engine_info"]["startup_facts"]  # vLLM 0.32 CPU: 1 GiB, 131,072 tokens, 64x
    check = check_against_engine(_SMALL, run["engine_args"], facts)
    assert check is not None
    # 2 (K,V) * 8 layers * 4 KV heads * 64 * 2 bytes = 8 KiB per token; 1 GiB / 8 KiB
    assert check["estimate"]["kv_bytes_per_token"] == 8192
    assert check["estimate"]["kv_cache_tokens"] == facts["kv_cache_size_tokens"] == 131072
    assert check["estimate"]["maximum_concurrency"] == facts["max_concurrency"] == 64.0
    assert check["difference_tokens"] == 0 and check["agrees"] is True
    assert check["printed_formula"] == "group-aware"


def test_check_flags_a_figure_beyond_rounding() -> None:
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


def test_check_says_unknown_instead_of_a_number() -> None:
    run = _demo_run()
    facts = run["engine_info"]["startup_facts"]
    check = check_against_engine(
        {**_SMALL, "layers_block_type": ["mamba"] * 8}, run["engine_args"], facts
    )
    assert check is not None and check["estimate"] is None and check["agrees"] is None
    assert check["unknown"]["field"] == "model.layers_block_type"
    assert check["engine"]["kv_cache_tokens"] == 131072


def test_check_reads_the_older_printed_count_by_version() -> None:
    """Before the group-aware count, V1 printed ``num_blocks // len(groups) * block_size``
    (``_report_kv_cache_config``, vllm-project/vllm#38364 "Fix incorrect KV cache log
    output"); a hybrid model's two counts differ, and the engine's version decides which
    applies (0.32.0: group-aware only)."""
    est = estimate_kv_cache(GPT_OSS_20B, SW_ENGINE, {"available_kv_cache": 4.0}, 32768)
    legacy = est["gpu_blocks"] // 2 * 16
    facts = {
        "available_kv_cache_memory_gib": 4.0,
        "kv_cache_size_tokens": legacy,
        "max_concurrency_context_tokens": 32768,
        "kv_cache_device": "GPU",
    }
    eng = {**SW_ENGINE, "block_size": 16}
    old = check_against_engine(GPT_OSS_20B, eng, {**facts, "vllm_version": "0.11.0"})
    assert old is not None and old["agrees"] is True and old["printed_formula"] == "blocks"
    new = check_against_engine(GPT_OSS_20B, eng, {**facts, "vllm_version": "0.32.0"})
    assert new is not None and new["agrees"] is False and new["printed_formula"] == "group-aware"


# --- memory figures and a given bytes-per-token (trial of 2026-12-04) ---------------------


@pytest.mark.parametrize(
    ("memory", "engine", "loc"),
    [
        # the total alone: weights and peaks taken as 0 gave 72 GiB of KV cache on 80
        ({"total_gpu_memory": 80}, {}, ("memory_gib", "peak_torch_memory")),
        # a typo drops a figure: refused, naming it
        (
            {"total_gpu_memory": 80, "weights_memory": 15, "peak_activaton_memory": 4},
            {},
            ("memory_gib", "peak_activaton_memory"),
        ),
        ({"peak_torch_memory": 20}, {}, ("memory_gib", "total_gpu_memory")),
        ({"available_kv_cache": float("nan")}, {}, ("memory_gib", "available_kv_cache")),
        ({"available_kv_cache": -5}, {}, ("memory_gib", "available_kv_cache")),
        ({"available_kv_cache": "10 GiB"}, {}, ("memory_gib", "available_kv_cache")),
        # 0 is not "unset": vLLM refuses it (CacheConfig gpu_memory_utilization gt=0, le=1)
        (
            {"total_gpu_memory": 80, "peak_torch_memory": 20},
            {"gpu_memory_utilization": 0},
            ("engine", "gpu_memory_utilization"),
        ),
    ],
)
def test_memory_figures_that_would_inflate_the_estimate_are_refused(
    memory: dict[str, Any], engine: dict[str, Any], loc: tuple[str, ...]
) -> None:
    with pytest.raises(KVConfigError) as info:
        estimate_kv_cache(LLAMA, engine, memory, 8192)
    assert info.value.loc == loc


def test_memory_profile_follows_determine_available_memory() -> None:
    """vllm/v1/worker/gpu_worker.py determine_available_memory: requested memory (total x
    gpu_memory_utilization) minus the profile's torch peak and non-torch memory."""
    est = estimate_kv_cache(
        LLAMA,
        {"gpu_memory_utilization": 0.5},
        {
            "total_gpu_memory": 80,
            "weights_memory": 15,
            "peak_activation_memory": 4,
            "non_torch_memory": 1,
        },
        8192,
    )
    assert est["available_kv_bytes"] == int((80 * 0.5 - 15 - 4 - 1) * 2**30)


def test_given_bytes_per_token_still_lists_unknown_keys_and_says_what_it_leaves_out() -> None:
    engine = {
        "speculative_config": {"method": "eagle", "model": "x", "num_speculative_tokens": 3},
        "frobnicate": 1,
    }
    est = estimate_kv_cache(
        None, engine, {"available_kv_cache": 10}, 8192, kv_bytes_per_token=131072
    )
    assert [k["key"] for k in est["ignored_keys"]] == ["frobnicate"]
    assert any("speculative_config is not added" in n for n in est["notes"])
