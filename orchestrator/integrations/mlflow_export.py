"""Export an experiment's runs to an MLflow tracking server (or a local MLflow store).

One MLflow run per vlab run, in the MLflow experiment named after the vlab experiment (or
the name given; created when missing). What a run becomes (params, summary metrics, the
``/metrics`` time series as metric history, tags): :mod:`orchestrator.integrations.mlflow_mapping`.
Summary metrics are logged at step 0 with the run's end time. The MLflow run's status
follows the vlab status (succeeded -> ``FINISHED``; failed, blocked -> ``FAILED``; cancelled
-> ``KILLED``); its start and end time are the run's.

Runs not finished (queued, preparing, running) are skipped: a later export adds them.
Failed, cancelled and blocked runs are exported with their status, params, tags and time
series and no summary metrics, or skipped with ``include_failed=False``.

**Idempotent**: the experiment's MLflow runs are looked up by their ``vlab.run_id`` tag
(active MLflow runs only). A run exported completely (tag ``vlab.export_complete``, written
last) is left as it is (``unchanged``); one whose export broke off is deleted in MLflow and
exported again (``replaced``), as is every one with ``replace=True``. Exports of one
experiment to one tracking URI are serialised within a process.

The database is read in short transactions (the experiment's runs first, then each run's
metrics and samples just before it is sent); the connection goes back to the pool before
each call to MLflow (:func:`orchestrator.core.db.release_connection`), so a slow tracking
server holds no database connection.

Which tracking URIs the API may use: :func:`check_api_tracking_uri`.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal
from urllib.parse import unquote, urlsplit, urlunsplit

import httpx
from sqlalchemy.orm import Session

from orchestrator.core.db import release_connection
from orchestrator.core.errors import (
    ExportRequestInvalidError,
    MlflowExperimentDeletedError,
    MlflowExportError,
    MlflowNotInstalledError,
    MlflowUnreachableError,
    VlabError,
)
from orchestrator.core.repositories import RunRepository
from orchestrator.core.settings import MlflowSettings
from orchestrator.core.states import ACTIVE
from orchestrator.experiments.service import get_experiment
from orchestrator.integrations.mlflow_mapping import (
    MLFLOW_STATUS,
    RunHead,
    epoch_ms,
    run_metrics,
    run_params,
    run_tags,
    series_metrics,
)
from orchestrator.runs.timeseries import Point, downsample

__all__ = [
    "ExportReport",
    "RunExport",
    "check_api_tracking_uri",
    "export_experiment",
    "redact_uri",
]

log = logging.getLogger(__name__)

# MLflow's limits (mlflow/utils/validation.py of mlflow-skinny 3.17: MAX_PARAMS_TAGS_PER_BATCH,
# MAX_METRICS_PER_BATCH, MAX_EXPERIMENT_NAME_LENGTH).
MAX_PARAMS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
MAX_EXPERIMENT_NAME = 500
#: Written last: an MLflow run without it is an export that broke off.
COMPLETE_TAG = "vlab.export_complete"

Action = Literal[
    "created", "replaced", "unchanged", "skipped_not_finished", "skipped_not_succeeded"
]


# --------------------------------------------------------------------------- results


@dataclass
class RunExport:
    """What the export did with one vlab run."""

    run_id: str
    variant: str
    repeat_index: int
    status: str
    action: Action
    mlflow_run_id: str | None = None
    params: int = 0
    metrics: int = 0
    series_points: int = 0
    unknown_metrics: list[str] = field(default_factory=list)


@dataclass
class ExportReport:
    """The export of one experiment: where it went and one :class:`RunExport` per run."""

    experiment_id: str
    tracking_uri: str  # userinfo removed (:func:`redact_uri`)
    mlflow_experiment_name: str
    mlflow_experiment_id: str
    runs: list[RunExport] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """How many runs got each action."""
        out: dict[str, int] = {}
        for r in self.runs:
            out[r.action] = out.get(r.action, 0) + 1
        return out

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "counts": self.counts()}


# --------------------------------------------------------------------------- tracking URIs


def redact_uri(uri: str) -> str:
    """``uri`` without a user name or password (never echoed in answers or logs)."""
    parts = urlsplit(uri)
    if not (parts.username or parts.password):
        return uri
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit(parts._replace(netloc=netloc))


def _is_http(uri: str) -> bool:
    return urlsplit(uri).scheme.lower() in ("http", "https")


#: The tracking-URI schemes MLflow's client stores take (``databricks`` has no ``://``).
_SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql", "databricks", "file")
_ACCEPTED = (
    "http(s)://host[:port], sqlite:///path.db, postgresql://..., mysql://..., databricks, "
    "or file:///path (MLflow 3 refuses file:// stores unless MLFLOW_ALLOW_FILE_STORE=true)"
)


def _scheme_known(uri: str) -> bool:
    """Whether MLflow has a store for ``uri``'s scheme (``databricks`` has no ``://``)."""
    base = urlsplit(uri).scheme.lower().split("+", 1)[0]  # postgresql+psycopg2:// ...
    return uri.lower() == "databricks" or (base in _SCHEMES and "://" in uri)


