"""Tests of :func:`jobs.engine.queries.resolve_engine_configs` (the launcher's ``resolve``).

The renderer of the standalone launcher must agree with
:func:`jobs.engine.command.render_engine_args` (no engine needed). With vLLM
(``needs_engine``): the configuration vLLM 0.32 CPU really resolves for the
tiny model, including the defaults it derives from other settings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from jobs.engine.command import RESERVED_ENGINE_ARGS, render_engine_args
from jobs.engine.queries import resolve_engine_configs
from jobs.engine.server import EngineError
from jobs.launcher import resolve as launcher_resolve
from tests.conftest import ENGINE_PYTHON, needs_engine


@pytest.mark.parametrize(
    "args",
    [
        {},
        {"enable_prefix_caching": True, "max_model_len": 2048, "load_format": "dummy"},
        {"enable_prefix_caching": False, "gpu_memory_utilization": 0.5, "max_num_seqs": None},
        {
            "compilation_config": {"mode": 0},
            "ignore_patterns": ["a", "b"],
            "tokenizer_mode": "auto",
        },
        {"ignore_patterns": [], "kv-cache-dtype": "auto"},
    ],
)
def test_launcher_renders_like_jobs_engine(args: dict[str, Any]) -> None:
    assert launcher_resolve.render_engine_args(args) == render_engine_args(args)


def test_launcher_refuses_reserved_args_like_jobs_engine() -> None:
    for reserved in ("model", "port", "host", "served_model_name"):
        with pytest.raises(ValueError):
            launcher_resolve.render_engine_args({reserved: "x"})
    assert launcher_resolve.RESERVED_ENGINE_ARGS == RESERVED_ENGINE_ARGS


def test_resolve_with_a_broken_engine_python_raises(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'Traceback: boom' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(EngineError) as info:
        resolve_engine_configs(str(fake), str(tmp_path), [{}], timeout_s=30)
    assert "exited with code 3" in str(info.value)


# --------------------------------------------------------------------------- real vLLM

BASE = {"load_format": "dummy"}


@pytest.mark.engine
@needs_engine
def test_resolve_real_derived_defaults(tiny_model_dir: Path) -> None:
    assert ENGINE_PYTHON is not None
    configs: list[dict[str, Any]] = [
        {**BASE, "max_model_len": 2048},  # 0
        {**BASE, "max_model_len": 4096},  # 1
        {**BASE, "max_model_len": 4096, "enable_chunked_prefill": False},  # 2
        {**BASE, "max_model_len": 2048, "enable_prefix_caching": None},  # 3
        {**BASE, "max_model_len": 2048, "enable_prefix_caching": False},  # 4
        {**BASE, "max_model_len": 99_999},  # 5: above the model's 16384
        {**BASE, "max_model_len": 2048, "tensor_parallel_size": 2},  # 6
        {**BASE, "block_size": "not-a-number"},  # 7
        {**BASE},  # 8: max_model_len from the model
    ]
    doc = resolve_engine_configs(ENGINE_PYTHON, str(tiny_model_dir), configs)
    assert doc["vllm_version"].startswith("0.")
    res = doc["results"]
    assert len(res) == len(configs)
    for i in (0, 1, 2, 3, 4, 6, 8):
        assert res[i]["ok"] is True, res[i]
    cfg = [r.get("config", {}) for r in res]

    c0 = cfg[0]
    assert c0["model_config.max_model_len"] == 2048
    assert c0["model_config.dtype"] == "bfloat16"
    assert c0["model_config.quantization"] is None
    assert c0["load_config.load_format"] == "dummy"
    assert c0["parallel_config.tensor_parallel_size"] == 1
    assert c0["parallel_config.pipeline_parallel_size"] == 1
    assert c0["parallel_config.data_parallel_size"] == 1
    assert c0["parallel_config.distributed_executor_backend"] == "mp"  # CPU: uni -> mp
    assert c0["cache_config.block_size"] == 128  # CPU default
    assert c0["cache_config.kv_cache_memory_bytes"] == 1 << 30  # VLLM_CPU_KVCACHE_SPACE=1
    assert c0["scheduler_config.enable_chunked_prefill"] is True
    assert c0["scheduler_config.long_prefill_token_threshold"] == 0
    assert isinstance(c0["compilation_config.mode"], str)
    assert "model_config.hf_config" not in c0  # objects are left out

    # vLLM 0.32 CPU, serve: max_num_batched_tokens = 2048 x world size, max_num_seqs
    # = 128 x world size; with chunked prefill (the default) it does not follow
    # max_model_len ...
    assert c0["scheduler_config.max_num_batched_tokens"] == 2048
    assert c0["scheduler_config.max_num_seqs"] == 128
    assert cfg[1]["scheduler_config.max_num_batched_tokens"] == 2048
    assert cfg[8]["model_config.max_model_len"] == 16384
    assert cfg[8]["scheduler_config.max_num_batched_tokens"] == 2048
    # ... without chunked prefill it is raised to max_model_len ...
    assert cfg[2]["scheduler_config.max_num_batched_tokens"] == 4096
    # ... and TP=2 doubles both.
    assert cfg[6]["scheduler_config.max_num_batched_tokens"] == 4096
    assert cfg[6]["scheduler_config.max_num_seqs"] == 256
    assert cfg[6]["parallel_config.world_size"] == 2

    # APC: unset (None) resolves to on for this model; False stays off.
    assert cfg[3]["cache_config.enable_prefix_caching"] is True
    assert c0["cache_config.enable_prefix_caching"] is True
    assert cfg[4]["cache_config.enable_prefix_caching"] is False
    differing = {k for k in cfg[3] if cfg[3][k] != cfg[4].get(k)}
    assert differing == {"cache_config.enable_prefix_caching"}

    # Rejected configs: vLLM's own message, not a crash.
    assert res[5]["ok"] is False
    assert "max_model_len" in res[5]["error"] and "99999" in res[5]["error"]
    assert res[7]["ok"] is False
    assert "block-size" in res[7]["error"] or "block_size" in res[7]["error"]


@pytest.mark.engine
@needs_engine
def test_resolve_real_env_and_reserved_arg(tiny_model_dir: Path) -> None:
    assert ENGINE_PYTHON is not None
    doc = resolve_engine_configs(
        ENGINE_PYTHON,
        str(tiny_model_dir),
        [{**BASE, "max_model_len": 1024}, {"model": "elsewhere"}],
        env={"VLLM_CPU_KVCACHE_SPACE": "2"},
    )
    first, second = doc["results"]
    assert first["ok"] is True
    assert first["config"]["cache_config.kv_cache_memory_bytes"] == 2 << 30
    assert first["argv"][:2] == ["serve", str(tiny_model_dir)]
    assert second["ok"] is False and "set by the launch" in second["error"]
