"""Export a tuning campaign to MLflow: one parent run for the campaign, its runs nested.

In the MLflow experiment named after the campaign (or the name given):

- a **parent run** (tag ``vlab.kind`` = ``campaign``) with
  - params: the model and revision, the objective (``objective.metric``,
    ``objective.direction``), the space (``space``: JSON; ``space.<variable>``: its levels),
    the decision rule (``rule.<field>``), the budget, the start and the final configuration
    (``start.<variable>``, ``final.<variable>``) and the final ``vllm serve`` line;
  - metrics: the cumulative gain and its interval (``cumulative_gain``,
    ``cumulative_gain_low``, ``cumulative_gain_high``: log ratio, positive is better, and
    ``cumulative_gain_relative``: as a fraction), the gain of each adopted step as a metric
    history (``step_gain``, ``step_gain_low``, ``step_gain_high``; step = its place on the
    path, 1 first), the confirmation's measured total when it ran, ``runs_used``;
  - tags: the campaign's status and phase, and each candidate's verdict
    (``vlab.verdict.r<round>.<variable>:<level>``: adopted, inert, worse, unknown,
    skipped ...), the path in words (``vlab.path``);
  - the path as a JSON artifact (``campaign_path.json``: path, candidates, cumulative gain,
    confirmation, start, final configuration, serve command, its runs by label);
- each of the campaign's runs exported as
  :func:`orchestrator.integrations.mlflow_export.export_experiment` exports a run (one
  experiment per cycle of the campaign), then nested under the parent
  (``mlflow.parentRunId``) and tagged with its campaign and label. A run measured again
  (``<label>.retry<k>``, in an experiment of its own where the configuration measured again
  is that experiment's baseline) is named by its campaign label, keeps the variant of the
  run it measures again (``vlab.variant``, ``vlab.is_baseline``: a candidate's retry is
  not ``baseline``), and says which run it measures again and why (``vlab.retry_of``,
  ``vlab.retry_reason``).

**Idempotent**: the parent is found by its ``vlab.campaign_id`` tag; one exported
completely when the campaign was as it is now (``vlab.campaign_updated_at``) is left as it
is (``unchanged``), otherwise it is deleted and exported again (``replaced``); the runs
follow the run export's rules.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from sqlalchemy.orm import Session

from orchestrator.campaigns.space import show_level
from orchestrator.core.db import release_connection
from orchestrator.core.errors import NotFoundError, VlabError
from orchestrator.core.models import Campaign, Run
from orchestrator.core.repositories import CampaignRepository
from orchestrator.integrations.mlflow_export import (
    COMPLETE_TAG,
    MAX_METRICS_PER_BATCH,
    MAX_PARAMS_PER_BATCH,
    ExportReport,
    _check_reachable,
    _chunks,
    _ensure_experiment,
    _export_failed,
    _load_mlflow,
    _lock_for,
    _mlflow_name,
    export_experiment,
    redact_uri,
)
from orchestrator.integrations.mlflow_mapping import (
    MAX_PARAM_VALUE,
    MAX_TAG_VALUE,
    cut_text,
    epoch_ms,
    mlflow_key,
    param_value,
)

__all__ = ["CampaignExportReport", "campaign_metrics", "campaign_params", "export_campaign"]

#: The artifact holding the path.
PATH_ARTIFACT = "campaign_path.json"
#: A retry's campaign label: the first run's label and ``.retry<k>``.
_RETRY = re.compile(r"\.retry\d+$")
#: MLflow statuses of an ended campaign (a campaign still advancing stays ``RUNNING``).
CAMPAIGN_STATUS = {"succeeded": "FINISHED", "failed": "FAILED", "cancelled": "KILLED"}


@dataclass
class CampaignExportReport:
    """The export of one campaign: its parent run and the export of each cycle."""

    campaign_id: str
    tracking_uri: str  # userinfo removed
    mlflow_experiment_name: str
    mlflow_experiment_id: str
    parent_run_id: str | None = None
    parent_action: Literal["created", "replaced", "unchanged"] = "created"
    params: int = 0
    metrics: int = 0
    nested: int = 0
    cycles: list[ExportReport] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "cycles": [c.as_dict() for c in self.cycles],
        }


# --------------------------------------------------------------------------- mapping


def campaign_params(row: Campaign) -> tuple[dict[str, str], list[str]]:
    """The parent run's params (module docstring), values cut to MLflow's limit; returns
    ``(params, names of the cut ones)``."""
    request = row.request or {}
    result = row.result or {}
    objective = request.get("objective") or {}
    raw: dict[str, Any] = {
        "model": request.get("model"),
        "revision": request.get("revision"),
        "objective.metric": objective.get("metric"),
        "objective.direction": objective.get("direction"),
        "budget.max_runs": (request.get("budget") or {}).get("max_runs"),
        "space": json.dumps(request.get("space") or [], sort_keys=True),
        "serve_command": result.get("serve_command"),
    }
    for v in request.get("space") or []:
        raw[f"space.{v['name']}"] = json.dumps(v.get("levels"))
    for k, v in (request.get("rule") or {}).items():
        raw[f"rule.{k}"] = v
    for prefix, config in (("start", result.get("start")), ("final", result.get("incumbent"))):
        for k, v in (config or {}).items():
            raw[f"{prefix}.{k}"] = v
    params: dict[str, str] = {}
    truncated: list[str] = []
    for k, v in raw.items():
        if v is None:
            continue
        text, cut = cut_text(param_value(v), MAX_PARAM_VALUE)
        params[mlflow_key(k)] = text
        if cut:
            truncated.append(k)
    return params, truncated


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def campaign_metrics(row: Campaign) -> list[tuple[str, float, int]]:
    """The parent run's metrics as ``(key, value, step)`` (module docstring): the cumulative
    gain at step 0, each adopted step's gain at its place on the path."""
    result = row.result or {}
    out: list[tuple[str, float, int]] = [("runs_used", float(result.get("runs_used", 0)), 0)]
    cumulative = result.get("cumulative") or {}
    if _finite(cumulative.get("estimate")):
        out += [
            ("cumulative_gain", cumulative["estimate"], 0),
            ("cumulative_gain_low", cumulative["low"], 0),
            ("cumulative_gain_high", cumulative["high"], 0),
            ("cumulative_gain_relative", math.expm1(cumulative["estimate"]), 0),
        ]
    for i, step in enumerate(result.get("path") or [], start=1):
        gain = step.get("gain") or {}
        if _finite(gain.get("estimate")):
            out += [
                ("step_gain", gain["estimate"], i),
                ("step_gain_low", gain["low"], i),
                ("step_gain_high", gain["high"], i),
            ]
    total = ((result.get("confirmation") or {}).get("total")) or {}
    if _finite(total.get("estimate")):
        out += [
            ("confirmed_gain", total["estimate"], 0),
            ("confirmed_gain_low", total["low"], 0),
            ("confirmed_gain_high", total["high"], 0),
        ]
    return [(k, float(v), step) for k, v, step in out if _finite(v)]


