"""A campaign's space proposed by vlab: ``"space": "auto"`` (issue 25).

:func:`propose_space` is pure given its inputs: the campaign's :class:`Evidence` (the
baseline with its workload, the model's facts, the cluster's devices; no runs yet), each
variable's starting value (the baseline's explicit value, else vLLM's resolved one; None:
unknown) and whether the objective is a latency. Every variable it considers gets a note
(proposed or not, and why, written for a user); the intake stores the notes with the
campaign (``result["space_proposal"]``). The rules:

- ``engine_args.enable_prefix_caching``: ``[false, true]``; left out when the prefix
  analyser predicts under 5 % hits for the workload (quoting it).
- ``engine_args.max_num_seqs`` (start s): s/2, s, 2s, and the workload's target
  concurrency when it is below s.
- ``engine_args.max_num_batched_tokens`` (start t): t/2 (only when it holds the longest
  prompt), t, 2t, 4t.
- ``engine_args.max_model_len``: the next power of two at or above the longest request
  (prompt + output) and the start, only when that request needs under half of the start
  (else "the workload needs the context").
- ``layout.tensor_parallel_size``: 1, 2, 4... up to the devices per node, only when a node
  has more than one device and the model's weights do not fit one device or the objective
  is a latency (``*_ms``); the facts :mod:`orchestrator.tuning.evidence` skips TP on.

Every variable with an unknown start is left out ("its starting value is unknown: set it in
the baseline"). Levels are whole numbers >= 1 (booleans for prefix caching), sorted, the
start always among them. The longest request is the experiment checks' estimate
(:func:`jobs.load.workload.longest_request_tokens` plus the chat template's allowance).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from jobs.load.workload import longest_request_tokens
from jobs.schemas import WorkloadSpec
from orchestrator.campaigns.space import Level
from orchestrator.experiments.engine_catalog import parse_human_int
from orchestrator.experiments.planner import PROMPT_OVERHEAD_TOKENS
from orchestrator.tuning.evidence import (
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    PREFIX_CACHING,
    Evidence,
    no_prefix_hits,
    one_device_fit,
    target_concurrency,
)

MAX_NUM_BATCHED_TOKENS = "engine_args.max_num_batched_tokens"
TENSOR_PARALLEL = "layout.tensor_parallel_size"
#: The variables vlab considers, in the order the proposal lists them.
AUTO_VARIABLES = (
    PREFIX_CACHING,
    MAX_NUM_SEQS,
    MAX_NUM_BATCHED_TOKENS,
    MAX_MODEL_LEN,
    TENSOR_PARALLEL,
)
#: At most this many levels per variable.
MAX_LEVELS = 5
UNKNOWN_START = "its starting value is unknown: set it in the baseline"


@dataclass(frozen=True)
class Proposal:
    """The proposed space (``variables``: ``{name, levels, start}`` as a request's space
    writes them) and one note per variable considered (``{name, proposed, why}``)."""

    variables: list[dict[str, Any]] = field(default_factory=list)
    notes: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class _Workload:
    """What the rules read of the baseline's workload (None: unknown, with ``problem``)."""

    concurrency: int
    longest: int | None = None  # prompt + output tokens, the chat template's allowance included
    longest_prompt: int | None = None
    problem: str | None = None

    @classmethod
    def of(cls, baseline: Mapping[str, Any]) -> _Workload:
        concurrency = target_concurrency(baseline)
        try:
            spec = WorkloadSpec.model_validate(baseline.get("workload") or {})
            longest = longest_request_tokens(spec) + PROMPT_OVERHEAD_TOKENS
        except ValueError as exc:
            why = " ".join(str(exc).split())[:200]
            return cls(concurrency, problem=f"the workload's requests cannot be sized ({why})")
        # shared_prefix outputs are fixed; other kinds' prompts are bounded by the total
        prompt = longest - spec.output_tokens if spec.kind == "shared_prefix" else longest
        return cls(concurrency, longest, max(1, prompt))


#: A rule: ``(evidence, start, latency objective, workload) -> (levels | None, start, why)``.
_Rule = Callable[[Evidence, Level, bool, _Workload], tuple[list[Level] | None, Level, str]]


def propose_space(
    evidence: Evidence, starts: Mapping[str, Level | None], latency_objective: bool
) -> Proposal:
    """The variables vlab proposes for ``evidence``'s campaign, and a note on each
    variable it considered (module docstring). Deterministic."""
    workload = _Workload.of(evidence.baseline)
    proposal = Proposal()
    for name in AUTO_VARIABLES:
        start = starts.get(name)
        levels: list[Level] | None = None
        if start is None:
            why = UNKNOWN_START
        else:
            levels, start, why = _RULES[name](evidence, start, latency_objective, workload)
        if levels is not None and start in levels and len(levels) >= 2:
            proposal.variables.append({"name": name, "levels": levels, "start": start})
            proposal.notes.append({"name": name, "proposed": True, "why": why})
        else:
            proposal.notes.append({"name": name, "proposed": False, "why": why})
    return proposal


def _whole(level: Level) -> int | None:
    """``level`` as a whole number >= 1 (``"4K"`` as vLLM reads it), else None."""
    if isinstance(level, bool):
        return None
    if isinstance(level, int):
        value: int | None = level
    elif isinstance(level, float) and level.is_integer():
        value = int(level)
    elif isinstance(level, str):
        value = parse_human_int(level)
    else:
        value = None
    return value if value is not None and value >= 1 else None


