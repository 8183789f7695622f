"""A campaign's final configuration in the two forms a user takes away (issue 25): the
``vllm serve`` command line that starts it, and an experiment document that re-runs it.

Both are built from the request alone (the baseline with every variable at its final
level), so the CLI can rebuild them from ``GET /api/v1/campaigns/{id}`` (``request`` and
``incumbent``) too. The engine arguments are the ones a run launches with
(:func:`orchestrator.experiments.planner.engine_args_of`: the spec's ``engine_args``, the
layout's tensor and pipeline parallel sizes, ``load_format: dummy`` for a generated
model), rendered as the launcher renders them (:func:`jobs.engine.command.render_engine_args`).
"""

from __future__ import annotations

import shlex
from typing import Any

from pydantic import ValidationError

from jobs.engine.command import render_engine_args
from orchestrator.campaigns.space import Level
from orchestrator.experiments.model_resolution import GENERATED_SHAPES
from orchestrator.experiments.planner import engine_args_of
from orchestrator.experiments.spec import ExperimentSpec
from orchestrator.tuning.campaign_request import CampaignRequest

#: Repeats of the re-run document: enough for an interval on each metric.
RERUN_REPEATS = 3


def final_spec(request: CampaignRequest, config: dict[str, Level], name: str) -> dict[str, Any]:
    """An experiment document that re-runs ``config`` (the final configuration) alone:
    the baseline at ``config``, no variants, :data:`RERUN_REPEATS` repeats."""
    doc = request.experiment_doc(
        f"{name} final"[:80],
        config,
        [],
        description=f"the final configuration of campaign {name!r}",
    )
    doc["repeats"] = RERUN_REPEATS
    return doc


def final_engine_args(request: CampaignRequest, config: dict[str, Level]) -> dict[str, Any]:
    """The engine arguments a run at ``config`` launches with (see the module docstring);
    the baseline's raw ``engine_args`` when the document is not a valid spec."""
    doc = final_spec(request, config, request.name)
    generated = request.model in GENERATED_SHAPES
    try:
        spec = ExperimentSpec.model_validate(doc)
    except ValidationError:
        args = dict((doc.get("baseline") or {}).get("engine_args") or {})
        return {"load_format": "dummy", **args} if generated else args
    return engine_args_of(spec.baseline, generated)


def serve_command(request: CampaignRequest, config: dict[str, Level]) -> str:
    """``vllm serve MODEL [--revision R] <engine args>`` for ``config``, shell-quoted (a
    generated model is named by its shape: ``vlab model generate`` makes its folder)."""
    argv = ["vllm", "serve", request.model]
    if request.revision is not None:
        argv += ["--revision", request.revision]
    argv += render_engine_args(final_engine_args(request, config))
    return shlex.join(argv)


def final_result(request: CampaignRequest, config: dict[str, Level]) -> dict[str, Any]:
    """``{"serve_command", "spec"}`` for ``config``, as a campaign's result stores them;
    ``{}`` when ``config`` does not give every variable a level (before a first step)."""
    if not config or request.auto_space or any(v.name not in config for v in request.variables()):
        return {}
    try:
        return {
            "serve_command": serve_command(request, config),
            "spec": final_spec(request, config, request.name),
        }
    except (KeyError, ValueError):  # a baseline section that is not an object; a bad key
        return {}