def campaign_tags(row: Campaign, truncated: list[str], base_url: str | None) -> dict[str, str]:
    """The parent run's tags: what it is, the status, each candidate's verdict, the path."""
    result = row.result or {}
    tags: dict[str, Any] = {
        "vlab.kind": "campaign",
        "vlab.campaign_id": row.id,
        "vlab.campaign_name": row.name,
        "vlab.campaign_updated_at": row.updated_at.isoformat(),
        "vlab.status": row.status,
        "vlab.phase": result.get("phase"),
        "vlab.status_reason": row.status_reason,
        "vlab.path": "; ".join(
            f"{s['variable']}: {show_level(s['from_level'])} -> {show_level(s['to_level'])} "
            f"({s.get('effect')})"
            for s in result.get("path") or []
        )
        or "no change adopted",
        "vlab.truncated_params": ", ".join(truncated) or None,
        "vlab.campaign_url": f"{base_url.rstrip('/')}/campaigns/{row.id}" if base_url else None,
    }
    confirmation = result.get("confirmation")
    if confirmation is not None:
        tags["vlab.confirmation_agrees"] = confirmation.get("agrees")
    for c in result.get("candidates") or []:
        cand = c.get("candidate") or {}
        level = param_value(cand.get("to_level"))
        key = mlflow_key(f"vlab.verdict.r{c.get('round')}.{cand.get('variable')}:{level}")
        tags[key] = c.get("outcome")
    return {k: cut_text(param_value(v), MAX_TAG_VALUE)[0] for k, v in tags.items() if v is not None}


