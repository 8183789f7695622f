"""A campaign's space proposed by vlab (``"space": "auto"``): the pure rules of
:mod:`orchestrator.tuning.auto_space`, and one campaign through the intake and the service
(fake recorded results, as :mod:`tests.orchestrator.tuning.test_campaign_service`)."""

from __future__ import annotations

from typing import Any

import pytest
from rich.console import Console
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.campaigns.space import Level
from orchestrator.cli.campaign import print_campaign
from orchestrator.core.db import unit_of_work
from orchestrator.core.errors import CampaignInvalidError
from orchestrator.core.repositories import CampaignRepository
from orchestrator.core.settings import Settings
from orchestrator.tuning import intake
from orchestrator.tuning.auto_space import UNKNOWN_START, Proposal, propose_space
from orchestrator.tuning.campaign_request import CampaignRequest
from orchestrator.tuning.evidence import Devices, Evidence, ModelFacts
from orchestrator.tuning.intake import accept_campaign
from tests.orchestrator.tuning.test_campaign_service import (
    campaign_doc,
    create,
    drive,
)
from tests.orchestrator.tuning.test_campaign_service import (
    database as database,  # noqa: F401 - fixture
)
from tests.orchestrator.tuning.test_campaign_service import (
    factory as factory,  # noqa: F401 - fixture
)
from tests.orchestrator.tuning.test_campaign_service import (
    settings as settings,  # noqa: F401 - fixture
)

APC = "engine_args.enable_prefix_caching"
SEQS = "engine_args.max_num_seqs"
TOKENS = "engine_args.max_num_batched_tokens"
CAP = "engine_args.max_model_len"
TP = "layout.tensor_parallel_size"

SHARED = {"num_requests": 32, "prefix_tokens": 512, "question_tokens": 48, "seed": 5}
UNIQUE = {"num_requests": 32, "prefix_tokens": 0, "question_tokens": 48, "seed": 5}
#: SHARED's longest request: 512 + 48 + 16 output + 32 for the chat template
LONGEST = 608

STARTS: dict[str, Level | None] = {APC: False, SEQS: 128, TOKENS: 2048, CAP: 4096, TP: 1}


def evidence(
    workload: dict[str, Any] | None = None, run_devices: int | None = None, **kw: Any
) -> Evidence:
    base: dict[str, Any] = {
        "engine_args": {},
        "workload": dict(SHARED if workload is None else workload),
    }
    if run_devices is not None:
        base["layout"] = {"devices": run_devices}
    return Evidence(baseline=base, **kw)


def propose(ev: Evidence | None = None, latency: bool = False, **starts: Level | None) -> Proposal:
    return propose_space(ev or evidence(), {**STARTS, **starts}, latency)


def variables(p: Proposal) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in p.variables}


def note(p: Proposal, name: str) -> dict[str, Any]:
    (found,) = [n for n in p.notes if n["name"] == name]
    return found


# ---- the rules ------------------------------------------------------------------------------


def test_every_variable_considered_has_a_note_and_levels_hold_their_start() -> None:
    p = propose()
    assert [n["name"] for n in p.notes] == [APC, SEQS, TOKENS, CAP, TP]
    assert {n["name"] for n in p.notes if n["proposed"]} == set(variables(p))
    for v in p.variables:
        assert v["start"] in v["levels"] and v["levels"] == sorted(v["levels"])
        assert 2 <= len(v["levels"]) <= 5 and len(set(v["levels"])) == len(v["levels"])
        if v["name"] != APC:
            assert all(isinstance(x, int) and x >= 1 for x in v["levels"])
    assert all(n["why"] for n in p.notes)


def test_the_proposal_is_deterministic() -> None:
    assert propose() == propose()
    assert propose(evidence(UNIQUE)) == propose(evidence(UNIQUE))


def test_prefix_caching_is_in_for_shared_prompts_and_out_quoting_the_analyser() -> None:
    p = propose()
    assert variables(p)[APC] == {"name": APC, "levels": [False, True], "start": False}
    p = propose(evidence(UNIQUE))
    assert APC not in variables(p)
    why = note(p, APC)["why"]
    assert why.startswith("the prefix analyser predicts no hits for this workload: ")
    assert "prefix cache hit rate of" in why


