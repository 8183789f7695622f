"""Node fingerprints as the flat fields the parity rules look at.

A fingerprint's name (:func:`node_name`), its fields with engine and launch arguments
spread out (:func:`flatten`), and one field's value on every node (:func:`field_values`).
Shapes: :mod:`orchestrator.cluster.parity`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from orchestrator.cluster.parity_env import NodeEnv, is_env_name
from orchestrator.cluster.parity_rules import not_captured_when_absent

__all__ = ["field_values", "flatten", "node_name"]

# Top-level keys that identify a node or are handled with their group.
_META_KEYS = {
    "node",
    "node_id",
    "hostname",
    "ip",
    "model_path_exists",
    "model_path",
    "model_error",
    "env",
    "env_vars",
    "environment",
    "env_scope",
    "launch_env",
    "launch_env_source",
    "interfaces",
    "network_interfaces",
    "engine_args",
    "resolved_engine_args",
    "launch_args",
}
# Top-level fingerprint keys whose null is a value, not "not captured".
_NULL_IS_VALUE = {"model_revision"}  # None: the model is a directory, not a snapshot


def node_name(node: Mapping[str, Any], index: int) -> str:
    for key in ("node", "node_id", "hostname", "ip"):
        if node.get(key):
            return str(node[key])
    return f"node-{index}"


def _args(value: Any) -> dict[str, Any]:
    """Engine/launch args as a dict; an argv list ``["--k", "v", "--flag"]`` is parsed."""
    if isinstance(value, Mapping):
        return {str(k).lstrip("-").replace("-", "_"): v for k, v in value.items()}
    out: dict[str, Any] = {}
    if isinstance(value, list | tuple):
        items = [str(v) for v in value]
        i = 0
        while i < len(items):
            item = items[i]
            if item.startswith("--"):
                key, eq, val = item[2:].partition("=")
                key = key.replace("-", "_")
                if eq:
                    out[key] = val
                elif i + 1 < len(items) and not items[i + 1].startswith("--"):
                    out[key] = items[i + 1]
                    i += 1
                else:
                    out[key] = True
            else:
                out.setdefault("_positional", []).append(item)
            i += 1
    return out


def flatten(node: Mapping[str, Any]) -> dict[str, Any]:
    """Fingerprint -> ``{field: value}`` with ``engine_args.*``, ``launch_args.*``
    (environment variables: :func:`node_env`)."""
    flat: dict[str, Any] = {}
    for key, value in node.items():
        if key in _META_KEYS or is_env_name(str(key)):
            continue
        if value is None and key not in _NULL_IS_VALUE:
            continue  # a fingerprint's null is "unknown": not captured (field_values)
        flat[key] = value
    for src, prefix in (
        ("engine_args", "engine_args"),
        ("resolved_engine_args", "engine_args"),
        ("launch_args", "launch_args"),
        ("engine_env", "engine_env"),  # and "engine_env" itself: the per-node check
    ):
        if src in node:
            for key, value in _args(node[src]).items():
                flat[f"{prefix}.{key}"] = value
    flat.pop("model_files", None)  # compared file by file, see parity_cluster.check_model_files
    if "model_files" in node or "model_path_exists" in node:
        flat["model_files"] = True  # marks the field as present (for rule matching)
    return flat


def field_values(
    field: str, names: list[str], flat: list[dict[str, Any]], envs: list[NodeEnv]
) -> tuple[dict[str, Any], list[str]]:
    """``({node: value}, [nodes where it was not captured])``; env: ``None`` = unset.

    A top-level field a node lacks (absent or ``null``: the probe's "unknown") is
    not captured there, except in :data:`_NULL_IS_VALUE`; engine/launch args keep
    ``None`` (an argument not given); an ``engine_env.*`` sub-field a node did not
    report is not captured there (``ABSENT_IS_NOT_CAPTURED``), its ``null`` a value."""
    if not field.startswith("env."):
        if ("." in field and not not_captured_when_absent(field)) or field in _NULL_IS_VALUE:
            return {name: fl.get(field) for name, fl in zip(names, flat, strict=True)}, []
        have = {name: fl[field] for name, fl in zip(names, flat, strict=True) if field in fl}
        return have, [name for name in names if name not in have]
    var = field.removeprefix("env.")
    values: dict[str, Any] = {}
    missing: list[str] = []
    for name, env in zip(names, envs, strict=True):
        known, value = env.state(var)
        if known:
            values[name] = value
        else:
            missing.append(name)
    return values, missing
