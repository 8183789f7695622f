"""Bodies of ``/api/v1/experiments``: an experiment submitted, listed and read, and its
export to MLflow, and the comparison of its variants (made of the analysis' own models:
:class:`~orchestrator.analysis.compare.MetricComparison`,
:class:`~orchestrator.analysis.capacity_compare.CapacityComparison`,
:class:`~orchestrator.analysis.findings.Finding`).

Submissions use :class:`orchestrator.experiments.spec.ExperimentSpec` (the request body
is read as JSON so every problem is reported at once, ``spec_invalid``).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from api.schemas.runs import RunBrief, RunOut
from orchestrator.analysis.capacity_compare import CapacityComparison
from orchestrator.analysis.compare import MetricComparison
from orchestrator.analysis.findings import Finding


class ExperimentCreated(BaseModel):
    id: str
    url: str
    runs: list[RunBrief]
    capacity_estimate: dict[str, Any] | None = Field(
        None,
        description="a capacity experiment: the longest its searches can take, in seconds "
        "(steps_max, step_s_max, drain_s_max, run_s_max, runs, experiment_s_max, note)",
    )


class ExperimentOut(BaseModel):
    id: str
    url: str
    name: str
    description: str | None
    model_id: str
    model_digest: str
    model_revision: str | None = Field(
        None, description="Hugging Face snapshot commit of a model named by id (else null)"
    )
    request_list_hash: str
    created_at: datetime
    submitted_by: str | None = Field(
        None, description="who submitted it: a token name, 'anonymous' or 'schedule:<name>'"
    )
    status: str
    repeats: int
    server_reuse: dict[str, Any] = Field(
        description="runs that reused a running vLLM server and the start-up seconds saved"
    )
    variants: list[dict[str, Any]] = Field(
        description="the chain: each variant's reference, the variable it changes, its changes"
    )
    spec: dict[str, Any]
    runs: list[RunOut]


class ExperimentListItem(BaseModel):
    id: str
    url: str
    name: str
    model_id: str
    created_at: datetime
    status: str
    run_count: int


class MlflowExportTarget(BaseModel):
    """Where and how to export to MLflow: the fields every export request shares (the
    experiment's and the campaign's)."""

    model_config = ConfigDict(extra="forbid")

    tracking_uri: str | None = Field(
        None,
        min_length=1,
        max_length=2000,
        description="the MLflow tracking server, e.g. https://mlflow.example.com (default "
        "VLAB_MLFLOW__TRACKING_URI); http(s) only unless VLAB_MLFLOW__ALLOW_LOCAL_STORES",
    )
    replace: StrictBool = Field(
        False, description="delete the MLflow runs an earlier export made and export anew"
    )
    max_points: int | None = Field(
        None,
        ge=1,
        le=100_000,
        strict=True,
        description="at most this many time-series points per run (default: every sample)",
    )


class MlflowExportRequest(MlflowExportTarget):
    """``POST /api/v1/experiments/{id}/export/mlflow``: where to export the runs."""

    experiment_name: str | None = Field(
        None,
        min_length=1,
        max_length=500,
        description="the MLflow experiment (default: the vlab experiment's name)",
    )
    include_failed: StrictBool = Field(
        True, description="export failed, cancelled and blocked runs (without summary metrics)"
    )


class MlflowRunExportOut(BaseModel):
    run_id: str
    variant: str
    repeat_index: int
    status: str
    action: Literal[
        "created", "replaced", "unchanged", "skipped_not_finished", "skipped_not_succeeded"
    ]
    mlflow_run_id: str | None
    params: int
    metrics: int = Field(description="summary metrics written (none for a run that failed)")
    series_points: int = Field(description="time-series points written as metric history")
    unknown_metrics: list[str] = Field(
        description="compared metrics the run lacks or holds as non-finite: not written"
    )


class MlflowExportOut(BaseModel):
    experiment_id: str
    tracking_uri: str = Field(description="where it went (without user name or password)")
    mlflow_experiment_name: str
    mlflow_experiment_id: str
    counts: dict[str, int] = Field(description="runs per action")
    runs: list[MlflowRunExportOut]


class ChainLink(BaseModel):
    """A variant and its reference: the variable it changes and the values on each side
    (``reference_value`` / ``variant_value``: present when both have runs; dicts keyed by
    path when the variable touches several paths)."""

    variant: str
    reference: str | None = Field(description="null for the baseline")
    variable: str | None
    paths: list[str] = Field(description="the dotted spec paths the variable touches")
    runs: int
    succeeded: int
    reference_value: Any = None
    variant_value: Any = None


class SucceededRepeats(BaseModel):
    reference: int
    variant: int


class VariantComparison(BaseModel):
    """One variant against its reference on every metric (only succeeded repeats count; a
    variant with none on a side has an empty metric list and a note saying so)."""

    variant: str
    reference: str
    variable: str | None
    succeeded: SucceededRepeats
    notes: list[str]
    metrics: list[MetricComparison]
    capacity: CapacityComparison | None = Field(
        description="null unless the experiment measures capacity under SLOs"
    )


class ExperimentComparison(BaseModel):
    """``GET /api/v1/experiments/{id}/comparison``:
    :func:`orchestrator.analysis.service.comparison`."""

    experiment_id: str
    repeats: int
    chain: list[ChainLink]
    variants: list[VariantComparison]
    findings: list[Finding]