def test_max_num_seqs_halves_doubles_and_adds_a_lower_target_concurrency() -> None:
    p = propose()
    assert variables(p)[SEQS] == {"name": SEQS, "levels": [1, 64, 128, 256], "start": 128}
    assert "target concurrency 1" in note(p, SEQS)["why"]
    p = propose(evidence({**SHARED, "concurrency": 8}), **{SEQS: 8})
    assert variables(p)[SEQS]["levels"] == [4, 8, 16]  # the target is not below the start
    p = propose(**{SEQS: 1})
    assert variables(p)[SEQS] == {"name": SEQS, "levels": [1, 2], "start": 1}


def test_max_num_batched_tokens_keeps_half_only_when_it_holds_the_longest_prompt() -> None:
    p = propose()
    assert variables(p)[TOKENS]["levels"] == [1024, 2048, 4096, 8192]
    p = propose(**{TOKENS: 1024})  # 512 < the longest prompt (about 592 tokens)
    assert variables(p)[TOKENS] == {"name": TOKENS, "levels": [1024, 2048, 4096], "start": 1024}
    assert "half left out" in note(p, TOKENS)["why"]


def test_max_model_len_lowers_to_the_next_power_of_two_only_when_the_requests_are_short() -> None:
    p = propose()
    assert variables(p)[CAP] == {"name": CAP, "levels": [1024, 4096], "start": 4096}
    assert str(LONGEST) in note(p, CAP)["why"]
    p = propose(**{CAP: "4K"})  # as vLLM reads it
    assert variables(p)[CAP] == {"name": CAP, "levels": [1024, 4096], "start": 4096}
    p = propose(**{CAP: 1024})  # 608 is not under half of 1024
    assert CAP not in variables(p)
    assert note(p, CAP)["why"].startswith("the workload needs the context")


def test_tensor_parallel_only_on_multi_device_nodes_for_big_models_or_latency() -> None:
    p = propose()
    assert TP not in variables(p) and "devices per node are unknown" in note(p, TP)["why"]
    one = Devices(per_node=1, count=4)
    p = propose(evidence(devices=one))
    assert TP not in variables(p) and "1 device per node" in note(p, TP)["why"]
    small = ModelFacts(weights_gib=10.0)
    four = Devices(per_node=4, memory_gib=80.0)
    # without a fixed device count, TP would change the run's devices too: left out
    p = propose(evidence(devices=four, model=small), latency=True)
    assert TP not in variables(p) and "sets no `devices`" in note(p, TP)["why"]
    p = propose(evidence(run_devices=4, devices=four, model=small))
    assert TP not in variables(p)
    assert "the model fits one device" in note(p, TP)["why"]
    assert "the objective is not a latency" in note(p, TP)["why"]
    p = propose(evidence(run_devices=4, devices=four, model=small), latency=True)
    assert variables(p)[TP] == {"name": TP, "levels": [1, 2, 4], "start": 1}
    big = ModelFacts(weights_gib=140.0)
    eight = Devices(per_node=8, memory_gib=80.0)
    p = propose(evidence(run_devices=8, devices=eight, model=big))
    assert variables(p)[TP] == {"name": TP, "levels": [1, 2, 4, 8], "start": 1}
    assert "do not fit one device" in note(p, TP)["why"]
    recorded = Devices(per_node=8, memory_gib=80.0, memory_from="as run r1 recorded its GPUs")
    p = propose(evidence(run_devices=8, devices=recorded, model=big))
    assert "of 80.0 GiB (as run r1 recorded its GPUs)" in note(p, TP)["why"]
    # a run of 2 devices on nodes of 8: TP up to 2
    p = propose(evidence(run_devices=2, devices=eight, model=big))
    assert variables(p)[TP]["levels"] == [1, 2]


def test_an_unknown_start_leaves_its_variable_out() -> None:
    p = propose(**{TOKENS: None, CAP: None})
    assert TOKENS not in variables(p) and CAP not in variables(p)
    assert note(p, TOKENS) == {"name": TOKENS, "proposed": False, "why": UNKNOWN_START}
    assert note(p, CAP)["why"] == UNKNOWN_START


# ---- through the intake and the service -------------------------------------------------------


def auto_doc(**kw: Any) -> dict[str, Any]:
    doc = campaign_doc(space="auto", **kw)
    doc["baseline"]["engine_args"]["max_num_seqs"] = 128
    return doc


