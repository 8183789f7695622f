"""``/api/v1/analyze/*``: what-if diagnostics that need no GPU.

``POST /api/v1/analyze/kv-cache`` answers "what context cap and concurrency fit
on 2 x 80 GB at TP=2?" from the model's ``config.json`` and the memory figures
(:mod:`orchestrator.analysis.kvcache`, formulas and sources in its docstring).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi import APIRouter

from api.deps import SessionDep, SettingsDep
from api.schemas import (
    ExperimentFindings,
    KVCacheAnalysis,
    KVCacheQuery,
    PrefixAnalysis,
    PrefixQuery,
    RunFindings,
)
from orchestrator.analysis import kvcache
from orchestrator.analysis.prefix import analyze_prefix as run_analysis
from orchestrator.analysis.service import experiment_advice, run_advice
from orchestrator.core.errors import AnalyzeRequestInvalidError, SpecInvalidError
from orchestrator.core.settings import Settings
from orchestrator.experiments.model_resolution import resolve_model

router = APIRouter(prefix="/api/v1/analyze", tags=["analyze"])


def _problem(loc: list[str], msg: str) -> AnalyzeRequestInvalidError:
    return AnalyzeRequestInvalidError(
        [{"loc": ["body", *loc], "msg": msg, "type": "value_error"}],
        detail=f"{'.'.join(loc)}: {msg}",
    )


def _model(settings: Settings, model: str | dict[str, Any]) -> tuple[dict[str, Any], Path | None]:
    if isinstance(model, dict):
        return model, None
    try:
        resolved = resolve_model(settings, model)
    except SpecInvalidError as exc:
        raise AnalyzeRequestInvalidError(exc.errors, detail=exc.errors[0]["msg"]) from None
    return json.loads((resolved.path / "config.json").read_text()), resolved.path


def _what_fits(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """:func:`orchestrator.analysis.kvcache.what_fits` with the estimator's refusals as 422s
    naming the field."""
    try:
        result: dict[str, Any] = kvcache.what_fits(*args, **kwargs)
    except kvcache.KVCacheUnknown as exc:
        raise _problem(
            list(exc.loc),
            f"{exc.msg}; the estimator will not guess: give kv_bytes_per_token (bytes per "
            "token per device, e.g. from a start's 'Available KV cache memory' / 'KV cache "
            "size' lines)",
        ) from None
    except kvcache.KVConfigError as exc:
        raise _problem(list(exc.loc), exc.msg) from None
    except (TypeError, ValueError, KeyError) as exc:  # a value of a shape no rule expected
        raise _problem([], f"the configuration cannot be read: {exc}") from None
    return result


@router.post("/kv-cache", response_model=KVCacheAnalysis, response_model_exclude_unset=True)
def analyze_kv_cache(query: KVCacheQuery, settings: SettingsDep) -> KVCacheAnalysis:
    """KV cache bytes per token, KV cache size in tokens, maximum concurrency at the
    context cap, whether the cap fits at all, and a table of caps, as vLLM 0.32 computes
    them (speculative decoding's drafter layers, sliding-window layers, MLA, KV dtypes).

    The answer is :func:`orchestrator.analysis.kvcache.what_fits` (``KVCacheAnalysis``:
    the estimate per device, the memory figures used, keys the estimator does not know,
    the cap for ``concurrency`` when given, a table of caps). Errors: 422
    problem+json naming the field (unknown model, a config without layer or head
    counts, a layout vLLM refuses, a layout the estimator cannot model (give
    ``kv_bytes_per_token``), no memory figures, no weight size).
    """
    config: dict[str, Any] | None = None
    path: Path | None = None
    if query.model is not None:
        config, path = _model(settings, query.model)
    elif query.kv_bytes_per_token is None:
        raise _problem(["model"], "give the model (name or config.json) or kv_bytes_per_token")
    draft = None
    if query.draft_model is not None:
        draft, _ = _model(settings, query.draft_model)
    answer = _what_fits(
        config,
        query.engine.model_dump(exclude_none=True),
        kvcache.MemoryProfile(**query.memory.model_dump()),
        model_dir=path,
        draft_config=draft,
        kv_bytes_per_token=query.kv_bytes_per_token,
        concurrency=query.concurrency,
    )
    return KVCacheAnalysis.model_validate(answer)


findings_router = APIRouter(prefix="/api/v1", tags=["findings"])


@findings_router.get("/runs/{run_id}/findings", response_model=RunFindings)
def run_findings(run_id: str, session: SessionDep) -> RunFindings:
    """The advisor's findings for a run, in the order operators roll changes back
    (:mod:`orchestrator.analysis.advisor`): ``{"run_id", "findings": [{code, severity, rank,
    scope, run_id, variant, message, action, evidence}]}``. 404 for an unknown run."""
    return RunFindings.model_validate({"run_id": run_id, "findings": run_advice(session, run_id)})


@findings_router.get("/experiments/{experiment_id}/findings", response_model=ExperimentFindings)
def experiment_findings(experiment_id: str, session: SessionDep) -> ExperimentFindings:
    """The advisor's findings for an experiment: each run's and the comparison's
    (bootstrap CIs), in rollback order. Shape as for runs, ``experiment_id`` instead."""
    findings = experiment_advice(session, experiment_id)
    return ExperimentFindings.model_validate({"experiment_id": experiment_id, "findings": findings})


@router.post("/prefix", response_model=PrefixAnalysis)
def analyze_prefix(query: PrefixQuery, settings: SettingsDep) -> PrefixAnalysis:
    """Render every request with the model's tokenizer and chat template and compare
    TOKENS: the prefix all requests share (tokens and whole KV blocks), clusters, the
    first divergence (token position and source location: message, field, characters),
    its cause (timestamp, uuid, request id, random id, user name, JSON key order,
    whitespace, reordered messages or tools, re-tokenization / whitespace merge), the
    best hit rate vLLM's prefix cache can reach for this list, the change that would
    raise it, and every later turn that resends an earlier answer, checked token by token
    (:func:`orchestrator.analysis.prefix.analyze_prefix`; shape: ``PrefixAnalysis``).
    422 problem+json: unknown model, a malformed request (named by index), a token id
    out of the model's vocabulary, a chat template that fails on a request, nothing
    comparable (text without a model)."""
    model_dir = None
    if query.model is not None:
        try:
            model_dir = resolve_model(settings, query.model).path
        except SpecInvalidError as exc:
            raise AnalyzeRequestInvalidError(exc.errors, detail=exc.errors[0]["msg"]) from None
    try:
        analysis = run_analysis(
            query.requests,
            model_dir,
            block_size=query.block_size,
            add_generation_prompt=query.add_generation_prompt,
        )
    except ValueError as exc:
        raise _problem(["requests"], str(exc)) from None
    return analysis
