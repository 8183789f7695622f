"""The MLflow export round-trips: exported to a real local MLflow store (SQLite, through
mlflow-skinny's own ``SqlAlchemyStore``) and read back with MLflow's ``MlflowClient``.

The experiment is the real demo run (``tests/web/data/demo_experiment.json``: vLLM 0.32.0
CPU build, APC off vs on, two repeats, its stored summary metrics and ``/metrics``
samples), loaded into the test Postgres with :func:`tests.web.seed.load_export`. MLflow's
limits and key rules are those of ``mlflow/utils/validation.py`` (mlflow-skinny 3.17);
the keys are checked with MLflow's own validators.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session

from jobs.engine.command import RESERVED_ENGINE_ARGS
from orchestrator.core.errors import (
    ExportRequestInvalidError,
    MlflowExperimentDeletedError,
    MlflowExportError,
    MlflowNotInstalledError,
    MlflowUnreachableError,
    NotFoundError,
)
from orchestrator.core.models import Experiment
from orchestrator.core.repositories import RunRepository
from orchestrator.core.settings import MlflowSettings
from orchestrator.integrations.mlflow_export import (
    check_api_tracking_uri,
    export_experiment,
    redact_uri,
)
from orchestrator.integrations.mlflow_mapping import (
    EXPECTED_METRICS,
    MAX_PARAM_VALUE,
    RunHead,
    mlflow_key,
    run_params,
    series_metrics,
    summary_metrics,
)
from orchestrator.runs.timeseries import Point
from tests.factories import make_experiment
from tests.web.seed import DATA, load_export

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # never report home from tests
mlflow = pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402
from mlflow.utils.validation import _validate_metric_name, _validate_param_name  # noqa: E402

DEMO = DATA / "demo_experiment.json"


def _store(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def _ms(t: Any) -> int:
    return int(t.timestamp() * 1000)


def _runs_by_vlab_id(client: MlflowClient, name: str) -> dict[str, Any]:
    exp = client.get_experiment_by_name(name)
    assert exp is not None
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    out: dict[str, Any] = {}
    for r in runs:
        rid = r.data.tags["vlab.run_id"]
        assert rid not in out, f"two active MLflow runs for {rid}"
        out[rid] = r
    return out


def test_demo_experiment_round_trips(db_session: Session, tmp_path: Path) -> None:
    ids = load_export(db_session, DEMO, name="demo-mlflow")
    exp = db_session.get(Experiment, ids["experiment_id"])
    assert exp is not None
    uri = _store(tmp_path)

    report = export_experiment(db_session, exp.id, uri)

    assert report.mlflow_experiment_name == "demo-mlflow"
    assert report.counts() == {"created": 4}
    client = MlflowClient(tracking_uri=uri)
    by_id = _runs_by_vlab_id(client, "demo-mlflow")
    assert set(by_id) == {r.id for r in exp.runs}
    repo = RunRepository(db_session)
    for run in exp.runs:
        got = by_id[run.id]
        tags, params, metrics = got.data.tags, got.data.params, got.data.metrics
        # tags: who it is, what changed, what it ran on
        assert tags["vlab.experiment_id"] == exp.id
        assert tags["vlab.experiment_name"] == "demo-mlflow"
        assert tags["vlab.variant"] == run.name
        assert tags["vlab.repeat_index"] == str(run.repeat_index)
        assert tags["vlab.request_list_hash"] == run.request_list_hash
        assert tags["vlab.status"] == "succeeded"
        assert tags["vlab.vllm_version"] == "0.32.0"
        assert tags["vlab.export_complete"] == "true"
        # numbered from 1 as the dashboard shows them (issue #26); the stored index stays
        assert tags["mlflow.runName"] == f"{run.name} #{run.repeat_index + 1}"
        assert tags["vlab.repeat"] == str(run.repeat_index + 1)
        # no capacity search in the demo: no capacity settings or results
        assert not any(k.startswith(("capacity.", "slos.")) for k in params)
        assert not any(k.startswith("vlab.capacity") for k in tags)
        if run.name == "apc-on":
            assert tags["vlab.variable"] == "engine_args.enable_prefix_caching"
            assert tags["vlab.reference_variant"] == "baseline"
        else:
            assert "vlab.variable" not in tags and tags["vlab.is_baseline"] == "true"
        # params: every resolved engine argument (317 in vLLM 0.32.0's list), the layout
        # asked for and the one the run got
        # less the launch-time ones (host, port: not what the engine got) and argparse's
        # ==SUPPRESS== placeholders (trial of 2026-12-04)
        shown = {
            k
            for k, v in run.engine_args.items()
            if k not in RESERVED_ENGINE_ARGS and v != "==SUPPRESS=="
        }
        assert {k.removeprefix("engine_args.") for k in params if k.startswith("engine_args.")} == {
            mlflow_key(k) for k in shown
        }
        assert "engine_args.port" not in params and "engine_args.host" not in params
        assert "==SUPPRESS==" not in params.values()
        apc = "true" if run.name == "apc-on" else "false"
        assert params["engine_args.enable_prefix_caching"] == apc
        assert params["engine_args.max_model_len"] == "2048"
        assert params["engine_args.load_format"] == "dummy"  # a string stays as it is
        assert params["layout.tensor_parallel_size"] == "1"
        assert params["layout.pipeline_parallel_size"] == "1"
        assert params["layout.devices"] == "2"
        assert params["placement.nnodes"] == "1"
        assert params["placement.devices"] == "2"
        assert params["placement.devices_per_node"] == "[2]"
        assert params["placement.resource"] == "CPU"
        assert params["workload.kind"] == "shared_prefix"
        assert params["model.digest"] == run.model_digest
        for key in params:
            _validate_param_name(key)
        # metrics: the stored summary, exactly; nothing invented
        stored = repo.metrics(run.id)
        assert {k: v for k, v in metrics.items() if not k.startswith("series/")} == stored
        assert metrics["median_ttft_ms"] == stored["median_ttft_ms"]
        unknown = tags["vlab.unknown_metrics"].split(", ")
        # no SLOs in the demo: no goodput; a CPU host: no GPU telemetry. Never written as 0.
        for name in ("request_goodput", "goodput_fraction", "energy_per_output_token_j"):
            assert name in unknown and name not in metrics
        if run.name == "baseline":  # APC off: no prefix-cache queries, so no hit rate
            assert "prefix_cache_hit_rate" in unknown
            assert "prefix_cache_hit_rate" not in metrics
        assert set(unknown) == {n for n in EXPECTED_METRICS if n not in stored}
        # the /metrics time series as metric history, one point per stored sample
        samples = repo.samples(run.id)
        history = client.get_metric_history(got.info.run_id, "series/kv_cache_usage")
        assert (
            len(history)
            == len(samples)
            == int(tags["vlab.series_points"]) // len(samples[0].values)
        )
        assert [(h.step, h.value) for h in sorted(history, key=lambda h: h.step)] == [
            (round(s.t_s * 1000), s.values["kv_cache_usage"]) for s in samples
        ]
        assert all(h.timestamp == h.step for h in history)
        waiting = client.get_metric_history(got.info.run_id, "series/num_requests_waiting")
        assert len(waiting) == len(samples)
        # the MLflow run's status and times are the run's
        assert got.info.status == "FINISHED"
        assert got.info.start_time == _ms(run.started_at)
        assert got.info.end_time == _ms(run.finished_at)


def test_re_export_is_idempotent_and_resumes_a_broken_off_run(
    db_session: Session, tmp_path: Path
) -> None:
    ids = load_export(db_session, DEMO, name="demo-idempotent")
    uri = _store(tmp_path)
    first = export_experiment(db_session, ids["experiment_id"], uri)
    client = MlflowClient(tracking_uri=uri)
    before = _runs_by_vlab_id(client, "demo-idempotent")

    again = export_experiment(db_session, ids["experiment_id"], uri)
    assert again.counts() == {"unchanged": 4}
    assert [r.mlflow_run_id for r in again.runs] == [r.mlflow_run_id for r in first.runs]
    after = _runs_by_vlab_id(client, "demo-idempotent")
    assert {k: r.info.run_id for k, r in after.items()} == {
        k: r.info.run_id for k, r in before.items()
    }
    # the metric history was not written twice
    some = next(iter(after.values()))
    n = len(client.get_metric_history(some.info.run_id, "series/kv_cache_usage"))
    assert n == len(RunRepository(db_session).samples(some.data.tags["vlab.run_id"]))

    # an export that broke off before its last tag is deleted and done again
    broken = first.runs[1]
    assert broken.mlflow_run_id is not None
    client.delete_tag(broken.mlflow_run_id, "vlab.export_complete")
    resumed = export_experiment(db_session, ids["experiment_id"], uri)
    assert resumed.counts() == {"replaced": 1, "unchanged": 3}
    assert resumed.runs[1].action == "replaced"
    assert client.get_run(broken.mlflow_run_id).info.lifecycle_stage == "deleted"
    assert len(_runs_by_vlab_id(client, "demo-idempotent")) == 4

    replaced = export_experiment(db_session, ids["experiment_id"], uri, replace=True)
    assert replaced.counts() == {"replaced": 4}
    assert len(_runs_by_vlab_id(client, "demo-idempotent")) == 4


def test_failed_cancelled_and_unfinished_runs(db_session: Session, tmp_path: Path) -> None:
    exp = make_experiment(db_session, n_runs=4)
    ok, failed, cancelled, queued = sorted(exp.runs, key=lambda r: r.sequence)
    repo = RunRepository(db_session)
    samples = [
        {"t_s": 1.5, "phase": "before", "values": {"kv_cache_usage": 0.0}},
        # JSONB holds no NaN: a value that could not be read is stored as null
        {"t_s": 2.5, "phase": "during", "values": {"kv_cache_usage": None}},
        {"t_s": 3.5, "phase": "after", "values": {"kv_cache_usage": 0.25}},
    ]
    ok.status, failed.status, cancelled.status = "succeeded", "failed", "cancelled"
    failed.error = "engine died: CUDA out of memory"
    failed.partial = True
    ok.engine_args = {**ok.engine_args, "chat_template": "x" * 7000, "odd key/../x": 1}
    repo.save_measurements(
        ok.id,
        metrics={"median_ttft_ms": 12.5, "p99_itl_ms": float("nan"), "goodput": float("inf")},
        samples=samples,
        requests=[],
        engine_log="",
    )
    repo.save_measurements(
        failed.id, metrics={"median_ttft_ms": 99.0}, samples=samples, requests=[], engine_log=""
    )
    db_session.flush()
    uri = _store(tmp_path)

    report = export_experiment(db_session, exp.id, uri, experiment_name="failures")

    actions = {r.run_id: r.action for r in report.runs}
    assert actions == {
        ok.id: "created",
        failed.id: "created",
        cancelled.id: "created",
        queued.id: "skipped_not_finished",
    }
    client = MlflowClient(tracking_uri=uri)
    by_id = _runs_by_vlab_id(client, "failures")
    good = by_id[ok.id]
    # finite numbers only; NaN and inf are named, never written
    assert {k: v for k, v in good.data.metrics.items() if "/" not in k} == {"median_ttft_ms": 12.5}
    unknown = good.data.tags["vlab.unknown_metrics"].split(", ")
    assert {"p99_itl_ms", "goodput"} <= set(unknown)
    # the unreadable sample point is left out and counted
    history = client.get_metric_history(good.info.run_id, "series/kv_cache_usage")
    assert sorted((h.step, h.value) for h in history) == [(1500, 0.0), (3500, 0.25)]
    assert good.data.tags["vlab.series_skipped_points"] == "1"
    # a value over MLflow's 6,000 characters is cut, marked and listed
    template = good.data.params["engine_args.chat_template"]
    assert len(template) == MAX_PARAM_VALUE and template.endswith("[truncated from 7000 chars]")
    assert good.data.tags["vlab.truncated_params"] == "engine_args.chat_template"
    assert good.data.params["engine_args.odd key/_/x"] == "1"
    # failed: status, error and time series; its numbers withheld
    bad = by_id[failed.id]
    assert bad.info.status == "FAILED"
    assert bad.data.tags["vlab.status"] == "failed"
    assert bad.data.tags["vlab.error"] == "engine died: CUDA out of memory"
    assert bad.data.tags["vlab.partial"] == "true"
    assert "vlab.metrics_withheld" in bad.data.tags
    assert "median_ttft_ms" not in bad.data.metrics
    assert len(client.get_metric_history(bad.info.run_id, "series/kv_cache_usage")) == 2
    assert by_id[cancelled.id].info.status == "KILLED"
    assert queued.id not in by_id

    # the queued run finishes: the next export adds it and leaves the others
    queued.status = "succeeded"
    db_session.flush()
    later = export_experiment(db_session, exp.id, uri, experiment_name="failures")
    assert {r.run_id: r.action for r in later.runs}[queued.id] == "created"
    assert later.counts() == {"created": 1, "unchanged": 3}

    (tmp_path / "x").mkdir()
    skip = export_experiment(
        db_session, exp.id, _store(tmp_path / "x"), experiment_name="ok-only", include_failed=False
    )
    assert {r.run_id: r.action for r in skip.runs}[failed.id] == "skipped_not_succeeded"
    assert set(_runs_by_vlab_id(MlflowClient(_store(tmp_path / "x")), "ok-only")) == {
        ok.id,
        queued.id,
    }


def test_deleted_mlflow_experiment_and_errors(db_session: Session, tmp_path: Path) -> None:
    exp = make_experiment(db_session, n_runs=1)
    uri = _store(tmp_path)
    client = MlflowClient(tracking_uri=uri)
    client.delete_experiment(client.create_experiment("gone"))
    with pytest.raises(MlflowExperimentDeletedError):
        export_experiment(db_session, exp.id, uri, experiment_name="gone")
    with pytest.raises(NotFoundError):
        export_experiment(db_session, "no-such-experiment", uri)
    with pytest.raises(ExportRequestInvalidError):
        export_experiment(db_session, exp.id, uri, experiment_name="  ")
    # nothing listens on the discard port of the loopback: refused at once, no retries
    with pytest.raises(MlflowUnreachableError) as caught:
        export_experiment(db_session, exp.id, "http://user:secret@127.0.0.1:9")
    assert "secret" not in caught.value.detail and "127.0.0.1:9" in caught.value.detail


class _NotMlflow(BaseHTTPRequestHandler):
    """A web server that is no MLflow: every request gets an HTML 404 page."""

    def _answer(self) -> None:
        body = b"<html>internal page: do-not-echo</html>"
        self.send_response(404)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def not_mlflow() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotMlflow)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_that_is_no_mlflow_is_a_502_without_its_page(
    db_session: Session, not_mlflow: str
) -> None:
    """MLflow's client quotes a non-MLflow answer ("Response body: '<html>...'",
    ``verify_rest_response`` in mlflow/utils/rest_utils.py): the problem does not, so the
    export cannot be used to read other servers' pages. A 404 is not retried by MLflow."""
    exp = make_experiment(db_session, n_runs=1)
    with pytest.raises(MlflowExportError) as caught:
        export_experiment(db_session, exp.id, not_mlflow)
    assert "answered HTTP 404 to an MLflow request" in caught.value.detail
    assert "do-not-echo" not in caught.value.detail
    assert caught.value.extra == {"runs_done": 0}


