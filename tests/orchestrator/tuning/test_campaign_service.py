"""Tuning campaigns stored and advanced (orchestrator.tuning) against a real Postgres.

The runs' results are **fake recorded results** (a test double): the test writes each
queued run's status and its stored objective metric directly (``record_fake_result``)
from a known surface of the configuration, instead of running an engine. A fresh
database per module keeps a dispatcher of another test from advancing these campaigns.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import create_engine, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.campaigns.outcomes import PlannedRun, Role
from orchestrator.core.db import normalize_url, unit_of_work, upgrade_to_head
from orchestrator.core.errors import CampaignInvalidError, ConflictError, EngineUnavailableError
from orchestrator.core.models import Campaign, Experiment, Run, RunMetric
from orchestrator.core.repositories import CampaignRepository, RunRepository
from orchestrator.core.settings import Settings
from orchestrator.core.states import RunStatus
from orchestrator.dispatch.dispatcher import Dispatcher
from orchestrator.experiments.engine_catalog import load_catalog
from orchestrator.experiments.service import parse_spec, validate_spec
from orchestrator.tuning import cycles, service
from orchestrator.tuning.campaign_request import CampaignRequest
from orchestrator.tuning.intake import accept_campaign
from tests.api.conftest import settings as settings  # noqa: F401 - fixture
from tests.conftest import fresh_database
from tests.orchestrator.dispatch.test_loops import StubBackend

METRIC = "output_throughput"


@pytest.fixture(scope="module")
def database(server_url: str) -> Iterator[str]:
    with fresh_database(server_url) as url:
        upgrade_to_head(url)
        yield url


@pytest.fixture
def factory(database: str) -> Iterator[sessionmaker[Session]]:
    engine = create_engine(normalize_url(database))
    try:
        yield sessionmaker(bind=engine, expire_on_commit=False)
    finally:
        engine.dispose()


def campaign_doc(**kw: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": "tune apc",
        "model": "tiny",
        "baseline": {
            "engine_args": {"max_model_len": 1024, "enable_prefix_caching": False},
            "workload": {"num_requests": 4, "prefix_tokens": 128, "seed": 3},
        },
        "objective": {"metric": METRIC},
        "space": [
            {"name": "engine_args.enable_prefix_caching", "levels": [False, True]},
            {"name": "engine_args.max_num_seqs", "levels": [64, 128, 256], "start": 128},
        ],
        "budget": {"max_runs": 40},
        "rule": {"min_repeats": 2, "max_repeats": 3},
    }
    doc.update(kw)
    return doc


def surface(run: Run) -> float:
    """The fake objective of a run: prefix caching x1.30, max_num_seqs 64 x0.90, 256 inert,
    with +-1 % noise seeded by the run's label (the same label, the same value)."""
    args = run.explicit_engine_args or {}
    value = 1000.0 * (1.30 if args.get("enable_prefix_caching") else 1.0)
    value *= 0.90 if args.get("max_num_seqs") == 64 else 1.0
    digest = hashlib.sha256(str(run.campaign_label).encode()).digest()
    return value * (1 + 0.01 * (digest[0] / 255 * 2 - 1))


def record_fake_result(
    session: Session, run: Run, value: float | None, metric: str = METRIC
) -> None:
    """Test double of a run's result: the state machine to ``succeeded`` with the objective
    stored as its summary metric ``metric`` (``None``: the run failed)."""
    repo = RunRepository(session)
    repo.transition(run, RunStatus.PREPARING)
    if value is None:
        repo.transition(run, RunStatus.FAILED, "fake failure")
        return
    repo.transition(run, RunStatus.RUNNING)
    session.add(RunMetric(run_id=run.id, name=metric, value=value))
    repo.transition(run, RunStatus.SUCCEEDED)
    session.flush()


#: How a test records a queued run's fake result (default: its surface value).
Record = Callable[[Session, Run], None]


def finish_queued(
    factory: sessionmaker[Session],
    campaign_id: str,
    limit: int | None = None,
    record: Record | None = None,
) -> int:
    """Record fake results for the campaign's queued runs (at most ``limit``), each as
    ``record`` does (default: :func:`surface`'s value as the objective)."""
    with unit_of_work(factory) as s:
        queued = [r for r in CampaignRepository(s).runs(campaign_id) if r.status == "queued"][
            :limit
        ]
        for run in queued:
            if record is None:
                record_fake_result(s, run, surface(run))
            else:
                record(s, run)
        return len(queued)


def create(factory: sessionmaker[Session], settings: Settings, **kw: Any) -> str:  # noqa: F811
    with unit_of_work(factory) as s:
        return accept_campaign(s, settings, campaign_doc(**kw)).id


def step(factory: sessionmaker[Session], settings: Settings, campaign_id: str) -> Campaign:  # noqa: F811
    with unit_of_work(factory) as s:
        row = service.advance(s, settings, campaign_id)
        assert row is not None
        return row