def tracking_uri_problem(uri: str) -> str | None:
    """Why ``uri`` is no tracking URI MLflow takes (None when it is one): no scheme, one
    MLflow has no store for, or a path with ``.``/``..`` segments (they would walk out
    of an allowed prefix). Checked before MLflow is loaded, so the answer is one line."""
    scheme = urlsplit(uri).scheme.lower()
    is_file = scheme.split("+", 1)[0] == "file"
    path = unquote(urlsplit(uri).path)
    if any(seg in (".", "..") for seg in re.split(r"[/\\]", path)):
        return (
            f"tracking URI {redact_uri(uri)!r}: a path with '.' or '..' segments is not "
            "accepted: give the path without them"
        )
    if _scheme_known(uri):
        if is_file and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in (
            "true",
            "1",
        ):
            return (
                f"tracking URI {redact_uri(uri)!r}: MLflow 3 refuses file:// stores unless "
                "MLFLOW_ALLOW_FILE_STORE=true; use sqlite:///path.db or an http(s):// server"
            )
        return None
    why = f"the scheme {scheme}:// is not one MLflow takes" if scheme else "it has no scheme"
    return f"not a tracking URI ({why}): give {_ACCEPTED}"


def check_api_tracking_uri(uri: str | None, settings: MlflowSettings) -> str:
    """The tracking URI an API request may export to: ``uri``, else the configured one.

    The API accepts ``http(s)`` tracking servers only, unless
    ``settings.allow_local_stores`` also allows stores on the service's own disk or a
    database (``file://``, ``sqlite://``, ``postgresql://`` ...): otherwise an API
    user could make the service write files wherever it may. With
    ``settings.allowed_uri_prefixes`` set, the URI must start with one of them.

    Raises:
        ExportRequestInvalidError: no URI, or one refused; located at
            ``["body", "tracking_uri"]``.
    """
    chosen = (uri or settings.tracking_uri or "").strip()

    def refuse(msg: str, kind: str) -> ExportRequestInvalidError:
        return ExportRequestInvalidError(
            [{"loc": ["body", "tracking_uri"], "msg": msg, "type": kind}]
        )

    if not chosen:
        raise refuse(
            "no tracking URI: give tracking_uri, or set VLAB_MLFLOW__TRACKING_URI", "missing"
        )
    problem = tracking_uri_problem(chosen)
    parts = urlsplit(chosen)
    unknown_scheme = bool(parts.scheme) and not _scheme_known(chosen)
    if _is_http(chosen):
        try:
            host = parts.hostname
            _ = parts.port  # raises on a port that is not a number
        except ValueError:
            host = None
        if not host:
            raise refuse("an http(s) tracking URI needs a host (and a numeric port)", "uri")
    elif not settings.allow_local_stores and not unknown_scheme:
        what = f"{parts.scheme}:// stores" if parts.scheme else "paths"
        raise refuse(
            "the API exports to http(s) MLflow tracking servers only; "
            f"{what} live on the service's own disk or in a database (the service's "
            "administrator may allow them with VLAB_MLFLOW__ALLOW_LOCAL_STORES=true; "
            "`vlab export mlflow` and `vlab export mlflow-campaign` go through this API, "
            "so the service's setting decides for them too)",
            "uri_scheme_refused",
        )
    if problem is not None:  # an unknown scheme, dot segments, a file:// MLflow refuses
        raise refuse(problem, "uri")
    prefixes = settings.allowed_uri_prefixes
    if prefixes and not any(chosen.startswith(p) for p in prefixes):
        raise refuse(
            "not a tracking URI this service exports to (VLAB_MLFLOW__ALLOWED_URI_PREFIXES: "
            + ", ".join(prefixes)
            + ")",
            "uri_not_allowed",
        )
    return chosen


