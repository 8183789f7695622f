"""Bodies of ``/api/v1/campaigns``: a tuning campaign, its path, candidates and confirmation.

A submission is :class:`orchestrator.tuning.campaign_request.CampaignRequest`. Gains are in
log-ratio units, positive is better (:class:`orchestrator.campaigns.decision.Gain`); the
``relative`` fields are the same as fractions (``0.10`` is 10 % better).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, Field

from api.schemas.common import IsoDatetime
from api.schemas.experiments import MlflowExportOut, MlflowExportTarget

#: One level of a variable (a spec field's value).
LevelOut = bool | int | float | str


class CampaignGain(BaseModel):
    """An effect over the incumbent (or the start): log ratio, positive is better."""

    estimate: float
    low: float = Field(description="one-sided lower bound at `confidence`")
    high: float = Field(description="one-sided upper bound at `confidence`")
    n: int = Field(description="pairs behind it")
    confidence: float
    relative: float = Field(description="the estimate as a fraction: 0.10 is 10 % better")
    relative_low: float
    relative_high: float

    @classmethod
    def from_stored(cls, gain: dict[str, Any] | None) -> CampaignGain | None:
        if not gain:
            return None
        return cls(
            estimate=gain["estimate"],
            low=gain["low"],
            high=gain["high"],
            n=gain["n"],
            confidence=gain["confidence"],
            relative=math.expm1(gain["estimate"]),
            relative_low=math.expm1(gain["low"]),
            relative_high=math.expm1(gain["high"]),
        )


class CampaignCandidateOut(BaseModel):
    """One candidate of one round and how it ended (``adopted``, ``inert``, ``worse``,
    ``unknown``, ``skipped``, ``outpaid``, ``marginal``, ``undecided``, ``failed``, or
    ``measuring`` in the round in progress)."""

    round: int
    label: str
    variable: str
    from_level: LevelOut
    to_level: LevelOut
    outcome: str
    verdict: str | None
    pairs: int
    effect: str | None = Field(description="e.g. +10.2 % [+7.9 %, +12.6 %]")
    gain: CampaignGain | None
    reason: str


class CampaignStepOut(BaseModel):
    """One adopted change of the path."""

    round: int
    variable: str
    from_level: LevelOut
    to_level: LevelOut
    verdict: str
    effect: str
    gain: CampaignGain
    reason: str


class CampaignConfirmationOut(BaseModel):
    """The final configuration against the start: the measured ``total``, the sum of the
    step gains (``steps``) and their difference (``interaction``); ``agrees`` when the
    interaction's interval holds 0."""

    total: CampaignGain
    steps: CampaignGain
    interaction: CampaignGain
    agrees: bool


class CampaignRunOut(BaseModel):
    """A run the campaign queued, by its label (``r1.c2.incumbent``,
    ``r1.c2.engine_args.max_num_seqs=64``, ``confirm.c1.final``)."""

    label: str
    id: str
    status: str
    experiment_id: str
    url: str


class CampaignWallTimeOut(BaseModel):
    """Where the campaign's wall time went, in seconds: each phase summed over its runs
    (:mod:`orchestrator.tuning.wall_time`), the wait for devices as wall time, and the
    campaign's own elapsed time."""

    elapsed_s: float = Field(description="from the campaign's creation to now, or its end")
    between_s: float = Field(
        0.0,
        description="wall time with no run of it queued or going: deciding a cycle and "
        "queuing the next, before the first and after the last",
    )
    queue_wait_s: float = Field(
        description="wall time during which a run of it was queued, waiting for devices "
        "(a cycle's runs wait together: counted once)"
    )
    startup_s: float = Field(description="engine start-ups (start to /health), summed")
    warmup_s: float = Field(description="warm-up requests, summed")
    measure_s: float = Field(description="measured phases (capacity steps), summed")
    stop_s: float = Field(description="stopping engines, summed")
    other_s: float = Field(
        description="the rest of the runs' time: request lists, cache resets, failed starts"
    )
    lost_s: float = Field(description="runs lost to the infrastructure, claim to end, summed")
    server_starts: int = Field(description="runs that started a vLLM server")
    servers_reused: int = Field(description="runs that ran on a server an earlier run started")


class CampaignSpaceNoteOut(BaseModel):
    """One variable vlab considered for a ``"space": "auto"`` campaign."""

    name: str = Field(description="the variable's dotted spec path")
    proposed: bool = Field(description="whether it is in the proposed space")
    why: str = Field(description="why it is in with its levels, or why it is left out")


