"""A campaign's planned runs as the experiments that store them (issue 25).

The core plans a **cycle** (:meth:`orchestrator.campaigns.loop.Campaign.next_runs`): the
incumbent and every candidate still measured, one pair each, or several pairs when the
cycle is measured side by side (:mod:`orchestrator.tuning.measuring_slots`), each
configuration's runs in a row. A cycle is stored as **one experiment**
(:func:`cycle_doc`): a round's cycle is the incumbent as the baseline with each candidate a
one-variable variant (so the one-variable rule applies to every candidate, also on what
vLLM resolves); the confirmation's is the start as the baseline with the final
configuration as its one variant, the changed variables one linked factor; the pairs are
its repeats. The experiment's runs take the core's labels in the core's order
(:func:`label_runs`), which is also their execution order: one configuration's runs in a
row are server mates, served by one vLLM server. Retries of runs lost to the
infrastructure are stored as :func:`experiments_of` groups them.
"""

from __future__ import annotations

import re
from typing import Any

from orchestrator.campaigns.outcomes import PlannedRun, Role
from orchestrator.core.errors import ConflictError
from orchestrator.core.models import Campaign, Run
from orchestrator.tuning.campaign_request import CampaignRequest

#: Characters an experiment's variant name may not hold (``NAME_PATTERN``).
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.=:,\- ]")


def experiments_of(cycle: list[PlannedRun], missing: list[PlannedRun]) -> list[list[PlannedRun]]:
    """The runs of ``missing`` (of the planned ``cycle``) grouped as the experiments that
    store them: the cycle's first runs together, then the retries (:func:`retry_groups`).
    409 ``campaign_cycle_partial`` when the first runs of the cycle are stored in part."""
    fresh = [p for p in missing if p.attempt == 0]
    if fresh and len(fresh) != sum(1 for p in cycle if p.attempt == 0):
        raise ConflictError(
            "the runs of cycle " + ", ".join(p.label for p in cycle) + " are stored in part",
            code_hint="campaign_cycle_partial",
        )
    return ([fresh] if fresh else []) + retry_groups([p for p in missing if p.attempt])


def retry_groups(retries: list[PlannedRun]) -> list[list[PlannedRun]]:
    """The retries to queue, as experiments, pair by pair: within a pair, with the
    incumbent's (or the start's) retry, one experiment (the candidates its one-variable
    variants; the final configuration against the start); each other retry an experiment
    of its own (its configuration as the baseline)."""
    groups: list[list[PlannedRun]] = []
    for pair in sorted({p.cycle for p in retries}):
        mine = [p for p in retries if p.cycle == pair]
        heads = [p for p in mine if p.role in (Role.INCUMBENT, Role.START)]
        groups += [heads + [p for p in mine if p not in heads]] if heads else [[p] for p in mine]
    return groups


def cycle_doc(row: Campaign, request: CampaignRequest, cycle: list[PlannedRun]) -> dict[str, Any]:
    """The experiment spec document of one cycle (module docstring); its repeats are the
    cycle's pairs."""
    head = cycle[0]
    pairs = sum(1 for p in cycle if p.role is head.role and p.config == head.config)
    others = [p for p in cycle if p.role is not head.role]
    prefix = cycle_name(head)
    if head.role is Role.START and others:  # the confirmation: final vs start, one factor
        final = others[0].config
        changed = [
            k
            for k in final
            if final[k] != head.config[k] or type(final[k]) is not type(head.config[k])
        ]
        level: Any = final[changed[0]] if len(changed) == 1 else {k: final[k] for k in changed}
        doc = request.experiment_doc(
            f"{row.name} {prefix}",
            head.config,
            [],
            description=f"campaign {row.id}: {prefix}, the final configuration vs the start",
        )
        doc["factors"] = [{"name": "final", "paths": changed, "levels": [level]}]
    else:
        candidates = list(dict.fromkeys(p.candidate for p in others if p.candidate is not None))
        names = _variant_names([c.label for c in candidates])
        variants = [
            {"name": name, "changes": {c.variable: c.to_level}}
            for name, c in zip(names, candidates, strict=True)
        ]
        doc = request.experiment_doc(
            f"{row.name} {prefix}",
            head.config,
            variants,
            description=f"campaign {row.id}: {prefix}, the incumbent and its candidates",
        )
    doc["repeats"] = pairs
    if head.attempt:
        doc["description"] = (
            f"campaign {row.id}: {prefix}, measured again (lost, or flagged by a finding): "
            + ", ".join(p.label for p in cycle)
        )
    return doc


def label_runs(row: Campaign, runs: list[Run], cycle: list[PlannedRun]) -> list[Run]:
    """Give the experiment's ``runs`` the core's labels: by variant (the baseline first) and
    repeat, which is the order the core plans a cycle in (each configuration's pairs in a
    row); their execution order becomes that order too, so one configuration's runs are
    server mates. 409 ``campaign_cycle_mismatch`` when the counts differ."""
    ordered = sorted(runs, key=lambda r: (r.position, r.repeat_index))
    if len(ordered) != len(cycle):
        raise ConflictError(
            f"cycle {cycle_name(cycle[0])} planned {len(cycle)} runs, its experiment has "
            f"{len(ordered)}",
            code_hint="campaign_cycle_mismatch",
        )
    first = min(r.sequence for r in ordered)
    for k, (run, planned) in enumerate(zip(ordered, cycle, strict=True)):
        run.campaign_id = row.id
        run.campaign_label = planned.label
        run.sequence = first + k
    return ordered


def cycle_name(head: PlannedRun) -> str:
    """``r2.c3`` or ``confirm.c1`` for the experiment of the cycle ``head`` opens; a retry
    of runs lost to the infrastructure adds ``retry<attempt>``."""
    name = f"confirm.c{head.cycle}" if head.round == 0 else f"r{head.round}.c{head.cycle}"
    return f"{name} retry{head.attempt}" if head.attempt else name


def _variant_names(labels: list[str]) -> list[str]:
    """Experiment variant names for candidate labels (what a name may not hold is ``_``;
    a name taken already gets ``-2``, ``-3``...)."""
    names: list[str] = []
    for label in labels:
        base = (_NAME_UNSAFE.sub("_", label)[:90].strip() or "candidate").lstrip("_.=:,- ")
        name, k = base or "candidate", 2
        while name in names or name == "baseline":
            name, k = f"{base}-{k}", k + 1
        names.append(name)
    return names
