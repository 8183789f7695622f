"""Would the value the other nodes use work on the node that lacks it?

When the parity check (:mod:`orchestrator.cluster.parity`) finds a setting missing on a
node (set on other nodes or in the launching environment, unset here), an operator's
first move is to copy the other nodes' value over. :func:`copy_checks` says, per node
and per value, whether that would work there, judged on what the node probe captured on
*that* node (``jobs/launcher/vllm_launcher.py fingerprint`` and the Ray side: its ``interfaces``,
``ip``, ``gpu_count``, ``engine_env``):

- ``works``: the value names things this node has (an interface it selects, GPUs it has,
  its own address);
- ``does_not_work``: it does not, and why (``eth9`` is not among this node's interfaces
  ``['eth0', 'lo']``; a per-node address or rank copied would be another node's);
- ``unknown``: the fact it depends on was not captured on this node (its interfaces, its
  GPU count, its Ray IP, InfiniBand HCAs, paths other than the engine's python), never
  guessed;
- ``not_node_specific``: the value names no interface, device, address, rank or path of a
  node (a flag, a level, a port, the rendezvous host): nothing on this node to check,
  and copying it makes the nodes agree.

Pure (no Ray, no database). The interface-selection rules of NCCL and the others are here
too (:func:`ifname_problem`), shared with the rule ``socket_ifname_exists``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from orchestrator.cluster.parity_engineenv import engine_env_problem
from orchestrator.cluster.parity_env import unset_reason

__all__ = [
    "CopyVerdict",
    "copy_checks",
    "copy_sentence",
    "ifname_problem",
    "interfaces_of",
    "judge_copy",
]

CopyVerdict = Literal["works", "does_not_work", "unknown", "not_node_specific"]

#: Per-node addresses: each node's own; a copy is another node's address.
_ADDRESS_VARS = ("VLLM_HOST_IP", "VLLM_NIXL_SIDE_CHANNEL_HOST")
#: Global ranks: unique per node, a copy duplicates one.
_RANK_VARS = ("VLLM_DP_RANK",)
#: Per node by design, with nothing captured to judge a value against.
_OWN_VALUE_VARS = (
    "VLLM_DP_RANK_LOCAL",
    "LOCAL_RANK",
    "VLLM_HOST_PORT",
    "VLLM_CPU_OMP_THREADS_BIND",
)
_NO_HCAS = (
    "this node's InfiniBand / RDMA devices are not captured by the node probe (only its "
    "network interface names)"
)


def interfaces_of(node: Mapping[str, Any]) -> list[str] | None:
    """The node's network interface names (``interfaces`` or ``network_interfaces``: a
    list of names or of ``{"name": ...}``, or a name-keyed mapping); None when not
    captured."""
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


def _ifname_selection(
    var: str, spec: Any, ifaces: list[str]
) -> tuple[list[str] | None, str | None]:
    """``(interfaces selected, problem)``; ``(None, None)`` when the program ignores the
    value (under 2 characters for NCCL and Gloo: auto-detection)."""
    if var.startswith(("NCCL_", "GLOO_")) and len(str(spec)) <= 1:
        return None, None  # the raw length, as NCCL and Gloo test it (not stripped)
    text = str(spec).strip()
    if var.startswith("NCCL_"):
        exclude = text.startswith("^")
        items = [i.strip() for i in text.lstrip("^").split(",") if i.strip()]

        def hit(iface: str) -> bool:
            return any(iface == i[1:] if i.startswith("=") else iface.startswith(i) for i in items)

        chosen = [i for i in ifaces if hit(i) != exclude]
        if not chosen:
            return [], f"{var}={text!r} selects no interface among {ifaces}"
        return chosen, None
    names = [i.strip() for i in text.split(",") if i.strip()]
    missing = [i for i in names if i not in ifaces]
    if missing:
        return [i for i in names if i in ifaces], f"{var} names {missing} not among {ifaces}"
    return names, None


def ifname_problem(var: str, spec: Any, ifaces: list[str]) -> str | None:
    """Why ``spec`` selects no usable interface on a node with ``ifaces``, or ``None``.

    NCCL (``NCCL_SOCKET_IFNAME``): comma list of prefixes; ``=name`` is exact;
    a leading ``^`` excludes the listed ones. Others (``GLOO_SOCKET_IFNAME``,
    ``TP_SOCKET_IFNAME``...): comma list of exact names, all used. NCCL and Gloo
    ignore a value under 2 characters and auto-detect (NCCL src/misc/socket.cc
    ``ncclFindInterfaces``: ``strlen(env) > 1``; torch ProcessGroupGloo.cpp
    ``create_default``: ``ifnameEnv->size() > 1``): no problem then.
    """
    return _ifname_selection(var, spec, ifaces)[1]


def _devices(value: str, node: Mapping[str, Any]) -> tuple[CopyVerdict, str]:
    """``CUDA_VISIBLE_DEVICES``: indices against the node's GPU count (``nvidia-smi``
    lists every GPU whatever the variable says); UUIDs cannot be checked."""
    count = node.get("gpu_count")
    items = [i.strip() for i in value.split(",") if i.strip()]
    if not isinstance(count, int) or isinstance(count, bool):
        return "unknown", "this node's GPUs were not counted (gpu_count not captured)"
    if not items:
        if count:
            return "does_not_work", f"an empty list hides all {count} GPUs of this node"
        return "works", "this node has no GPU, and the list shows none"
    if any(not i.lstrip("-").isdigit() for i in items):
        return "unknown", (
            f"{value!r} names GPUs by UUID (or MIG instance); the node probe captures "
            "their number, not their UUIDs"
        )
    missing = [i for i in items if not 0 <= int(i) < count]
    if missing:
        have = f"0-{count - 1}" if count > 1 else ("0" if count else "none")
        return "does_not_work", (
            f"device(s) {', '.join(missing)} not among this node's {count} GPU(s) ({have}); "
            "CUDA stops reading the list at the first one"
        )
    return "works", f"device(s) {', '.join(items)} exist among this node's {count} GPU(s)"


def _ucx_devices(value: str, node: Mapping[str, Any]) -> tuple[CopyVerdict, str]:
    """``UCX_NET_DEVICES``: ``all``, network interfaces (``eth0``) or RDMA device ports
    (``mlx5_0:1``), which the probe does not capture."""
    items = [i.strip() for i in value.split(",") if i.strip()]
    if not items or items == ["all"]:
        return "works", "'all' lets UCX use whatever devices this node has"
    ifaces = interfaces_of(node)
    plain = [i for i in items if ":" not in i]
    if plain and ifaces is None:
        return "unknown", "this node's network interfaces were not captured"
    missing = [i for i in plain if i not in (ifaces or [])]
    if missing:
        return "does_not_work", f"{missing} not among this node's interfaces {ifaces}"
    if len(plain) < len(items):
        return "unknown", _NO_HCAS
    return "works", f"{plain} are among this node's interfaces {ifaces}"


def _address(
    var: str, value: str, node: Mapping[str, Any], others: Sequence[str]
) -> tuple[CopyVerdict, str]:
    """A per-node address: this node's own Ray IP works; another node's never does."""
    ip = node.get("ip")
    if others:
        own = f"set this node's Ray IP {ip} here" if ip else "this node's Ray IP was not captured"
        return "does_not_work", (
            f"{var} is each node's own address and {value} is {', '.join(others)}'s: a copy "
            f"gives two nodes one address ({own})"
        )
    if not ip:
        return "unknown", f"this node's Ray IP was not captured: whether {value} is its address"
    if str(ip) == str(value):
        return "works", f"{value} is this node's Ray IP"
    return "does_not_work", (
        f"{var} is each node's own address: {value} is not this node's Ray IP {ip}; set {ip} here"
    )


def judge_copy(
    var: str, value: Any, node: Mapping[str, Any], others: Sequence[str] = ()
) -> tuple[CopyVerdict, str]:
    """Whether ``var=value`` would work on ``node`` (its fingerprint), and why.

    ``others``: the *other* nodes that set this very value (a per-node address or rank
    copied from one of them is a duplicate). Judged on the node's captured facts only;
    what was not captured gives ``unknown``.
    """
    text = "" if value is None else str(value)
    reason = unset_reason(var, text)
    if reason is not None:
        return "does_not_work", reason
    if var.endswith("_SOCKET_IFNAME"):
        ifaces = interfaces_of(node)
        if ifaces is None:
            return "unknown", "this node's network interfaces were not captured"
        chosen, problem = _ifname_selection(var, text, ifaces)
        if problem and var.startswith("NCCL_"):
            return "does_not_work", f"it selects none of this node's interfaces {ifaces}"
        if problem:
            missing = [i for i in text.split(",") if i.strip() and i.strip() not in ifaces]
            return "does_not_work", (
                f"{', '.join(i.strip() for i in missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not among this node's interfaces {ifaces}"
            )
        return "works", f"it selects {chosen} among this node's interfaces {ifaces}"
    if var in _ADDRESS_VARS:
        return _address(var, text, node, others)
    if var in _RANK_VARS:
        return "does_not_work", (
            f"{var} is a rank, unique per node: a copy of {text} duplicates "
            f"{', '.join(others) if others else 'the value set elsewhere'}; give this node its own"
        )
    if var in _OWN_VALUE_VARS:
        return "unknown", (
            f"{var} differs per node by design: whether {text!r} suits this node depends on "
            "its own ranks, ports or cores, which the node probe does not capture"
        )
    if var == "CUDA_VISIBLE_DEVICES":
        return _devices(text, node)
    if var == "UCX_NET_DEVICES":
        return _ucx_devices(text, node)
    if var == "NCCL_IB_HCA":
        return "unknown", _NO_HCAS
    if text.startswith(("/", "~")):
        return "unknown", (
            f"whether {text} exists on this node was not captured (the node probe looks at "
            "the model directory and the engine's python only)"
        )
    return "not_node_specific", (
        "the value names no interface, device, address, rank or path of a node: nothing on "
        "this node to check; copying it makes the nodes agree"
    )


def _engine_python(python: str, node_facts: Mapping[str, Any]) -> tuple[CopyVerdict, str]:
    """The engine python another node uses, on a node whose own is not usable."""
    mine = node_facts.get("python")
    if node_facts.get("kind", "path") != "path" or node_facts.get("error"):
        return "unknown", (
            "this node's engine environment could not be checked as a path "
            f"({node_facts.get('error') or node_facts.get('kind')})"
        )
    if mine == python:
        return "does_not_work", (
            "it is this node's own configured python, and the probe found it unusable here"
        )
    return "unknown", (
        f"this node's probe checked only its own python {mine}"
        + (f" ({node_facts['source']})" if node_facts.get("source") else "")
        + f": whether {python} exists here was not captured"
    )


def copy_sentence(what: str, item: Mapping[str, Any], verb: str = "set") -> str:
    """A copy check in words: ``copying NCCL_SOCKET_IFNAME='eth9' (set on node-0) would not
    work here: ...``; ``what`` names the setting and its value."""
    where = [*item.get("set_on", [])]
    if item.get("launch_source"):
        where.append(f"in {item['launch_source']}")
    origin = f" ({verb} {'on ' if item.get('set_on') else ''}{', '.join(where)})" if where else ""
    what = f"{what}{origin}"
    verdict = item["verdict"]
    if verdict == "works":
        return f"{what} would work here: {item['reason']}"
    if verdict == "does_not_work":
        return f"{what} would not work here: {item['reason']}"
    if verdict == "unknown":
        return f"whether {what} would work here is unknown: {item['reason']}"
    return f"{what}: {item['reason']}"


def copy_checks(
    field: str,
    values: Mapping[str, Any],
    nodes: Mapping[str, Mapping[str, Any]],
    launch_env: Mapping[str, Any] | None,
    launch_source: str | None,
    display: Callable[[str, Any], Any] = lambda _f, v: v,
) -> dict[str, list[dict[str, Any]]]:
    """Per node that lacks ``field``'s setting, whether each value set elsewhere would work.

    Args:
        field: an ``env.<NAME>`` field (a variable unset, or counting as unset, on some
            nodes while set on others or in the launching environment) or ``engine_env``
            (a node whose engine python is not usable while other nodes' are).
        values: ``{node: value}`` where the field was captured (``None``: unset).
        nodes: ``{node: fingerprint}``.
        launch_env / launch_source: the launching environment, where it was captured.
        display: how a value is shown (secrets redacted).

    Returns:
        ``{node: [{"value", "set_on": [nodes], "launch_source"?, "verdict", "reason",
        "message"}]}``, one entry per distinct value, the most used first; empty when no
        node lacks the setting or no node has a value to copy.
    """
    if field == "engine_env":
        return _engine_copies(values)
    if not field.startswith("env."):
        return {}
    var = field.removeprefix("env.")
    sources: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        if value is not None and unset_reason(var, value) is None:
            sources.setdefault(str(value), {"set_on": []})["set_on"].append(name)
    launch_value = (launch_env or {}).get(var)
    if launch_value is not None and unset_reason(var, launch_value) is None:
        sources.setdefault(str(launch_value), {"set_on": []})["launch_source"] = (
            launch_source or "the launching environment"
        )
    lacking = [n for n, v in values.items() if v is None or unset_reason(var, v) is not None]
    if not sources or not lacking:
        return {}
    ordered = sorted(sources.items(), key=lambda kv: -len(kv[1]["set_on"]))
    out: dict[str, list[dict[str, Any]]] = {}
    for name in lacking:
        items = []
        for value, src in ordered:
            others = [n for n in src["set_on"] if n != name]
            verdict, reason = judge_copy(var, value, nodes.get(name, {}), others)
            item = {"value": display(field, value), **src, "verdict": verdict, "reason": reason}
            item["message"] = copy_sentence(f"copying {var}={item['value']!r}", item)
            items.append(item)
        out[name] = items
    return out


def _engine_copies(values: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """``engine_env``: the pythons of the nodes whose own is usable (a path on the node),
    tried on each node whose own is not."""
    sources: dict[str, list[str]] = {}
    lacking = []
    for name, facts in values.items():
        if not isinstance(facts, Mapping):
            continue
        if engine_env_problem(facts) is not None:
            lacking.append(name)
        elif facts.get("kind", "path") == "path" and facts.get("python"):
            sources.setdefault(str(facts["python"]), []).append(name)
    out: dict[str, list[dict[str, Any]]] = {}
    for name in lacking:
        items = []
        for python, set_on in sorted(sources.items(), key=lambda kv: -len(kv[1])):
            verdict, reason = _engine_python(python, values[name])
            item: dict[str, Any] = {
                "value": python,
                "set_on": set_on,
                "verdict": verdict,
                "reason": reason,
            }
            item["message"] = copy_sentence(f"using the engine python {python}", item, "used")
            items.append(item)
        if items:
            out[name] = items
    return out