def _check_reachable(uri: str, timeout_s: float) -> None:
    """For an http(s) URI: raise :class:`MlflowUnreachableError` unless something answers
    HTTP there (any status counts: a 401 or 404 is a server that answers).

    MLflow's own client retries a refused connection for minutes (7 retries with
    exponential backoff by default, ``MLFLOW_HTTP_REQUEST_MAX_RETRIES``); this answers at
    once. ``verify=False``: the probe sends no credentials and uses nothing it reads; the
    export's own requests verify TLS as MLflow is configured to.
    """
    if not _is_http(uri):
        return
    try:
        httpx.get(uri.rstrip("/") + "/health", timeout=timeout_s, verify=False)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        reason = " ".join(str(exc).split())[:300] or "no answer"
        raise MlflowUnreachableError(
            f"cannot reach the MLflow tracking server at {redact_uri(uri)}: {reason}"
        ) from exc


# --------------------------------------------------------------------------- mlflow


@dataclass(frozen=True)
class _Mlflow:
    """The parts of the ``mlflow`` package the export uses."""

    client: Any  # mlflow.tracking.MlflowClient
    metric: Any  # mlflow.entities.Metric
    param: Any  # mlflow.entities.Param
    exception: type[Exception]  # mlflow.exceptions.MlflowException