def _not_whole(start: Level) -> str:
    return f"its starting value {start!r} is not a whole number of at least 1"


def _levels(values: set[int], start: int) -> list[Level]:
    """``values`` (>= 1) in order, at most :data:`MAX_LEVELS`: the start and those
    nearest it (by ratio; the smaller first on a tie)."""
    kept = sorted(
        {v for v in values if v >= 1} | {start}, key=lambda v: (max(v, start) / min(v, start), v)
    )
    return list(sorted(kept[:MAX_LEVELS]))


# ----------------------------------------------------------------- the rules


def _prefix_caching(
    evidence: Evidence, start: Level, latency: bool, workload: _Workload
) -> tuple[list[Level] | None, Level, str]:
    if not isinstance(start, bool):
        return None, start, f"its starting value {start!r} is not true or false"
    no_hits = no_prefix_hits(evidence, dict(evidence.baseline))
    if no_hits:
        return None, start, no_hits
    return (
        [False, True],
        start,
        "the prefix analyser does not predict under 5 % prefix cache hits for this "
        "workload: whether caching pays is worth measuring",
    )


def _max_num_seqs(
    evidence: Evidence, start: Level, latency: bool, workload: _Workload
) -> tuple[list[Level] | None, Level, str]:
    s = _whole(start)
    if s is None:
        return None, start, _not_whole(start)
    values = {max(1, s // 2), s, 2 * s}
    why = f"half and twice the start {s}"
    if workload.concurrency < s:
        values.add(workload.concurrency)
        why += f", and the workload's target concurrency {workload.concurrency}"
    return _levels(values, s), s, why + ": the batch limit trades throughput for latency"


def _max_num_batched_tokens(
    evidence: Evidence, start: Level, latency: bool, workload: _Workload
) -> tuple[list[Level] | None, Level, str]:
    t = _whole(start)
    if t is None:
        return None, start, _not_whole(start)
    values = {t, 2 * t, 4 * t}
    prompt = workload.longest_prompt
    if prompt is not None and t // 2 >= prompt:
        values.add(t // 2)
        why = f"half, twice and 4x the start {t}"
    elif prompt is None:
        why = f"the start {t}, twice and 4x it (half left out: {workload.problem})"
    else:
        why = (
            f"the start {t}, twice and 4x it (half left out: {t // 2} is below the longest "
            f"prompt, about {prompt} tokens)"
        )
    return _levels(values, t), t, why + ": the token budget of a step sets prefill's share"


def _max_model_len(
    evidence: Evidence, start: Level, latency: bool, workload: _Workload
) -> tuple[list[Level] | None, Level, str]:
    cap = _whole(start)
    if cap is None:
        return None, start, _not_whole(start)
    longest = workload.longest
    if longest is None:
        return None, cap, str(workload.problem)
    if 2 * longest >= cap:
        return (
            None,
            cap,
            f"the workload needs the context: its longest request takes about {longest} "
            f"tokens (prompt and output), not under half of max_model_len {cap}",
        )
    lower = 1 << (longest - 1).bit_length()
    return (
        _levels({lower, cap}, cap),
        cap,
        f"the longest request takes about {longest} tokens (prompt and output), under half "
        f"of max_model_len {cap}: a cap of {lower} frees KV cache for more sequences",
    )


def _tensor_parallel(
    evidence: Evidence, start: Level, latency: bool, workload: _Workload
) -> tuple[list[Level] | None, Level, str]:
    tp = _whole(start)
    if tp is None:
        return None, start, _not_whole(start)
    per_node = evidence.devices.per_node
    if per_node is None:
        return None, tp, "the devices per node are unknown (no live orchestrator reports them)"
    if per_node <= 1:
        return None, tp, f"the cluster has {per_node} device per node: nothing to split over"
    asked = (evidence.baseline.get("layout") or {}).get("devices")
    devices = asked if isinstance(asked, int) and not isinstance(asked, bool) else None
    if devices is None or devices < 2:
        return (
            None,
            tp,
            (
                "the baseline's layout sets no `devices` of 2 or more: a run's devices follow its "
                "TP, so TP would change them too (two variables); set `layout.devices` and TP "
                "changes inside it"
            ),
        )
    fits_one, fit = one_device_fit(evidence)
    top = min(per_node, devices)
    sizes = {1 << k for k in range(top.bit_length()) if 1 << k <= top and devices % (1 << k) == 0}
    sizes |= {tp}
    if fits_one is False:
        why = fit
    elif latency:
        why = "the objective is a latency: splitting the model can shorten each step"
    else:
        return None, tp, f"{fit} and the objective is not a latency"
    return (
        _levels(sizes, tp),
        tp,
        (
            f"{why}; powers of two up to the {top} devices of a run (the baseline's {devices}, "
            f"{per_node} per node) that divide them"
        ),
    )


_RULES: dict[str, _Rule] = {
    PREFIX_CACHING: _prefix_caching,
    MAX_NUM_SEQS: _max_num_seqs,
    MAX_NUM_BATCHED_TOKENS: _max_num_batched_tokens,
    MAX_MODEL_LEN: _max_model_len,
    TENSOR_PARALLEL: _tensor_parallel,
}
