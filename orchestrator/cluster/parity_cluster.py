"""The parity checks over the cluster rather than one field at a time.

The model directory per node against the per-file majority (:func:`check_model_files`)
and the GPUs of all nodes against TP x PP (:func:`check_world_size`), with the value
comparison both share with :mod:`orchestrator.cluster.parity` (:func:`canon`,
:func:`odd_nodes`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from orchestrator.cluster.parity_rules import Rule

__all__ = ["canon", "check_model_files", "check_world_size", "odd_nodes"]


def canon(value: Any) -> str:
    """A value as comparable text (JSON, keys sorted)."""
    return json.dumps(value, sort_keys=True, default=str)


def odd_nodes(values: Mapping[str, Any]) -> list[str]:
    """Nodes outside the largest group of equal values (ties: the first node's group)."""
    groups: dict[str, list[str]] = {}
    for node, value in values.items():
        groups.setdefault(canon(value), []).append(node)
    first = next(iter(values))
    majority = max(groups.values(), key=lambda g: (len(g), first in g))
    return [n for n in values if n not in majority]


def check_world_size(
    nodes: list[dict[str, Any]], names: list[str], launch: Mapping[str, Any], rule: Rule
) -> dict[str, Any] | None:
    """All nodes together must hold TP x PP GPUs (only when every node reports gpu_count)."""
    tp = int(launch.get("tensor_parallel_size") or 1)
    pp = int(launch.get("pipeline_parallel_size") or 1)
    counts: dict[str, Any] = {
        name: node.get("gpu_count") for name, node in zip(names, nodes, strict=True)
    }
    if any(count is None for count in counts.values()):
        return None
    total = sum(int(count) for count in counts.values())
    if total >= tp * pp:
        return None
    problem = f"{total} GPUs in all, TP x PP = {tp} x {pp} = {tp * pp} needed"
    return {
        "field": "gpu_count",
        "values": counts,
        "severity": rule.severity,
        "odd_nodes": [],
        "rule": rule.why,
        "rule_name": rule.name,
        "check": rule.check,
        "problems": {"cluster": problem},
    }


# --------------------------------------------------------------------------- model files


def _manifest(node: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{file name: (size, sha256)}`` from a list of dicts or a name-keyed dict."""
    raw = node.get("model_files") or {}
    if isinstance(raw, Mapping):
        return {str(k): (v.get("size"), v.get("sha256")) for k, v in raw.items()}
    out = {}
    for item in raw:
        name = item.get("path") or item.get("name")
        out[str(name)] = (item.get("size"), item.get("sha256"))
    return out


def check_model_files(
    nodes: list[dict[str, Any]], names: list[str], launch: Mapping[str, Any], rule: Rule
) -> list[dict[str, Any]]:
    """Per-node model-directory findings against the per-file majority.

    A node whose ``model_path_exists`` is false is reported as missing the whole
    directory and takes no part in the majority. For every other node each file
    name gets a value (``(size, sha256)`` or absent); the majority value (ties:
    the first node's) is the reference: absent where the reference has it ->
    ``missing``; another size/digest -> ``differs``; present where the reference
    is absent -> ``extra``.
    """
    if not any("model_files" in n or "model_path_exists" in n for n in nodes):
        return []
    out: list[dict[str, Any]] = []
    present = [
        (name, _manifest(node))
        for name, node in zip(names, nodes, strict=True)
        if node.get("model_path_exists", True) is not False
    ]
    file_names: list[str] = []
    for _, manifest in present:
        file_names += [f for f in manifest if f not in file_names]
    reference: dict[str, str] = {}
    for fname in file_names:
        values = {name: manifest.get(fname) for name, manifest in present}
        odd = set(odd_nodes(values))
        majority_node = next(n for n in values if n not in odd)
        reference[fname] = canon(values[majority_node])
    absent = canon(None)
    by_node = dict(present)
    for name, node in zip(names, nodes, strict=True):
        base = {"node": name, "field": "model_files"}
        tail = {"severity": rule.severity, "odd_nodes": [name], "rule": rule.why}
        if name not in by_node:
            path = launch.get("model") or node.get("model_path")
            why = {"error": node["model_error"]} if node.get("model_error") else {}
            out.append({**base, "missing_model_path": path, **why, **tail})
            continue
        manifest = by_node[name]
        missing, differs, extra = [], [], []
        for fname in file_names:
            ref, mine = reference[fname], canon(manifest.get(fname))
            if ref == mine:
                continue
            if mine == absent:
                missing.append(fname)
            elif ref == absent:
                extra.append(fname)
            else:
                differs.append(fname)
        lists = {"missing": missing, "differs": differs, "extra": extra}
        found = {k: v for k, v in lists.items() if v}
        if found:
            out.append({**base, **found, **tail})
    return out
