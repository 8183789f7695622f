"""``engine-args``: every argument of ``vllm serve``, read from vLLM's own serve parser."""

from __future__ import annotations

import argparse
import importlib.metadata as _md
import sys
from typing import Any


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
        # deferred: vLLM takes seconds to import; must see the sys.argv set just above
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
