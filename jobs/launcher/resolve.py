"""``resolve``: the engine configuration vLLM resolves for each set of engine args.

Nothing is started and no KV cache is allocated: each configuration is parsed by
vLLM's own ``serve`` parser, validated and resolved on the current platform.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib.metadata as _md
import json
import os
import sys
from typing import Any

#: Sub-configs of vLLM's ``VllmConfig`` whose scalar fields ``resolve`` reports.
RESOLVED_SECTIONS = (
    "model_config",
    "cache_config",
    "scheduler_config",
    "parallel_config",
    "load_config",
    "device_config",
    "attention_config",
)
#: The few ``compilation_config`` fields reported (the others are internals).
RESOLVED_COMPILATION_FIELDS = ("mode", "backend", "cudagraph_mode")
#: Keys the launch sets itself; refused in ``resolve`` configs (as in jobs.engine.server).
RESERVED_ENGINE_ARGS = frozenset(
    {
        "model",
        "model_tag",
        "served_model_name",
        "host",
        "port",
        # set from the spec: the model's revision, and layout.executor
        "revision",
        "distributed_executor_backend",
    }
)


class _ParseError(Exception):
    """argparse wanted to exit: raised instead, carrying its message."""


def render_engine_args(engine_args: dict[str, Any]) -> list[str]:
    """Engine args (snake_case) as ``vllm serve`` CLI tokens.

    Same rules as ``jobs.engine.command.render_engine_args`` (the launcher cannot import
    the rest of ``jobs``; a test checks both agree): ``True`` -> ``--flag``,
    ``False`` -> ``--no-flag``, ``None`` and empty lists omitted, lists ->
    ``--flag v1 v2``, dicts -> ``--flag '<json>'``, else ``--flag str(v)``.
    Raises ``ValueError`` for reserved or invalid names.
    """
    out: list[str] = []
    for name, value in engine_args.items():
        key = name.replace("-", "_")
        if key in RESERVED_ENGINE_ARGS:
            raise ValueError(f"engine arg {name!r} is set by the launch itself")
        if not key.isidentifier():
            raise ValueError(f"invalid engine arg name {name!r}")
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list | tuple):
            if not value:
                continue
            out.append(flag)
            out.extend(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)
        elif isinstance(value, dict):
            out.extend([flag, json.dumps(value, separators=(",", ":"))])
        else:
            out.extend([flag, str(value)])
    return out


_SKIP = object()


def _scalar(value: Any) -> Any:
    """A JSON-safe form of a config value, or ``_SKIP`` for objects (hf_config ...).

    Scalars as is; enums by name; ``torch.dtype`` as ``"bfloat16"``; lists
    and string-keyed dicts of such values item-wise.
    """
    if value is None or isinstance(value, bool | int | float | str):
        if isinstance(value, enum.Enum):
            return value.name
        return value
    if isinstance(value, enum.Enum):
        return value.name
    if type(value).__name__ == "dtype" and type(value).__module__ == "torch":
        return str(value).removeprefix("torch.")
    if isinstance(value, list | tuple | set | frozenset):
        items = [_scalar(v) for v in value]
        return _SKIP if any(v is _SKIP for v in items) else items
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        mapped = {k: _scalar(v) for k, v in value.items()}
        return _SKIP if any(v is _SKIP for v in mapped.values()) else mapped
    return _SKIP


def flatten_vllm_config(vllm_config: Any) -> dict[str, Any]:
    """The scalar fields of the sub-configs in :data:`RESOLVED_SECTIONS`, flat.

    Keys are ``"<section>.<field>"`` (``scheduler_config.max_num_batched_tokens``);
    private fields (``_x``) and object-valued fields are left out. Adds the
    :data:`RESOLVED_COMPILATION_FIELDS` of ``compilation_config`` and
    ``speculative_config.enabled`` / ``lora_config.enabled``.
    """
    flat: dict[str, Any] = {}
    for section in RESOLVED_SECTIONS:
        sub = getattr(vllm_config, section, None)
        if sub is None or not dataclasses.is_dataclass(sub):
            continue
        for field in dataclasses.fields(sub):
            if field.name.startswith("_"):
                continue
            value = _scalar(getattr(sub, field.name, None))
            if value is not _SKIP:
                flat[f"{section}.{field.name}"] = value
    compilation = getattr(vllm_config, "compilation_config", None)
    for name in RESOLVED_COMPILATION_FIELDS:
        if compilation is not None and hasattr(compilation, name):
            value = _scalar(getattr(compilation, name))
            flat[f"compilation_config.{name}"] = None if value is _SKIP else value
    for optional in ("speculative_config", "lora_config"):
        flat[f"{optional}.enabled"] = getattr(vllm_config, optional, None) is not None
    return flat


def resolve_configs(model: str, configs: list[Any]) -> dict[str, Any]:
    """The engine configuration ``vllm serve`` would use, for each set of engine args.

    Each config (a dict of engine args, snake_case) is rendered as CLI tokens,
    parsed by vLLM's own ``serve`` parser (so types and defaults are exactly
    those of ``vllm serve <model> ...``), validated like ``vllm serve`` does,
    turned into ``AsyncEngineArgs.from_cli_args`` and resolved with
    ``create_engine_config(usage_context=OPENAI_API_SERVER)`` on the current
    platform. Nothing is started and no KV cache is allocated; each config
    sees the same ``os.environ`` (changes vLLM makes are undone).

    Returns ``{"vllm_version": str, "results": [item, ...]}``, one item per
    config in order: ``{"ok": true, "argv": [...], "config": {flat, see
    flatten_vllm_config}}`` or ``{"ok": false, "argv": [...] | null, "error":
    "<ExceptionType>: <vLLM's message>"}`` (``"invalid arguments: ..."`` for
    what the parser rejects).
    """
    saved_argv = sys.argv
    sys.argv = ["vllm", "serve"]
    try:
        # deferred: vLLM takes seconds to import; must see the sys.argv set just above
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.cli.serve import ServeSubcommand
        from vllm.usage.usage_lib import UsageContext
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    finally:
        sys.argv = saved_argv

    def raise_parse_error(message: str) -> Any:
        raise _ParseError(message)

    root = FlexibleArgumentParser(prog="vllm")
    subparsers = root.add_subparsers(dest="subparser")
    serve = ServeSubcommand()
    parser = serve.subparser_init(subparsers)
    root.error = raise_parse_error  # type: ignore[method-assign]
    parser.error = raise_parse_error  # type: ignore[method-assign]

    results: list[dict[str, Any]] = []
    for config in configs:
        argv: list[str] | None = None
        saved_env = dict(os.environ)
        try:
            if not isinstance(config, dict):
                raise ValueError(f"a config must be an object, not {type(config).__name__}")
            argv = ["serve", model, *render_engine_args(config)]
            try:
                args = root.parse_args(argv)
            except SystemExit as exc:  # e.g. --help, or a parser that exits anyway
                raise _ParseError(f"argument parsing exited with {exc.code}") from None
            if getattr(args, "model_tag", None) is not None:
                args.model = args.model_tag
            serve.validate(args)
            engine_args = AsyncEngineArgs.from_cli_args(args)
            with contextlib.suppress(ImportError):
                # deferred: vLLM (heavy); absent from older vLLM versions
                from vllm.entrypoints.launchers.cli_args import propagate_flash_late_interaction

                propagate_flash_late_interaction(args, engine_args)
            vllm_config = engine_args.create_engine_config(
                usage_context=UsageContext.OPENAI_API_SERVER
            )
            results.append({"ok": True, "argv": argv, "config": flatten_vllm_config(vllm_config)})
        except Exception as exc:
            kind = "invalid arguments" if isinstance(exc, _ParseError) else type(exc).__name__
            message = f"{kind}: {exc}".strip()
            results.append({"ok": False, "argv": argv, "error": message})
        finally:
            os.environ.clear()
            os.environ.update(saved_env)
    return {"vllm_version": _md.version("vllm"), "results": results}


def read_resolve_request(text: str) -> tuple[str, list[Any]]:
    doc = json.loads(text)
    if not isinstance(doc, dict) or not isinstance(doc.get("model"), str):
        raise ValueError('stdin must be {"model": "<dir>", "configs": [{...}, ...]}')
    configs = doc.get("configs", [])
    if not isinstance(configs, list):
        raise ValueError('"configs" must be a list')
    return doc["model"], configs