def test_an_auto_campaign_stores_the_proposed_space_and_runs_to_its_result(
    factory: sessionmaker[Session],  # noqa: F811
    settings: Settings,  # noqa: F811
) -> None:
    with unit_of_work(factory) as s:
        cid = accept_campaign(s, settings, auto_doc(budget={"max_runs": 100})).id
    with factory() as s:
        row = CampaignRepository(s).get(cid)
        assert row is not None
        stored = CampaignRequest.model_validate(row.request)
        names = [v.name for v in stored.variables()]
        assert APC in names and SEQS in names  # no resolver: the other starts are unknown
        assert TOKENS not in names
        assert stored.start()[SEQS] == 128 and stored.start()[APC] is False
        notes = {n["name"]: n for n in row.result["space_proposal"]}
        assert notes[CAP]["proposed"] and variables_of(stored)[CAP] == [256, 1024]
        assert notes[APC]["proposed"] and notes[SEQS]["proposed"]
        assert notes[TOKENS] == {"name": TOKENS, "proposed": False, "why": UNKNOWN_START}
    row = drive(factory, settings, cid)
    assert row.status == "succeeded", row.status_reason
    assert row.result["space_proposal"] == list(notes.values())
    assert row.result["incumbent"][APC] is True


def test_vllms_resolved_configuration_gives_the_starts_the_baseline_leaves_out(
    factory: sessionmaker[Session],  # noqa: F811
    settings: Settings,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[dict[str, Any]] = []

    def resolver(model_dir: str, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        asked.extend(configs)
        config = {
            "scheduler_config.max_num_batched_tokens": 4096,
            "cache_config.enable_prefix_caching": True,
        }
        return [{"ok": True, "config": config} for _ in configs]

    monkeypatch.setattr(intake, "engine_resolver", lambda _settings: None)
    request = CampaignRequest.model_validate(auto_doc())
    with factory() as s:
        evidence_of = intake.gather_evidence(s, settings, request, [])
    monkeypatch.setattr(intake, "engine_resolver", lambda _settings: resolver)
    starts = intake.auto_starts(settings, request, evidence_of)
    assert len(asked) == 1 and asked[0]["max_num_seqs"] == 128  # one call, the baseline's
    assert starts[TOKENS] == 4096  # resolved
    assert starts[APC] is False and starts[SEQS] == 128  # the baseline's own values win
    assert starts[TP] == 1


def test_an_auto_space_with_nothing_to_propose_is_refused_with_the_reasons(
    factory: sessionmaker[Session],  # noqa: F811
    settings: Settings,  # noqa: F811
) -> None:
    doc = campaign_doc(space="auto")
    doc["baseline"]["engine_args"] = {"max_model_len": 128}  # the workload needs it all
    with pytest.raises(CampaignInvalidError) as info, unit_of_work(factory) as s:
        accept_campaign(s, settings, doc)
    (err,) = info.value.errors
    assert err["loc"] == ["body", "space"] and err["type"] == "space_auto_empty"
    assert UNKNOWN_START in err["msg"] and "the workload needs the context" in err["msg"]


def variables_of(request: CampaignRequest) -> dict[str, list[Level]]:
    return {v.name: list(v.levels) for v in request.variables()}


def test_campaign_show_lists_the_proposal_only_when_there_is_one() -> None:
    body: dict[str, Any] = {
        "id": "c1",
        "name": "tune",
        "status": "queued",
        "request": {"space": [{"name": SEQS, "levels": [64, 128], "start": 128}]},
        "space_proposal": [
            {"name": SEQS, "proposed": True, "why": "half and twice"},
            {"name": TOKENS, "proposed": False, "why": UNKNOWN_START},
        ],
    }
    out = Console(record=True, width=200)
    print_campaign(body, out)
    text = out.export_text()
    assert "space proposed by vlab" in text and "64, 128" in text and UNKNOWN_START in text
    out = Console(record=True, width=200)
    print_campaign({**body, "space_proposal": None}, out)
    assert "space proposed by vlab" not in out.export_text()


def test_a_listed_space_keeps_an_empty_result_and_no_proposal(
    factory: sessionmaker[Session],  # noqa: F811
    settings: Settings,  # noqa: F811
) -> None:
    cid = create(factory, settings)
    with factory() as s:
        row = CampaignRepository(s).get(cid)
        assert row is not None and row.result == {}