def _load_mlflow() -> _Mlflow:
    """Import ``mlflow`` (its telemetry off unless ``MLFLOW_DISABLE_TELEMETRY`` is set:
    the service never reports home on its own). Raises :class:`MlflowNotInstalledError`."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    try:
        # deferred: heavy (about a second to import) and optional (the `mlflow` extra)
        from mlflow.entities import Metric, Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
    except ImportError as exc:
        raise MlflowNotInstalledError(
            "the mlflow package is not installed where the service runs: "
            "pip install 'vlab[mlflow]' (or mlflow-skinny)"
        ) from exc
    return _Mlflow(MlflowClient, Metric, Param, MlflowException)


_locks_guard = threading.Lock()
_locks: dict[tuple[str, str], threading.Lock] = {}


def _lock_for(uri: str, experiment_id: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault((uri, experiment_id), threading.Lock())


def _chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


# --------------------------------------------------------------------------- the export


def export_experiment(
    session: Session,
    experiment_id: str,
    tracking_uri: str,
    *,
    experiment_name: str | None = None,
    include_failed: bool = True,
    replace: bool = False,
    max_points: int | None = None,
    connect_timeout_s: float = 10.0,
    base_url: str | None = None,
) -> ExportReport:
    """Export the runs of experiment ``experiment_id`` to the MLflow store at
    ``tracking_uri`` (see the module docstring for what goes where).

    Args:
        session: a session (its transaction is committed before each MLflow call; it
            writes nothing).
        experiment_id: the vlab experiment.
        tracking_uri: any URI MLflow takes (``http(s)://``, ``sqlite:///``, ...); the API
            checks it first with :func:`check_api_tracking_uri`.
        experiment_name: the MLflow experiment (default: the vlab experiment's name).
        include_failed: export failed, cancelled and blocked runs (without summary
            metrics); False skips them.
        replace: delete the MLflow runs an earlier export made of these runs and export
            them again.
        max_points: at most this many ``during`` samples per run
            (:func:`orchestrator.runs.timeseries.downsample`); None: every stored sample.
        connect_timeout_s: how long an http(s) tracking server may take to answer at all.
        base_url: the dashboard's base URL, for the ``vlab.run_url`` tag (none without it).

    Returns:
        The :class:`ExportReport` (one entry per run, in execution order).

    Raises:
        NotFoundError: no such experiment (``experiment_not_found``).
        ExportRequestInvalidError: an experiment name MLflow cannot take.
        MlflowNotInstalledError: no ``mlflow`` package.
        MlflowUnreachableError: nothing answers at an http(s) ``tracking_uri``.
        MlflowExperimentDeletedError: the MLflow experiment of that name is deleted.
        MlflowExportError: MLflow refused or failed a request (``runs_done`` says how many
            runs were exported before).
    """
    exp = get_experiment(session, experiment_id)
    name = _mlflow_name(experiment_name if experiment_name is not None else exp.name)
    heads = [RunHead.of(r) for r in sorted(exp.runs, key=lambda r: (r.sequence, r.id))]
    vlab_name = exp.name
    release_connection(session)
    ml = _load_mlflow()
    _check_reachable(tracking_uri, connect_timeout_s)
    report: ExportReport | None = None
    with _lock_for(tracking_uri, experiment_id):
        try:
            client = ml.client(tracking_uri=tracking_uri)
            mlflow_exp_id = _ensure_experiment(ml, client, name)
            report = ExportReport(experiment_id, redact_uri(tracking_uri), name, mlflow_exp_id)
            existing = _existing_runs(client, mlflow_exp_id, experiment_id)
            for head in heads:
                report.runs.append(
                    _export_run(
                        ml,
                        client,
                        session,
                        head,
                        mlflow_exp_id,
                        vlab_name,
                        experiment_id,
                        existing.get(head.id, []),
                        include_failed=include_failed,
                        replace=replace,
                        max_points=max_points,
                        base_url=base_url,
                    )
                )
        except VlabError:
            raise
        except Exception as exc:  # noqa: BLE001 - every MLflow/store failure is one problem
            raise _export_failed(exc, report, tracking_uri, experiment_id) from exc
    assert report is not None
    return report


def _mlflow_name(name: str) -> str:
    """``name`` stripped; :class:`ExportRequestInvalidError` when MLflow cannot take it."""
    name = name.strip()
    if not name or len(name) > MAX_EXPERIMENT_NAME:
        msg = f"an MLflow experiment name has 1 to {MAX_EXPERIMENT_NAME} characters"
        loc = ["body", "experiment_name"]
        raise ExportRequestInvalidError([{"loc": loc, "msg": msg, "type": "value_error"}])
    return name


def _export_failed(
    exc: Exception, report: ExportReport | None, tracking_uri: str, experiment_id: str
) -> MlflowExportError:
    """The one-line error of a failed export (logged as one line, the traceback at DEBUG:
    an expected failure, a wrong URI or a server that is no MLflow server, is the
    caller's to fix), saying how many runs were exported before."""
    done = sum(1 for r in report.runs if r.action in ("created", "replaced")) if report else 0
    message = _failure_message(exc, tracking_uri)
    where = redact_uri(tracking_uri)
    log.warning("MLflow export of %s to %s failed: %s", experiment_id, where, message)
    log.debug("MLflow export failure", exc_info=True)
    return MlflowExportError(
        f"the MLflow export to {where} failed after {done} run(s): {message}", runs_done=done
    )


_HTTP_STATUS = re.compile(r"failed with error code (\d{3})")


def _is_mlflow_error_code(code: object) -> bool:
    """``code`` is one of MLflow's error codes (``RESOURCE_DOES_NOT_EXIST`` ...)."""
    if not isinstance(code, str):
        return False
    try:
        # deferred: mlflow is heavy and optional (the `mlflow` extra); only after an export failed
        from mlflow.protos.databricks_pb2 import ErrorCode

        ErrorCode.Value(code)
    except (ImportError, ValueError):
        return False
    return True


def _failure_message(exc: Exception, uri: str) -> str:
    """What the caller is told of an MLflow failure: never the body or headers of the
    remote answer (the API must not be a way to read other services' pages).

    An MLflow error (``{"error_code": "RESOURCE_DOES_NOT_EXIST", "message": ...}``) keeps
    MLflow's message; any other answer is described by its HTTP status alone.
    """
    answer = getattr(exc, "json", None)  # mlflow.exceptions.RestException: a JSON answer
    if isinstance(answer, dict):
        code = answer.get("error_code")
        if _is_mlflow_error_code(code) and isinstance(answer.get("message"), str):
            return " ".join(f"{code}: {answer['message']}".split())[:500]
        return (
            f"the tracking server at {redact_uri(uri)} answered an MLflow request with an "
            "error that is not an MLflow error: is it an MLflow tracking server?"
        )
    text = " ".join(str(exc).split())
    if " Response body:" in text:  # MLflow quotes the answer that is not JSON, or not MLflow's
        status = _HTTP_STATUS.search(text)
        answered = f"HTTP {status.group(1)}" if status else "something that is not MLflow's JSON"
        return (
            f"the tracking server at {redact_uri(uri)} answered {answered} to an MLflow "
            "request: is it an MLflow tracking server?"
        )
    return text[:500] or type(exc).__name__


def _ensure_experiment(ml: _Mlflow, client: Any, name: str) -> str:
    """The id of the active MLflow experiment ``name``, created when missing."""
    found = client.get_experiment_by_name(name)
    if found is None:
        try:
            return str(client.create_experiment(name, tags={"vlab.source": "vlab"}))
        except ml.exception:
            found = client.get_experiment_by_name(name)  # created meanwhile by another export
            if found is None:
                raise
    if found.lifecycle_stage != "active":
        raise MlflowExperimentDeletedError(
            f"the MLflow experiment {name!r} is deleted: restore it in MLflow, or export "
            "under another experiment name"
        )
    return str(found.experiment_id)


def _existing_runs(client: Any, mlflow_exp_id: str, experiment_id: str) -> dict[str, list[Any]]:
    """The active MLflow runs an earlier export made of this experiment, by vlab run id."""
    if not re.fullmatch(r"[\w-]+", experiment_id):  # ids are UUIDs; never quote into a filter
        raise ExportRequestInvalidError(
            [{"loc": ["path", "experiment_id"], "msg": "not an id", "type": "value_error"}]
        )
    out: dict[str, list[Any]] = {}
    token: str | None = None
    while True:
        page = client.search_runs(
            [mlflow_exp_id],
            filter_string=f"tags.`vlab.experiment_id` = '{experiment_id}'",
            max_results=1000,
            page_token=token,
        )
        for run in page:
            rid = run.data.tags.get("vlab.run_id")
            if rid:
                out.setdefault(rid, []).append(run)
        token = page.token
        if not token:
            return out


def _export_run(
    ml: _Mlflow,
    client: Any,
    session: Session,
    head: RunHead,
    mlflow_exp_id: str,
    experiment_name: str,
    experiment_id: str,
    earlier: list[Any],
    *,
    include_failed: bool,
    replace: bool,
    max_points: int | None,
    base_url: str | None,
) -> RunExport:
    entry = RunExport(head.id, head.name, head.repeat_index, head.status, "created")
    if head.status in ACTIVE:
        entry.action = "skipped_not_finished"
        return entry
    if head.status != "succeeded" and not include_failed:
        entry.action = "skipped_not_succeeded"
        return entry
    complete = [r for r in earlier if r.data.tags.get(COMPLETE_TAG) == "true"]
    if complete and not replace:
        for stale in earlier:  # a broken-off duplicate next to the complete one
            if stale is not complete[0]:
                client.delete_run(stale.info.run_id)
        entry.action = "unchanged"
        entry.mlflow_run_id = complete[0].info.run_id
        return entry
    for old in earlier:
        client.delete_run(old.info.run_id)
    if earlier:
        entry.action = "replaced"

    repo = RunRepository(session)
    stored = repo.metrics(head.id)
    rows = repo.samples(head.id)
    points = (
        downsample(rows, max_points)
        if max_points
        else [Point(float(s.t_s), str(s.phase), dict(s.values)) for s in rows]
    )
    release_connection(session)

    params, truncated = run_params(head)
    metrics, unknown = run_metrics(head, stored)
    series, skipped = series_metrics(points)
    tags = run_tags(
        head,
        experiment_name,
        experiment_id,
        unknown=unknown,
        truncated=truncated,
        series_points=len(series),
        series_skipped=skipped,
        run_url=f"{base_url.rstrip('/')}/runs/{head.id}" if base_url else None,
    )
    run = client.create_run(
        mlflow_exp_id,
        start_time=epoch_ms(head.started_at or head.created_at),
        tags=tags,
        run_name=f"{head.name} #{head.repeat}",  # numbered from 1, as the dashboard does
    )
    rid = run.info.run_id
    for chunk in _chunks(list(params.items()), MAX_PARAMS_PER_BATCH):
        client.log_batch(rid, params=[ml.param(k, v) for k, v in chunk], synchronous=True)
    ended = epoch_ms(head.finished_at) or epoch_ms(datetime.now(UTC))
    entities = [ml.metric(k, v, ended, 0) for k, v in metrics.items()]
    entities += [ml.metric(k, v, step, step) for k, v, step in series]
    for chunk in _chunks(entities, MAX_METRICS_PER_BATCH):
        client.log_batch(rid, metrics=list(chunk), synchronous=True)
    client.set_terminated(rid, status=MLFLOW_STATUS.get(head.status, "FAILED"), end_time=ended)
    client.set_tag(rid, COMPLETE_TAG, "true")
    entry.mlflow_run_id = rid
    entry.params = len(params)
    entry.metrics = len(metrics)
    entry.series_points = len(series)
    entry.unknown_metrics = unknown
    return entry