class CampaignRetryReasonOut(BaseModel):
    """Why a campaign's run was measured again."""

    kind: Literal["lost", "flagged", "no_value"] = Field(
        description="lost: the infrastructure lost it (its orchestrator, supervisor or node "
        "died, or its launch raised); flagged: it succeeded but a finding flags its objective "
        "(a warm prefix cache, token bursts, the client's TTFT lag), so it gives no verdict; "
        "no_value: it succeeded without a value of the objective (a capacity search that "
        "found no boundary yet)"
    )
    why: str = Field(
        description="in words: `lost to the infrastructure: <how>`, `a finding flagged its "
        "objective: <finding>: <evidence>`, or what it measured without"
    )


class CampaignOut(BaseModel):
    """A tuning campaign: its request, status and what it decided so far."""

    id: str
    url: str
    name: str
    status: str = Field(description="queued, running, succeeded, failed or cancelled")
    status_reason: str | None
    submitted_by: str | None
    created_at: IsoDatetime
    updated_at: IsoDatetime
    request: dict[str, Any] = Field(description="the submitted CampaignRequest")
    phase: str | None = Field(description="rounds, confirming or done (None before a step)")
    runs_used: int
    budget: int
    start: dict[str, LevelOut]
    incumbent: dict[str, LevelOut]
    path: list[CampaignStepOut]
    candidates: list[CampaignCandidateOut]
    cumulative: CampaignGain | None = Field(description="the sum of the step gains")
    confirmation: CampaignConfirmationOut | None
    pending: list[str] = Field(description="labels of the runs it waits for")
    runs: list[CampaignRunOut]
    retried: dict[str, str] = Field(
        default_factory=dict,
        description="runs measured again (lost to the infrastructure, or giving no verdict: "
        "a finding flagged the objective, no value of it): label -> the retry's label "
        "(`r1.c2.incumbent` -> `r1.c2.incumbent.retry1`); why: `retry_reasons`",
    )
    retry_reasons: dict[str, CampaignRetryReasonOut] = Field(
        default_factory=dict,
        description="why each run of `retried` was measured again: label -> reason (absent "
        "for a campaign last advanced before reasons were kept)",
    )
    unmeasured: dict[str, str] = Field(
        default_factory=dict,
        description="runs lost to the infrastructure, or giving no verdict, and not measured "
        "again: label -> why",
    )
    wall_time: CampaignWallTimeOut | None = Field(
        None, description="where the wall time went (None before its first advance)"
    )
    serve_command: str | None = Field(
        None,
        description="the incumbent (the final configuration once done) as a `vllm serve` "
        "command line, shell-quoted; None before the campaign was first advanced",
    )
    spec: dict[str, Any] | None = Field(
        None,
        description="an experiment document (POST /api/v1/experiments) that re-runs the "
        "incumbent alone, with repeats; None before the campaign was first advanced",
    )
    slots: int | None = Field(
        None,
        description="server slots the campaign measures on at once (side by side: each "
        "configuration of a cycle on its own devices, several pairs a cycle); 1: interleaved "
        "on one; None before its first advance",
    )
    space_proposal: list[CampaignSpaceNoteOut] | None = Field(
        None,
        description='a campaign submitted with "space": "auto": each variable vlab '
        "considered, whether it proposed it and why (the proposed space is the request's "
        "`space`); None for a listed space",
    )


class CampaignListItem(BaseModel):
    id: str
    url: str
    name: str
    status: str
    objective: str
    created_at: IsoDatetime
    updated_at: IsoDatetime
    run_count: int


class CampaignMlflowExportRequest(MlflowExportTarget):
    """``POST /api/v1/campaigns/{id}/export/mlflow``: where to export the campaign."""

    experiment_name: str | None = Field(
        None,
        min_length=1,
        max_length=500,
        description="the MLflow experiment (default: the campaign's name)",
    )


class CampaignMlflowExportOut(BaseModel):
    """The export of one campaign
    (:class:`orchestrator.integrations.mlflow_campaign.CampaignExportReport`): its parent
    run and the export of each cycle (one experiment per cycle), its runs nested."""

    campaign_id: str
    tracking_uri: str = Field(description="where it went (without user name or password)")
    mlflow_experiment_name: str
    mlflow_experiment_id: str
    parent_run_id: str | None = Field(description="the MLflow run of the campaign")
    parent_action: Literal["created", "replaced", "unchanged"]
    params: int = Field(description="params written on the parent run")
    metrics: int = Field(description="metric values written on the parent run")
    nested: int = Field(description="exported runs nested under the parent run")
    cycles: list[MlflowExportOut] = Field(description="the export of each cycle's experiment")
