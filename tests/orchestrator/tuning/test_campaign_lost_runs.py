"""A campaign's run lost to the infrastructure is measured again (a retry label, its own
experiment), a run failed by its configuration stays a failure; and where the campaign's
wall time went. Against a real Postgres, with the fake recorded results of
``test_campaign_service`` (a test double of the runs' results); lost runs are ended the
way the dispatcher ends them (:func:`orchestrator.dispatch.lost_runs.fail_lost`).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.core.db import unit_of_work
from orchestrator.core.models import Campaign, Experiment, Run, RunMetric
from orchestrator.core.repositories import CampaignRepository, RunRepository
from orchestrator.core.settings import Settings
from orchestrator.core.states import RunStatus
from orchestrator.dispatch.lost_runs import fail_lost
from orchestrator.tuning import service
from orchestrator.tuning.run_loss import loss_of, lost_to_infrastructure
from orchestrator.tuning.wall_time import wall_time
from tests.api.conftest import settings as settings  # noqa: F401 - fixture
from tests.orchestrator.tuning.test_campaign_service import (
    METRIC,
    create,
    database,  # noqa: F401 - fixture
    factory,  # noqa: F401 - fixture
    labels,
    record_fake_result,
    step,
    surface,
)

APC = "engine_args.enable_prefix_caching=true"
SEQS_64 = "engine_args.max_num_seqs=64"


def _lose(s: Session, run: Run) -> None:
    """End ``run`` as the dispatcher ends a run whose orchestrator restarted."""
    RunRepository(s).transition(run, RunStatus.PREPARING)
    fail_lost(RunRepository(s), run, "orchestrator restarted and the run's supervisor is gone")


def _fail(error: str) -> Callable[[Session, Run], None]:
    def end(s: Session, run: Run) -> None:
        repo = RunRepository(s)
        repo.transition(run, RunStatus.PREPARING)
        repo.transition(run, RunStatus.FAILED, error)
        run.error = error

    return end


def _finish(
    factory: sessionmaker[Session],  # noqa: F811
    cid: str,
    ends: dict[str, Callable[[Session, Run], None]],
    metric: str = METRIC,
) -> None:
    """Record the campaign's queued runs: those named in ``ends`` as it says, the others
    with the fake surface's objective."""
    with unit_of_work(factory) as s:
        for run in CampaignRepository(s).runs(cid):
            if run.status != "queued":
                continue
            end = ends.get(str(run.campaign_label))
            if end is not None:
                end(s, run)
            else:
                record_fake_result(s, run, surface(run), metric)


def test_a_lost_run_is_queued_again_and_its_candidate_goes_on(
    factory: sessionmaker[Session],  # noqa: F811
    settings: Settings,  # noqa: F811
) -> None:
    cid = create(factory, settings)
    step(factory, settings, cid)
    _finish(factory, cid, {f"r1.c1.{SEQS_64}": _lose})
    row = step(factory, settings, cid)
    retry = f"r1.c1.{SEQS_64}.retry1"
    assert labels(factory, cid)[4:] == [retry]  # the cycle waits for it: no r1.c2 yet
    assert row.result["pending"] == [retry]
    assert row.result["retried"] == {f"r1.c1.{SEQS_64}": retry}
    assert row.result["retry_reasons"] == {  # why: the infrastructure lost it, and how
        f"r1.c1.{SEQS_64}": {
            "kind": "lost",
            "why": "lost to the infrastructure: orchestrator restarted and the run's "
            "supervisor is gone",
        }
    }
    with factory() as s:
        runs = {r.campaign_label: r for r in CampaignRepository(s).runs(cid)}
        again, first = runs[retry], runs[f"r1.c1.{SEQS_64}"]
        assert again.experiment_id != first.experiment_id  # its own experiment
        assert again.explicit_engine_args == first.explicit_engine_args
        assert again.is_baseline and again.status == "queued"
        exp = s.get(Experiment, again.experiment_id)
        assert exp is not None and exp.name == "tune apc r1.c1 retry1"
    # advancing again (or after a restart) queues it once
    step(factory, settings, cid)
    assert labels(factory, cid).count(retry) == 1
    _finish(factory, cid, {})
    row = step(factory, settings, cid)
    assert [label for label in labels(factory, cid) if label.startswith("r1.c2.")] == [
        "r1.c2.incumbent",
        f"r1.c2.{APC}",
        f"r1.c2.{SEQS_64}",
        "r1.c2.engine_args.max_num_seqs=256",
    ]
    outcomes = {c["label"]: c["outcome"] for c in row.result["candidates"]}
    assert outcomes[SEQS_64] == "measuring"
    assert row.result["runs_used"] == 5