def path_artifact(row: Campaign) -> dict[str, Any]:
    """The JSON artifact: the campaign's path and what it decided (module docstring)."""
    result = row.result or {}
    keys = ("path", "candidates", "cumulative", "confirmation", "start", "incumbent", "runs")
    return {
        "campaign_id": row.id,
        "name": row.name,
        "status": row.status,
        "objective": (row.request or {}).get("objective"),
        **{k: result.get(k) for k in keys},
        "serve_command": result.get("serve_command"),
        "spec": result.get("spec"),
    }


# --------------------------------------------------------------------------- the export


def export_campaign(
    session: Session,
    campaign_id: str,
    tracking_uri: str,
    *,
    experiment_name: str | None = None,
    replace: bool = False,
    max_points: int | None = None,
    connect_timeout_s: float = 10.0,
    base_url: str | None = None,
) -> CampaignExportReport:
    """Export campaign ``campaign_id`` to the MLflow store at ``tracking_uri`` (module
    docstring): the parent run, then every cycle's runs nested under it.

    Raises :class:`NotFoundError` (``campaign_not_found``) and what
    :func:`orchestrator.integrations.mlflow_export.export_experiment` raises.
    """
    row = CampaignRepository(session).get(campaign_id)
    if row is None:
        raise NotFoundError(f"no campaign {campaign_id}", code_hint="campaign_not_found")
    name = _mlflow_name(experiment_name if experiment_name is not None else row.name)
    runs = CampaignRepository(session).runs(row.id)
    labels = nested_tags(row, runs)
    cycle_ids = list(dict.fromkeys(r.experiment_id for r in runs if r.experiment_id))
    release_connection(session)
    ml = _load_mlflow()
    _check_reachable(tracking_uri, connect_timeout_s)
    report: CampaignExportReport | None = None
    with _lock_for(tracking_uri, campaign_id):
        try:
            client = ml.client(tracking_uri=tracking_uri)
            mlflow_exp_id = _ensure_experiment(ml, client, name)
            report = CampaignExportReport(
                campaign_id, redact_uri(tracking_uri), name, mlflow_exp_id
            )
            _export_parent(ml, client, row, mlflow_exp_id, report, replace, base_url)
        except VlabError:
            raise
        except Exception as exc:  # noqa: BLE001 - every MLflow/store failure is one problem
            raise _export_failed(exc, None, tracking_uri, campaign_id) from exc
    assert report is not None
    for exp_id in cycle_ids:
        cycle = export_experiment(
            session,
            exp_id,
            tracking_uri,
            experiment_name=name,
            replace=replace,
            max_points=max_points,
            connect_timeout_s=connect_timeout_s,
            base_url=base_url,
        )
        report.cycles.append(cycle)
        try:
            _nest(client, cycle, report, labels)
        except Exception as exc:  # noqa: BLE001 - every MLflow/store failure is one problem
            raise _export_failed(exc, cycle, tracking_uri, campaign_id) from exc
    return report


def nested_tags(row: Campaign, runs: list[Run]) -> dict[str, dict[str, str]]:
    """The tags each of the campaign's ``runs`` gets when nested (run id -> tags): its
    campaign label; for a retry (module docstring) its run name, the variant of the run it
    measures again, that run's label and why it was measured again."""
    result = row.result or {}
    by_label = {r.campaign_label: r for r in runs if r.campaign_label}
    retry_of = {retry: first for first, retry in (result.get("retried") or {}).items()}
    reasons = result.get("retry_reasons") or {}
    out: dict[str, dict[str, str]] = {}
    for run in runs:
        label = run.campaign_label
        if not label:
            continue
        tags = {"vlab.campaign_label": label}
        if _RETRY.search(label):
            first = by_label.get(_RETRY.sub("", label))
            previous = retry_of.get(label)
            why = (reasons.get(previous) or {}).get("why") if previous else None
            tags["mlflow.runName"] = label
            tags["vlab.variant"] = first.name if first is not None else _RETRY.sub("", label)
            if first is not None:
                tags["vlab.is_baseline"] = param_value(bool(first.is_baseline))
            if previous:
                tags["vlab.retry_of"] = previous
            if why:
                tags["vlab.retry_reason"] = cut_text(why, MAX_TAG_VALUE)[0]
        out[run.id] = tags
    return out


