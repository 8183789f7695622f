"""Which configuration keys the KV cache estimator reads, which it knows to be irrelevant,
and which it reports as ignored.

Every key of the model's ``config.json``, of the engine arguments and of
``speculative_config`` falls in one of four classes:

- **read**: the estimator models it (:data:`MODEL_READ`, :data:`ENGINE_READ`,
  :data:`SPEC_READ`);
- **irrelevant**: known not to change the KV cache's size or layout for the memory the
  engine gives it (:data:`MODEL_IRRELEVANT` plus the prefixes and suffixes of
  :func:`model_key_irrelevant`, :data:`ENGINE_IRRELEVANT`, :data:`SPEC_IRRELEVANT`);
- **changes the KV cache, not modelled**: :data:`ENGINE_UNMODELLED` (and the structural
  model keys :mod:`.layers` checks): at its neutral value it changes nothing; at any other
  value the estimate is *unknown* (a :class:`~.layers.KVCacheUnknown`), never a guess;
- **unknown**: anything else. It is listed in ``ignored_keys`` with the reason, never
  dropped silently: a key the estimator has never seen may change the attention layout.

The engine-argument names are vLLM 0.32.0's ``AsyncEngineArgs`` fields plus the
``vllm serve`` frontend arguments (the resolved arguments a run stores); a newer vLLM's
new arguments show up as unknown until they are classified here.

Size: one classification table per source of keys (the engine arguments alone are some
280 names, one a line so a review sees each); split, the tables and the few functions
that read them would only import each other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "ENGINE_IRRELEVANT",
    "ENGINE_READ",
    "ENGINE_UNMODELLED",
    "MODEL_IRRELEVANT",
    "MODEL_READ",
    "SPEC_IRRELEVANT",
    "SPEC_READ",
    "ignored_engine_keys",
    "ignored_model_keys",
    "ignored_spec_keys",
    "is_neutral",
    "model_key_irrelevant",
    "unmodelled_engine_keys",
    "unmodelled_spec_keys",
]

#: Model config keys the estimator reads (HF names, and the aliases vLLM's
#: ``ModelArchConfigConvertorBase`` reads; ``kv_cache_dtype``, ``use_mla`` and
#: ``extra_kv_layers``/``num_draft_layers``/``num_mtp_layers`` are this product's own).
MODEL_READ = frozenset(
    {
        "architectures",
        "attention_chunk_size",
        "dtype",
        "extra_kv_layers",
        "head_dim",
        "hidden_size",
        "hidden_size_per_head",
        "is_causal",
        "kv_cache_dtype",
        "kv_lora_rank",
        "layer_types",
        "max_position_embeddings",
        "max_seq_len",
        "max_seq_length",
        "max_sequence_length",
        "max_target_positions",
        "max_window_layers",
        "model_max_length",
        "model_type",
        "mtp_num_hidden_layers",
        "multi_query_group_num",
        "n_head_kv",
        "n_positions",
        "num_attention_groups",
        "num_attention_heads",
        "num_draft_layers",
        "num_hidden_layers",
        "num_key_value_heads",
        "num_kv_heads",
        "num_kv_shared_layers",
        "num_mtp_layers",
        "num_nextn_predict_layers",
        "original_max_position_embeddings",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "quantization_config",
        "rope_parameters",
        "rope_scaling",
        "seq_len",
        "seq_length",
        "sliding_window",
        "speculators_model_type",
        "text_config",
        "torch_dtype",
        "transformer_layer_config",
        "use_mla",
        "use_sliding_window",
        "v_head_dim",
    }
)

#: Model config keys known not to change the KV cache (weights, MLP/MoE shapes, RoPE,
#: norms, token ids, generation defaults, encoders: vLLM keeps no KV cache for
#: encoder-only attention, ``attention.py`` ``get_kv_cache_spec``).
MODEL_IRRELEVANT = frozenset(
    {
        "add_cross_attention",
        "attention_bias",
        "attention_multiplier",
        "attn_implementation",
        "auto_map",
        "bad_words_ids",
        "bias",
        "boi_token_index",
        "chunk_size_feed_forward",
        "decoder_sparse_step",
        "diversity_penalty",
        "draft_vocab_size",
        "eagle_aux_hidden_state_layer_ids",
        "eagle_config",
        "fc_norm",
        "do_sample",
        "early_stopping",
        "embedding_multiplier",
        "eoi_token_index",
        "ep_size",
        "final_logit_softcapping",
        "finetuning_task",
        "hidden_act",
        "id2label",
        "image_seq_length",
        "interleave_moe_layer_step",
        "intermediate_size",
        "is_decoder",
        "label2id",
        "length_penalty",
        "logits_scaling",
        "max_length",
        "min_length",
        "mlp_bias",
        "mlp_only_layers",
        "multimodal_projector_bias",
        "no_repeat_ngram_size",
        "norm_before_fc",
        "norm_before_residual",
        "norm_output",
        "no_rope_layers",
        "norm_topk_prob",
        "num_beam_groups",
        "num_beams",
        "num_local_experts",
        "num_return_sequences",
        "pad_vocab_size_multiple",
        "partial_rotary_factor",
        "prefix",
        "pretraining_tp",
        "problem_type",
        "projector_hidden_act",
        "pruned_heads",
        "q_lora_rank",
        "query_pre_attn_scalar",
        "remove_invalid_values",
        "repetition_penalty",
        "residual_multiplier",
        "rms_norm_eps",
        "scoring_func",
        "seq_aux",
        "sep_token_id",
        "shared_expert_intermediate_size",
        "spatial_merge_size",
        "suppress_tokens",
        "task_specific_params",
        "temperature",
        "text_config_dict",
        "tf_legacy_loss",
        "tie_encoder_decoder",
        "target_hidden_size",
        "tie_word_embeddings",
        "tokenizer_class",
        "top_k",
        "top_p",
        "torchscript",
        "transformers_version",
        "truncated_vocab_size",
        "typical_p",
        "use_bfloat16",
        "use_cache",
        "use_qk_norm",
        "use_return_dict",
        "vision_feature_layer",
        "vision_feature_select_strategy",
        "vocab_size",
    }
)

_MODEL_IRRELEVANT_PREFIXES = (
    "_",
    "aux_loss",
    "audio_",
    "expert",
    "first_k_dense",
    "image_",
    "initializer_",
    "layer_norm",
    "mm_",
    "moe_",
    "n_group",
    "n_routed",
    "n_shared",
    "norm_",
    "num_experts",
    "output_",
    "return_",
    "rope_",
    "routed_",
    "router_",
    "topk_",
    "video_",
    "vision_",
)
_MODEL_IRRELEVANT_SUFFIXES = (
    "_act",
    "_dropout",
    "_dropout_prob",
    "_eps",
    "_epsilon",
    "_pdrop",
    "_softcapping",
    "_token_id",
    "_token_ids",
    "_token_index",
)


def model_key_irrelevant(key: str) -> bool:
    """Whether a model config key is known not to change the KV cache."""
    return (
        key in MODEL_IRRELEVANT
        or key.startswith(_MODEL_IRRELEVANT_PREFIXES)
        or key.endswith(_MODEL_IRRELEVANT_SUFFIXES)
    )


#: Engine arguments the estimator reads (vLLM names; ``-`` and ``_`` are the same).
ENGINE_READ = frozenset(
    {
        "async_scheduling",
        "block_size",
        "disable_hybrid_kv_cache_manager",
        "disable_sliding_window",
        "dtype",
        "gpu_memory_utilization",
        "hf_overrides",
        "kv_cache_dtype",
        "kv_cache_memory_bytes",
        "max_model_len",
        "max_num_batched_tokens",
        "num_gpu_blocks_override",
        "pipeline_parallel_size",
        "spec_method",
        "spec_model",
        "spec_tokens",
        "speculative_config",
        "tensor_parallel_size",
    }
)


def _none_or(*values: Any) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        return value is None or value in values

    return check


def _empty(value: Any) -> bool:
    return value is None or value in ({}, [], "", "{}", "[]")


def _attention_config_neutral(value: Any) -> bool:
    # a resolved run stores the config object's repr: AttentionConfig(backend=None, ...)
    if _empty(value):
        return True
    if isinstance(value, Mapping):
        return value.get("backend") is None and value.get("hisparse_config") is None
    text = str(value)
    return "backend=None" in text and "hisparse_config=None" in text


#: Engine arguments that change the KV cache in ways the estimator does not model: the
#: check says whether a value is neutral (vLLM's default, no effect); any other value
#: makes the estimate unknown, with the reason.
ENGINE_UNMODELLED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "decode_context_parallel_size": (
        _none_or(1),
        "decode context parallelism shards the KV cache's tokens over ranks",
    ),
    "prefill_context_parallel_size": (
        _none_or(1),
        "prefill context parallelism multiplies the printed KV cache size",
    ),
    "kv_cache_dtype_skip_layers": (_empty, "some layers keep another KV dtype"),
    "kv_sharing_fast_prefill": (_none_or(False), "layers share KV caches"),
    "kv_transfer_config": (
        _empty,
        "a KV connector may turn the hybrid KV cache manager off or change the pool",
    ),
    "kv_offloading_size": (_none_or(0), "KV offloading adds a second tier"),
    "quantization_config": (_empty, "an online quantization config may set the KV dtype"),
    "attention_config": (
        _attention_config_neutral,
        "an attention backend chooses the page layout and block size; HiSparse adds a host pool",
    ),
    "attention_backend": (_empty, "an attention backend chooses the page layout"),
    "hf_config_path": (_empty, "the model config is read from another file"),
    "model_impl": (
        _none_or("auto", "vllm"),
        "the Transformers backend decides MLA from kv_lora_rank alone",
    ),
    "runner": (_none_or("auto", "generate", "draft"), "a pooling runner keeps no KV cache"),
    "convert": (_none_or("auto", "none"), "a converted (pooling) model keeps no KV cache"),
    "additional_config": (_empty, "platform-specific options"),
    "ec_transfer_config": (_empty, "an encoder-cache producer keeps no KV cache"),
    "diffusion_config": (_empty, "diffusion decoding changes the lookahead"),
    "engram_config": (_empty, "not modelled"),
    "mamba_cache_dtype": (_none_or("auto"), "Mamba state dtype"),
    "mamba_ssm_cache_dtype": (_none_or("auto"), "Mamba state dtype"),
    "mamba_block_size": (_empty, "Mamba state block size"),
    "mamba_cache_mode": (_none_or("none", "align"), "Mamba prefix-cache mode"),
    "mamba_config": (_empty, "Mamba state options"),
    "model_class_overrides": (_empty, "another model class builds the attention layers"),
    "config_format": (_none_or("auto", "hf"), "another config format is parsed"),
    "mm_encoder_only": (_none_or(False), "an encoder-only engine keeps no KV cache"),
}

#: vLLM 0.32.0 engine and ``vllm serve`` arguments known not to change the KV cache for
#: the memory the engine gives it (they may change that memory: weights, CUDA graphs,
#: activations, which the memory figures carry).
ENGINE_IRRELEVANT = frozenset(
    [
        "aggregate_engine_logging",
        "all2all_backend",
        "allow_credentials",
        "allow_deprecated_quantization",
        "allowed_headers",
        "allowed_local_media_path",
        "allowed_media_domains",
        "allowed_methods",
        "allowed_origins",
        "anthropic_disabled_thinking_effort",
        "api_key",
        "api_server_count",
        "aux_output_config",
        "chat_template",
        "chat_template_content_format",
        "code_revision",
        "cohere_format",
        "cohere_is_reasoning_model",
        "collect_detailed_traces",
        "compilation_config",
        "config",
        "cp_kv_cache_interleave_size",
        "cpu_distributed_timeout_seconds",
        "cpu_offload_gb",
        "cpu_offload_params",
        "cudagraph_capture_sizes",
        "cudagraph_metrics",
        "custom_histogram_buckets",
        "data_parallel_address",
        "data_parallel_backend",
        "data_parallel_external_lb",
        "data_parallel_hybrid_lb",
        "data_parallel_multi_port_external_lb",
        "data_parallel_rank",
        "data_parallel_rpc_port",
        "data_parallel_size",
        "data_parallel_size_local",
        "data_parallel_start_rank",
        "data_parallel_supervisor_port",
        "dbo_decode_token_threshold",
        "dbo_prefill_token_threshold",
        "dcp_comm_backend",
        "dcp_kv_cache_interleave_size",
        "dcp_q_replicate",
        "default_chat_template_kwargs",
        "default_mm_loras",
        "device_ids",
        "disable_access_log_for_endpoints",
        "disable_cascade_attn",
        "disable_chunked_mm_input",
        "disable_custom_all_reduce",
        "disable_fastapi_docs",
        "disable_log_requests",
        "disable_log_stats",
        "disable_nccl_for_dp_synchronization",
        "disable_uvicorn_access_log",
        "distributed_executor_backend",
        "distributed_timeout_seconds",
        "download_dir",
        "dp_supervisor_probe_failure_threshold",
        "dp_supervisor_probe_interval_s",
        "dp_supervisor_probe_timeout_s",
        "dp_sync_interval",
        "ec_manager_config",
        "elastic_ep_max_dp_size",
        "enable_auto_tool_choice",
        "enable_batch_sharded_sampling",
        "enable_chunked_prefill",
        "enable_cumem_allocator",
        "enable_dbo",
        "enable_elastic_ep",
        "enable_ep_weight_filter",
        "enable_eplb",
        "enable_expert_parallel",
        "enable_fault_tolerance",
        "enable_flash_late_interaction",
        "enable_flashinfer_autotune",
        "enable_force_include_usage",
        "enable_hc_sp",
        "enable_layerwise_nvtx_tracing",
        "enable_log_deltas",
        "enable_log_outputs",
        "enable_log_requests",
        "enable_logging_iteration_details",
        "enable_lora",
        "enable_mamba_cache_stochastic_rounding",
        "enable_mamba_shared_prefix_checkpoint",
        "enable_mfu_metrics",
        "enable_mixed_moe_lora_format",
        "enable_mm_embeds",
        "enable_mm_processor_stats",
        "enable_moe_shared_loras",
        "enable_nccl_comm_suspend",
        "enable_offline_docs",
        "enable_per_request_metrics",
        "enable_prefix_caching",
        "enable_prompt_embeds",
        "enable_prompt_tokens_details",
        "enable_request_id_headers",
        "enable_return_routed_experts",
        "enable_scale_out",
        "enable_server_load_tracking",
        "enable_shm_tensor_arena",
        "enable_sleep_mode",
        "enable_ssl_refresh",
        "enable_tokenizer_info_endpoint",
        "enable_tower_connector_lora",
        "enable_trace_replay",
        "enforce_eager",
        "eplb_config",
        "exclude_tools_when_tool_choice_none",
        "expert_placement_strategy",
        "fail_on_environ_validation",
        "fault_tolerance_config",
        "fingerprint_mode",
        "fingerprint_value",
        "fully_sharded_loras",
        "gdn_prefill_backend",
        "generation_config",
        "grpc",
        "grpc_port",
        "h11_max_header_count",
        "h11_max_incomplete_event_size",
        "headless",
        "hf_token",
        "host",
        "ignore_patterns",
        "interleave_mm_strings",
        "io_processor_plugin",
        "ir_op_priority",
        "jit_monitor_mode",
        "jit_monitor_verbose",
        "kda_decode_backend",
        "kda_prefill_backend",
        "kernel_config",
        "kv_cache_metrics",
        "kv_cache_metrics_sample",
        "kv_events_config",
        "kv_offloading_backend",
        "language_model_only",
        "limit_mm_per_prompt",
        "linear_backend",
        "load_format",
        "log_config_file",
        "log_error_stack",
        "log_level",
        "logging_config",
        "logits_processors",
        "logprobs_mode",
        "long_prefill_token_threshold",
        "long_prefill_token_threshold_adaptive",
        "lora_dtype",
        "lora_modules",
        "lora_target_modules",
        "mamba_backend",
        "mamba_cache_philox_rounds",
        "mamba_ssu_algorithm",
        "master_addr",
        "master_port",
        "max_cpu_loras",
        "max_cudagraph_capture_size",
        "max_log_len",
        "max_logprobs",
        "max_lora_cls_labels",
        "max_lora_rank",
        "max_loras",
        "max_num_active_seqs",
        "max_num_queued_reqs",
        "max_num_queued_tokens",
        "max_num_scheduled_tokens",
        "max_num_seqs",
        "max_parallel_loading_workers",
        "media_io_kwargs",
        "middleware",
        "mm_device_do_normalize",
        "mm_encoder_attn_backend",
        "mm_encoder_attn_dtype",
        "mm_encoder_fp8_scale_path",
        "mm_encoder_fp8_scale_save_margin",
        "mm_encoder_fp8_scale_save_path",
        "mm_encoder_tp_mode",
        "mm_hasher_algorithm",
        "mm_ipc_gpu_memory_gb",
        "mm_processor_cache_gb",
        "mm_processor_cache_type",
        "mm_processor_device",
        "mm_processor_kwargs",
        "mm_shm_cache_max_object_size_mb",
        "mm_tensor_ipc",
        "model",
        "model_loader_extra_config",
        "model_tag",
        "model_weights",
        "moe_backend",
        "nnodes",
        "node_rank",
        "numa_bind",
        "numa_bind_cpus",
        "numa_bind_nodes",
        "offload_backend",
        "offload_group_size",
        "offload_num_in_group",
        "offload_params",
        "offload_prefetch_step",
        "optimization_level",
        "otlp_traces_endpoint",
        "override_generation_config",
        "per_request_spec_decode_metrics",
        "performance_mode",
        "pooler_config",
        "port",
        "prefill_schedule_interval",
        "prefix_cache_retention_interval",
        "prefix_caching_hash_algo",
        "prefix_match_unit",
        "profiler_config",
        "pt_load_map_location",
        "quantization",
        "ray_workers_use_nsight",
        "reasoning_config",
        "reasoning_parser",
        "reasoning_parser_plugin",
        "renderer_num_workers",
        "replayssm_buffer_len",
        "response_role",
        "return_sampling_mask",
        "return_tokens_as_token_ids",
        "revision",
        "root_path",
        "safetensors_load_strategy",
        "safetensors_prefetch_block_size",
        "safetensors_prefetch_num_threads",
        "scheduler_cls",
        "scheduler_reserve_full_isl",
        "scheduling_policy",
        "seed",
        "served_model_name",
        "show_hidden_metrics_for_version",
        "shutdown_timeout",
        "skip_mm_profiling",
        "skip_tokenizer_init",
        "sleep_mode_offload_cudagraph",
        "sleep_preserve_parameter_names",
        "sparse_indexer_topk_backend",
        "specialize_active_lora",
        "sse_keep_alive_interval",
        "ssl_ca_certs",
        "ssl_cert_reqs",
        "ssl_certfile",
        "ssl_ciphers",
        "ssl_keyfile",
        "stream_interval",
        "structured_outputs_config",
        "swa_bounded_replay",
        "tokenizer",
        "tokenizer_mode",
        "tokenizer_revision",
        "tokens_only",
        "tool_call_parser",
        "tool_parser_plugin",
        "tool_server",
        "tool_strict_level",
        "trust_remote_code",
        "trust_request_chat_template",
        "trust_request_mm_kwargs",
        "ubatch_size",
        "uds",
        "use_fp64_gumbel",
        "use_replayssm",
        "use_tqdm_on_load",
        "uvicorn_log_level",
        "video_pruning_method",
        "video_pruning_rate",
        "watermark",
        "watermark_config",
        "weight_transfer_config",
        "worker_cls",
        "worker_extension_cls",
    ]
)

#: ``speculative_config`` keys the estimator reads (vLLM ``config/speculative.py`` names).
SPEC_READ = frozenset(
    {
        "draft_tensor_parallel_size",
        "kv_cache_dtype",
        "method",
        "model",
        "num_speculative_tokens",
        "tensor_parallel_size",
    }
)

#: ``speculative_config`` keys known not to change the KV cache (sampling, proposer
#: tuning, draft weights' format).
SPEC_IRRELEVANT = frozenset(
    {
        "code_revision",
        "disable_eagle_block_drop",
        "disable_padded_drafter_batch",
        "draft_load_config",
        "dspark_draft_topk",
        "enable_adaptive_verification",
        "enforce_eager",
        "index_share_for_mtp_iteration",
        "max_model_len",
        "moe_backend",
        "num_speculative_tokens_per_batch_size",
        "parallel_drafting",
        "prompt_lookup_max",
        "prompt_lookup_min",
        "quantization",
        "rejection_sample_method",
        "revision",
        "suffix_decoding_max_cached_requests",
        "suffix_decoding_max_spec_factor",
        "suffix_decoding_max_tree_depth",
        "suffix_decoding_min_token_prob",
        "synthetic_acceptance_length",
        "synthetic_acceptance_rates",
        "use_heterogeneous_vocab",
        "use_local_argmax_reduction",
    }
)

#: ``speculative_config`` keys that change the drafter's KV cache in ways not modelled.
SPEC_UNMODELLED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "attention_backend": (_empty, "the drafter's attention backend chooses its page layout"),
}


def is_neutral(
    table: Mapping[str, tuple[Callable[[Any], bool], str]], key: str, value: Any
) -> bool:
    """Whether ``value`` of an unmodelled key leaves the KV cache as vLLM's default does."""
    return table[key][0](value)


