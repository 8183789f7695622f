"""Node environment parity check before a multi-node TP+PP launch.

Pure function: no database, no Ray, no HTTP. Input is one *node fingerprint*
per node (collected by ``jobs/`` on each node) plus the launch; output is a
JSON-safe report that either lets the launch go (``"ok"``) or blocks it
(``"blocked"``), naming every offending field, every node's value and the odd
node(s) out, with the verdict of every rule that applies to the field.

Why: a multi-node vLLM launch with drifting environments fails late and
obscurely (Ray refuses a worker with another Python patch level; a different
vLLM build pulls another Ray; a model directory present only on the head node
makes vLLM treat the path as a hub repository id on the workers; an
``NCCL_SOCKET_IFNAME`` naming an interface the node lacks hangs NCCL init; a
``GLOO_SOCKET_IFNAME`` exported only in the shell that runs ``vllm serve`` on the
head never reaches the Ray workers, whose Gloo then falls back to loopback).
Sources: vllm-project/vllm issues 2289, 3786, 5094, 5727, 7074, 50616;
ray-project/ray issues 30333, 44063, 50511; gpustack/gpustack issue 1640.

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
                                         # (upper-case top-level keys count as env too)
      "env_scope": {"prefixes": ["NCCL_", ...], "names": ["MASTER_ADDR", ...]},
      "launch_env": {...},               # the launching shell's environment, on the head
      "interfaces": ["lo", "eth0"],      # or [{"name": "eth0", ...}] or {"eth0": ...}
      "engine_args": {"max_model_len": 8192, ...},   # resolved engine args
      "launch_args": {...} or ["--flag", "value", ...]
    }

Environment: ``env`` is the environment of the Ray worker processes on that node
(what vLLM's workers there start with). A variable is *set* (its value, ``""``
included), *unset* (absent from ``env`` although ``env_scope`` covers its name; a
fingerprint without ``env_scope`` is taken to list every variable it was asked
for) or *not captured* (the node has no ``env`` at all, ``env_scope`` does not
cover the name, or the value is ``null``): a not-captured value is never compared,
and a rule that could only be decided with it says ``"unknown"``. A value NCCL, Gloo
or vLLM ignore (``NCCL_``/``GLOO_SOCKET_IFNAME`` under 2 characters, ``VLLM_HOST_IP``
``""``) counts as unset for the ``present_everywhere`` and ``launch_env`` checks;
scalars are compared as strings. A top-level field absent or ``null`` on a node
(the probe's "unknown") is not captured there, except ``model_revision``.

Launch shape: ``{"model": "/models/x" or "org/name", "tensor_parallel_size": 8,
"pipeline_parallel_size": 3, "gpus_per_node": 8, "launch_env": {NAME: value},
"launch_env_source": "the shell of vllm serve on head-0"}`` (all optional).
``launch_env`` is the environment of the process that launches (the driver/CLI
side: the shell of ``vllm serve`` on the head, or vlab's orchestrator); a head
fingerprint's own ``launch_env`` is used when the launch has none.

The rules live in one table, :data:`RULES` (:mod:`orchestrator.cluster.parity_rules`);
see :class:`Rule`. Every rule that applies to a field is evaluated, not only the first.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

from orchestrator.cluster.parity_cluster import (
    canon,
    check_model_files,
    check_world_size,
    odd_nodes,
)
from orchestrator.cluster.parity_copy import copy_checks, ifname_problem, interfaces_of
from orchestrator.cluster.parity_env import (
    NodeEnv,
    launch_environment_of,
    node_env,
    unset_reason,
)
from orchestrator.cluster.parity_fields import field_values, flatten, node_name
from orchestrator.cluster.parity_rules import (
    COMM_ENV,
    PER_NODE_ENV,
    RULES,
    Rule,
    rule_for,
    rules_for,
    rules_markdown,
)

__all__ = [
    "COMM_ENV",
    "PER_NODE_ENV",
    "RULES",
    "Rule",
    "check_parity",
    "rule_for",
    "rules_for",
    "rules_markdown",
]


_SECRET_MARKERS = ("TOKEN", "SECRET", "PASSWORD", "KEY")
_NO_LAUNCH_ENV = (
    "the launching environment (the shell of vllm serve on the head, or the orchestrator) "
    "was not captured: a communication setting made only there cannot be detected"
)
_FAIL = ("blocking", "warning")
_LAUNCH_CHECKS = ("launch_env", "launch_env_same")


@dataclass
class _Context:
    nodes: list[dict[str, Any]]
    names: list[str]
    launch: Mapping[str, Any]
    launch_env: dict[str, Any] | None
    launch_source: str | None


def check_parity(nodes: list[dict[str, Any]], launch: dict[str, Any] | None = None) -> dict:
    """Check that all nodes of a multi-node launch have the same environment.

    Args:
        nodes: one fingerprint per node (shape in the module docstring), in rank
            order; the first node breaks ties when deciding the majority.
        launch: the launch (``model`` path, ``tensor_parallel_size``,
            ``pipeline_parallel_size``, ``gpus_per_node``, ``launch_env``,
            ``launch_env_source``), optional.

    Returns:
        ``{"verdict": "blocked" | "unknown" | "ok", "verdict_reasons": [str],
        "mismatches": [...], "warnings": [...],
        "unknown": [...], "nodes": [names], "unchecked_fields": [...],
        "evaluations": [...], "launch_env_source": str | None}``.

        ``mismatches`` holds the blocking findings, ``warnings`` the warn-only ones,
        in :data:`RULES` order. A field finding is ``{"field", "values": {node:
        value}, "severity", "odd_nodes", "rule": why, "rule_name", "check", "rules":
        [verdict of every rule that applies]}`` where ``odd_nodes``, ``rule``,
        ``rule_name`` and ``check`` are those of its first failing rule (blocking
        first); ``values`` holds ``None`` where the variable is unset and leaves out
        the nodes where it was not captured. Optional keys: ``problems`` ({node:
        reason} of every failing rule), ``unset_on`` and ``not_captured_on`` (env
        fields), ``launch_value`` and ``launch_source`` (when the launching
        environment sets the variable), ``copy_check`` (env fields and
        ``engine_env``: for each node that lacks the setting while another node or the
        launching environment has it, whether that value would work on this node,
        :func:`orchestrator.cluster.parity_copy.copy_checks`; its ``message`` is also
        appended to the node's ``problems`` entry where the node has one or is odd).
        A verdict is ``{"rule", "check", "severity", "verdict": "ok" | "blocking" |
        "warning" | "unknown" | "ignored", "why"}`` plus ``odd_nodes``, ``problems``,
        ``not_captured_on`` or ``note`` where they apply.

        A model-directory finding is per node: ``{"node", "field": "model_files",
        "missing_model_path": path}`` when the directory is absent (plus
        ``"error"``: the node's ``model_error``, when it gave one), else ``{"node",
        "field": "model_files", "missing": [...], "differs": [...], "extra":
        [...]}`` (empty lists left out) against the per-file majority; both also
        carry ``severity``, ``odd_nodes``, ``rule``.

        ``verdict``: ``"blocked"`` with a blocking finding; else ``"unknown"`` when,
        on two or more nodes, a blocking rule was undecided for a field (the launch
        is still permitted; the missing launching environment alone does not count);
        else ``"ok"``. ``verdict_reasons``: why it is not ``"ok"``, one line each.

        ``unknown``: ``{"field", "rule", "severity", "note", "not_captured_on"?}``
        for each rule
        that could not be decided (a value not captured; no launching environment:
        one entry with ``field`` ``None``). ``evaluations``: ``{"field", "rule",
        "check", "severity", "verdict"}`` for every field and rule.
        Env values of names with a TOKEN/KEY/SECRET/PASSWORD part (``HF_TOKEN``,
        ``VLLM_API_KEY``; not ``NCCL_IB_PKEY``) are shown as ``"<set sha256:12 hex>"``.

    Size: the code is ~30 lines (a field's rules: :func:`_check_field`); the rest is the
    report's contract.

    Raises:
        ValueError: no nodes, or two fingerprints with the same node name.
    """
    if not nodes:
        raise ValueError("parity check needs at least one node fingerprint")
    launch = launch or {}
    names = [node_name(n, i) for i, n in enumerate(nodes)]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate node names in fingerprints: {names}")
    flat = [flatten(n) for n in nodes]
    envs = [node_env(n) for n in nodes]
    launch_env, launch_source = launch_environment_of(nodes, names, launch)
    ctx = _Context(nodes, names, launch, launch_env, launch_source)

    found = _Found({rule.name: i for i, rule in enumerate(RULES)})
    for field in sorted(_fields(flat, envs, launch_env)):
        _check_field(found, field, flat, envs, ctx)
    world = check_world_size(nodes, names, launch, RULES[found.index["gpu_count"]])
    if world is not None:
        found.add("gpu_count", world)
    if launch_env is None:
        found.unknown.insert(
            0, {"field": None, "rule": "comm_launch_shell_only", "note": _NO_LAUNCH_ENV}
        )
    unknown = found.unknown
    findings = [entry for _, _, entry in sorted(found.ranked, key=lambda t: (t[0], t[1]))]
    return {
        **_verdict(findings, unknown, len(nodes)),
        "unknown": unknown,
        "nodes": names,
        "unchecked_fields": found.unchecked,
        "evaluations": found.evaluations,
        "launch_env_source": launch_source,
    }


@dataclass
class _Found:
    """What the checks found so far: findings ranked by rule, every verdict, the unknowns."""

    index: dict[str, int]  # rule name -> its row in RULES
    ranked: list[tuple[int, int, dict[str, Any]]] = dataclass_field(default_factory=list)
    evaluations: list[dict[str, Any]] = dataclass_field(default_factory=list)
    unknown: list[dict[str, Any]] = dataclass_field(default_factory=list)
    unchecked: list[str] = dataclass_field(default_factory=list)

    def add(self, rule_name: str, entry: dict[str, Any]) -> None:
        self.ranked.append((self.index[rule_name], len(self.ranked), entry))


def _check_field(
    found: _Found,
    field: str,
    flat: list[dict[str, Any]],
    envs: list[NodeEnv],
    ctx: _Context,
) -> None:
    """Evaluate every rule that applies to ``field`` into ``found``."""
    rules = rules_for(field)
    if not rules:
        found.unchecked.append(field)
        return
    if field == "model_files":
        entries = check_model_files(ctx.nodes, ctx.names, ctx.launch, rules[0])
        for entry in entries:
            found.add(rules[0].name, entry)
        found.evaluations.append(_brief(field, rules[0], rules[0].severity if entries else "ok"))
        return
    values, not_captured = field_values(field, ctx.names, flat, envs)
    verdicts = [_evaluate(rule, field, values, not_captured, ctx) for rule in rules]
    found.evaluations += [
        _brief(field, r, v["verdict"]) for r, v in zip(rules, verdicts, strict=True)
    ]
    found.unknown += _undecided(field, rules, verdicts, ctx.launch_env is None)
    finding = _finding(field, values, not_captured, rules, verdicts, ctx)
    if finding is not None:
        found.add(finding["rule_name"], finding)


def _fields(flat: list[dict[str, Any]], envs: list[NodeEnv], launch_env: Any) -> set[str]:
    """Every field some node has, its captured env variables, and the launching side's
    variables that a ``launch_env`` rule looks at (nothing else of the launching side)."""
    fields = {f for fl in flat for f in fl}
    for env in envs:
        fields |= {f"env.{k}" for k, v in env.values.items() if v is not None}
    launch_fields = {f"env.{k}" for k in launch_env or {}}
    fields |= {f for f in launch_fields if any(r.check == "launch_env" for r in rules_for(f))}
    return fields


def _undecided(
    field: str, rules: list[Rule], verdicts: list[dict[str, Any]], no_launch_env: bool
) -> list[dict[str, Any]]:
    """The ``unknown`` entries of a field's undecided rules (a launch rule without the
    launching environment is reported once for the whole check instead)."""
    out: list[dict[str, Any]] = []
    for rule, v in zip(rules, verdicts, strict=True):
        if v["verdict"] != "unknown" or (rule.check in _LAUNCH_CHECKS and no_launch_env):
            continue
        note = v.get("note") or "a value this rule needs was not captured"
        extra: dict[str, Any] = {k: v[k] for k in ("not_captured_on", "undecided") if k in v}
        out.append(
            {"field": field, "rule": rule.name, "severity": rule.severity, "note": note, **extra}
        )
    return out


def _verdict(
    findings: list[dict[str, Any]], unknown: list[dict[str, Any]], node_count: int
) -> dict[str, Any]:
    """``verdict``, ``verdict_reasons``, ``mismatches`` and ``warnings`` of the findings."""
    mismatches = [f for f in findings if f["severity"] == "blocking"]
    warnings = [f for f in findings if f["severity"] == "warning"]
    # A blocking rule left undecided on a field of a multi-node check: not "ok".
    undecided = [u for u in unknown if u["field"] is not None and u.get("severity") == "blocking"]
    reasons = [
        f"{m['field']}: {m.get('rule_name', m['rule'])} blocks"
        + (f" on {', '.join(m['odd_nodes'])}" if m.get("odd_nodes") else "")
        for m in mismatches
    ]
    if not mismatches and node_count > 1:
        reasons = [f"{u['field']}: {u['rule']} undecided: {u['note']}" for u in undecided]
    overall = "blocked" if mismatches else ("unknown" if reasons else "ok")
    return {
        "verdict": overall,
        "verdict_reasons": reasons,
        "mismatches": mismatches,
        "warnings": warnings,
    }


# --------------------------------------------------------------------------- evaluation


def _display(field: str, value: Any) -> Any:
    name = field.rpartition(".")[2].upper()
    secret = any(m in name.split("_") for m in _SECRET_MARKERS)  # not NCCL_IB_PKEY
    if value is not None and field.startswith("env.") and secret:
        return f"<set sha256:{hashlib.sha256(str(value).encode()).hexdigest()[:12]}>"
    return value


def _brief(field: str, rule: Rule, verdict: str) -> dict[str, Any]:
    return {
        "field": field,
        "rule": rule.name,
        "check": rule.check,
        "severity": rule.severity,
        "verdict": verdict,
    }


def _evaluate(
    rule: Rule, field: str, values: dict[str, Any], not_captured: list[str], ctx: _Context
) -> dict[str, Any]:
    """One rule's verdict on one field over the nodes where the field is known."""
    out: dict[str, Any] = {
        "rule": rule.name,
        "check": rule.check,
        "severity": rule.severity,
        "verdict": "ok",
        "why": rule.why,
    }
    if rule.check == "ignore":
        out["verdict"] = "ignored"
        return out
    problems: dict[str, str] = {}
    undecided: dict[str, str] = {}
    odd: list[str] = []
    var = field.removeprefix("env.")
    if rule.check == "identical":
        if len({canon(v) for v in values.values()}) > 1:
            odd = odd_nodes(values)
    elif rule.check == "present_everywhere":
        set_on = [n for n, v in values.items() if _is_set(var, v)]
        odd = [n for n, v in values.items() if not _is_set(var, v)] if set_on else []
        problems = {n: f"{_unset_text(var, values[n])} but set on {', '.join(set_on)}" for n in odd}
    elif rule.check in _LAUNCH_CHECKS:
        if ctx.launch_env is None:
            out["verdict"] = "unknown"
            out["note"] = _NO_LAUNCH_ENV
            return out
        launch_value = ctx.launch_env.get(var)
        if not _is_set(var, launch_value):
            out["note"] = "not set in the launching environment" + (
                f" ({var}={launch_value!r}: {unset_reason(var, launch_value)})"
                if launch_value is not None
                else ""
            )
        elif rule.check == "launch_env":
            odd = [n for n, v in values.items() if not _is_set(var, v)]
            problems = {
                n: f"{var} is set in {ctx.launch_source} but "
                + (
                    "unset in the Ray workers' environment of this node"
                    if values[n] is None
                    else f"{values[n]!r} in the Ray workers' environment of this node counts "
                    f"as unset ({unset_reason(var, values[n])})"
                )
                for n in odd
            }
        else:
            odd = [n for n, v in values.items() if _is_set(var, v) and str(v) != str(launch_value)]
            problems = {
                n: f"{var}={values[n]!r} in the Ray workers' environment of this node but "
                f"{launch_value!r} in {ctx.launch_source}"
                for n in odd
            }
    elif rule.node_check is not None:  # per_node with the row's own check
        found = {n: rule.node_check(v) for n, v in values.items()}
        problems = {n: text for n, text in found.items() if text}
        odd = [n for n in ctx.names if n in problems]
    else:
        problems, undecided = _per_node_problems(field, values, ctx)
        odd = [n for n in ctx.names if n in problems]
    if not_captured:
        out["not_captured_on"] = not_captured
    if odd:
        out["verdict"] = rule.severity
        out["odd_nodes"] = odd
        if problems:
            out["problems"] = problems
    elif not_captured:
        out["verdict"] = "unknown"
        out["note"] = f"{var} was not captured on {', '.join(not_captured)}"
    if undecided and not odd:
        # the value is known but a node fact the rule needs is not: never "ok"
        out["verdict"] = "unknown"
        out["undecided"] = undecided
        told = [f"{n}: {r}" for n, r in undecided.items()]
        out["note"] = "; ".join([out["note"], *told] if "note" in out else told)
    return out


def _is_set(var: str, value: Any) -> bool:
    """Set, and to a value the program uses (see :func:`unset_reason`)."""
    return value is not None and unset_reason(var, value) is None


def _unset_text(var: str, value: Any) -> str:
    """``"X is unset here"`` or ``"X='' counts as unset here (why)"``."""
    if value is None:
        return f"{var} is unset here"
    return f"{var}={value!r} counts as unset here ({unset_reason(var, value)})"


def _finding(
    field: str,
    values: dict[str, Any],
    not_captured: list[str],
    rules: list[Rule],
    verdicts: list[dict[str, Any]],
    ctx: _Context,
) -> dict[str, Any] | None:
    """The field's finding from its failing verdicts (``None`` when none fails)."""
    failing = [(r, v) for r, v in zip(rules, verdicts, strict=True) if v["verdict"] in _FAIL]
    if not failing:
        return None
    rule, primary = next(((r, v) for r, v in failing if v["verdict"] == "blocking"), failing[0])
    entry: dict[str, Any] = {
        "field": field,
        "values": {n: _display(field, v) for n, v in values.items()},
        "severity": primary["verdict"],
        "odd_nodes": primary["odd_nodes"],
        "rule": rule.why,
        "rule_name": rule.name,
        "check": rule.check,
        "rules": verdicts,
    }
    problems: dict[str, str] = {}
    for _, v in failing:
        for node, reason in (v.get("problems") or {}).items():
            problems[node] = f"{problems[node]}; {reason}" if node in problems else reason
    copies = copy_checks(
        field,
        values,
        dict(zip(ctx.names, ctx.nodes, strict=True)),
        ctx.launch_env,
        ctx.launch_source,
        _display,
    )
    for node, items in copies.items():  # what copying the others' value would do here
        if node not in primary["odd_nodes"] and node not in problems:
            continue
        told = "; ".join(item["message"] for item in items)
        problems[node] = f"{problems[node]}; {told}" if node in problems else told
    if problems:
        entry["problems"] = problems
    if copies:
        entry["copy_check"] = copies
    if field.startswith("env."):
        var = field.removeprefix("env.")
        unset = [n for n, v in values.items() if v is None]
        if unset:
            entry["unset_on"] = unset
        if not_captured:
            entry["not_captured_on"] = not_captured
        if ctx.launch_env is not None and var in ctx.launch_env:
            entry["launch_value"] = _display(field, ctx.launch_env[var])
            entry["launch_source"] = ctx.launch_source
    return entry


def _per_node_problems(
    field: str, values: Mapping[str, Any], ctx: _Context
) -> tuple[dict[str, str], dict[str, str]]:
    """``(problems, undecided)`` of a per-node rule, by node: what is wrong, and why it
    cannot be decided there (a node fact the rule needs was not captured)."""
    problems: dict[str, str] = {}
    undecided: dict[str, str] = {}
    var = field.removeprefix("env.")
    nodes = dict(zip(ctx.names, ctx.nodes, strict=True))
    if field.endswith("_SOCKET_IFNAME"):
        for name, spec in values.items():
            ifaces = interfaces_of(nodes[name])
            if spec is None or not _is_set(var, spec):
                continue
            if ifaces is None:
                undecided[name] = (
                    f"its network interfaces were not captured: whether {var}={spec!r} "
                    "selects one is unknown"
                )
                continue
            problem = ifname_problem(var, spec, ifaces)
            if problem:
                problems[name] = problem
    elif field == "env.VLLM_HOST_IP":
        seen: dict[str, list[str]] = {}
        for name, value in values.items():
            if value not in (None, ""):
                seen.setdefault(str(value), []).append(name)
        for name, value in values.items():
            if value in (None, ""):  # vLLM's get_ip() treats "" as unset
                continue
            reasons = []
            if len(seen[str(value)]) > 1:
                others = [n for n in seen[str(value)] if n != name]
                reasons.append(f"same VLLM_HOST_IP as {', '.join(others)}")
            ip = nodes[name].get("ip")
            if ip and str(ip) != str(value):
                reasons.append(f"differs from the node's Ray IP {ip}")
            elif not ip:
                undecided[name] = (
                    f"its Ray IP was not captured: whether VLLM_HOST_IP={value!r} is this "
                    "node's address is unknown"
                )
            if reasons:
                problems[name] = "; ".join(reasons)
    elif field == "gpu_count":
        need = ctx.launch.get("gpus_per_node")
        for name, have in values.items():
            if need is not None and (have is None or int(have) < int(need)):
                problems[name] = f"has {have} GPUs, launch needs {need} per node"
    return problems, undecided


# --------------------------------------------------------------------------- per node
