"""The node parity rules table (:data:`RULES`) and its Markdown rendering.

Used by :func:`orchestrator.cluster.parity.check_parity`, which evaluates every row
that applies to a field; ``docs/PARITY.md`` ends with :func:`rules_markdown`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from orchestrator.cluster.parity_engineenv import engine_env_problem, image_pin_problem

Check = Literal[
    "identical", "per_node", "present_everywhere", "launch_env", "launch_env_same", "ignore"
]
Severity = Literal["blocking", "warning"]

__all__ = [
    "ABSENT_IS_NOT_CAPTURED",
    "COMM_ENV",
    "PER_NODE_ENV",
    "RULES",
    "Check",
    "Rule",
    "Severity",
    "not_captured_when_absent",
    "rule_for",
    "rules_for",
    "rules_markdown",
]


@dataclass(frozen=True)
class Rule:
    """One row of the parity table.

    - ``name``: the rule's id in reports (``"rules"`` of a finding, ``evaluations``).
    - ``fields``: flattened field names or ``fnmatch`` patterns over them, minus those
      matching ``exclude``. Top-level fingerprint keys keep their name; environment
      variables are ``env.<NAME>``; resolved engine args ``engine_args.<key>``; launch
      args ``launch_args.<key>``.
    - ``check``: ``"identical"`` (same value on every node, unset counting as a value;
      the odd nodes out are the minority), ``"per_node"`` (each node's value must be
      valid on that node; see ``why``), ``"present_everywhere"`` (set on one node ->
      set on every node; the odd nodes are those where it is unset),
      ``"launch_env"`` (set in the launching environment -> set in the Ray workers'
      environment of every node, the head's included; the odd nodes are those where
      it is unset), ``"launch_env_same"`` (set in the launching environment and set
      in a node's Ray workers -> the same value; the odd nodes are those with another
      value) or ``"ignore"`` (expected to differ between nodes). A value NCCL, Gloo or
      vLLM treat as unset (an ``NCCL_``/``GLOO_SOCKET_IFNAME`` under 2 characters, an
      empty ``VLLM_HOST_IP``) counts as unset for ``present_everywhere`` and
      ``launch_env``.
    - ``severity``: ``"blocking"`` blocks the launch, ``"warning"`` only warns.
    - ``node_check``: for a ``"per_node"`` row, the function that judges one node's
      value (returns the problem, or None); rows without one use the checks built
      into :mod:`orchestrator.cluster.parity`.

    Every row that applies to a field is evaluated; a finding's ``odd_nodes`` and
    ``rule`` are those of its first failing row (blocking rows before warning ones).
    """

    name: str
    fields: tuple[str, ...]
    check: Check
    severity: Severity
    why: str
    exclude: tuple[str, ...] = ()
    node_check: Callable[[Any], str | None] | None = None

    def applies(self, field: str) -> bool:
        """Whether ``field`` is one of :attr:`fields` and none of :attr:`exclude`."""
        hit = any(fnmatch.fnmatchcase(field, p) for p in self.fields)
        return hit and not any(fnmatch.fnmatchcase(field, p) for p in self.exclude)


_SAME = "must be identical on all nodes"

#: Communication settings: where one is unset, NCCL/Gloo/tensorpipe/vLLM fall back to
#: auto-detection on that node (NCCL: ``ib*`` first, then any interface but ``docker``
#: and ``lo``, NCCL src/misc/socket.cc ``ncclFindInterfaces``; Gloo: the address the
#: hostname resolves to, loopback as the last resort: vllm-project/vllm#7074).
COMM_ENV: tuple[str, ...] = (
    "env.*_SOCKET_IFNAME",  # NCCL_, GLOO_, TP_ (tensorpipe)
    "env.NCCL_IB_*",
    "env.NCCL_P2P_*",
    "env.NCCL_NET*",
    "env.NCCL_SOCKET_*",
    "env.NCCL_CROSS_NIC",
    "env.GLOO_*",
    "env.UCX_NET_DEVICES",
    "env.UCX_TLS",
    "env.MASTER_ADDR",
    "env.MASTER_PORT",
    "env.VLLM_HOST_IP",
    "env.VLLM_PORT",
    "env.VLLM_DP_*",
    "env.VLLM_USE_RAY_*",
    "env.VLLM_RAY_*",
    "env.VLLM_NCCL_SO_PATH",
    "env.VLLM_PP_LAYER_PARTITION",
    "env.VLLM_SKIP_P2P_CHECK",
    "env.VLLM_DISABLE_PYNCCL",
    "env.VLLM_ALLREDUCE_USE_SYMM_MEM",
    "env.VLLM_DISTRIBUTED_*",
)

#: Variables that differ per node by design: vLLM's ``WORKER_SPECIFIC_ENV_VARS``
#: (vllm/v1/executor/ray_utils.py, vLLM 0.32), the data-parallel rank and the CPU
#: thread binding vlab sets per node.
PER_NODE_ENV: tuple[str, ...] = (
    "env.VLLM_HOST_IP",
    "env.VLLM_HOST_PORT",
    "env.VLLM_NIXL_SIDE_CHANNEL_HOST",
    "env.VLLM_DP_RANK",
    "env.VLLM_DP_RANK_LOCAL",
    "env.VLLM_CPU_OMP_THREADS_BIND",
    "env.LOCAL_RANK",
)

_IFNAME = ("env.*_SOCKET_IFNAME",)
_RANK_ARGS = (
    "engine_args.node_rank",
    "engine_args.headless",
    "launch_args.node_rank",
    "launch_args.headless",
)


def _same(name: str, fields: tuple[str, ...], what: str, **kw: Any) -> Rule:
    return Rule(name, fields, "identical", "blocking", f"{what} {_SAME}", **kw)


#: Sub-fields a node may not report: where its fingerprint lacks one, the value is *not
#: captured* on that node (never compared, the rule says ``unknown``); a ``null`` it
#: reports is a value (``engine_env.image_uri``: no image).
ABSENT_IS_NOT_CAPTURED: tuple[str, ...] = ("engine_env.*",)

_ENGINE_WHERE = (
    "engine_env.python",
    "engine_env.source",
    "engine_env.exists",
    "engine_env.is_file",
    "engine_env.executable",
    "engine_env.error",
)

RULES: tuple[Rule, ...] = (
    # --- the engine environment (VLAB_ENGINE__PYTHON, ..._PYTHON_BY_NODE, ..._IMAGE_URI):
    # checked on the chosen nodes before anything is placed, single-node runs included.
    Rule(
        "engine_env",
        ("engine_env",),
        "per_node",
        "blocking",
        "the engine environment must be on every node: its python present, a file and "
        "executable (inside the image with VLAB_ENGINE__IMAGE_URI); else the launch "
        "would fail on that node",
        node_check=engine_env_problem,
    ),
    Rule(
        "engine_env_kind",
        ("engine_env.kind", "engine_env.image_uri"),
        "identical",
        "blocking",
        "every node must run the engine the same way: the same container image, or a "
        "python on the node everywhere (an image brings its own CUDA, NCCL and system "
        "libraries)",
    ),
    Rule(
        "engine_image_pinned",
        ("engine_env.image_uri",),
        "per_node",
        "warning",
        "an image named by tag only may be a different image on each node (each pulls "
        "what the tag names when it pulls); pin it by digest",
        node_check=image_pin_problem,
    ),
    Rule(
        "engine_env_packages",
        ("engine_env.digest", "engine_env.distributions"),
        "identical",
        "warning",
        "the engine environments should hold the same packages at the same versions "
        "(a digest of every name==version); vLLM and torch are compared by their own rules",
    ),
    Rule(
        "engine_env_where",
        _ENGINE_WHERE,
        "ignore",
        "warning",
        "where the engine python is may differ per node (VLAB_ENGINE__PYTHON_BY_NODE); "
        "whether it is there is rule engine_env",
    ),
    # --- software versions: Ray refuses a Python/Ray mismatch at join time;
    # vLLM/torch/CUDA/NCCL drift gives wrong kernels or a hung collective.
    Rule(
        "python",
        ("python",),
        "identical",
        "blocking",
        f"Python version {_SAME} (even the patch level)",
    ),
    _same("ray", ("ray",), "Ray version"),
    _same("vllm", ("vllm",), "vLLM version"),
    _same("torch", ("torch",), "torch build"),
    _same("cuda_runtime", ("cuda_runtime",), "CUDA runtime"),
    _same("nccl", ("nccl",), "NCCL version"),
    Rule(
        "nvidia_driver", ("nvidia_driver",), "identical", "warning", "driver versions should match"
    ),
    # --- hardware: TP/PP shards assume the same GPU and memory on every rank.
    _same("gpu_model", ("gpu_model",), "GPU model"),
    _same("gpu_memory_mib", ("gpu_memory_mib",), "GPU memory"),
    Rule(
        "gpu_count",
        ("gpu_count",),
        "per_node",
        "blocking",
        "each node needs at least launch.gpus_per_node GPUs, and all nodes together "
        "at least tensor_parallel_size x pipeline_parallel_size",
    ),
    # --- model: the Hugging Face snapshot each node resolved, then every file in it.
    Rule(
        "model_revision",
        ("model_revision",),
        "identical",
        "blocking",
        "the model revision (the commit of the Hugging Face snapshot each node resolved "
        "the model id to; none for directories) must be identical on all nodes",
    ),
    Rule(
        "model_source",
        ("model_source",),
        "identical",
        "warning",
        "nodes should find the model the same way (local_dir, model_root, hf_cache, hf_hub)",
    ),
    Rule(
        "model_files",
        ("model_files",),
        "identical",
        "blocking",
        "the model directory must exist on every node with the same files "
        "(names, sizes, sha256), config and tokenizer included",
    ),
    # --- communication settings (every row applies; see COMM_ENV).
    Rule(
        "comm_launch_shell_only",
        COMM_ENV,
        "launch_env",
        "blocking",
        "a communication setting made in the launching environment (the shell of vllm "
        "serve on the head, or vlab's orchestrator) must also be set in the Ray workers' "
        "environment on every node, the head's own included: Ray workers inherit the "
        "environment of `ray start`, not the launching shell's; whether vLLM copies a "
        "variable to its Ray workers depends on its version and executor (never "
        "VLLM_HOST_IP), and nothing reaches --headless nodes. Set it where Ray is "
        "started on every node (run_cluster.sh -e NAME=value, the shell of `ray start`)",
    ),
    Rule(
        "comm_launch_shell_differs",
        COMM_ENV,
        "launch_env_same",
        "warning",
        "a communication setting made in the launching environment with another value "
        "than in a node's Ray workers: which one the engine uses depends on vLLM's "
        "executor (0.32's default Ray executor V2 keeps the workers' value; "
        "RayDistributedExecutor, VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0, overwrites it "
        "with the driver's for the VLLM_, NCCL_, UCX_, HF_ prefixes), so the value the "
        "operator sees is not necessarily the one in use; a warning, not a block, "
        "because every node still "
        "gets the same value either way (comm_set_everywhere and the per-node rules "
        "check the workers' values). Per-node variables (VLLM_HOST_IP ...) are exempt",
        exclude=PER_NODE_ENV,
    ),
    Rule(
        "comm_set_everywhere",
        COMM_ENV,
        "present_everywhere",
        "blocking",
        "a communication setting (NCCL, Gloo, tensorpipe, UCX, MASTER_*, vLLM "
        "distributed) set on one node must be set on every node: where it is unset, "
        "that node falls back to auto-detection (another interface, HCA or address); "
        "a value NCCL, Gloo or vLLM ignore counts as unset (NCCL_/GLOO_SOCKET_IFNAME "
        "under 2 characters, an empty VLLM_HOST_IP)",
    ),
    Rule(
        "socket_ifname_exists",
        _IFNAME,
        "per_node",
        "blocking",
        "an interface named in *_SOCKET_IFNAME must exist on that node "
        "(NCCL: prefix match, '=' exact, '^' exclude, under 2 characters ignored; "
        "others: every name exact)",
    ),
    Rule(
        "vllm_host_ip",
        ("env.VLLM_HOST_IP",),
        "per_node",
        "blocking",
        "VLLM_HOST_IP, when set, must be unique across nodes and equal the node's Ray IP",
    ),
    Rule(
        "master_same",
        ("env.MASTER_ADDR", "env.MASTER_PORT"),
        "identical",
        "blocking",
        f"the rendezvous address (MASTER_ADDR, MASTER_PORT) {_SAME}",
    ),
    Rule(
        "socket_ifname_same",
        _IFNAME,
        "identical",
        "warning",
        "*_SOCKET_IFNAME differs between nodes: valid only where each node's value "
        "names its interface on the same network (prefer one value that matches on "
        "every node, such as a prefix or an exclusion list)",
    ),
    Rule("nccl_debug", ("env.NCCL_DEBUG*",), "identical", "warning", "debug settings should match"),
    Rule(
        "vllm_logging",
        ("env.VLLM_LOGGING_LEVEL", "env.VLLM_CONFIGURE_LOGGING"),
        "identical",
        "warning",
        "logging settings should match",
    ),
    _same("nccl_same", ("env.NCCL_*",), "NCCL settings", exclude=("env.NCCL_DEBUG*", *_IFNAME)),
    _same("gloo_same", ("env.GLOO_*",), "Gloo settings", exclude=_IFNAME),
    _same("ucx_same", ("env.UCX_*",), "UCX settings"),
    _same(
        "vllm_env_same",
        ("env.VLLM_*",),
        "vLLM environment settings",
        exclude=("env.VLLM_LOGGING_LEVEL", "env.VLLM_CONFIGURE_LOGGING", *PER_NODE_ENV),
    ),
    Rule(
        "per_node_env",
        tuple(f for f in PER_NODE_ENV if f != "env.VLLM_HOST_IP"),
        "ignore",
        "warning",
        "differs per node by design (vLLM's worker-specific variables, DP rank, CPU binding)",
    ),
    Rule("hf_env", ("env.HF_*",), "identical", "warning", "Hugging Face settings should match"),
    Rule(
        "cuda_visible_devices",
        ("env.CUDA_VISIBLE_DEVICES",),
        "identical",
        "warning",
        "visible GPU lists usually match; Ray sets them per worker anyway",
    ),
    # --- resolved engine / launch args: rank-specific ones differ by design.
    Rule("rank_args", _RANK_ARGS, "ignore", "warning", "differs per node by design"),
    _same("engine_args", ("engine_args.*",), "resolved engine args", exclude=_RANK_ARGS),
    _same("launch_args", ("launch_args.*",), "launch args", exclude=_RANK_ARGS),
    # --- everything else that is informative only.
    Rule("os", ("os",), "identical", "warning", "OS releases should match"),
    Rule("kernel", ("kernel",), "identical", "warning", "kernel versions should match"),
)


def not_captured_when_absent(field: str) -> bool:
    """Whether a node lacking ``field`` has it *not captured* (:data:`ABSENT_IS_NOT_CAPTURED`)."""
    return any(fnmatch.fnmatchcase(field, p) for p in ABSENT_IS_NOT_CAPTURED)


def rules_for(field: str) -> list[Rule]:
    """Every :data:`RULES` row that applies to a flattened field name, in table order."""
    return [rule for rule in RULES if rule.applies(field)]


def rule_for(field: str) -> Rule | None:
    """The first :data:`RULES` row that applies to ``field``, or ``None``."""
    rules = rules_for(field)
    return rules[0] if rules else None


def rules_markdown() -> str:
    """:data:`RULES` as a Markdown table (``docs/PARITY.md`` ends with this text; a test
    keeps it so)."""
    lines = [
        "| rule | fields | check | severity | why |",
        "|---|---|---|---|---|",
    ]
    for rule in RULES:
        fields = ", ".join(f"`{f}`" for f in rule.fields)
        if rule.exclude:
            fields += " except " + ", ".join(f"`{f}`" for f in rule.exclude)
        why = rule.why.replace("|", "\\|")
        lines.append(f"| {rule.name} | {fields} | {rule.check} | {rule.severity} | {why} |")
    return "\n".join(lines) + "\n"
