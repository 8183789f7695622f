"""Reading node environments for the parity check (:mod:`orchestrator.cluster.parity`):
set, unset and not-captured variables, values a program ignores, the launching side.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "NodeEnv",
    "env_value",
    "is_env_name",
    "launch_environment_of",
    "node_env",
    "unset_reason",
]


@dataclass
class NodeEnv:
    """A node's Ray-worker environment: ``captured`` False when it has none at all;
    ``scope`` the (prefixes, names) it covers, ``None`` when it lists everything."""

    captured: bool
    values: dict[str, Any]
    scope: tuple[tuple[str, ...], frozenset[str]] | None

    def state(self, var: str) -> tuple[bool, Any]:
        """``(known, value)``: ``(True, None)`` unset, ``(False, None)`` not captured."""
        if not self.captured:
            return False, None
        if var in self.values:
            value = self.values[var]
            return value is not None, value
        if self.scope is None:
            return True, None
        prefixes, names = self.scope
        return var.startswith(prefixes) or var in names, None


def is_env_name(key: str) -> bool:
    """An environment variable's name (``MASTER_ADDR``), not a fingerprint key
    (fingerprint keys are lower case)."""
    return key.isupper() and key.replace("_", "").isalnum()


def env_value(value: Any) -> Any:
    """Environment values are strings: a scalar another producer wrote as a number or
    a boolean (``1``) is compared as its text (``"1"``); ``None`` stays not captured."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int | float):
        return str(value)
    return value


def node_env(node: Mapping[str, Any]) -> NodeEnv:
    """The node's environment from ``env`` (or ``env_vars``/``environment``) and any
    upper-case top-level key (``"MASTER_ADDR": ...``). A top-level variable without
    ``env`` and ``env_scope`` is captured for its own name only."""
    env: dict[str, Any] = {}
    captured = False
    for key in ("env", "env_vars", "environment"):
        if isinstance(node.get(key), Mapping):
            env.update({str(k): env_value(v) for k, v in node[key].items()})
            captured = True
    top = {key: env_value(v) for key, v in node.items() if is_env_name(str(key))}
    env.update(top)
    scope = None
    raw = node.get("env_scope")
    if isinstance(raw, Mapping):
        prefixes = tuple(str(p) for p in raw.get("prefixes") or ())
        scope = (prefixes, frozenset(str(n) for n in raw.get("names") or ()))
    elif top and not captured:
        scope = ((), frozenset(top))
    return NodeEnv(captured or bool(top), env, scope)


def unset_reason(var: str, value: Any) -> str | None:
    """Why a set ``value`` of ``var`` acts as unset (the program falls back to its
    default), or ``None`` when it is used.

    - ``NCCL_SOCKET_IFNAME``/``GLOO_SOCKET_IFNAME`` under 2 characters: NCCL
      src/misc/socket.cc ``ncclFindInterfaces`` reads it only when
      ``strlen(env) > 1``, torch ProcessGroupGloo.cpp ``create_default`` only when
      ``size() > 1``; both auto-detect otherwise.
    - ``VLLM_HOST_IP`` ``""``: vLLM 0.32 vllm/envs.py:722 reads it as
      ``os.getenv("VLLM_HOST_IP", "")`` and vllm/utils/network_utils.py:62
      ``get_ip()`` uses it only ``if host_ip:``, else picks an address itself.
    """
    if value is None:
        return None
    text = str(value)
    if var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME") and len(text) <= 1:
        who = "NCCL" if var.startswith("NCCL_") else "Gloo"
        return f"{who} ignores a {var} under 2 characters and auto-detects the interface"
    if var == "VLLM_HOST_IP" and text == "":
        return "vLLM treats an empty VLLM_HOST_IP as unset and picks an address itself"
    return None


def launch_environment_of(
    nodes: list[dict[str, Any]], names: list[str], launch: Mapping[str, Any]
) -> tuple[dict[str, Any] | None, str | None]:
    """The launching environment (set variables only) and where it was captured."""
    if isinstance(launch.get("launch_env"), Mapping):
        env = {str(k): env_value(v) for k, v in launch["launch_env"].items() if v is not None}
        return env, str(launch.get("launch_env_source") or "the launching environment")
    for name, node in zip(names, nodes, strict=True):
        if isinstance(node.get("launch_env"), Mapping):
            env = {str(k): env_value(v) for k, v in node["launch_env"].items() if v is not None}
            source = node.get("launch_env_source") or f"the launching shell on {name}"
            return env, str(source)
    return None, None