def labels(factory: sessionmaker[Session], campaign_id: str) -> list[str]:
    with factory() as s:
        return [str(r.campaign_label) for r in CampaignRepository(s).runs(campaign_id)]


def drive(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
    campaign_id: str,
    record: Record | None = None,
) -> Campaign:
    """Advance the campaign, recording its queued runs' fake results as ``record`` does
    (:func:`finish_queued`), until it ends."""
    for _ in range(200):
        row = step(factory, settings, campaign_id)
        if row.status != "running":
            return row
        finish_queued(factory, campaign_id, record=record)
    raise AssertionError("the campaign did not end")


# ---- create ------------------------------------------------------------------------------


def test_a_campaign_is_stored_queued_with_its_request(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    cid = create(factory, settings)
    with factory() as s:
        row = CampaignRepository(s).get(cid)
        assert row is not None and row.status == "queued" and row.result == {}
        assert row.request["objective"] == {"metric": METRIC, "direction": "higher"}
        assert row.request["space"][1]["levels"] == [64, 128, 256]
        assert [v["start"] for v in row.request["space"]] == [False, 128]  # as resolved
        assert CampaignRepository(s).runs(cid) == []  # the dispatcher queues them
        assert cid in CampaignRepository(s).advancing_ids()


@pytest.mark.parametrize(
    ("change", "loc", "kind"),
    [
        (
            {"space": [{"name": "engine_args.max_num_seq", "levels": [1, 2], "start": 1}]},
            ["body", "space", 0, "levels", 0],
            "unknown_engine_arg",
        ),
        (
            {"space": [{"name": "engine_args.enable_prefix_caching", "levels": ["x", True]}]},
            ["body", "space", 0, "levels", 0],
            None,
        ),
        (
            {"space": [{"name": "engine_args.max_num_seqs", "levels": [64, 128]}]},
            ["body", "space", 0, "start"],
            "start_missing",
        ),
        (
            {"space": [{"name": "engine_args.max_num_seqs", "levels": [64, 128], "start": 3}]},
            ["body", "space", 0, "start"],
            "start_not_a_level",
        ),
        (
            {
                "space": [
                    {"name": "engine_args.enable_prefix_caching", "levels": [False, True]},
                    {"name": "engine_args.max_model_len", "levels": [512, 1024], "start": 512},
                ]
            },
            ["body", "space", 1, "start"],
            "start_conflicts_baseline",
        ),
        ({"objective": {"metric": "ttft_ms.p50"}}, ["body", "objective", "metric"], None),
        (
            {"objective": {"metric": "median_ttft_ms", "direction": "higher"}},
            ["body", "objective", "direction"],
            "objective_direction",
        ),
        ({"budget": {"max_runs": 5}}, ["body", "budget", "max_runs"], "budget_too_small"),
        ({"space": []}, ["body", "space"], None),
        (
            {"constraints": [{"metric": "ttft_p99", "max": 500}]},
            ["body", "constraints", 0, "metric"],
            "constraint_unknown",
        ),
        ({"constraints": [{"metric": "p99_ttft_ms"}]}, ["body", "constraints", 0], None),
        (
            {"constraints": [{"metric": "p99_ttft_ms", "min": 9, "max": 1}]},
            ["body", "constraints", 0],
            None,
        ),
        (
            {"space": [{"name": "engine_args.max_num_seqs", "levels": [64], "start": 64}]},
            ["body", "space", 0, "levels"],
            None,
        ),
    ],
)
def test_bad_campaigns_are_refused_with_their_fields_and_nothing_is_stored(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
    change: dict[str, Any],
    loc: list[Any],
    kind: str | None,
) -> None:
    with factory() as s:
        before = s.scalar(select(func.count()).select_from(Campaign))
    with pytest.raises(CampaignInvalidError) as info, unit_of_work(factory) as s:
        accept_campaign(s, settings, campaign_doc(**change))
    assert info.value.code == "campaign_invalid"
    found = [e for e in info.value.errors if e["loc"] == loc]
    assert found, info.value.errors
    if kind is not None:
        assert found[0]["type"] == kind
    with factory() as s:
        assert s.scalar(select(func.count()).select_from(Campaign)) == before


def test_a_tp_space_refused_for_its_devices_says_how_to_change_tp_alone(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    """TP 1 -> 2 with the devices left to TP x PP changes the devices too (refused as
    two variables); the refusal says to set layout.devices, and doing so is accepted."""
    space = [{"name": "layout.tensor_parallel_size", "levels": [1, 2]}]  # starts at 1
    with pytest.raises(CampaignInvalidError) as info, unit_of_work(factory) as s:
        accept_campaign(s, settings, campaign_doc(space=space))
    (err,) = info.value.errors
    assert err["loc"] == ["body", "space", 0] and err["type"] == "more_than_one_variable"
    assert "Set layout.devices in the baseline (e.g. 2," in err["msg"]
    doc = campaign_doc(space=space)
    doc["baseline"]["layout"] = {"devices": 2}
    with unit_of_work(factory) as s:
        assert accept_campaign(s, settings, doc).id


def test_the_first_rounds_experiment_check_applies(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    """A baseline the experiment checks refuse is the campaign's problem, at its place."""
    doc = campaign_doc()
    doc["baseline"]["engine_args"]["no_such_arg"] = 1
    with pytest.raises(CampaignInvalidError) as info, unit_of_work(factory) as s:
        accept_campaign(s, settings, doc)
    assert any(e["loc"][:3] == ["body", "baseline", "engine_args"] for e in info.value.errors), (
        info.value.errors
    )


# ---- advance -----------------------------------------------------------------------------


def test_advancing_queues_one_cycle_as_a_one_variable_experiment(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    cid = create(factory, settings)
    row = step(factory, settings, cid)
    assert row.status == "running"
    assert labels(factory, cid) == [
        "r1.c1.incumbent",
        "r1.c1.engine_args.enable_prefix_caching=true",
        "r1.c1.engine_args.max_num_seqs=64",
        "r1.c1.engine_args.max_num_seqs=256",
    ]
    with factory() as s:
        runs = CampaignRepository(s).runs(cid)
        assert {r.experiment_id for r in runs} == {runs[0].experiment_id}
        exp = s.get(Experiment, runs[0].experiment_id)
        assert exp is not None and exp.name == "tune apc r1.c1"
        assert runs[0].is_baseline and runs[0].explicit_engine_args["max_num_seqs"] == 128
        for run in runs[1:]:  # each candidate one variable away from the incumbent
            assert run.reference_variant == "baseline"
            assert len(run.changes) == 1 and run.variable in run.changes
        assert all(r.status == "queued" for r in runs)
        assert row.result["pending"] == labels(factory, cid)
        assert set(row.result["runs"]) == set(labels(factory, cid))
        assert [c["outcome"] for c in row.result["candidates"]] == ["measuring"] * 3


def test_advancing_twice_creates_no_duplicate_run(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    cid = create(factory, settings)
    step(factory, settings, cid)
    first = labels(factory, cid)
    step(factory, settings, cid)
    step(factory, settings, cid)
    assert labels(factory, cid) == first
    # half a cycle recorded: still waiting, nothing new
    finish_queued(factory, cid, limit=2)
    step(factory, settings, cid)
    assert labels(factory, cid) == first
    # the cycle recorded: the next one, once, however often it is advanced
    finish_queued(factory, cid)
    step(factory, settings, cid)
    step(factory, settings, cid)
    second = labels(factory, cid)
    assert len(second) == 8 and len(set(second)) == 8
    assert second[4:] == [label.replace("r1.c1", "r1.c2") for label in first]


def test_the_database_refuses_a_second_run_with_the_same_label(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    cid = create(factory, settings)
    step(factory, settings, cid)
    with pytest.raises(IntegrityError), unit_of_work(factory) as s:
        runs = CampaignRepository(s).runs(cid)
        runs[1].campaign_label = runs[0].campaign_label
        s.flush()


def test_a_campaign_runs_to_its_result(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    cid = create(factory, settings)
    row = drive(factory, settings, cid)
    assert row.status == "succeeded", row.status_reason
    result = row.result
    assert result["phase"] == "done"
    assert [(s["variable"], s["to_level"]) for s in result["path"]] == [
        ("engine_args.enable_prefix_caching", True)
    ]
    assert result["incumbent"] == {
        "engine_args.enable_prefix_caching": True,
        "engine_args.max_num_seqs": 128,
    }
    outcomes = {(c["round"], c["label"]): c["outcome"] for c in result["candidates"]}
    assert outcomes[(1, "engine_args.enable_prefix_caching=true")] == "adopted"
    assert outcomes[(1, "engine_args.max_num_seqs=64")] == "worse"
    assert result["confirmation"] is not None and result["confirmation"]["agrees"]
    assert result["pending"] == []
    all_labels = labels(factory, cid)
    assert len(all_labels) == len(set(all_labels)) == result["runs_used"] <= 40
    assert any(label.startswith("confirm.c") for label in all_labels)
    with factory() as s:  # the confirmation: the start vs the final, one linked change
        runs = CampaignRepository(s).runs(cid)
        confirm = [r for r in runs if r.campaign_label == "confirm.c1.final"]
        assert confirm[0].changes == {"engine_args.enable_prefix_caching": True}
    assert "1 change(s) adopted" in (row.status_reason or "")
    # a campaign that ended is left as it is
    assert step(factory, settings, cid).result == result


def test_a_restart_continues_from_the_recorded_runs(
    factory: sessionmaker[Session],
    settings: Settings,
    database: str,  # noqa: F811
) -> None:
    """A campaign interrupted mid-way and advanced by a new service (a new engine and
    session factory over the same database) ends exactly as one never interrupted."""
    straight = drive(factory, settings, create(factory, settings))

    cid = create(factory, settings)
    for _ in range(4):  # part of the way: some cycles recorded, one queued
        step(factory, settings, cid)
        finish_queued(factory, cid)
    step(factory, settings, cid)
    before = labels(factory, cid)
    factory.kw["bind"].dispose()  # the service is gone

    engine = create_engine(normalize_url(database))
    try:
        restarted = sessionmaker(bind=engine, expire_on_commit=False)
        row = step(restarted, settings, cid)  # nothing lost, nothing repeated
        assert labels(restarted, cid) == before
        row = drive(restarted, settings, cid)
        after = labels(restarted, cid)
    finally:
        engine.dispose()
    assert after[: len(before)] == before and len(after) == len(set(after))
    assert row.status == "succeeded"
    for key in ("path", "candidates", "confirmation", "incumbent", "runs_used"):
        assert row.result[key] == straight.result[key], key


def test_a_failed_run_is_recorded_as_failed(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    cid = create(factory, settings)
    step(factory, settings, cid)
    with unit_of_work(factory) as s:
        for run in CampaignRepository(s).runs(cid):
            failed = run.campaign_label == "r1.c1.engine_args.max_num_seqs=64"
            record_fake_result(s, run, None if failed else surface(run))
    row = step(factory, settings, cid)
    reasons = {c["label"]: c["reason"] for c in row.result["candidates"] if c["round"] == 1}
    assert reasons["engine_args.max_num_seqs=64"] == "run r1.c1.engine_args.max_num_seqs=64 failed"
    assert "r1.c2.engine_args.max_num_seqs=64" not in labels(factory, cid)
    assert "r1.c2.engine_args.max_num_seqs=256" in labels(factory, cid)


def test_advance_campaigns_advances_every_running_campaign(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    cid = create(factory, settings)
    assert service.advance_campaigns(factory, settings) >= 1
    assert len(labels(factory, cid)) == 4
    service.advance_campaigns(factory, settings)
    assert len(labels(factory, cid)) == 4


# ---- cancel ------------------------------------------------------------------------------


def test_cancel_ends_the_queued_runs_and_the_campaign(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    cid = create(factory, settings)
    step(factory, settings, cid)
    finish_queued(factory, cid, limit=1)
    with unit_of_work(factory) as s:
        row = service.cancel_campaign(s, cid)
        assert row.status == "cancelled"
        outcomes = {(c["outcome"], c["reason"]) for c in row.result["candidates"]}
        assert outcomes == {("unknown", "the campaign was cancelled before it was decided")}
    with factory() as s:
        statuses = [r.status for r in CampaignRepository(s).runs(cid)]
    assert statuses == ["succeeded", "cancelled", "cancelled", "cancelled"]
    assert step(factory, settings, cid).status == "cancelled"  # no longer advanced
    assert len(labels(factory, cid)) == 4
    with pytest.raises(ConflictError), unit_of_work(factory) as s:
        service.cancel_campaign(s, cid)


# ---- what the checks say at an advance ----------------------------------------------------


def test_a_cycle_the_experiment_checks_refuse_fails_the_campaign(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    cid = create(factory, settings)
    with unit_of_work(factory) as s:  # what was valid at submission no longer is
        row = CampaignRepository(s).get(cid)
        assert row is not None
        request = dict(row.request)
        request["baseline"] = {**request["baseline"], "engine_args": {"no_such_arg": 1}}
        row.request = request
    row = step(factory, settings, cid)
    assert row.status == "failed"
    assert (row.status_reason or "").startswith("spec_invalid:")
    assert labels(factory, cid) == []  # nothing stored of the refused cycle
    assert step(factory, settings, cid).status == "failed"


def test_a_campaign_the_core_cannot_replay_fails(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    cid = create(factory, settings)
    with unit_of_work(factory) as s:
        row = CampaignRepository(s).get(cid)
        assert row is not None
        space = [dict(v) for v in row.request["space"]]
        space[1]["start"] = 512  # not one of its levels
        row.request = {**row.request, "space": space}
    row = step(factory, settings, cid)
    assert row.status == "failed" and (row.status_reason or "").startswith("campaign_broken:")


def test_a_check_that_cannot_be_done_now_is_retried(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    cid = create(factory, settings)

    def engine_down() -> Any:
        raise EngineUnavailableError("the engine environment does not answer")

    with pytest.raises(EngineUnavailableError), unit_of_work(factory) as s:
        service.advance(s, settings, cid, catalog=engine_down)
    with factory() as s:
        row = CampaignRepository(s).get(cid)
        assert row is not None and row.status == "queued"
    assert step(factory, settings, cid).status == "running"  # the next advance goes on
    assert len(labels(factory, cid)) == 4


def test_the_dispatchers_campaigns_loop_advances_them(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    cid = create(factory, settings)
    dispatcher = Dispatcher(settings, factory, StubBackend())  # type: ignore[arg-type]
    assert dispatcher.loops["campaigns"].interval_s == 5.0
    dispatcher.loops["campaigns"].turn()
    assert len(labels(factory, cid)) == 4
    finish_queued(factory, cid)
    dispatcher.loops["campaigns"].turn()
    assert len(labels(factory, cid)) == 8


def test_a_lower_is_better_objective(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    """TTFT p50 (lower is better): the fake TTFT is the inverse of the surface."""
    cid = create(factory, settings, objective={"metric": "median_ttft_ms"})
    row = drive(
        factory,
        settings,
        cid,
        lambda s, run: record_fake_result(s, run, 1e5 / surface(run), "median_ttft_ms"),
    )
    assert row.status == "succeeded" and row.request["objective"]["direction"] == "lower"
    assert [s["to_level"] for s in row.result["path"]] == [True]
    assert row.result["path"][0]["gain"]["estimate"] > 0  # positive is better


def test_a_campaign_where_nothing_pays_keeps_the_start_without_confirmation(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    space = [{"name": "engine_args.max_num_seqs", "levels": [128, 256], "start": 128}]
    cid = create(factory, settings, space=space)
    row = drive(factory, settings, cid)
    assert row.status == "succeeded"
    assert row.status_reason == "no candidate paid: the starting configuration stays"
    assert row.result["path"] == [] and row.result["confirmation"] is None
    assert row.result["incumbent"] == {"engine_args.max_num_seqs": 128}
    assert not any(label.startswith("confirm") for label in labels(factory, cid))
    (candidate,) = row.result["candidates"]
    assert candidate["outcome"] in ("inert", "undecided")


def test_the_loop_asks_vllm_about_a_cycle_before_the_locked_advance(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cycle about to be queued is prechecked (no connection held) once; a campaign
    waiting on its runs is not."""
    cid = create(factory, settings)
    asked: list[str] = []
    monkeypatch.setattr(service, "precheck", lambda _s, _c, doc: asked.append(doc["name"]))
    with factory() as s:
        others = [i for i in CampaignRepository(s).advancing_ids() if i != cid]
    with unit_of_work(factory) as s:  # only this campaign advances here
        for other in others:
            service.cancel_campaign(s, other)
    service.advance_campaigns(factory, settings)
    assert asked == ["tune apc r1.c1"]
    service.advance_campaigns(factory, settings)
    assert asked == ["tune apc r1.c1"]  # waiting on its runs: nothing to ask
    finish_queued(factory, cid)
    service.advance_campaigns(factory, settings)
    assert asked == ["tune apc r1.c1", "tune apc r1.c2"]
    assert len(labels(factory, cid)) == 8


def test_a_campaign_advanced_elsewhere_now_is_skipped(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    """Two orchestrators: the one that holds the campaign's row advances it; the other
    skips it (SKIP LOCKED) instead of queueing the same cycle."""
    cid = create(factory, settings)
    with factory() as holder:
        assert CampaignRepository(holder).get(cid, for_update=True) is not None
        with unit_of_work(factory) as s:
            assert service.advance(s, settings, cid) is None
        holder.rollback()
    assert labels(factory, cid) == []
    step(factory, settings, cid)
    assert len(labels(factory, cid)) == 4


def test_a_cycle_stored_in_part_fails_the_campaign(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    """A cycle's runs are stored together; one of them gone (its experiment's run deleted
    by hand) is refused rather than guessed at."""
    cid = create(factory, settings)
    step(factory, settings, cid)
    with unit_of_work(factory) as s:
        s.delete(CampaignRepository(s).runs(cid)[-1])
    row = step(factory, settings, cid)
    assert row.status == "failed"
    assert (row.status_reason or "").startswith("campaign_cycle_partial:")


def test_a_confirmation_of_several_steps_passes_the_experiment_checks(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    """The confirmation changes every adopted variable at once: one linked factor, which
    the one-variable rule accepts as one variable."""
    request = CampaignRequest.model_validate(campaign_doc())
    start = request.start()
    final = {**start, "engine_args.enable_prefix_caching": True, "engine_args.max_num_seqs": 256}
    space = request.core_space()
    cycle = [
        PlannedRun("confirm.c1.start", start, Role.START, 0, 1, None, space.server_key(start)),
        PlannedRun("confirm.c1.final", final, Role.FINAL, 0, 1, None, space.server_key(final)),
    ]
    row = Campaign(id="c" * 36, name="tune apc", request={}, result={})
    doc = cycles.cycle_doc(row, request, cycle)
    assert doc["factors"] == [
        {
            "name": "final",
            "paths": ["engine_args.enable_prefix_caching", "engine_args.max_num_seqs"],
            "levels": [
                {"engine_args.enable_prefix_caching": True, "engine_args.max_num_seqs": 256}
            ],
        }
    ]
    catalog = load_catalog(settings)
    with factory() as s:
        spec = parse_spec(doc, settings, catalog)
        validate_spec(s, settings, spec, catalog)  # raises on any problem


def test_a_constraint_makes_a_paying_candidate_that_breaks_it_infeasible(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    """The stored runs' p99 TTFT is the constraint's metric: prefix caching pays most on
    the objective but its p99 TTFT breaks the SLO, so it ends infeasible (with the breach)
    and is never adopted; the campaign goes on from the start."""
    slo = {"metric": "p99_ttft_ms", "max": 500}
    cid = create(factory, settings, constraints=[slo])
    for _ in range(40):
        row = step(factory, settings, cid)
        if row.status in ("succeeded", "failed") or row.result.get("phase") != "rounds":
            break
        with unit_of_work(factory) as s:
            for run in CampaignRepository(s).runs(cid):
                if run.status == "queued":
                    record_fake_result(s, run, surface(run))
                    apc = (run.explicit_engine_args or {}).get("enable_prefix_caching")
                    s.add(RunMetric(run_id=run.id, name="p99_ttft_ms", value=800 if apc else 300))
    first = [c for c in row.result["candidates"] if c["round"] == 1]
    apc = next(c for c in first if c["label"] == "engine_args.enable_prefix_caching=true")
    assert apc["outcome"] == "infeasible"
    assert apc["reason"] == "breaks p99_ttft_ms <= 500: median 800 over 2 runs"
    assert all(s["variable"] != "engine_args.enable_prefix_caching" for s in row.result["path"])
    assert row.request["constraints"] == [{**slo, "min": None}]


def test_a_device_hour_budget_counts_each_runs_devices_from_claim_to_end(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    """Each run holds its 1 device for 360 s (a tenth of a device-hour): a budget of 1.5
    device-hours affords 15 runs, the confirmation's 6 among them, so the rounds stop early
    with their candidates unknown, and the confirmation runs."""
    cid = create(factory, settings, budget={"max_runs": 40, "max_device_hours": 1.5})

    def held_360_s(s: Session, run: Run) -> None:
        record_fake_result(s, run, surface(run))
        assert run.finished_at is not None
        run.claimed_at = run.finished_at - timedelta(seconds=360)

    row = drive(factory, settings, cid, held_360_s)
    assert row.status == "succeeded", row.result
    assert row.result["runs_used"] <= 15
    assert row.result["confirmation"] is not None, (row.result["candidates"], row.result["path"])
    reasons = [c["reason"] for c in row.result["candidates"] if c["outcome"] == "unknown"]
    assert reasons and all(r.startswith("the device-hour budget ran out") for r in reasons)


def test_a_wall_time_budget_counts_from_the_submission_to_each_runs_end(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    """Each run ends 6 minutes after the one before it (a tenth of an hour a run, the
    first 6 minutes after the submission): a budget of 1.5 wall-clock hours affords 15
    runs, the confirmation's 6 among them, so the rounds stop early with their candidates
    unknown saying which budget ran out, and the confirmation runs."""
    cid = create(factory, settings, budget={"max_runs": 40, "max_wall_hours": 1.5})
    with unit_of_work(factory) as s:
        began = CampaignRepository(s).get(cid).created_at  # type: ignore[union-attr]
    ended = [0]

    def six_minutes_apart(s: Session, run: Run) -> None:
        record_fake_result(s, run, surface(run))
        ended[0] += 1
        run.finished_at = began + timedelta(minutes=6 * ended[0])

    row = drive(factory, settings, cid, six_minutes_apart)
    assert row.status == "succeeded", row.result
    assert row.result["runs_used"] <= 15
    assert row.result["confirmation"] is not None, (row.result["candidates"], row.result["path"])
    reasons = [c["reason"] for c in row.result["candidates"] if c["outcome"] == "unknown"]
    assert reasons and all(r.startswith("the wall-time budget ran out") for r in reasons)
    assert f"{len(reasons)} candidate(s) left undecided (the wall-time budget ran out" in (
        row.status_reason or ""
    )


def test_a_per_device_objective_is_the_stored_throughput_over_the_reserved_devices(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    """``output_throughput_per_device`` is read from the stored ``output_throughput``
    divided by the devices each run reserved: a run on TP=2 yields half its throughput per
    device; on one device each, the campaign decides as on the throughput itself."""
    cid = create(factory, settings, objective={"metric": "output_throughput_per_device"})
    row = drive(factory, settings, cid)
    assert row.status == "succeeded", row.status_reason
    assert [s["variable"] for s in row.result["path"]] == ["engine_args.enable_prefix_caching"]
    with factory() as s:
        run = CampaignRepository(s).runs(cid)[0]
        metrics = {run.id: {"output_throughput": 1000.0}}
        assert service._objective(run, metrics, "output_throughput_per_device") == 1000.0
        run.layout = {**(run.layout or {}), "tensor_parallel_size": 2}
        assert service._objective(run, metrics, "output_throughput_per_device") == 500.0
        assert service._objective(run, metrics, "output_throughput") == 1000.0


def test_a_j_per_token_run_without_the_energy_reading_is_unknown_not_failed(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    """A J/token objective on runs that succeeded without GPU energy telemetry: each run
    is measured again (at most twice), then its candidate ends ``unknown`` with the
    reason; nothing is judged ``failed`` or ``worse`` for a missing reading."""
    cid = create(factory, settings, objective={"metric": "energy_per_output_token_j"})
    row = drive(factory, settings, cid)  # the fake results store output_throughput only
    outcomes = {c["outcome"] for c in row.result["candidates"] if c["round"] == 1}
    assert outcomes == {"unknown"}, row.result["candidates"]
    assert row.result["path"] == []
    why = next(iter(row.result["unmeasured"].values()))
    assert "measured without energy_per_output_token_j (its GPU telemetry" in why, why
    assert "measuring it again would not change" in why
    assert row.result["retried"] == {}  # no run spent on measuring it again
    with factory() as s:
        stored = CampaignRepository(s).get(cid)
        assert stored is not None and stored.request["objective"]["direction"] == "lower"


def test_a_j_per_token_run_whose_telemetry_sampled_too_little_is_measured_again() -> None:
    """A run whose GPU telemetry read the GPUs but got too few samples in its window (a read
    past its timeout on a loaded node) may get them another time: measured again; a run
    without GPU telemetry at all would read the same again: not."""
    from orchestrator.core.models import Run

    metric = "energy_per_output_token_j"
    short = "fewer than 2 usable GPU power/energy samples: energy metrics left out"
    sampled = Run(
        status="succeeded", engine_info={"gpu_telemetry": {"available": True, "notes": [short]}}
    )
    assert service._unread(sampled, metric) == (
        f"measured without {metric} (its GPU telemetry sampled too little: {short})",
        True,
    )
    none = Run(status="succeeded", engine_info={"gpu_telemetry": {"available": False}})
    why, again = service._unread(none, metric) or ("", True)
    assert "read no energy counter" in why and again is False
    assert service._unread(Run(status="failed", engine_info={}), metric) is None


def test_j_per_token_is_refused_on_a_cluster_of_cpus() -> None:
    """An objective or constraint only GPU telemetry gives, on a live CPU cluster: one
    problem per field naming why; a GPU cluster, or one not known yet, is not refused."""
    from orchestrator.experiments.cluster_view import ClusterView
    from orchestrator.tuning.intake import telemetry_problems

    request = CampaignRequest.model_validate(
        campaign_doc(
            objective={"metric": "energy_per_output_token_j"},
            constraints=[{"metric": "energy_per_output_token_j", "max": 0.5}],
        )
    )
    problems = telemetry_problems(request, ClusterView(devices=2, kind="CPU"))
    assert [p["loc"] for p in problems] == [
        ["body", "objective", "metric"],
        ["body", "constraints", 0, "metric"],
    ]
    assert all(p["type"] == "objective_needs_gpu" and "NVML" in p["msg"] for p in problems)
    assert telemetry_problems(request, ClusterView(devices=8, kind="GPU")) == []
    assert telemetry_problems(request, ClusterView()) == []
    plain = CampaignRequest.model_validate(campaign_doc())
    assert telemetry_problems(plain, ClusterView(devices=2, kind="CPU")) == []


CAPACITY = {"slos": {"ttft_ms": {"p50": 500}}, "min": 0.5, "max": 16}
CAPACITY_BASELINE = {
    "engine_args": {"max_model_len": 1024, "enable_prefix_caching": False},
    "workload": {
        "num_requests": 10,
        "prefix_tokens": 128,
        "seed": 3,
        "arrival": "poisson",
        "request_rate": 1.0,
        "concurrency": 64,
    },
}


def test_a_capacity_objective_needs_a_capacity_search_and_the_search_needs_it(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    """``capacity`` without a search, or a search with a latency objective: one 422 each,
    nothing stored; with both, every cycle's experiment carries the search."""
    with pytest.raises(CampaignInvalidError) as no_search:
        create(factory, settings, objective={"metric": "capacity"})
    assert [e["type"] for e in no_search.value.errors] == ["objective_capacity"]
    with pytest.raises(CampaignInvalidError) as wrong_objective:
        create(factory, settings, baseline=CAPACITY_BASELINE, capacity=CAPACITY)
    assert [(e["type"], e["loc"]) for e in wrong_objective.value.errors] == [
        ("objective_capacity", ["body", "capacity"])
    ]
    cid = create(
        factory,
        settings,
        baseline=CAPACITY_BASELINE,
        capacity=CAPACITY,
        objective={"metric": "capacity_per_device"},
    )
    step(factory, settings, cid)
    with factory() as s:
        runs = CampaignRepository(s).runs(cid)
        assert runs
        for run in runs:
            experiment = s.get(Experiment, run.experiment_id)
            assert experiment is not None and experiment.spec["capacity"]["min"] == 0.5


@pytest.mark.parametrize(
    ("status", "retried"),
    [("client_limited", True), ("below_min", False), ("at_least_max", False)],
)
def test_a_capacity_search_without_a_boundary_leaves_its_candidate_unknown(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
    status: str,
    retried: bool,
) -> None:
    """Runs whose search found no boundary (no ``capacity`` stored): their candidates end
    ``unknown`` quoting the search, never ``failed`` or ``worse``; a client-limited search
    is measured again first (a quieter client may find it), a boundary outside the range
    is not (it would be again)."""
    cid = create(
        factory,
        settings,
        baseline=CAPACITY_BASELINE,
        capacity=CAPACITY,
        objective={"metric": "capacity"},
    )

    def no_boundary(s: Session, run: Run) -> None:
        record_fake_result(s, run, 3.0, metric="median_ttft_ms")
        run.capacity = {
            "variable": "request_rate",
            "status": status,
            "note": "at least 4 req/s; the load generator's ceiling here is 4 req/s",
        }

    row = drive(factory, settings, cid, no_boundary)
    first = {c["outcome"] for c in row.result["candidates"] if c["round"] == 1}
    assert first == {"unknown"}, row.result["candidates"]
    why = next(iter(row.result["unmeasured"].values()))
    assert f"the search ended {status} (at least 4 req/s" in why, why
    assert bool(row.result["retried"]) is retried
    # each retry says why: no value of its objective (neither lost nor flagged)
    assert row.result["retry_reasons"].keys() == row.result["retried"].keys()
    for reason in row.result["retry_reasons"].values():
        assert reason["kind"] == "no_value"
        assert reason["why"].startswith(f"measured without a capacity: the search ended {status}")


def test_a_capacity_campaign_decides_from_the_capacity_each_search_found(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    """Searches that found a boundary: the stored ``capacity`` is the objective, and the
    campaign adopts what raises it (prefix caching on the fake surface)."""
    cid = create(
        factory,
        settings,
        baseline=CAPACITY_BASELINE,
        capacity=CAPACITY,
        objective={"metric": "capacity"},
    )
    row = drive(
        factory,
        settings,
        cid,
        lambda s, run: record_fake_result(s, run, surface(run) / 100, metric="capacity"),
    )
    assert row.status == "succeeded", row.status_reason
    assert [s["variable"] for s in row.result["path"]] == ["engine_args.enable_prefix_caching"]
    assert row.result["confirmation"]["agrees"] is True


def test_a_confirmation_that_disagrees_with_the_path_leads_the_status_reason(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    """The rounds adopt prefix caching (+30 %), but the confirmation measures the final
    configuration no better than the start: the campaign ends with the disagreement first
    in its status reason, with both numbers, before the change it adopted."""
    cid = create(factory, settings)

    def unconfirmed(s: Session, run: Run) -> None:
        confirming = str(run.campaign_label).startswith("confirm.")
        record_fake_result(s, run, 1000.0 if confirming else surface(run))

    row = drive(factory, settings, cid, unconfirmed)
    assert row.status == "succeeded"
    assert row.result["confirmation"]["agrees"] is False
    reason = row.status_reason or ""
    assert reason.startswith("the confirmation does NOT agree with the path: the final "), reason
    assert "; 1 change(s) adopted: engine_args.enable_prefix_caching: false -> true" in reason


def test_a_candidate_refused_for_a_derived_change_says_what_to_pin() -> None:
    """The experiment check's remedy for a second argument vLLM resolves differently (a
    linked factor) has no place in a campaign: the message names what to pin instead."""
    from orchestrator.experiments.planner import LINKED_FACTOR_REMEDY
    from orchestrator.tuning.intake import _pin_hint

    error = {
        "type": "derived_default_changes",
        "msg": "with layout.tensor_parallel_size changed, vLLM also resolves "
        "max_num_batched_tokens: 2048 -> 4096 vs 'baseline': that is more than one variable. "
        + LINKED_FACTOR_REMEDY,
        "variables": {"max_num_batched_tokens": [2048, 4096]},
    }
    msg = _pin_hint("layout.tensor_parallel_size", error)["msg"]
    assert "linked factor" not in msg
    assert msg.endswith(
        "Pin engine_args.max_num_batched_tokens: 2048 in the baseline so that only "
        "layout.tensor_parallel_size changes"
    )
    assert _pin_hint("x", {"type": "more_than_one_variable", "msg": "m"}) == {}


def test_an_unknown_engine_argument_is_one_problem(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    """Not one per level, nor a missing start beside it."""
    space = [{"name": "engine_args.no_such_arg", "levels": [1, 2]}]
    with pytest.raises(CampaignInvalidError) as info, unit_of_work(factory) as s:
        accept_campaign(s, settings, campaign_doc(space=space))
    assert [(e["loc"], e["type"]) for e in info.value.errors] == [
        (["body", "space", 0, "levels", 0], "unknown_engine_arg")
    ]


def test_a_space_the_core_refuses_is_said_in_plain_words_at_its_variable(
    factory: sessionmaker[Session],
    settings: Settings,  # noqa: F811
) -> None:
    space = [{"name": "engine_args.max_num_seqs", "levels": [64, 64], "start": 64}]
    with pytest.raises(CampaignInvalidError) as info, unit_of_work(factory) as s:
        accept_campaign(s, settings, campaign_doc(space=space))
    msgs = [e["msg"] for e in info.value.errors]
    assert "engine_args.max_num_seqs: level 64 is listed twice" in msgs, msgs
    assert not any("Value error" in m for m in msgs)