def _nest(
    client: Any,
    cycle: ExportReport,
    report: CampaignExportReport,
    tags: dict[str, dict[str, str]],
) -> None:
    """Nest the exported runs of one cycle under the parent, with campaign and label (and
    a retry's name, variant and reason: :func:`nested_tags`)."""
    for run in cycle.runs:
        if run.mlflow_run_id is None:
            continue
        client.set_tag(run.mlflow_run_id, "mlflow.parentRunId", report.parent_run_id)
        client.set_tag(run.mlflow_run_id, "vlab.campaign_id", report.campaign_id)
        for key, value in tags.get(run.run_id, {}).items():
            client.set_tag(run.mlflow_run_id, key, value)
        report.nested += 1


def _existing_parents(client: Any, mlflow_exp_id: str, campaign_id: str) -> list[Any]:
    """The active parent runs an earlier export made of this campaign."""
    if not all(ch.isalnum() or ch == "-" for ch in campaign_id):  # never quote into a filter
        raise NotFoundError(f"no campaign {campaign_id}", code_hint="campaign_not_found")
    return list(
        client.search_runs(
            [mlflow_exp_id],
            filter_string=f"tags.`vlab.campaign_id` = '{campaign_id}' and "
            "tags.`vlab.kind` = 'campaign'",
            max_results=1000,
        )
    )


def _export_parent(
    ml: Any,
    client: Any,
    row: Campaign,
    mlflow_exp_id: str,
    report: CampaignExportReport,
    replace: bool,
    base_url: str | None,
) -> None:
    """Create (or keep, or replace) the campaign's parent run; fills ``report``."""
    earlier = _existing_parents(client, mlflow_exp_id, row.id)
    stamp = row.updated_at.isoformat()
    current = [
        r
        for r in earlier
        if r.data.tags.get(COMPLETE_TAG) == "true"
        and r.data.tags.get("vlab.campaign_updated_at") == stamp
    ]
    if current and not replace:
        for stale in earlier:
            if stale is not current[0]:
                client.delete_run(stale.info.run_id)
        report.parent_run_id, report.parent_action = current[0].info.run_id, "unchanged"
        return
    for old in earlier:
        client.delete_run(old.info.run_id)
    report.parent_action = "replaced" if earlier else "created"
    params, truncated = campaign_params(row)
    metrics = campaign_metrics(row)
    run = client.create_run(
        mlflow_exp_id,
        start_time=epoch_ms(row.created_at),
        tags=campaign_tags(row, truncated, base_url),
        run_name=f"campaign {row.name}",
    )
    rid = run.info.run_id
    for chunk in _chunks(list(params.items()), MAX_PARAMS_PER_BATCH):
        client.log_batch(rid, params=[ml.param(k, v) for k, v in chunk], synchronous=True)
    ended = epoch_ms(row.updated_at) or epoch_ms(datetime.now(UTC))
    entities = [ml.metric(k, v, ended, step) for k, v, step in metrics]
    for chunk in _chunks(entities, MAX_METRICS_PER_BATCH):
        client.log_batch(rid, metrics=list(chunk), synchronous=True)
    client.log_dict(rid, path_artifact(row), PATH_ARTIFACT)
    status = CAMPAIGN_STATUS.get(row.status)
    if status is not None:
        client.set_terminated(rid, status=status, end_time=ended)
    client.set_tag(rid, COMPLETE_TAG, "true")
    report.parent_run_id = rid
    report.params, report.metrics = len(params), len(metrics)