def test_the_loop_asks_vllm_about_a_retry_before_the_locked_advance(
    factory: sessionmaker[Session],  # noqa: F811
    settings: Settings,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cid = create(factory, settings)
    with factory() as s:
        others = [i for i in CampaignRepository(s).advancing_ids() if i != cid]
    with unit_of_work(factory) as s:  # only this campaign advances here
        for other in others:
            service.cancel_campaign(s, other)
    step(factory, settings, cid)
    _finish(factory, cid, {f"r1.c1.{SEQS_64}": _lose})
    asked: list[dict[str, object]] = []
    monkeypatch.setattr(service, "precheck", lambda _s, _c, doc: asked.append(doc))
    service.advance_campaigns(factory, settings)
    assert [d["name"] for d in asked] == ["tune apc r1.c1 retry1"]
    (doc,) = asked
    assert doc["variants"] == []  # the candidate's configuration as the baseline
    assert doc["baseline"]["engine_args"]["max_num_seqs"] == 64  # type: ignore[index]
    assert labels(factory, cid)[4:] == [f"r1.c1.{SEQS_64}.retry1"]
    service.advance_campaigns(factory, settings)
    assert len(asked) == 1  # waiting on the retry: nothing to ask


def test_a_lost_incumbent_is_queued_again_with_its_lost_candidates_as_variants(
    factory: sessionmaker[Session],  # noqa: F811
    settings: Settings,  # noqa: F811
) -> None:
    cid = create(factory, settings)
    step(factory, settings, cid)
    launch = _fail("launch failed: TimeoutError: placement group not ready in 60 s")
    _finish(factory, cid, {"r1.c1.incumbent": _lose, f"r1.c1.{APC}": launch})
    row = step(factory, settings, cid)
    assert row.result["retry_reasons"][f"r1.c1.{APC}"] == {
        "kind": "lost",
        "why": "lost to the infrastructure: launch failed: TimeoutError: placement group not "
        "ready in 60 s",
    }
    with factory() as s:
        runs = {r.campaign_label: r for r in CampaignRepository(s).runs(cid)}
        inc, cand = runs["r1.c1.incumbent.retry1"], runs[f"r1.c1.{APC}.retry1"]
        assert inc.experiment_id == cand.experiment_id and inc.is_baseline
        assert cand.changes == {"engine_args.enable_prefix_caching": True}
        assert cand.explicit_engine_args == runs[f"r1.c1.{APC}"].explicit_engine_args


def test_a_run_failed_by_its_configuration_is_not_measured_again(
    factory: sessionmaker[Session],  # noqa: F811
    settings: Settings,  # noqa: F811
) -> None:
    cid = create(factory, settings)
    step(factory, settings, cid)
    oom = _fail("the vLLM engine died during run x: CUDA out of memory")
    _finish(factory, cid, {f"r1.c1.{SEQS_64}": oom})
    row = step(factory, settings, cid)
    assert not any(".retry" in label for label in labels(factory, cid))
    reasons = {c["label"]: (c["outcome"], c["reason"]) for c in row.result["candidates"]}
    assert reasons[SEQS_64] == ("failed", f"run r1.c1.{SEQS_64} failed")
    assert row.result["retried"] == {} and row.result["retry_reasons"] == {}


def _run(status: str = "failed", **kw: object) -> Run:
    return Run(status=status, engine_info=kw.pop("engine_info", {}), **kw)


@pytest.mark.parametrize(
    ("run", "lost"),
    [
        (_run(engine_info={"recovered": {"requests": 0}}, error="run supervisor died"), True),
        (_run(error="launch failed: TimeoutError: not ready"), True),
        (_run(status_reason="launch failed: RayActorError"), True),
        (_run(error="node rank 1 (10.0.0.2, Ray node abc) was lost: RayError: gone"), True),
        (_run(error="supervisor error: node rank 1 (10.0.0.2) was lost: RayError"), True),
        (_run(error="the vLLM engine died during run r: CUDA out of memory"), False),
        (_run(error="vLLM did not become healthy within 600 s"), False),
        (_run(error="the cluster has 2 GPUs; tensor_parallel_size 4 cannot be placed"), False),
        (_run(status="cancelled", error="launch failed: x"), False),
        (_run(status="blocked", error="node parity failed"), False),
        (_run(status="succeeded", engine_info={"recovered": {}}), False),
    ],
)
def test_lost_to_infrastructure_tells_a_lost_run_from_a_failed_configuration(
    run: Run, lost: bool
) -> None:
    assert lost_to_infrastructure(run) is lost
    loss = loss_of(run)
    assert (loss is not None) is lost
    if loss is not None:  # how it was lost: the reason or error that says so
        assert loss in (run.status_reason, run.error)


T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def test_wall_time_sums_the_runs_phases_and_counts_a_shared_wait_once() -> None:
    campaign = Campaign(created_at=_at(0))
    first = _run(
        status="succeeded",
        created_at=_at(10),
        claimed_at=_at(40),
        finished_at=_at(100),
        engine_info={"server_reused": False},
        timings={"startup_s": 20.0, "warmup_s": 2.0, "measure_s": 30.0, "total_s": 55.0},
    )
    mate = _run(  # its batch mate on the same server: the same wait, no start
        status="succeeded",
        created_at=_at(10),
        claimed_at=_at(40),
        finished_at=_at(130),
        engine_info={"server_reused": True},
        timings={"startup_saved_s": 20.0, "measure_s": 25.0, "stop_s": 3.0, "total_s": 30.0},
    )
    lost = _run(
        created_at=_at(130),
        claimed_at=_at(150),
        finished_at=_at(170),
        engine_info={"recovered": {}},
        error="orchestrator restarted",
    )
    queued = _run(status="queued", created_at=_at(190))
    got = wall_time(campaign, [first, mate, lost, queued], now=_at(200))
    assert got == {
        "elapsed_s": 200.0,
        "between_s": 10.0 + 20.0,  # 0-10 before the first run, 170-190 between cycles
        "queue_wait_s": 30.0 + 20.0 + 10.0,  # 10-40 (both runs), 130-150, 190-now
        "startup_s": 20.0,
        "warmup_s": 2.0,
        "measure_s": 55.0,
        "stop_s": 3.0,
        "other_s": 3.0 + 2.0,  # total_s minus the timed phases
        "lost_s": 20.0,
        "server_starts": 1,
        "servers_reused": 1,
    }


def test_a_campaigns_result_says_where_its_wall_time_went(
    factory: sessionmaker[Session],  # noqa: F811
    settings: Settings,  # noqa: F811
) -> None:
    cid = create(factory, settings)
    step(factory, settings, cid)
    with unit_of_work(factory) as s:
        for i, run in enumerate(CampaignRepository(s).runs(cid)):
            record_fake_result(s, run, surface(run))
            run.engine_info = {"server_reused": i % 2 == 1}
            run.timings = {"startup_s": 10.0, "measure_s": 4.0, "total_s": 15.0}
    row = step(factory, settings, cid)
    spent = row.result["wall_time"]
    assert (spent["startup_s"], spent["measure_s"], spent["other_s"]) == (40.0, 16.0, 4.0)
    assert (spent["server_starts"], spent["servers_reused"]) == (2, 2)
    assert spent["elapsed_s"] > 0 and spent["queue_wait_s"] > 0  # cycle 2 waits now
    with unit_of_work(factory) as s:
        cancelled = service.cancel_campaign(s, cid)
        assert cancelled.result["wall_time"]["elapsed_s"] >= spent["elapsed_s"]


def _flag(how: str, metric: str = METRIC) -> Callable[[Session, Run], None]:
    """End ``run`` succeeded with its objective, but flagged by a finding: ``warm`` (its
    measured requests began on a warm prefix cache) or ``bursts`` (token bursts, which
    taint TPOT and ITL, not this campaign's objective)."""

    def end(s: Session, run: Run) -> None:
        record_fake_result(s, run, surface(run), metric)
        if how == "warm":
            run.engine_info = {
                **(run.engine_info or {}),
                "cache_contamination": {"status": "contaminated"},
            }
        else:
            s.add(RunMetric(run_id=run.id, name="itl_burst_fraction", value=0.9))
        if how == "lag":  # bursts and the client's TTFT 50 ms above the server's
            s.add(RunMetric(run_id=run.id, name="mean_ttft_client_minus_server_ms", value=50.0))
        s.flush()

    return end


def test_a_measurement_a_finding_flags_gives_no_verdict_and_is_measured_again(
    factory: sessionmaker[Session],  # noqa: F811
    settings: Settings,  # noqa: F811
) -> None:
    """A number a finding flags gives no verdict anywhere: the campaign does not decide
    from a run whose objective a finding taints (here a warm prefix cache, which taints
    every number); it measures that run again, saying why. A flag on another quantity
    (token bursts: TPOT and ITL) leaves the objective as measured."""
    cid = create(factory, settings)
    step(factory, settings, cid)
    warm, bursty = f"r1.c1.{SEQS_64}", f"r1.c1.{APC}"
    _finish(factory, cid, {warm: _flag("warm"), bursty: _flag("bursts")})
    row = step(factory, settings, cid)
    assert row.result["retried"] == {warm: f"{warm}.retry1"}
    # measured again because a finding flagged its objective, not lost: it says which
    (why,) = row.result["retry_reasons"].values()
    assert why["kind"] == "flagged"
    assert why["why"].startswith(
        "a finding flagged its objective: warm_cache: measured on a warm prefix cache"
    )
    assert labels(factory, cid)[4:] == [f"{warm}.retry1"]
    # flagged every time: past the retries the candidate is unknown, with the finding
    for attempt in (1, 2):
        _finish(factory, cid, {f"{warm}.retry{attempt}": _flag("warm")})
        row = step(factory, settings, cid)
    reason = row.result["unmeasured"][f"{warm}.retry2"]
    assert reason.startswith(f"run {warm}.retry2 was flagged by a finding (")
    assert "warm prefix cache" in reason and reason.endswith("3 times; not measured")


def test_token_bursts_with_the_clients_ttft_lag_withhold_a_ttft_objective(
    factory: sessionmaker[Session],  # noqa: F811
    settings: Settings,  # noqa: F811
) -> None:
    """The same run flags (token bursts, the client's TTFT 50 ms above the server's) taint
    a TTFT objective: that run is measured again, with the finding."""
    cid = create(factory, settings, objective={"metric": "median_ttft_ms"})  # lower: fine
    step(factory, settings, cid)
    lagging = f"r1.c1.{SEQS_64}"
    ttft = "median_ttft_ms"
    _finish(factory, cid, {lagging: _flag("lag", ttft)}, metric=ttft)
    row = step(factory, settings, cid)
    assert row.result["retried"] == {lagging: f"{lagging}.retry1"}
    assert row.result["retry_reasons"] == {
        lagging: {
            "kind": "flagged",
            "why": "a finding flagged its objective: client_ttft_lag: token bursts: the "
            "client's TTFT is 50 ms above the server's",
        }
    }


def test_waiting_for_devices_leaves_out_the_time_the_campaigns_own_runs_held_them() -> None:
    """A cycle of two runs on one slot: the second waits 10-70 while the first runs 10-70,
    then runs 70-130; that wait is the first run's time, not a wait for devices, so the
    wait is only the 5 s before the first was claimed, and the wait plus the runs' time on
    their devices is the campaign's elapsed time."""
    campaign = Campaign(created_at=_at(0))
    first = _run(status="succeeded", created_at=_at(5), claimed_at=_at(10), finished_at=_at(70))
    second = _run(status="succeeded", created_at=_at(5), claimed_at=_at(70), finished_at=_at(130))
    got = wall_time(campaign, [first, second], now=_at(135))
    assert got["queue_wait_s"] == 5.0
