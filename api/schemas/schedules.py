"""Bodies of ``/api/v1/schedules``: a scheduled sweep, its fires and their regressions."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator
from pydantic_core import PydanticCustomError

from api.schemas.common import IsoDatetime
from orchestrator.schedules.cron import check_cron, zone


class ScheduleIn(BaseModel):
    """A scheduled sweep (``POST /api/v1/schedules``).

    ``cron``: 5-field cron expression, evaluated in ``timezone`` (IANA name).
    ``template``: an experiment spec, as ``POST /api/v1/experiments`` takes.
    ``concurrency_policy``: ``skip`` a fire while the previous sweep has
    unfinished runs, or ``queue`` it anyway. ``catch_up`` after downtime:
    ``latest`` runs the most recent missed fire once, ``none`` skips them all.
    ``end_at``: no fires after it (a naive value is taken as UTC).
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=200)
    cron: str = Field(max_length=200, json_schema_extra={"pattern": r"^\s*\S+(\s+\S+){4}\s*$"})
    timezone: str = Field("UTC", max_length=64)
    template: dict[str, Any]
    enabled: StrictBool = True
    concurrency_policy: Literal["skip", "queue"] = "skip"
    catch_up: Literal["latest", "none"] = "latest"
    end_at: IsoDatetime | None = None

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
    template: dict[str, Any] | None = None
    enabled: StrictBool | None = None
    concurrency_policy: Literal["skip", "queue"] | None = None
    catch_up: Literal["latest", "none"] | None = None
    end_at: IsoDatetime | None = None


class FireBrief(BaseModel):
    """A fire time (in the schedule's zone) and what happened: fired, skipped,
    skipped_busy or failed."""

    fire_time: datetime
    status: str
    experiment_id: str | None
    detail: str | None


class Regression(BaseModel):
    """A metric that got worse than in the previous completed sweep (95 % interval).

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

    ``comparison``: ``not_fired``, ``pending`` (runs unfinished), ``no_previous``
    or ``compared``.
    """

    comparison: str
    compared_with: dict[str, Any] | None
    regressions: list[Regression]
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
    template: dict[str, Any]
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
