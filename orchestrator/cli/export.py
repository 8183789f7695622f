"""``vlab export``: an experiment's runs, or a tuning campaign, sent to MLflow by the
service (through the API, as every ``vlab`` command: the CLI never opens the database).

``vlab export mlflow <experiment id>`` posts to ``POST /api/v1/experiments/{id}/export/mlflow``
(:func:`orchestrator.integrations.mlflow_export.export_experiment` runs in the service);
``vlab export mlflow-campaign <campaign id>`` to ``POST /api/v1/campaigns/{id}/export/mlflow``
(:func:`orchestrator.integrations.mlflow_campaign.export_campaign`): a parent run with the
objective, space, rule, final configuration, gains and verdicts, the path as a JSON
artifact, and the campaign's runs nested under it. The service writes to the tracking
URI: ``http(s)://`` servers, or stores on the service's own disk (``sqlite:///...``) when
it allows them (``VLAB_MLFLOW__ALLOW_LOCAL_STORES``). Without ``--tracking-uri`` (or
``MLFLOW_TRACKING_URI``) the service's ``VLAB_MLFLOW__TRACKING_URI`` is used.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from orchestrator.cli.client import Api, make_console, print_json, repeat_number
from orchestrator.cli.common import ApiOpt, friendly
from orchestrator.cli.specfile import CliError

export_app = typer.Typer(
    help="Export an experiment's runs, or a tuning campaign, to another system (MLflow).",
    no_args_is_help=True,
)

TrackingUri = Annotated[
    str | None,
    typer.Option(
        "--tracking-uri",
        envvar="MLFLOW_TRACKING_URI",
        help="MLflow tracking URI the service exports to: http(s)://server, or "
        "sqlite:///path.db where the service allows local stores (default "
        "$MLFLOW_TRACKING_URI, then the service's VLAB_MLFLOW__TRACKING_URI)",
    ),
]
console = make_console()
JsonOpt = Annotated[bool, typer.Option("--json", help="print the API's JSON answer only")]
Replace = Annotated[
    bool, typer.Option(help="delete the MLflow runs an earlier export made and export anew")
]
MaxPoints = Annotated[
    int | None,
    typer.Option(min=1, help="at most this many time-series points per run (default: all)"),
]
#: An export writes every run's time series: minutes for a large experiment.
EXPORT_TIMEOUT_S = 1800.0


def _target(
    tracking_uri: str | None, experiment_name: str | None, replace: bool, max_points: int | None
) -> dict[str, Any]:
    """The request body's shared fields; a URI MLflow cannot take is refused here, in one
    line, before anything is sent."""
    # deferred: the MLflow export's module (SQLAlchemy, the experiments' service: about
    # 1 s), for its check of the URI only
    from orchestrator.integrations.mlflow_export import tracking_uri_problem

    uri = (tracking_uri or "").strip() or None
    if uri is not None and (problem := tracking_uri_problem(uri)):
        raise CliError(problem)
    body: dict[str, Any] = {"tracking_uri": uri, "replace": replace, "max_points": max_points}
    if experiment_name:
        body["experiment_name"] = experiment_name
    return {k: v for k, v in body.items() if v is not None}


@export_app.command("mlflow")
@friendly
def export_mlflow(
    experiment_id: Annotated[str, typer.Argument(help="the vlab experiment id")],
    tracking_uri: TrackingUri = None,
    experiment_name: Annotated[
        str | None,
        typer.Option(help="the MLflow experiment (default: the vlab experiment's name)"),
    ] = None,
    skip_failed: Annotated[
        bool, typer.Option(help="leave out failed, cancelled and blocked runs")
    ] = False,
    replace: Replace = False,
    max_points: MaxPoints = None,
    json_out: JsonOpt = False,
    api: ApiOpt = None,
) -> None:
    """Export an experiment's runs to MLflow through the service: one MLflow run per run
    (params, summary metrics, the /metrics time series as metric history, tags). Runs
    exported before are left as they are (unless --replace)."""
    body = _target(tracking_uri, experiment_name, replace, max_points)
    body["include_failed"] = not skip_failed
    report = Api(api).call(
        "POST",
        f"/api/v1/experiments/{experiment_id}/export/mlflow",
        json_body=body,
        timeout_s=EXPORT_TIMEOUT_S,
    )
    if json_out:
        print_json(report)
        return
    print_report(report)


@export_app.command("mlflow-campaign")
@friendly
def export_mlflow_campaign(
    campaign_id: Annotated[str, typer.Argument(help="the vlab campaign id")],
    tracking_uri: TrackingUri = None,
    experiment_name: Annotated[
        str | None,
        typer.Option(help="the MLflow experiment (default: the campaign's name)"),
    ] = None,
    replace: Replace = False,
    max_points: MaxPoints = None,
    json_out: JsonOpt = False,
    api: ApiOpt = None,
) -> None:
    """Export a tuning campaign to MLflow through the service: a parent run (objective,
    space, rule, final configuration as params; cumulative gain with its interval and each
    step's gain as metrics; verdicts as tags; the path as a JSON artifact) with the
    campaign's runs nested under it. Runs exported before are left as they are (unless
    --replace)."""
    report = Api(api).call(
        "POST",
        f"/api/v1/campaigns/{campaign_id}/export/mlflow",
        json_body=_target(tracking_uri, experiment_name, replace, max_points),
        timeout_s=EXPORT_TIMEOUT_S,
    )
    if json_out:
        print_json(report)
        return
    print_campaign_report(report)


def print_campaign_report(report: dict[str, Any]) -> None:
    """The parent run, then one table of the nested runs (a cycle column) and one line
    of totals (``POST /campaigns/{id}/export/mlflow``'s answer)."""
    console.print(
        f"campaign {report['campaign_id']}: parent MLflow run {report['parent_run_id']} "
        f"({report['parent_action']}; {report['params']} params, {report['metrics']} "
        f"metrics), {report['nested']} run(s) nested",
        markup=False,
        soft_wrap=True,
    )
    _print_runs(report.get("cycles") or [], with_cycle=True)


def print_report(report: dict[str, Any]) -> None:
    """A table of what happened to each run, then one line of totals
    (``POST /experiments/{id}/export/mlflow``'s answer)."""
    _print_runs([report], with_cycle=False)


def _print_runs(reports: list[dict[str, Any]], with_cycle: bool) -> None:
    """One table of the runs of ``reports`` (each an experiment's export; a campaign's
    cycles numbered from 1 when ``with_cycle``), then one line of totals over them all."""
    if not reports:
        return
    columns = ["variant", "repeat", "status", "action", "MLflow run", "params", "metrics"]
    table = Table(*(["cycle"] if with_cycle else []), *columns, "points", "unknown metrics")
    for col in table.columns:
        col.overflow = "fold"
    counts: dict[str, int] = {}
    for number, report in enumerate(reports, start=1):
        for r in report.get("runs") or []:
            counts[r["action"]] = counts.get(r["action"], 0) + 1
            table.add_row(
                *([str(number)] if with_cycle else []),
                r["variant"],
                str(repeat_number(r)),
                r["status"],
                r["action"],
                r.get("mlflow_run_id") or "–",
                str(r["params"]),
                str(r["metrics"]),
                str(r["series_points"]),
                ", ".join(r.get("unknown_metrics") or []) or "–",
            )
    console.print(table)
    first = reports[0]
    total = ", ".join(f"{n} {action}" for action, n in sorted(counts.items()))
    console.print(
        f"MLflow experiment {first['mlflow_experiment_name']!r} "
        f"(id {first['mlflow_experiment_id']}) at {first['tracking_uri']}: "
        f"{total or 'no runs'}",
        markup=False,
        soft_wrap=True,  # one line: a tracking URI is never broken, the totals stay on it
    )
