"""Run vLLM 0.32.0's own KV cache sizing on hand-built layer specs (stdin: JSON cases).

Run with the engine venv's python by tests/orchestrator/analysis/test_kvcache.py
(``test_matches_vllm_own_sizing``); prints one JSON list of results.
"""

import json
import re
import sys
from types import SimpleNamespace as NS

import torch
from vllm.v1.core import kv_cache_utils as ku
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

DT = {"bf16": torch.bfloat16, "fp8": torch.uint8}


def spec(d, bs):
    if d["kind"] == "mla":
        return MLAAttentionSpec(
            block_size=bs,
            num_kv_heads=1,
            head_size=d["head"],
            dtype=DT[d["dtype"]],
            cache_dtype_str=d.get("cache", "auto"),
        )
    if d["kind"] == "sliding":
        return SlidingWindowSpec(
            block_size=bs,
            num_kv_heads=d["heads"],
            head_size=d["head"],
            dtype=DT[d["dtype"]],
            sliding_window=d["window"],
        )
    return FullAttentionSpec(
        block_size=bs, num_kv_heads=d["heads"], head_size=d["head"], dtype=DT[d["dtype"]]
    )


def run(case):
    bs, L = case["block_size"], case["L"]
    cache = NS(
        num_gpu_blocks_override=case.get("override"),
        prefix_cache_retention_interval=0,
        get_resolved_kv_cache_layout=lambda: KVCacheLayout.LBHNC,
    )
    cfg = NS(
        cache_config=cache,
        model_config=NS(max_model_len=L, original_max_model_len=L),
        scheduler_config=NS(
            disable_hybrid_kv_cache_manager=case.get("disable_hma", False),
            max_num_batched_tokens=case.get("mnbt", 2048),
        ),
        parallel_config=NS(
            tensor_parallel_size=1,
            decode_context_parallel_size=1,
            prefill_context_parallel_size=1,
            pipeline_parallel_size=len(case["workers"]),
        ),
        attention_config=NS(hisparse_config=None),
        speculative_config=None,
        num_prefill_lookahead_tokens=case.get("lookahead", 0),
        max_in_flight_tokens=case.get("in_flight", 0),
        device_config=NS(device_type="cuda"),
    )
    specs, n = [], 0
    for worker in case["workers"]:
        one = {}
        for d in worker:
            for _ in range(d["count"]):
                one[f"model.layers.{n}.attn"] = spec(d, bs)
                n += 1
        specs.append(one)
    avail = [case["avail"]] * len(specs)
    try:
        confs = ku.get_kv_cache_configs(cfg, specs, avail)
    except ValueError as exc:
        m = re.search(r"estimated maximum model length is (\d+)", str(exc))
        g = re.search(r"\(([\d.]+) GiB KV cache is needed", str(exc))
        return {
            "fits": False,
            "estimated_max_len": int(m.group(1)) if m else 0,
            "needed_gib": g.group(1) if g else None,
        }
    sched = ku.generate_scheduler_kv_cache_config(confs)
    tokens, conc = ku.get_kv_cache_capacity(cfg, sched)
    groups = ku.get_kv_cache_groups(cfg, {k: v for s in specs for k, v in s.items()})
    # vLLM checks each worker's own layers (kv_cache_utils.py L2637-L2646)
    needed = max(
        ku._max_memory_usage_bytes_from_groups(
            cfg, ku._project_kv_cache_groups_to_worker(groups, worker)
        )
        for worker in specs
    )
    return {
        "fits": True,
        "num_blocks": sched.num_blocks,
        "groups": len(sched.kv_cache_groups),
        "tokens": tokens,
        "concurrency": conc,
        "needed_bytes": needed,
    }


print(json.dumps([run(c) for c in json.load(sys.stdin)]))