def _short(value: Any) -> Any:
    if isinstance(value, str | int | float | bool) or value is None:
        return value if not isinstance(value, str) or len(value) <= 80 else value[:77] + "..."
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


_UNKNOWN_REASON = (
    "not known to the estimator: it may change the attention layout, and the estimate "
    "ignores it; check it, or give kv_bytes_per_token"
)


def ignored_model_keys(config: Mapping[str, Any], prefix: str = "") -> list[dict[str, Any]]:
    """``[{"key", "source": "model", "value", "reason"}]`` for keys of a model config the
    estimator neither reads nor knows to be irrelevant (``text_config`` is walked too)."""
    out: list[dict[str, Any]] = []
    for key, value in config.items():
        if key == "text_config" and isinstance(value, Mapping):
            out.extend(ignored_model_keys(value, prefix=f"{prefix}text_config."))
            continue
        if key in MODEL_READ or model_key_irrelevant(key):
            continue
        out.append(
            {
                "key": prefix + key,
                "source": "model",
                "value": _short(value),
                "reason": _UNKNOWN_REASON,
            }
        )
    return out


def _norm(key: str) -> str:
    return key.replace("-", "_")


def ignored_engine_keys(engine: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``ignored_keys`` entries for engine arguments the estimator does not know.

    Unmodelled keys at a non-neutral value are not listed here: they make the estimate
    unknown (:func:`unmodelled_engine_keys`)."""
    out: list[dict[str, Any]] = []
    for raw, value in engine.items():
        key = _norm(raw)
        if key in ENGINE_READ or key in ENGINE_IRRELEVANT or key in ENGINE_UNMODELLED:
            continue
        out.append(
            {"key": raw, "source": "engine", "value": _short(value), "reason": _UNKNOWN_REASON}
        )
    return out


def unmodelled_engine_keys(engine: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``[(key, reason)]`` for engine arguments set to a value the estimator cannot model."""
    out = []
    for raw, value in engine.items():
        key = _norm(raw)
        if key in ENGINE_UNMODELLED and not is_neutral(ENGINE_UNMODELLED, key, value):
            out.append((raw, ENGINE_UNMODELLED[key][1]))
    return out


def ignored_spec_keys(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``ignored_keys`` entries for ``speculative_config`` keys the estimator does not know."""
    out: list[dict[str, Any]] = []
    for raw, value in spec.items():
        key = _norm(raw)
        if key in SPEC_READ or key in SPEC_IRRELEVANT or key in SPEC_UNMODELLED:
            continue
        out.append(
            {
                "key": f"speculative_config.{raw}",
                "source": "engine",
                "value": _short(value),
                "reason": _UNKNOWN_REASON,
            }
        )
    return out


def unmodelled_spec_keys(spec: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``[(key, reason)]`` for ``speculative_config`` keys set to an unmodelled value."""
    return [
        (f"speculative_config.{raw}", SPEC_UNMODELLED[_norm(raw)][1])
        for raw, value in spec.items()
        if _norm(raw) in SPEC_UNMODELLED and not is_neutral(SPEC_UNMODELLED, _norm(raw), value)
    ]
