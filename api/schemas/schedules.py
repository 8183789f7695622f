"""Bodies of ``/api/v1/schedules``: a scheduled sweep, its fires and their regressions."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator
from pydantic_core import PydanticCustomError

from api.schemas.common import IsoDatetime
from orchestrator.schedules.cron import check_cron, zone
from orchestrator.tuning.campaign_request import CampaignRequest

#: One level of a campaign variable (a spec field's value).
Level = bool | int | float | str


class ScheduleIn(BaseModel):
    """A scheduled sweep (``POST /api/v1/schedules``).

    ``cron``: 5-field cron expression, evaluated in ``timezone`` (IANA name).
    ``template``: an experiment spec, as ``POST /api/v1/experiments`` takes; or
    ``campaign``: a tuning campaign request, as ``POST /api/v1/campaigns`` takes (one
    campaign started per fire; the fires say whether its best configuration moved). Exactly
    one of the two.
    ``concurrency_policy``: ``skip`` a fire while the previous sweep has
    unfinished runs, or ``queue`` it anyway. ``catch_up`` after downtime:
    ``latest`` runs the most recent missed fire once, ``none`` skips them all.
    ``end_at``: no fires after it (a naive value is taken as UTC).
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=200)
    cron: str = Field(max_length=200, json_schema_extra={"pattern": r"^\s*\S+(\s+\S+){4}\s*$"})
    timezone: str = Field("UTC", max_length=64)
    template: dict[str, Any] | None = None
    campaign: CampaignRequest | None = None
    enabled: StrictBool = True
    concurrency_policy: Literal["skip", "queue"] = "skip"
    catch_up: Literal["latest", "none"] = "latest"
    end_at: IsoDatetime | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> ScheduleIn:
        if (self.template is None) == (self.campaign is None):
            raise PydanticCustomError(
                "template_or_campaign",
                "give exactly one of template (a scheduled sweep) and campaign (a "
                "scheduled tuning campaign)",
            )
        return self

    @field_validator("cron")
    @classmethod
    def _cron(cls, v: str) -> str:
        try:
            return check_cron(v)
        except ValueError as exc:
            raise PydanticCustomError("cron_invalid", str(exc)) from exc

    @field_validator("timezone")
    @classmethod
    def _tz(cls, v: str) -> str:
        try:
            zone(v)
        except ValueError as exc:
            raise PydanticCustomError("timezone_invalid", str(exc)) from exc
        return v

    @field_validator("end_at")
    @classmethod
    def _aware(cls, v: datetime | None) -> datetime | None:
        return v.replace(tzinfo=UTC) if v is not None and v.tzinfo is None else v


class ScheduleUpdate(BaseModel):
    """A partial update (``PATCH``): only the fields given change; same rules as ScheduleIn."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, min_length=1, max_length=200)
    cron: str | None = Field(
        None, max_length=200, json_schema_extra={"pattern": r"^\s*\S+(\s+\S+){4}\s*$"}
    )
    timezone: str | None = Field(None, max_length=64)
    template: dict[str, Any] | None = Field(
        None, description="a new experiment template (a campaign schedule becomes a sweep)"
    )
    campaign: CampaignRequest | None = Field(
        None, description="a new campaign request (a sweep schedule becomes a campaign one)"
    )
    enabled: StrictBool | None = None
    concurrency_policy: Literal["skip", "queue"] | None = None
    catch_up: Literal["latest", "none"] | None = None
    end_at: IsoDatetime | None = None


class ConfigChange(BaseModel):
    """A variable whose best level differs from the previous campaign's (None: the
    variable is not in that campaign's space)."""

    variable: str
    from_level: Level | None
    to_level: Level | None


class CampaignMovement(BaseModel):
    """Whether a fired campaign's best configuration moved since the previous fired
    campaign of the schedule that succeeded.

    ``comparison``: ``pending`` (the campaign runs), ``no_result`` (it ended failed or
    cancelled), ``no_previous`` (no earlier campaign of the schedule succeeded), ``held``
    (the same final configuration) or ``moved`` (``changes`` lists each variable, from ->
    to)."""

    campaign_id: str
    campaign_url: str
    campaign_status: str | None
    comparison: Literal["pending", "no_result", "no_previous", "held", "moved"]
    summary: str | None = Field(None, description="one line: moved (what, from -> to) or held")
    final: dict[str, Level] | None = Field(description="the campaign's final configuration")
    serve_command: str | None = Field(description="the final configuration as `vllm serve`")
    compared_with: dict[str, Any] | None = Field(
        description="the previous campaign: fire_time, campaign_id, final"
    )
    changes: list[ConfigChange]


class FireBrief(BaseModel):
    """A fire time (in the schedule's zone) and what happened: fired, skipped,
    skipped_busy or failed. A campaign schedule's fire names its campaign and whether the
    best configuration moved (``movement``)."""

    fire_time: datetime
    status: str
    experiment_id: str | None
    detail: str | None
    campaign_id: str | None = None
    movement: CampaignMovement | None = None


class Regression(BaseModel):
    """A metric that got worse than in the previous completed sweep (95 % interval), by at
    least the regression floor (5 %: ``orchestrator.analysis.regression``).

    Capacity: ``reference_value`` / ``value`` are the mean capacities, None where a sweep
    found only a bound (``at least``/``below``); then the interval is one-sided (``ci_low``
    None) and ``statement`` says it with the bounds (``lower: at most 0.25x (at least 24
    -> below 6 requests/s)``)."""

    variant: str
    metric: str
    unit: str
    reference_value: float | None
    value: float | None
    ratio: float | None
    ci_low: float | None
    ci_high: float | None
    ci_of: str | None
    statement: str | None = None


class Withheld(BaseModel):
    """A metric the regression check gave no verdict on: a flag of a compared run taints
    it (token bursts, a warm prefix cache: ``orchestrator.analysis.trust``)."""

    variant: str
    metric: str
    reason: str | None


class FireOut(FireBrief):
    """A fire with its regression check against the previous completed sweep.

    ``comparison``: ``not_fired``, ``not_a_sweep`` (a campaign's fire: see
    ``movement``), ``pending`` (runs unfinished), ``no_previous`` or ``compared``.
    """

    comparison: str
    compared_with: dict[str, Any] | None
    regressions: list[Regression]
    under_floor: list[Regression] = Field(
        default_factory=list,
        description=(
            "worse verdicts (a capacity: lower) smaller than the regression floor (5 %): "
            "not regressions, listed so that nothing worse goes unsaid"
        ),
    )
    withheld: list[Withheld] = Field(
        default_factory=list,
        description="metrics with no verdict: flagged untrustworthy for a compared run",
    )


class ScheduleOut(BaseModel):
    id: str
    url: str
    fires_url: str
    name: str
    cron: str
    timezone: str
    kind: Literal["sweep", "campaign"] = Field(
        description="sweep: submits `template`; campaign: starts `campaign`"
    )
    template: dict[str, Any] | None
    campaign: dict[str, Any] | None
    enabled: bool
    concurrency_policy: str
    catch_up: str
    end_at: datetime | None
    created_at: datetime
    updated_at: datetime
    created_by: str | None = Field(None, description="the token name that created it")
    updated_by: str | None = Field(None, description="the token name that last changed it")
    last_fire_at: datetime | None
    next_fire_times: list[datetime] = Field(
        description="the next 5 fire times, in the schedule's time zone"
    )
    recent_fires: list[FireBrief] = Field(description="the latest 10 fires, newest first")
    last_movement: CampaignMovement | None = Field(
        None,
        description="a campaign schedule: whether the newest fired campaign moved the best "
        "configuration (its fire's movement)",
    )
