"""The order hook of a tuning campaign (orchestrator.tuning.evidence): each rule, with the
real analysers over request lists that :func:`jobs.load.workload.build_requests` generates
for the generated tiny model (no engine, no database)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchestrator.analysis.advisor import run_findings
from orchestrator.campaigns.decision import DecisionRule
from orchestrator.campaigns.loop import Campaign
from orchestrator.campaigns.outcomes import Outcome, Triage
from orchestrator.campaigns.space import Candidate, Space, Variable, config_key, neighbours
from orchestrator.tuning.evidence import (
    Devices,
    Evidence,
    ModelFacts,
    RunFacts,
    order_by_evidence,
    spec_at,
    triage,
)
from orchestrator.tuning.evidence_inputs import RoundOrders
from tests.jobs.conftest import tiny_model_dir as tiny_model_dir  # noqa: F401 - fixture

APC = "engine_args.enable_prefix_caching"
SEQS = "engine_args.max_num_seqs"
CAP = "engine_args.max_model_len"
TP = "layout.tensor_parallel_size"
NO_HITS = "the prefix analyser predicts no hits for this workload: "

UNIQUE = {"num_requests": 32, "prefix_tokens": 0, "question_tokens": 48, "seed": 5}
SHARED = {"num_requests": 32, "prefix_tokens": 512, "question_tokens": 48, "seed": 5}


def space(*variables: Variable) -> Space:
    return Space(variables=variables)


def apc_seqs() -> Space:
    return space(Variable.boolean(APC), Variable(name=SEQS, levels=(64, 128, 256)))


START = {APC: False, SEQS: 128}


def model(model_dir: Path) -> ModelFacts:
    return ModelFacts(
        model_dir=model_dir, config=json.loads((model_dir / "config.json").read_text())
    )


def evidence(model_dir: Path | None, workload: dict[str, Any], **kw: Any) -> Evidence:
    base = {"engine_args": {"max_model_len": 2048}, "workload": workload}
    if "model" not in kw:
        kw["model"] = model(model_dir) if model_dir is not None else ModelFacts()
    return Evidence(baseline=base, **kw)


def ordered(ev: Evidence, sp: Space, start: dict[str, Any]) -> list[Triage]:
    return triage(ev, start, neighbours(start, sp))


def labels(answer: list[Triage]) -> list[tuple[str, str | None]]:
    return [(t.candidate.label, t.skip) for t in answer]


# ---- prefix caching ------------------------------------------------------------------------


def test_all_unique_prompts_skip_prefix_caching_with_the_analysers_figure(
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    answer = ordered(evidence(tiny_model_dir, UNIQUE), apc_seqs(), START)
    assert [t.candidate.label for t in answer] == [
        f"{SEQS}=64",
        f"{SEQS}=256",
        f"{APC}=true",
    ]
    skip = answer[-1].skip
    assert skip is not None and skip.startswith(NO_HITS), skip
    assert "prefix cache hit rate of 0.0%" in skip and "over 32 requests" in skip
    assert "approximate" not in skip  # the model's own tokenizer
    assert all(t.skip is None for t in answer[:-1])


def test_a_shared_prefix_tries_prefix_caching_first(tiny_model_dir: Path) -> None:  # noqa: F811
    answer = ordered(evidence(tiny_model_dir, SHARED), apc_seqs(), START)
    assert labels(answer)[0] == (f"{APC}=true", None)
    assert all(t.skip is None for t in answer)


def test_the_seeds_order_puts_prefix_caching_before_a_space_listing_it_later(
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    sp = space(Variable(name=SEQS, levels=(64, 128, 256)), Variable.boolean(APC))
    answer = ordered(evidence(tiny_model_dir, SHARED), sp, START)
    assert [t.candidate.label for t in answer] == [f"{APC}=true", f"{SEQS}=64", f"{SEQS}=256"]


def test_prefix_caching_is_measured_when_the_space_lists_nothing_else(
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    answer = ordered(evidence(tiny_model_dir, UNIQUE), space(Variable.boolean(APC)), {APC: False})
    assert labels(answer) == [(f"{APC}=true", None)]


def test_turning_prefix_caching_off_is_never_skipped_for_no_hits(
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    answer = ordered(evidence(tiny_model_dir, UNIQUE), apc_seqs(), {APC: True, SEQS: 128})
    assert all(t.skip is None for t in answer)


def test_without_the_models_tokenizer_the_prediction_is_approximate() -> None:
    unique = ordered(evidence(None, UNIQUE), apc_seqs(), START)
    skip = unique[-1].skip
    assert skip is not None and skip.startswith(NO_HITS) and "approximate" in skip
    shared = ordered(evidence(None, SHARED), apc_seqs(), START)
    assert labels(shared)[0] == (f"{APC}=true", None)


def test_a_given_request_list_is_what_the_analyser_reads(tiny_model_dir: Path) -> None:  # noqa: F811
    same = [{"messages": [{"role": "user", "content": "word " * 200}]} for _ in range(4)]
    ev = Evidence(
        baseline={"workload": UNIQUE}, model=model(tiny_model_dir), requests=same
    )  # the workload says unique; the list given is all one prompt
    assert all(t.skip is None for t in ordered(ev, apc_seqs(), START))


# ---- context caps and the KV cache estimator -----------------------------------------------


def cap_space() -> Space:
    return space(Variable(name=CAP, levels=(1024, 2048, 4096)), Variable.boolean(APC))


def test_a_cap_that_cannot_reach_the_target_concurrency_is_skipped_and_lowering_comes_first(
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    """With 0.01 GiB of KV cache the tiny model (512 bytes a token) holds 20,971 tokens:
    20.48 full-length requests at 1024, 10.24 at 2048, 5.12 at 4096; the workload wants
    12 at once."""
    workload = {**SHARED, "concurrency": 12}
    ev = evidence(tiny_model_dir, workload, devices=Devices(kind="GPU", kv_cache_gib=0.01))
    answer = ordered(ev, cap_space(), {CAP: 2048, APC: False})
    assert [t.candidate.label for t in answer] == [f"{CAP}=1024", f"{APC}=true", f"{CAP}=4096"]
    assert answer[0].skip is None and answer[1].skip is None
    skip = answer[2].skip
    assert skip is not None and "maximum concurrency of 5.12" in skip, skip
    assert "max_model_len 4096" in skip and "target concurrency 12" in skip


def test_the_engines_printed_kv_cache_wins_over_the_devices_figure(
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    workload = {**SHARED, "concurrency": 8}
    start = {CAP: 2048, APC: False}
    printed = {config_key(start): [RunFacts(kv_cache_gib=1.0)]}  # plenty: 512 at 2048
    ev = evidence(tiny_model_dir, workload, devices=Devices(kv_cache_gib=0.01), runs=printed)
    answer = ordered(ev, cap_space(), start)
    assert [t.candidate.label for t in answer] == [f"{APC}=true", f"{CAP}=1024", f"{CAP}=4096"]
    assert all(t.skip is None for t in answer)


def test_without_memory_figures_the_caps_keep_their_order(tiny_model_dir: Path) -> None:  # noqa: F811
    ev = evidence(tiny_model_dir, {**SHARED, "concurrency": 64})
    answer = ordered(ev, cap_space(), {CAP: 2048, APC: False})
    assert all(t.skip is None for t in answer)
    assert answer[0].candidate.label == f"{APC}=true"


def test_an_out_of_memory_finding_puts_the_lower_cap_and_max_num_seqs_first(
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    start = {CAP: 2048, APC: False, SEQS: 128}
    failed = {
        "id": "r1",
        "status": "failed",
        "error": "torch.OutOfMemoryError: CUDA out of memory",
        "engine_args": {"max_model_len": 2048},
        "engine_info": {},
    }
    findings = tuple(run_findings(failed, {}))
    assert [a.code for a in findings] == ["out_of_memory"]
    ev = evidence(tiny_model_dir, SHARED, runs={config_key(start): [RunFacts(findings=findings)]})
    sp = space(
        Variable(name=CAP, levels=(1024, 2048, 4096)),
        Variable.boolean(APC),
        Variable(name=SEQS, levels=(64, 128, 256)),
    )
    answer = ordered(ev, sp, start)
    assert [t.candidate.label for t in answer][:3] == [
        f"{SEQS}=64",
        f"{CAP}=1024",
        f"{APC}=true",
    ]


# ---- a waiting queue -----------------------------------------------------------------------


def test_a_waiting_queue_puts_the_batch_limits_first_raising_before_lowering(
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    sp = space(
        Variable.boolean(APC),
        Variable(name=SEQS, levels=(64, 128, 256)),
        Variable(name="engine_args.max_num_batched_tokens", levels=(1024, 2048)),
    )
    start = {APC: False, SEQS: 128, "engine_args.max_num_batched_tokens": 1024}
    queue = [RunFacts(metrics={"num_requests_waiting_peak": v}) for v in (6.0, 9.0, 0.0)]
    ev = evidence(tiny_model_dir, SHARED, runs={config_key(start): queue})
    assert [t.candidate.label for t in ordered(ev, sp, start)] == [
        f"{SEQS}=256",
        "engine_args.max_num_batched_tokens=2048",
        f"{SEQS}=64",
        f"{APC}=true",
    ]
    calm = [RunFacts(metrics={"num_requests_waiting_peak": 0.0})] * 3
    ev = evidence(tiny_model_dir, SHARED, runs={config_key(start): calm})
    assert ordered(ev, sp, start)[0].candidate.label == f"{APC}=true"
    # another configuration's queue is not the incumbent's
    other = {**start, SEQS: 64}
    ev = evidence(tiny_model_dir, SHARED, runs={config_key(other): queue})
    assert ordered(ev, sp, start)[0].candidate.label == f"{APC}=true"


# ---- tensor and pipeline parallel ----------------------------------------------------------


def tp_space() -> Space:
    return space(Variable.boolean(APC), Variable(name=TP, levels=(1, 2)))


def test_tp_is_skipped_for_a_throughput_objective_when_nothing_says_the_model_does_not_fit(
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    answer = ordered(evidence(tiny_model_dir, SHARED), tp_space(), {APC: False, TP: 1})
    assert answer[0] == Triage(Candidate(variable=APC, from_level=False, to_level=True))
    skip = answer[1].skip
    assert skip is not None and "nothing shows the model does not fit one device" in skip
    fits = evidence(
        tiny_model_dir,
        SHARED,
        model=ModelFacts(weights_gib=2.0),
        devices=Devices(memory_gib=80.0),
    )
    skip = ordered(fits, tp_space(), {APC: False, TP: 1})[1].skip
    assert skip is not None and "fits one device (weights 2.0 GiB of 80.0 GiB)" in skip


def test_tp_is_measured_for_a_latency_objective_or_a_model_that_does_not_fit(
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    latency = evidence(tiny_model_dir, SHARED, latency_objective=True)
    assert all(t.skip is None for t in ordered(latency, tp_space(), {APC: False, TP: 1}))
    big = evidence(
        tiny_model_dir,
        SHARED,
        model=ModelFacts(weights_gib=140.0),
        devices=Devices(memory_gib=80.0, count=8),
    )
    answer = ordered(big, tp_space(), {APC: False, TP: 1})
    assert labels(answer) == [(f"{APC}=true", None), (f"{TP}=2", None)]
    # lowering TP below what the weights need is skipped
    skip = ordered(big, tp_space(), {APC: False, TP: 2})[1].skip
    assert skip is not None and "do not fit 1 device(s) of 80.0 GiB" in skip


def test_tp_beyond_the_clusters_devices_is_skipped_even_for_latency(
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    ev = evidence(tiny_model_dir, SHARED, latency_objective=True, devices=Devices(count=1))
    skip = ordered(ev, tp_space(), {APC: False, TP: 1})[1].skip
    assert skip == "tensor_parallel_size 2 needs 2 devices; the cluster has 1"


# ---- the hook in the core, and kept per round ----------------------------------------------


def test_the_core_records_the_skip_and_its_reason(tiny_model_dir: Path) -> None:  # noqa: F811
    hook = order_by_evidence(evidence(tiny_model_dir, UNIQUE))
    core = Campaign(apc_seqs(), START, DecisionRule(min_repeats=2, max_repeats=3), 40, order=hook)
    assert [p.label for p in core.next_runs()] == [
        "r1.c1.incumbent",
        f"r1.c1.{SEQS}=64",
        f"r1.c1.{SEQS}=256",
    ]
    (skipped,) = [c for c in core.candidates() if c.outcome is Outcome.SKIPPED]
    assert skipped.candidate.label == f"{APC}=true" and skipped.reason.startswith(NO_HITS)


def test_a_kept_round_answers_the_same_whatever_the_evidence_says_later(
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    cands = neighbours(START, apc_seqs())
    orders = RoundOrders()
    first = orders.hook(lambda: evidence(tiny_model_dir, UNIQUE))(START, cands)
    kept = json.loads(json.dumps(orders.kept))  # as the campaign row stores it
    calls: list[int] = []

    def shared() -> Evidence:
        calls.append(1)
        return evidence(tiny_model_dir, SHARED)

    again = RoundOrders(kept).hook(shared)(START, cands)
    assert again == first and calls == []  # not even gathered
    fresh = RoundOrders().hook(shared)(START, cands)
    assert labels(fresh)[0] == (f"{APC}=true", None) and calls == [1]


def test_broken_evidence_falls_back_to_the_spaces_order() -> None:
    def broken() -> Evidence:
        raise RuntimeError("no model")

    cands = neighbours(START, apc_seqs())
    assert RoundOrders().hook(broken)(START, cands) == [Triage(c) for c in cands]


def test_spec_at_sets_each_path() -> None:
    base = {"engine_args": {"max_model_len": 2048}, "workload": {"seed": 1}}
    got = spec_at(base, {SEQS: 64, "workload.concurrency": 4, TP: 2})
    assert got == {
        "engine_args": {"max_model_len": 2048, "max_num_seqs": 64},
        "workload": {"seed": 1, "concurrency": 4},
        "layout": {"tensor_parallel_size": 2},
    }
    assert base == {"engine_args": {"max_model_len": 2048}, "workload": {"seed": 1}}


@pytest.mark.parametrize("workload", [UNIQUE, SHARED])
def test_the_hook_is_deterministic(tiny_model_dir: Path, workload: dict[str, Any]) -> None:  # noqa: F811
    ev = evidence(tiny_model_dir, workload)
    cands = neighbours(START, apc_seqs())
    assert triage(ev, START, cands) == triage(ev, START, cands)


def test_caps_written_as_vllm_reads_them_are_estimated_too(tiny_model_dir: Path) -> None:  # noqa: F811
    """``"2K"`` is 2048 (vLLM's human-readable integers): the same figures as above."""
    ev = evidence(tiny_model_dir, {**SHARED, "concurrency": 12}, devices=Devices(kv_cache_gib=0.01))
    sp = space(Variable(name=CAP, levels=("1K", "2K", "4K")), Variable.boolean(APC))
    answer = ordered(ev, sp, {CAP: "2K", APC: False})
    assert [t.candidate.label for t in answer] == [f"{CAP}=1K", f"{APC}=true", f"{CAP}=4K"]
    assert answer[2].skip is not None and "maximum concurrency of 5.12" in answer[2].skip
