"""``vlab export``: an experiment's runs, or a tuning campaign, sent to systems outside the
service.

``vlab export mlflow <experiment id> --tracking-uri URI`` exports straight from the
database (no running API needed) with
:func:`orchestrator.integrations.mlflow_export.export_experiment`;
unlike the API it takes any tracking URI MLflow takes (``http(s)://``, ``sqlite:///``,
``databricks`` ...). ``vlab export mlflow-campaign <campaign id>`` exports a campaign
(:func:`orchestrator.integrations.mlflow_campaign.export_campaign`): a parent run with the
objective, space, rule, final configuration, gains and verdicts, the path as a JSON
artifact, and the campaign's runs nested under it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Annotated, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.table import Table
from sqlalchemy.orm import Session

from orchestrator.cli.runtime import Runtime
from orchestrator.core.db import unit_of_work
from orchestrator.core.errors import VlabError
from orchestrator.core.settings import Settings, get_settings
from orchestrator.integrations.mlflow_campaign import CampaignExportReport, export_campaign
from orchestrator.integrations.mlflow_export import (
    ExportReport,
    export_experiment,
    tracking_uri_problem,
)

export_app = typer.Typer(
    help="Export an experiment's runs, or a tuning campaign, to another system (MLflow).",
    no_args_is_help=True,
)

TrackingUri = Annotated[
    str | None,
    typer.Option(
        "--tracking-uri",
        envvar="MLFLOW_TRACKING_URI",
        help="MLflow tracking URI: http(s)://server, sqlite:///path.db, ... "
        "(default $MLFLOW_TRACKING_URI, then VLAB_MLFLOW__TRACKING_URI)",
    ),
]
T = TypeVar("T")
console = Console() if sys.stdout.isatty() else Console(width=200, soft_wrap=True)


Replace = Annotated[
    bool, typer.Option(help="delete the MLflow runs an earlier export made and export anew")
]
MaxPoints = Annotated[
    int | None,
    typer.Option(min=1, help="at most this many time-series points per run (default: all)"),
]


@export_app.command("mlflow")
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
) -> None:
    """Export an experiment's runs to MLflow: one MLflow run per run (params, summary
    metrics, the /metrics time series as metric history, tags). Runs exported before are
    left as they are (unless --replace)."""
    settings = get_settings()
    uri = _tracking_uri(tracking_uri, settings.mlflow.tracking_uri)
    report = _in_database(
        settings,
        lambda session: export_experiment(
            session,
            experiment_id,
            uri,
            experiment_name=experiment_name,
            include_failed=not skip_failed,
            replace=replace,
            max_points=max_points,
            connect_timeout_s=settings.mlflow.connect_timeout_s,
            base_url=settings.api.public_url,
        ),
    )
    print_report(report)


@export_app.command("mlflow-campaign")
def export_mlflow_campaign(
    campaign_id: Annotated[str, typer.Argument(help="the vlab campaign id")],
    tracking_uri: TrackingUri = None,
    experiment_name: Annotated[
        str | None,
        typer.Option(help="the MLflow experiment (default: the campaign's name)"),
    ] = None,
    replace: Replace = False,
    max_points: MaxPoints = None,
) -> None:
    """Export a tuning campaign to MLflow: a parent run (objective, space, rule, final
    configuration as params; cumulative gain with its interval and each step's gain as
    metrics; verdicts as tags; the path as a JSON artifact) with the campaign's runs nested
    under it. Runs exported before are left as they are (unless --replace)."""
    settings = get_settings()
    uri = _tracking_uri(tracking_uri, settings.mlflow.tracking_uri)
    report = _in_database(
        settings,
        lambda session: export_campaign(
            session,
            campaign_id,
            uri,
            experiment_name=experiment_name,
            replace=replace,
            max_points=max_points,
            connect_timeout_s=settings.mlflow.connect_timeout_s,
            base_url=settings.api.public_url,
        ),
    )
    print_campaign_report(report)


def _in_database(settings: Settings, export: Callable[[Session], T]) -> T:
    """``export`` in one unit of work on the configured database (started for the command,
    stopped after); a :class:`VlabError` is one line and exit code 2."""
    rt = Runtime(settings)
    try:
        rt.start_database()
        with unit_of_work(rt.sessions) as session:
            return export(session)
    except VlabError as exc:
        _fail(exc.detail)
    finally:
        rt.stop()


def _tracking_uri(given: str | None, configured: str | None) -> str:
    """The tracking URI to use; exits with a message when there is none or it is bad."""
    uri = (given or configured or "").strip()
    if not uri:
        _fail("no tracking URI: give --tracking-uri (or set MLFLOW_TRACKING_URI)")
    problem = tracking_uri_problem(uri)
    if problem:
        _fail(problem)
    return uri


def print_campaign_report(report: CampaignExportReport) -> None:
    """The parent run, then one table of the nested runs (a cycle column) and one line
    of totals."""
    console.print(
        f"campaign {report.campaign_id}: parent MLflow run {report.parent_run_id} "
        f"({report.parent_action}; {report.params} params, {report.metrics} metrics), "
        f"{report.nested} run(s) nested",
        markup=False,
    )
    _print_runs(report.cycles, with_cycle=True)


def _fail(message: str) -> NoReturn:
    """One line on stderr, exit code 2 (as every other ``vlab`` command)."""
    Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {message}", markup=True)
    raise typer.Exit(2)


def print_report(report: ExportReport) -> None:
    """A table of what happened to each run, then one line of totals."""
    _print_runs([report], with_cycle=False)


def _print_runs(reports: list[ExportReport], with_cycle: bool) -> None:
    """One table of the runs of ``reports`` (each an experiment; a campaign's cycles
    numbered from 1 when ``with_cycle``), then one line of totals over them all."""
    if not reports:
        return
    columns = ["variant", "repeat", "status", "action", "MLflow run", "params", "metrics"]
    table = Table(*(["cycle"] if with_cycle else []), *columns, "points", "unknown metrics")
    counts: dict[str, int] = {}
    for number, report in enumerate(reports, start=1):
        for r in report.runs:
            counts[r.action] = counts.get(r.action, 0) + 1
            table.add_row(
                *([str(number)] if with_cycle else []),
                r.variant,
                str(r.repeat_index),
                r.status,
                r.action,
                r.mlflow_run_id or "–",
                str(r.params),
                str(r.metrics),
                str(r.series_points),
                ", ".join(r.unknown_metrics) or "–",
            )
    console.print(table)
    first = reports[0]
    total = ", ".join(f"{n} {action}" for action, n in sorted(counts.items()))
    console.print(
        f"MLflow experiment {first.mlflow_experiment_name!r} "
        f"(id {first.mlflow_experiment_id}) at {first.tracking_uri}: {total or 'no runs'}",
        markup=False,
    )
