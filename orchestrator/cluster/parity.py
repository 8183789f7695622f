"""Node environment parity check before a multi-node TP+PP launch.

Pure function: no database, no Ray, no HTTP. Input is one *node fingerprint*
per node (collected by ``jobs/`` on each node) plus the launch; output is a
JSON-safe report that either lets the launch go (``"ok"``) or blocks it
(``"blocked"``), naming every offending field, every node's value and the odd
node(s) out.

Why: a multi-node vLLM launch with drifting environments fails late and
obscurely (Ray refuses a worker with another Python patch level; a different
vLLM build pulls another Ray; a model directory present only on the head node
makes vLLM treat the path as a hub repository id on the workers; an
``NCCL_SOCKET_IFNAME`` naming an interface the node lacks hangs NCCL init).
Sources: vllm-project/vllm issues 2289, 3786, 5727, 50616; ray-project/ray
issues 44063, 50511; gpustack/gpustack issue 1640.

Fingerprint shape (every key optional; unknown top-level keys are listed in
``unchecked_fields``)::

    {
      "node": "node-0", "ip": "10.0.0.1",            # name (else hostname/ip/"node-<i>")
      "python": "3.10.13", "ray": "2.43.0", "vllm": "0.8.2", "torch": "2.6.0+cu124",
      "cuda_runtime": "12.4", "nccl": "2.21.5", "nvidia_driver": "550.54.15",
      "gpu_model": "NVIDIA H100 80GB HBM3", "gpu_count": 8, "gpu_memory_mib": 81559,
      "model_path_exists": true,
      "model_files": [{"path": "config.json", "size": 663, "sha256": "..."}, ...]
                     # or {"config.json": {"size": 663, "sha256": "..."}, ...}
      "model_source": "hf_cache",        # fingerprint --model NAME: how it was found,
      "model_revision": "<commit sha>",  # the snapshot's commit (None for directories),
      "model_error": "...",              # and why it was not, when it was not
      "env": {"NCCL_SOCKET_IFNAME": "eth0", "VLLM_HOST_IP": "10.0.0.1", ...},
      "interfaces": ["lo", "eth0"],      # or [{"name": "eth0", ...}] or {"eth0": ...}
      "engine_args": {"max_model_len": 8192, ...},   # resolved engine args
      "launch_args": {...} or ["--flag", "value", ...]
    }

Launch shape: ``{"model": "/models/x" or "org/name", "tensor_parallel_size": 8,
"pipeline_parallel_size": 3, "gpus_per_node": 8}`` (all optional).

The rules live in one table, :data:`RULES`; see :class:`Rule`.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Check = Literal["identical", "per_node", "ignore"]
Severity = Literal["blocking", "warning"]

__all__ = ["RULES", "Rule", "check_parity", "rule_for", "rules_markdown"]


@dataclass(frozen=True)
class Rule:
    """One row of the parity table.

    - ``field``: a flattened field name or an ``fnmatch`` pattern over them.
      Top-level fingerprint keys keep their name; environment variables are
      ``env.<NAME>``; resolved engine args ``engine_args.<key>``; launch args
      ``launch_args.<key>``.
    - ``check``: ``"identical"`` (same value on every node; the odd nodes out are
      the minority), ``"per_node"`` (each node's value must be valid on that
      node; see ``why``) or ``"ignore"`` (expected to differ between nodes).
    - ``severity``: ``"blocking"`` blocks the launch, ``"warning"`` only warns.

    The first row whose ``field`` matches wins, so specific rows come first.
    """

    field: str
    check: Check
    severity: Severity
    why: str


_SAME = "must be identical on all nodes"

RULES: tuple[Rule, ...] = (
    # --- software versions: Ray refuses a Python/Ray mismatch at join time;
    # vLLM/torch/CUDA/NCCL drift gives wrong kernels or a hung collective.
    Rule("python", "identical", "blocking", f"Python version {_SAME} (even the patch level)"),
    Rule("ray", "identical", "blocking", f"Ray version {_SAME}"),
    Rule("vllm", "identical", "blocking", f"vLLM version {_SAME}"),
    Rule("torch", "identical", "blocking", f"torch build {_SAME}"),
    Rule("cuda_runtime", "identical", "blocking", f"CUDA runtime {_SAME}"),
    Rule("nccl", "identical", "blocking", f"NCCL version {_SAME}"),
    Rule("nvidia_driver", "identical", "warning", "driver versions should match"),
    # --- hardware: TP/PP shards assume the same GPU and memory on every rank.
    Rule("gpu_model", "identical", "blocking", f"GPU model {_SAME}"),
    Rule("gpu_memory_mib", "identical", "blocking", f"GPU memory {_SAME}"),
    Rule(
        "gpu_count",
        "per_node",
        "blocking",
        "each node needs at least launch.gpus_per_node GPUs, and all nodes together "
        "at least tensor_parallel_size x pipeline_parallel_size",
    ),
    # --- model: the Hugging Face snapshot each node resolved, then every file in it.
    Rule(
        "model_revision",
        "identical",
        "blocking",
        "the model revision (the commit of the Hugging Face snapshot each node resolved "
        "the model id to; none for directories) must be identical on all nodes",
    ),
    Rule(
        "model_source",
        "identical",
        "warning",
        "nodes should find the model the same way (local_dir, model_root, hf_cache, hf_hub)",
    ),
    # --- model directory: names, sizes and digests of every file, not only weights.
    Rule(
        "model_files",
        "identical",
        "blocking",
        "the model directory must exist on every node with the same files "
        "(names, sizes, sha256), config and tokenizer included",
    ),
    # --- communication settings.
    Rule(
        "env.*_SOCKET_IFNAME",
        "per_node",
        "blocking",
        "an interface named in *_SOCKET_IFNAME must exist on that node "
        "(NCCL: prefix match, '=' exact, '^' exclude; others: every name exact)",
    ),
    Rule(
        "env.VLLM_HOST_IP",
        "per_node",
        "blocking",
        "VLLM_HOST_IP, when set, must be unique across nodes and equal the node's Ray IP",
    ),
    Rule("env.NCCL_DEBUG*", "identical", "warning", "debug settings should match"),
    Rule("env.VLLM_LOGGING_LEVEL", "identical", "warning", "logging settings should match"),
    Rule("env.VLLM_CONFIGURE_LOGGING", "identical", "warning", "logging settings should match"),
    Rule("env.NCCL_*", "identical", "blocking", f"NCCL settings {_SAME}"),
    Rule("env.GLOO_*", "identical", "blocking", f"Gloo settings {_SAME}"),
    Rule("env.UCX_*", "identical", "blocking", f"UCX settings {_SAME}"),
    Rule("env.VLLM_*", "identical", "blocking", f"vLLM environment settings {_SAME}"),
    Rule("env.HF_*", "identical", "warning", "Hugging Face settings should match"),
    Rule(
        "env.CUDA_VISIBLE_DEVICES",
        "identical",
        "warning",
        "visible GPU lists usually match; Ray sets them per worker anyway",
    ),
    # --- resolved engine / launch args: rank-specific ones differ by design.
    Rule("engine_args.node_rank", "ignore", "warning", "differs per node by design"),
    Rule("engine_args.headless", "ignore", "warning", "differs per node by design"),
    Rule("launch_args.node_rank", "ignore", "warning", "differs per node by design"),
    Rule("launch_args.headless", "ignore", "warning", "differs per node by design"),
    Rule("engine_args.*", "identical", "blocking", f"resolved engine args {_SAME}"),
    Rule("launch_args.*", "identical", "blocking", f"launch args {_SAME}"),
    # --- everything else that is informative only.
    Rule("os", "identical", "warning", "OS releases should match"),
    Rule("kernel", "identical", "warning", "kernel versions should match"),
)

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
    "interfaces",
    "network_interfaces",
    "engine_args",
    "resolved_engine_args",
    "launch_args",
}
_ENV_PREFIXES = ("NCCL_", "GLOO_", "VLLM_", "HF_", "UCX_", "CUDA_VISIBLE_DEVICES")
_SECRET_MARKERS = ("TOKEN", "SECRET", "PASSWORD", "KEY")


def rule_for(field: str) -> Rule | None:
    """The first :data:`RULES` row matching a flattened field name, or ``None``."""
    for rule in RULES:
        if fnmatch.fnmatchcase(field, rule.field):
            return rule
    return None


def check_parity(nodes: list[dict[str, Any]], launch: dict[str, Any] | None = None) -> dict:
    """Check that all nodes of a multi-node launch have the same environment.

    Args:
        nodes: one fingerprint per node (shape in the module docstring), in rank
            order; the first node breaks ties when deciding the majority.
        launch: the launch (``model`` path, ``tensor_parallel_size``,
            ``pipeline_parallel_size``, ``gpus_per_node``), optional.

    Returns:
        ``{"verdict": "blocked" | "ok", "mismatches": [...], "warnings": [...],
        "nodes": [names], "unchecked_fields": [...]}``. ``mismatches`` holds the
        blocking findings, ``warnings`` the warn-only ones, in :data:`RULES`
        order. A field finding is ``{"field", "values": {node: value}, "severity",
        "odd_nodes": [minority nodes], "rule": why}`` (per-node rules add
        ``"problems": {node: reason}``). A model-directory finding is per node:
        ``{"node", "field": "model_files", "missing_model_path": path}`` when the
        directory is absent (plus ``"error"``: the node's ``model_error``, when it
        gave one), else ``{"node", "field": "model_files", "missing":
        [...], "differs": [...], "extra": [...]}`` (empty lists left out) against
        the per-file majority; both also carry ``severity``, ``odd_nodes``,
        ``rule``. Secret-looking env values (``*TOKEN*``, ``*KEY*`` ...) are shown
        as ``"<set sha256:12 hex>"``.

    Raises:
        ValueError: no nodes, or two fingerprints with the same node name.
    """
    if not nodes:
        raise ValueError("parity check needs at least one node fingerprint")
    launch = launch or {}
    names = [_node_name(n, i) for i, n in enumerate(nodes)]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate node names in fingerprints: {names}")
    flat = [_flatten(n) for n in nodes]

    findings: list[dict[str, Any]] = []
    all_fields = sorted({f for fl in flat for f in fl})
    unchecked = [f for f in all_fields if rule_for(f) is None]
    for rule in RULES:
        fields = [f for f in all_fields if rule_for(f) is rule]
        if rule.field == "model_files":
            findings += _check_model_files(nodes, names, launch, rule)
            continue
        if rule.check == "ignore":
            continue
        for field in fields:
            values = {name: fl.get(field) for name, fl in zip(names, flat, strict=True)}
            if rule.check == "identical":
                entry = _check_identical(field, values, rule)
            else:
                entry = _check_per_node(field, values, nodes, names, launch, rule)
            if entry is not None:
                findings.append(entry)
        if rule.field == "gpu_count":
            entry = _check_world_size(nodes, names, launch, rule)
            if entry is not None:
                findings.append(entry)

    mismatches = [f for f in findings if f["severity"] == "blocking"]
    warnings = [f for f in findings if f["severity"] == "warning"]
    return {
        "verdict": "blocked" if mismatches else "ok",
        "mismatches": mismatches,
        "warnings": warnings,
        "nodes": names,
        "unchecked_fields": unchecked,
    }


# --------------------------------------------------------------------------- helpers


def _node_name(node: Mapping[str, Any], index: int) -> str:
    for key in ("node", "node_id", "hostname", "ip"):
        if node.get(key):
            return str(node[key])
    return f"node-{index}"


def _env(node: Mapping[str, Any]) -> dict[str, Any]:
    env: dict[str, Any] = {}
    for key in ("env", "env_vars", "environment"):
        if isinstance(node.get(key), Mapping):
            env.update(node[key])
    for key, value in node.items():  # env vars reported at top level
        if key.isupper() and key.startswith(_ENV_PREFIXES):
            env[key] = value
    return env


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


def _flatten(node: Mapping[str, Any]) -> dict[str, Any]:
    """Fingerprint -> ``{field: value}`` with ``env.*``, ``engine_args.*``, ``launch_args.*``."""
    flat: dict[str, Any] = {}
    for key, value in node.items():
        if key in _META_KEYS or (key.isupper() and key.startswith(_ENV_PREFIXES)):
            continue
        flat[key] = value
    for name, value in _env(node).items():
        flat[f"env.{name}"] = value
    for src, prefix in (
        ("engine_args", "engine_args"),
        ("resolved_engine_args", "engine_args"),
        ("launch_args", "launch_args"),
    ):
        if src in node:
            for key, value in _args(node[src]).items():
                flat[f"{prefix}.{key}"] = value
    flat.pop("model_files", None)  # compared file by file, see _check_model_files
    if "model_files" in node or "model_path_exists" in node:
        flat["model_files"] = True  # marks the field as present (for rule matching)
    return flat


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _display(field: str, value: Any) -> Any:
    name = field.rpartition(".")[2].upper()
    if value is not None and field.startswith("env.") and any(m in name for m in _SECRET_MARKERS):
        return f"<set sha256:{hashlib.sha256(str(value).encode()).hexdigest()[:12]}>"
    return value


def _odd_nodes(values: Mapping[str, Any]) -> list[str]:
    """Nodes outside the largest group of equal values (ties: the first node's group)."""
    groups: dict[str, list[str]] = {}
    for node, value in values.items():
        groups.setdefault(_canon(value), []).append(node)
    first = next(iter(values))
    majority = max(groups.values(), key=lambda g: (len(g), first in g))
    return [n for n in values if n not in majority]


def _entry(
    field: str, values: Mapping[str, Any], odd: list[str], rule: Rule, **extra: Any
) -> dict[str, Any]:
    return {
        "field": field,
        "values": {n: _display(field, v) for n, v in values.items()},
        "severity": rule.severity,
        "odd_nodes": odd,
        "rule": rule.why,
        **extra,
    }


def _check_identical(field: str, values: Mapping[str, Any], rule: Rule) -> dict[str, Any] | None:
    if len({_canon(v) for v in values.values()}) <= 1:
        return None
    return _entry(field, values, _odd_nodes(values), rule)


def _interfaces(node: Mapping[str, Any]) -> list[str] | None:
    raw = node.get("interfaces", node.get("network_interfaces"))
    if raw is None:
        return None
    if isinstance(raw, Mapping):
        return [str(k) for k in raw]
    names = []
    for item in raw:
        if isinstance(item, Mapping):
            names.append(str(item.get("name") or item.get("ifname") or ""))
        else:
            names.append(str(item))
    return names


def _ifname_problem(var: str, spec: str, ifaces: list[str]) -> str | None:
    """Why ``spec`` selects no usable interface on a node with ``ifaces``, or ``None``.

    NCCL (``NCCL_SOCKET_IFNAME``): comma list of prefixes; ``=name`` is exact;
    a leading ``^`` excludes the listed ones. Others (``GLOO_SOCKET_IFNAME``,
    ``TP_SOCKET_IFNAME``...): comma list of exact names, all used.
    """
    spec = str(spec).strip()
    if var.startswith("NCCL_"):
        exclude = spec.startswith("^")
        items = [i.strip() for i in spec.lstrip("^").split(",") if i.strip()]

        def hit(iface: str) -> bool:
            return any(iface == i[1:] if i.startswith("=") else iface.startswith(i) for i in items)

        chosen = [i for i in ifaces if hit(i) != exclude]
        if not chosen:
            return f"{var}={spec!r} selects no interface among {ifaces}"
        return None
    missing = [i.strip() for i in spec.split(",") if i.strip() and i.strip() not in ifaces]
    if missing:
        return f"{var} names {missing} not among {ifaces}"
    return None


def _check_per_node(
    field: str,
    values: Mapping[str, Any],
    nodes: list[dict[str, Any]],
    names: list[str],
    launch: Mapping[str, Any],
    rule: Rule,
) -> dict[str, Any] | None:
    problems: dict[str, str] = {}
    var = field.removeprefix("env.")
    if field.endswith("_SOCKET_IFNAME"):
        for name, node in zip(names, nodes, strict=True):
            spec, ifaces = values[name], _interfaces(node)
            if spec in (None, "") or ifaces is None:
                continue
            problem = _ifname_problem(var, spec, ifaces)
            if problem:
                problems[name] = problem
    elif field == "env.VLLM_HOST_IP":
        seen: dict[str, list[str]] = {}
        for name in names:
            if values[name] not in (None, ""):
                seen.setdefault(str(values[name]), []).append(name)
        for name, node in zip(names, nodes, strict=True):
            value = values[name]
            if value in (None, ""):
                continue
            reasons = []
            if len(seen[str(value)]) > 1:
                others = [n for n in seen[str(value)] if n != name]
                reasons.append(f"same VLLM_HOST_IP as {', '.join(others)}")
            if node.get("ip") and str(node["ip"]) != str(value):
                reasons.append(f"differs from the node's Ray IP {node['ip']}")
            if reasons:
                problems[name] = "; ".join(reasons)
    elif field == "gpu_count":
        need = launch.get("gpus_per_node")
        for name in names:
            have = values[name]
            if need is not None and (have is None or int(have) < int(need)):
                problems[name] = f"has {have} GPUs, launch needs {need} per node"
    if not problems:
        return None
    return _entry(field, values, [n for n in names if n in problems], rule, problems=problems)


def _check_world_size(
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
    return _entry("gpu_count", counts, [], rule, problems={"cluster": problem})


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


def _check_model_files(
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
        odd = set(_odd_nodes(values))
        majority_node = next(n for n in values if n not in odd)
        reference[fname] = _canon(values[majority_node])
    absent = _canon(None)
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
            ref, mine = reference[fname], _canon(manifest.get(fname))
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


def rules_markdown() -> str:
    """:data:`RULES` as a Markdown table (``docs/PARITY.md`` is this text; a test keeps it so)."""
    lines = [
        "| field | check | severity | why |",
        "|---|---|---|---|",
    ]
    for rule in RULES:
        why = rule.why.replace("|", "\\|")
        lines.append(f"| `{rule.field}` | {rule.check} | {rule.severity} | {why} |")
    return "\n".join(lines) + "\n"
