"""A capacity search in an experiment: the submission's checks and the search's time bound.

``capacity`` (a :class:`jobs.capacity.search.CapacitySpec`) is a measurement setting of the
whole experiment (:mod:`orchestrator.experiments.spec`). At submission:

- :func:`capacity_spec_problems`: the spec's own rules beyond the model's (field errors);
- :func:`capacity_errors`: each run's workload fits the search variable, no variant
  changes what the search drives, and **its steps can reach a steady state**
  (:func:`steady_state_problems`: the fewest requests a step sends fit in ``max_step_s``
  at ``min``, the objectives' percentiles can be bounded there, and the request list
  holds the shortest step at ``max``), each a 422 problem with a stable ``type``;
- :func:`search_time_bound`: the longest the search can take, stored with the
  experiment (``spec.capacity_estimate``) and shown where the spec is accepted.

The step rules themselves are :mod:`jobs.capacity.steadystate`'s (the runner plans every step
with them); this module only applies them to the spec before anything runs.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from jobs.capacity.loadsteps import step_floor
from jobs.capacity.search import CapacitySpec, min_requests_to_pass, percentile_of
from jobs.capacity.steadystate import DRAIN_REQUEST_TIMES, MAX_LIST_REQUESTS
from jobs.schemas import WorkloadSpec

if TYPE_CHECKING:  # spec imports this module
    from orchestrator.experiments.spec import PlannedVariant

__all__ = [
    "CAPACITY_ARRIVALS",
    "capacity_driven_paths",
    "capacity_errors",
    "capacity_spec_problems",
    "capacity_workload_problem",
    "search_time_bound",
    "steady_state_problems",
]

#: Arrivals each capacity variable can drive.
CAPACITY_ARRIVALS: dict[str, tuple[str, ...]] = {
    "request_rate": ("constant", "poisson"),
    "concurrency": ("closed",),
}
#: Most concurrency a workload allows (:class:`jobs.schemas.WorkloadSpec`).
_MAX_CONCURRENCY = 4096
_MAX_REQUEST_RATE = 100_000.0


def capacity_spec_problems(capacity: CapacitySpec) -> list[str]:
    """What is wrong with a capacity search in an experiment (field named in each), or [].

    On top of :class:`jobs.capacity.search.CapacitySpec`'s own rules (an objective, percentile
    names, objectives above 0, ``min`` not over ``max``, ``max_step_s`` not under
    ``min_step_s``): a metric in ``slos`` names at least one percentile; ``min`` is below
    ``max`` (a search needs a range); for ``concurrency`` both are whole numbers up to
    4096, for ``request_rate`` ``max`` is at most 100000 requests/s (the workload's own
    limits).
    """
    problems: list[str] = [
        f'capacity.slos.{metric}: give at least one percentile, e.g. {{"p99": 500}}'
        for metric, objectives in capacity.slos.items()
        if not objectives
    ]
    if capacity.min >= capacity.max:
        problems.append(
            f"capacity.min ({capacity.min:g}) must be below capacity.max ({capacity.max:g})"
        )
    if capacity.variable == "concurrency":
        for name in ("min", "max"):
            value = getattr(capacity, name)
            if not float(value).is_integer() or value > _MAX_CONCURRENCY:
                problems.append(
                    f"capacity.{name} ({value:g}): concurrency is a whole number of requests "
                    f"in flight, 1 to {_MAX_CONCURRENCY}"
                )
    elif capacity.max > _MAX_REQUEST_RATE:
        problems.append(
            f"capacity.max ({capacity.max:g}): at most {_MAX_REQUEST_RATE:g} requests/s"
        )
    return problems


def capacity_driven_paths(capacity: CapacitySpec, workload: WorkloadSpec) -> dict[str, str]:
    """Workload paths a capacity search sets itself in every step: ``{path: why}``.

    The search variable (``workload.request_rate`` or ``workload.concurrency``), and
    ``workload.num_requests`` when ``requests_per_step`` sets each step's request count
    (not for kind ``replay``, whose list is the replayed bodies).
    """
    driven = {
        f"workload.{capacity.variable}": f"the capacity search drives {capacity.variable} "
        f"from {capacity.min:g} to {capacity.max:g}"
    }
    if capacity.requests_per_step is not None and workload.kind != "replay":
        driven["workload.num_requests"] = (
            f"capacity.requests_per_step ({capacity.requests_per_step}) sets each step's "
            "request count"
        )
    return driven


def capacity_workload_problem(capacity: CapacitySpec, workload: WorkloadSpec) -> str | None:
    """Why a run with ``workload`` cannot search ``capacity.variable``, or None.

    ``request_rate`` drives an open loop: arrival ``constant`` or ``poisson``;
    ``concurrency`` a closed loop: arrival ``closed``.
    """
    allowed = CAPACITY_ARRIVALS[capacity.variable]
    if workload.arrival not in allowed:
        return (
            f"a capacity search over {capacity.variable} needs workload arrival "
            f"{' or '.join(repr(a) for a in allowed)}, not {workload.arrival!r}"
        )
    return None


def steady_state_problems(
    capacity: CapacitySpec, workload: WorkloadSpec
) -> list[tuple[list[str | int], str, str]]:
    """Why the steps of a run with ``workload`` cannot reach a steady state:
    ``[(loc under the capacity, message, type)]``, [] when they can.

    - the fewest requests a step sends (:func:`jobs.capacity.loadsteps.step_floor`:
      ``requests_per_step``, default the workload's ``num_requests``, raised to what the
      objectives' percentiles and the steadiness test need) must fit in the request list;
    - ``request_rate``: at ``min`` they must arrive within ``max_step_s`` (else a step
      there would be cut short of them: ``capacity_too_few_requests`` on the objective
      when an objective's percentile is what needs them, ``capacity_no_steady_state``
      otherwise), and the request list must hold the shortest step at ``max``
      (``min_step_s`` of arrivals).
    """
    out: list[tuple[list[str | int], str, str]] = []
    floor = step_floor(workload, capacity)
    held = len(workload.replay or []) if workload.kind == "replay" else MAX_LIST_REQUESTS
    what = f"the replay's {held} bodies" if workload.kind == "replay" else f"{held} requests"
    if floor > held:
        out.append(
            (
                ["requests_per_step"],
                f"a step sends at least {floor} requests (requests_per_step and what the "
                f"objectives and the steadiness test need); the request list holds {what}",
                "capacity_no_steady_state",
            )
        )
    if capacity.variable != "request_rate":
        return out
    lasts = (floor - 1) / capacity.min
    if lasts > capacity.max_step_s:
        most = capacity.min * capacity.max_step_s + 1  # requests a step at min can send
        measured = math.floor(most * (1 - capacity.warmup_fraction))
        objective_short = False
        for metric, objectives in capacity.slos.items():
            for name in objectives:
                need = min_requests_to_pass(percentile_of(name), capacity.confidence)
                if need > measured:
                    objective_short = True
                    out.append(
                        (
                            ["slos", metric, name],
                            f"a {name} objective at {capacity.confidence:.0%} confidence needs "
                            f"at least {need} measured requests a step to ever pass; at min "
                            f"({capacity.min:g} req/s) a step of at most max_step_s "
                            f"({capacity.max_step_s:g} s) holds {measured} after its warm-up "
                            "(raise min or max_step_s, or use a lower percentile)",
                            "capacity_too_few_requests",
                        )
                    )
        if not objective_short:
            out.append(
                (
                    ["max_step_s"],
                    f"at min ({capacity.min:g} req/s) a step's {floor} requests (requests_per_step "
                    "and the measured requests a steady state needs) take "
                    f"{lasts:.0f} s, over max_step_s ({capacity.max_step_s:g} s): raise min "
                    "or max_step_s, or lower requests_per_step",
                    "capacity_no_steady_state",
                )
            )
    shortest = math.ceil(capacity.max * capacity.min_step_s) + 1
    if shortest > held:
        out.append(
            (
                ["max"],
                f"a step at max ({capacity.max:g} req/s) lasts at least min_step_s "
                f"({capacity.min_step_s:g} s): {shortest} requests, and the request list "
                f"holds {what} (lower max or min_step_s)",
                "capacity_no_steady_state",
            )
        )
    return out


CALIBRATION_S = 10.0
"""Seconds a run's load-generator calibration takes at most (jobs.load.loadceiling: a 6 s ramp
budget, the stub's and the workers' start)."""


def search_time_bound(capacity: CapacitySpec, runs: int) -> dict[str, Any]:
    """The longest a capacity search can take, in seconds: ``max_steps`` steps (the
    re-measurements included), each at most ``max_step_s`` of arrivals and its drain
    limit (:meth:`jobs.capacity.search.CapacitySpec.drain_s`, or
    :data:`~jobs.capacity.steadystate.DRAIN_REQUEST_TIMES` unloaded request times if longer), for
    each of the experiment's ``runs``; the servers' start-up, warm-ups and cache resets
    come on top. A request-rate search that calibrates its load generator adds
    :data:`CALIBRATION_S` a run."""
    drain = capacity.drain_s()
    step = capacity.max_step_s + drain
    calibration = CALIBRATION_S if capacity.calibrates else 0.0
    run = capacity.max_steps * step + calibration
    return {
        "steps_max": capacity.max_steps,
        "step_s_max": capacity.max_step_s,
        "drain_s_max": drain,
        "calibration_s_max": calibration,
        "run_s_max": run,
        "runs": runs,
        "experiment_s_max": run * runs,
        "note": (
            f"at most {capacity.max_steps} steps of at most {capacity.max_step_s:g} s of "
            f"arrivals and {drain:g} s of drain (or "
            f"{DRAIN_REQUEST_TIMES:g} unloaded request times, if longer) per run"
            + (f", {calibration:g} s of load-generator calibration" if calibration else "")
            + "; server start-up, warm-ups and cache resets come on top"
        ),
    }


def capacity_errors(
    capacity: CapacitySpec, variants: list[PlannedVariant], locs: dict[str, list[str | int]]
) -> list[dict[str, Any]]:
    """Problems of a capacity search with the experiment's runs (``locs``: each variant's
    location in the submitted document).

    Each run's steps must reach a steady state (:func:`steady_state_problems`, reported
    once per problem under ``body.capacity``); each run's workload must fit the search
    variable (:func:`capacity_workload_problem`; reported where the workload's arrival is
    set: the baseline, or the variant whose change broke it), and no variant may change a
    path the search sets itself (:func:`capacity_driven_paths`): it would measure
    nothing different.
    """
    errors: list[dict[str, Any]] = []
    seen: set[tuple[str, ...]] = set()
    driven_by = {v.name: capacity_driven_paths(capacity, v.config.workload) for v in variants}
    problems = {v.name: capacity_workload_problem(capacity, v.config.workload) for v in variants}
    for v in variants:
        for loc, msg, kind in steady_state_problems(capacity, v.config.workload):
            key = (kind, *map(str, loc))
            if key not in seen:
                seen.add(key)
                named = msg if v.reference is None else f"{v.name}: {msg}"
                errors.append({"loc": ["body", "capacity", *loc], "msg": named, "type": kind})
    for v in variants:
        loc = locs.get(v.name, ["body"])
        problem = problems[v.name]
        if problem and (v.reference is None or not problems.get(v.reference)):
            where = (
                [*loc, "workload", "arrival"]
                if v.reference is None
                else [*loc, "changes", *[p for p in v.changes if p.startswith("workload.")][:1]]
            )
            errors.append({"loc": where, "msg": f"{v.name}: {problem}", "type": "capacity_arrival"})
        driven = driven_by[v.name]
        for path in v.changes:
            if path in driven:
                errors.append(
                    {
                        "loc": [*loc, "changes", path],
                        "msg": f"{v.name} changes {path}, which {driven[path]}: the runs would "
                        "measure nothing different",
                        "type": "capacity_driven",
                    }
                )
    return errors
