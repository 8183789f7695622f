"""How a vLLM server is started: its command line and its environment.

:func:`build_serve_command` (``vllm serve`` through the launcher, run by path by the
engine venv's python: :data:`LAUNCHER_PATH`), the engine arguments as CLI tokens
(:func:`render_engine_args`), the process environment (:func:`engine_env`) and a free
port (:func:`find_free_port`). Running the process: :mod:`jobs.engine.server`.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

from jobs.schemas import EngineLaunch

__all__ = [
    "LAUNCHER_PATH",
    "RESERVED_ENGINE_ARGS",
    "build_serve_command",
    "engine_env",
    "find_free_port",
    "render_engine_args",
]

LAUNCHER_PATH = Path(__file__).resolve().parents[1] / "launcher" / "vllm_launcher.py"
"""The launcher's entry point (:mod:`jobs.launcher`), run by path by the engine venv's python."""

#: Keys that :func:`build_serve_command` sets itself; refused in ``engine_args``.
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

#: Environment variables of the calling (orchestrator) venv that would confuse
#: the engine's interpreter.
_DROPPED_ENV = (
    "VIRTUAL_ENV",
    "VIRTUAL_ENV_PROMPT",
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONSTARTUP",
    "PYTHONEXECUTABLE",
    "__PYVENV_LAUNCHER__",
    "CONDA_PREFIX",
)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def render_engine_args(engine_args: dict[str, Any]) -> list[str]:
    """Render vLLM engine arguments (snake_case names) as ``vllm serve`` CLI tokens.

    - ``True`` -> ``--flag``; ``False`` -> ``--no-flag`` (vLLM's
      ``BooleanOptionalAction``; e.g. ``--no-enable-prefix-caching``, needed
      because APC is on by default in vLLM V1);
    - ``None`` -> omitted (vLLM's default);
    - list/tuple -> ``--flag v1 v2 ...`` (vLLM list arguments use ``nargs="+"``);
      an empty list is omitted;
    - dict -> ``--flag '<json>'``;
    - anything else -> ``--flag str(value)``.

    Raises ``ValueError`` for a key in :data:`RESERVED_ENGINE_ARGS` or one
    that is not an identifier.
    """
    out: list[str] = []
    for name, value in engine_args.items():
        key = name.replace("-", "_")
        if key in RESERVED_ENGINE_ARGS:
            raise ValueError(f"engine arg {name!r} is set by the launch itself")
        if not key.isidentifier():
            raise ValueError(f"invalid engine arg name {name!r}")
        flag = _flag(key)
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


def build_serve_command(launch: EngineLaunch, *, port: int | None = None) -> list[str]:
    """The argv that starts ``vllm serve`` for ``launch``.

    ``[engine_python, LAUNCHER_PATH, "serve", model_dir, "--served-model-name",
    name, "--host", host, "--port", str(port), *render_engine_args(...)]``.
    ``port`` overrides ``launch.port`` (used when ``launch.port == 0`` picks a
    free port). A multi-node launch (``nnodes > 1``) appends ``--nnodes N
    --node-rank r --master-addr A --master-port P``, and ``--headless`` on
    followers (rank > 0), the same engine arguments on every node. Raises
    ``ValueError`` for reserved engine-arg names or a multi-node launch without
    its rendezvous address. ``executor == "ray"`` appends
    ``--distributed-executor-backend ray`` (one process; vLLM's Ray workers take
    the run's placement group, see :mod:`jobs.launcher.vllm_launcher`); a model named by
    Hugging Face id and not resolved to a directory on this node gets
    ``--revision <commit>``.
    """
    multi_node: list[str] = []
    if launch.nnodes > 1:
        if launch.master_addr is None or launch.master_port is None:
            raise ValueError("a multi-node launch needs master_addr and master_port")
        multi_node = [
            "--nnodes",
            str(launch.nnodes),
            "--node-rank",
            str(launch.node_rank),
            "--master-addr",
            launch.master_addr,
            "--master-port",
            str(launch.master_port),
        ]
        if launch.headless:
            multi_node.append("--headless")
    if launch.executor == "ray":
        if launch.nnodes > 1:
            raise ValueError("the Ray executor starts one vllm serve; --nnodes is for 'mp'")
        multi_node = ["--distributed-executor-backend", "ray"]
    if launch.model_revision and not launch.resolve_model_on_node:
        multi_node += ["--revision", launch.model_revision]
    return [
        launch.engine_python,
        str(LAUNCHER_PATH),
        "serve",
        launch.model_dir,
        "--served-model-name",
        launch.served_model_name,
        "--host",
        launch.host,
        "--port",
        str(launch.port if port is None else port),
        *render_engine_args(launch.engine_args),
        *multi_node,
    ]


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def engine_env(launch: EngineLaunch, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of the server process.

    ``base`` (default ``os.environ``) minus the calling venv's variables
    (``VIRTUAL_ENV``, ``PYTHONPATH`` ...; the venv's ``bin`` removed from
    ``PATH``), with ``VLLM_SERVER_DEV_MODE=1`` (enables ``POST
    /reset_prefix_cache``), ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) unless already
    set, and the engine venv's ``bin`` first on ``PATH``; ``launch.env`` wins.
    """
    env = dict(os.environ if base is None else base)
    own_venv = env.get("VIRTUAL_ENV")
    for key in _DROPPED_ENV:
        env.pop(key, None)
    path_parts = [p for p in env.get("PATH", "").split(os.pathsep) if p]
    if own_venv:
        own_bin = str(Path(own_venv) / "bin")
        path_parts = [p for p in path_parts if p != own_bin]
    engine_bin = str(Path(launch.engine_python).parent)
    env["PATH"] = os.pathsep.join([engine_bin, *[p for p in path_parts if p != engine_bin]])
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(launch.env)
    return env