def test_mlflow_missing_is_a_clear_error(
    db_session: Session, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exp = make_experiment(db_session, n_runs=1)
    for name in [m for m in sys.modules if m == "mlflow" or m.startswith("mlflow.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(MlflowNotInstalledError) as caught:
        export_experiment(db_session, exp.id, _store(tmp_path))
    assert "vlab[mlflow]" in caught.value.detail


# --------------------------------------------------------------------------- pure parts


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("engine_args.max_model_len", "engine_args.max_model_len"),
        ("series/kv_cache_usage", "series/kv_cache_usage"),
        ("a b:c-d", "a b:c-d"),
        ("weird=key{x}", "weird_key_x_"),
        ("a//b/./c/../d/", "a/b/_/c/_/d"),
        ("/", "_"),
        ("x" * 300, "x" * 250),
    ],
)
def test_keys_are_what_mlflow_accepts(name: str, key: str) -> None:
    assert mlflow_key(name) == key
    _validate_param_name(key)
    _validate_metric_name(key)


def test_uri_policy_of_the_api(monkeypatch: pytest.MonkeyPatch) -> None:
    strict = MlflowSettings()
    assert check_api_tracking_uri("https://mlflow.example.com", strict) == (
        "https://mlflow.example.com"
    )
    for refused in ("file:///etc", "sqlite:////tmp/x.db", "/var/lib/x", "postgresql://db/x"):
        with pytest.raises(ExportRequestInvalidError) as caught:
            check_api_tracking_uri(refused, strict)
        assert caught.value.errors[0]["loc"] == ["body", "tracking_uri"]
        assert caught.value.errors[0]["type"] == "uri_scheme_refused"
        # the CLI goes through the API: no advice that the command line takes any URI
        said = caught.value.errors[0]["msg"]
        assert "VLAB_MLFLOW__ALLOW_LOCAL_STORES=true" in said and "any URI" not in said
        assert "the service's setting decides" in said
    for bad in ("http://", "https://host:port", None, "  "):
        with pytest.raises(ExportRequestInvalidError):
            check_api_tracking_uri(bad, strict)
    local = MlflowSettings(allow_local_stores=True, tracking_uri="sqlite:////tmp/m.db")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(ExportRequestInvalidError, match="MLFLOW_ALLOW_FILE_STORE"):
        check_api_tracking_uri("file:///tmp/mlruns", local)  # MLflow 3 refuses it too
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert check_api_tracking_uri("file:///tmp/mlruns", local) == "file:///tmp/mlruns"
    assert check_api_tracking_uri(None, local) == "sqlite:////tmp/m.db"
    fenced = MlflowSettings(allowed_uri_prefixes=["https://mlflow.internal/"])
    assert check_api_tracking_uri("https://mlflow.internal/team", fenced)
    for outside in ("https://mlflow.internal.evil.example/", "https://mlflow.internal@evil/"):
        with pytest.raises(ExportRequestInvalidError):
            check_api_tracking_uri(outside, fenced)
    assert redact_uri("https://u:p@h.example:8443/x") == "https://h.example:8443/x"
    # trial of 2026-12-04: "../" walked out of an allowed folder and the store was written
    fenced_local = MlflowSettings(
        allow_local_stores=True, allowed_uri_prefixes=["sqlite:////srv/mlflow/"]
    )
    assert check_api_tracking_uri("sqlite:////srv/mlflow/team.db", fenced_local)
    for escape in (
        "sqlite:////srv/mlflow/../escape.db",
        "sqlite:////srv/mlflow/%2e%2e/escape.db",
        "sqlite:////srv/mlflow/./x/../../escape.db",
        "https://mlflow.internal/team/../../admin",
    ):
        with pytest.raises(ExportRequestInvalidError, match="'..' segments"):
            check_api_tracking_uri(escape, fenced_local)
    # a scheme MLflow has no store for is named as such, not as "a local store"
    with pytest.raises(ExportRequestInvalidError, match="not one MLflow takes"):
        check_api_tracking_uri("bogus://x", strict)


def test_unknown_numbers_are_named_not_zero() -> None:
    metrics, unknown = summary_metrics("succeeded", {"median_ttft_ms": 3.0, "x": math.nan})
    assert metrics == {"median_ttft_ms": 3.0}
    assert "x" in unknown and "p99_ttft_ms" in unknown and "median_ttft_ms" not in unknown
    assert summary_metrics("failed", {"median_ttft_ms": 3.0}) == ({}, [])
    points, skipped = series_metrics(
        [Point(0.0004, "before", {"a": 1.0}), Point(1.25, "during", {"a": math.inf, "b": 2.0})]
    )
    assert points == [("series/a", 1.0, 0), ("series/b", 2.0, 1250)] and skipped == 1


def test_params_of_a_run_never_placed(db_session: Session) -> None:
    exp = make_experiment(db_session, n_runs=1)
    head = RunHead.of(exp.runs[0])
    params, truncated = run_params(head)
    assert not any(k.startswith("placement.") for k in params)  # unknown: absent
    assert params["layout.tensor_parallel_size"] == "1" and truncated == []
