""":mod:`orchestrator.analysis.prefix`: every headline figure is the aggregate of its
per-request details, or says what it leaves out.

Headlines: the prediction's ``queries_tokens`` / ``hits_tokens`` / ``hit_rate`` and its
split (``hits_shared_prefix_tokens`` + ``hits_prompt_tokens`` + ``hits_generated_tokens``),
``shared_prefix_tokens`` / ``reusable_prefix_tokens``, the summary a run keeps
(:func:`summarize`, resends included) and the plan's predicted hit rate. Details: the
per-request predictions, the resends, the advice steps. Inputs: multi-turn chats with the
engine's generated ids (and without them), prompts given as token ids, a chat template,
block sizes that round the shared prefix away; and a property test over generated
workloads, checked against an oracle written another way (prefix tuples, not chained
block nodes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from jobs.modelgen.generator import generate_model
from orchestrator.analysis.prefix import (
    HitRatePrediction,
    PrefixAnalysis,
    RequestPrediction,
    analyze_prefix,
    hit_rate_finding,
    load_tokenizer,
    summarize,
)
from tests.orchestrator.analysis.bpe_model import build_bpe_model

DATA = Path(__file__).parent / "data" / "prefix"
SYSTEM = {"role": "system", "content": "You are a helpful assistant"}
TURN1 = [SYSTEM, {"role": "user", "content": "The user asks about the incident"}]
ANSWER = "Here is the plan\n\nCheck the logs first"
OTHER = [SYSTEM, {"role": "user", "content": "Hello Alice"}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_model(tmp_path_factory.mktemp("prefix-summary-tiny") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bpe_model(tmp_path_factory.mktemp("prefix-summary") / "bpe")


def _ids(tok: Any, text: str) -> list[int]:
    return [int(t) for t in tok(text, add_special_tokens=False)["input_ids"]]


def _chat_ids(tok: Any, messages: list[dict[str, Any]]) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return _ids(tok, text)


def _lcp(*lists: list[int]) -> int:
    n = 0
    while all(n < len(x) for x in lists) and len({x[n] for x in lists}) == 1:
        n += 1
    return n


# --------------------------------------------------------------------------- the oracle


def _oracle(
    prompts: list[list[int]], generated: list[list[int] | None], bs: int
) -> list[tuple[int, int, int]]:
    """``(cached, cached_shared_prefix, cached_generated)`` per request, computed from the
    cached *token prefixes* (a block is cached when the whole prefix up to its end is) and
    who first cached each: not from chained block nodes as the analyser does."""
    first: dict[tuple[int, ...], bool] = {}  # cached prefix -> first cached from generated
    shared = _lcp(*prompts)
    reusable = bs * (max(0, min(shared, min(len(p) for p in prompts) - 1)) // bs)
    out = []
    for p, g in zip(prompts, generated, strict=True):
        hits = 0
        while (hits + 1) * bs <= len(p) - 1 and tuple(p[: (hits + 1) * bs]) in first:
            hits += 1
        gen_hits = sum(first[tuple(p[: (b + 1) * bs])] for b in range(hits))
        held = [*p, *g][: len(p) + len(g) - 1] if g else p
        for b in range(len(held) // bs):
            first.setdefault(tuple(held[: (b + 1) * bs]), (b + 1) * bs > len(p))
        out.append((hits * bs, min(hits * bs, reusable), gen_hits * bs))
    return out


def _previous(prompts: list[list[int]]) -> dict[int, int]:
    """For each request, the latest of the longest earlier prompts it extends."""
    out = {}
    for k, p in enumerate(prompts):
        ext = [
            j for j in range(k) if len(prompts[j]) < len(p) and p[: len(prompts[j])] == prompts[j]
        ]
        if ext:
            out[k] = max(ext, key=lambda j: (len(prompts[j]), j))
    return out


def _assert_headlines_are_the_details(a: PrefixAnalysis) -> None:
    """Every headline figure of ``a`` and of its summary against its details."""
    p = a.prediction
    per = p.per_request
    assert [x.index for x in per] == list(range(a.num_requests))
    assert a.prompt_tokens == [x.prompt_tokens for x in per]
    assert p.queries_tokens == sum(x.prompt_tokens for x in per)
    assert p.hits_tokens == sum(x.cached_tokens for x in per)
    assert p.hit_rate == pytest.approx(p.hits_tokens / p.queries_tokens)
    for x in per:
        parts = (x.cached_shared_prefix_tokens, x.cached_prompt_tokens, x.cached_generated_tokens)
        assert min(parts) >= 0 and sum(parts) == x.cached_tokens
        assert all(v % a.block_size == 0 for v in (x.cached_tokens, *parts))
    assert p.hits_shared_prefix_tokens == sum(x.cached_shared_prefix_tokens for x in per)
    assert p.hits_prompt_tokens == sum(x.cached_prompt_tokens for x in per)
    assert p.hits_generated_tokens == sum(x.cached_generated_tokens for x in per)
    assert p.hits_shared_prefix_tokens + p.hits_prompt_tokens + p.hits_generated_tokens == (
        p.hits_tokens
    )
    # the "shared by all" headline is what every request after the first hits of it
    assert (a.shared_prefix_tokens, a.reusable_prefix_tokens) == (
        p.shared_prefix_tokens,
        p.reusable_prefix_tokens,
    )
    assert a.shared_prefix_blocks == a.shared_prefix_tokens // a.block_size
    assert p.hits_shared_prefix_tokens == a.reusable_prefix_tokens * (a.num_requests - 1)
    assert all(x.cached_tokens >= a.reusable_prefix_tokens for x in per[1:])
    if a.divergence is not None:
        assert a.divergence.token_position == a.shared_prefix_tokens
    assert all(c.shared_prefix_tokens >= a.shared_prefix_tokens for c in a.clusters)
    # resends: the prediction counts at least what each says it counts
    for r in a.resends:
        assert per[r.request].cached_tokens >= r.reusable_tokens_in_prediction
        assert r.reusable_tokens_in_prediction <= r.reusable_tokens
        if r.checked_with == "generated_token_ids":
            assert r.reusable_tokens_in_prediction == r.reusable_tokens
    # what the prediction leaves out is said, in the field and in a note
    counted = set(p.generated_tokens_counted)
    assert not counted & set(a.generated_tokens_not_counted)
    assert a.prediction_counts_generated_tokens == bool(counted)
    assert bool(a.generated_tokens_not_counted) == any("leaves out what" in n for n in a.notes)
    if not counted:
        assert p.hits_generated_tokens == 0
    # the plan's figure is the plan's best step
    plan = [x for x in a.advice if x.raises_hit_rate]
    assert a.predicted_hit_rate_after_plan == (
        max(x.predicted_hit_rate_after or 0.0 for x in plan) if plan else None
    )
    # the summary a run keeps: the same figures, and sums of the same details
    s = summarize(a)
    assert (s["queries_tokens"], s["hits_tokens"], s["predicted_hit_rate"]) == (
        p.queries_tokens,
        p.hits_tokens,
        p.hit_rate,
    )
    assert (
        s["hits_shared_prefix_tokens"] + s["hits_prompt_tokens"] + s["hits_generated_tokens"]
        == (s["hits_tokens"])
    )
    assert s["hits_generated_tokens"] == p.hits_generated_tokens
    assert s["reusable_prefix_tokens"] == a.reusable_prefix_tokens
    assert s["generated_tokens_not_counted"] == a.generated_tokens_not_counted
    assert s["predicted_hit_rate_after_plan"] == a.predicted_hit_rate_after_plan
    if a.resends:
        rs = s["resends"]
        assert rs["count"] == len(a.resends)
        assert rs["reusable_tokens"] == sum(r.reusable_tokens for r in a.resends)
        assert rs["reusable_tokens_in_prediction"] == sum(
            r.reusable_tokens_in_prediction for r in a.resends
        )
        assert rs["lost_tokens"] == sum(r.lost_tokens or 0 for r in a.resends)
    else:
        assert s["resends"] is None
    assert type(a).model_validate_json(a.model_dump_json()) == a


# --------------------------------------------------------------------------- crafted


def test_generated_answer_hits_are_in_the_headline_split(bpe_dir: Path) -> None:
    """Turn 2 resends turn 1's generated answer; a third request shares only the system
    prompt. The split says which hit tokens come from what, and adds up."""
    tok = load_tokenizer(bpe_dir)
    generated = [*_ids(tok, ANSWER), tok.convert_tokens_to_ids("<|im_end|>")]
    turn2 = [*TURN1, {"role": "assistant", "content": ANSWER}, {"role": "user", "content": "Hi"}]
    reqs = [
        {"messages": TURN1, "generated_token_ids": generated},
        {"messages": turn2},
        {"messages": OTHER},
    ]
    p0, p1, p2 = (_chat_ids(tok, m) for m in (TURN1, turn2, OTHER))
    held0 = [*p0, *generated][: len(p0) + len(generated) - 1]
    shared = _lcp(p0, p1, p2)
    for bs in (1, 4, 16):
        a = analyze_prefix(reqs, bpe_dir, block_size=bs)
        _assert_headlines_are_the_details(a)
        reusable = bs * (min(shared, min(map(len, (p0, p1, p2))) - 1) // bs)
        assert (a.shared_prefix_tokens, a.reusable_prefix_tokens) == (shared, reusable)
        hit1 = bs * (min(_lcp(held0, p1), len(p1) - 1) // bs)
        per = a.prediction.per_request
        assert per[1].cached_tokens == hit1
        # turn 2 hits its conversation's prompt and generated blocks, past the shared prefix
        assert per[1].cached_generated_tokens == hit1 - bs * (len(p0) // bs) > 0
        assert per[1].cached_shared_prefix_tokens == reusable
        assert per[2].cached_tokens == per[2].cached_shared_prefix_tokens == reusable
        assert a.prediction.generated_tokens_counted == [0]
        assert a.generated_tokens_not_counted == []
        s = summarize(a)
        assert s["hits_generated_tokens"] == per[1].cached_generated_tokens
    # block size 16: the prefix all three share rounds to no block, yet a third of the
    # prompt tokens hit: the headline says where from instead of "0 tokens reusable"
    a16 = analyze_prefix(reqs, bpe_dir, block_size=16)
    assert a16.reusable_prefix_tokens == 0 < a16.prediction.hits_tokens
    assert a16.prediction.hits_tokens == (
        a16.prediction.hits_prompt_tokens + a16.prediction.hits_generated_tokens
    )


def test_without_generated_ids_the_left_out_answer_is_named(bpe_dir: Path) -> None:
    """No generated ids: the resend (checked with the tokenizer) reuses the answer's own
    encoding, an assumption; the prediction counts the prompt blocks only, and says so."""
    tok = load_tokenizer(bpe_dir)
    turn2 = [*TURN1, {"role": "assistant", "content": ANSWER}, {"role": "user", "content": "Hi"}]
    reqs = [{"messages": TURN1}, {"messages": turn2}, {"messages": OTHER}]
    bs = 4
    a = analyze_prefix(reqs, bpe_dir, block_size=bs)
    _assert_headlines_are_the_details(a)
    p0 = _chat_ids(tok, TURN1)
    (r,) = a.resends
    assert r.checked_with == "tokenizer" and r.divergence is None
    assert r.reusable_tokens > r.reusable_tokens_in_prediction == bs * (len(p0) // bs)
    assert a.prediction.per_request[1].cached_tokens == r.reusable_tokens_in_prediction
    assert a.prediction.hits_generated_tokens == 0
    assert a.generated_tokens_not_counted == [0]
    (note,) = [n for n in a.notes if "leaves out" in n]
    assert "1 request(s) generated (requests[0])" in note
    s = summarize(a)
    assert s["resends"]["reusable_tokens"] == r.reusable_tokens
    assert s["resends"]["reusable_tokens_in_prediction"] == r.reusable_tokens_in_prediction
    # a measured rate above the prediction names the left-out answers first
    f = hit_rate_finding(0.1, 0.6, metrics={"num_preemptions_delta": 0}, summary=s)
    assert f is not None and f.evidence["generated_tokens_not_counted"] == [0]
    assert "answers of 1 request(s) that later turns resend" in f.message


def test_token_id_turns_count_generated_ids_in_the_headline() -> None:
    """Completions over token ids: turn 2 appends turn 1's generated ids (token in, token
    out); turn 3 extends turn 2, whose generated ids are not given."""
    sys_ids = list(range(100, 113))  # 13 shared tokens
    p0 = [*sys_ids, 1, 2, 3]
    g0 = [7, 8, 9, 10, 11, 12, 13]
    p1 = [*p0, *g0, 4, 5, 6]
    p2 = [*p1, 40, 41, 42, 43, 44, 45, 46, 47, 48]
    reqs = [
        {"prompt": p0, "generated_token_ids": g0},
        {"prompt_token_ids": p1},
        {"token_ids": p2},
        {"prompt": [*sys_ids, 9, 9]},
    ]
    prompts = [p0, p1, p2, reqs[3]["prompt"]]
    for bs in (1, 2, 4, 8, 16):
        a = analyze_prefix(reqs, None, block_size=bs)
        _assert_headlines_are_the_details(a)
        want = _oracle(prompts, [g0, None, None, None], bs)
        got = [
            (x.cached_tokens, x.cached_shared_prefix_tokens, x.cached_generated_tokens)
            for x in a.prediction.per_request
        ]
        assert got == want
        assert a.generated_tokens_not_counted == [1]  # turn 3 extends turn 2
    a4 = analyze_prefix(reqs, None, block_size=4)
    assert a4.prediction.per_request[1].cached_generated_tokens == 4  # [7..10] hit, [11..] not
    assert a4.prediction.per_request[2].cached_generated_tokens == 4


def test_plan_figure_is_the_plans_and_a_chat_templates_headlines_agree(
    tiny_dir: Path,
) -> None:
    """A clock in the system prompt (Llama-3 chat template of ``jobs.modelgen.generator``): the
    summary's advice is the plan, and the figure beside it is the plan's own prediction,
    re-computed here on the requests rewritten by hand."""
    case = json.loads((DATA / "clock_in_system_prompt.json").read_text())
    a = analyze_prefix(case["requests"], tiny_dir)
    _assert_headlines_are_the_details(a)
    (adv,) = [x for x in a.advice if x.raises_hit_rate]
    assert a.predicted_hit_rate_after_plan == adv.predicted_hit_rate_after > a.prediction.hit_rate
    s = summarize(a)
    assert s["advice"] == adv.change
    assert s["predicted_hit_rate_after_plan"] == adv.predicted_hit_rate_after
    without = analyze_prefix(
        [{"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9]}, {"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9]}],
        None,
        block_size=4,
    )
    _assert_headlines_are_the_details(without)
    assert without.predicted_hit_rate_after_plan is None and summarize(without)["advice"] is None


def test_totals_that_are_not_the_requests_sums_are_refused() -> None:
    per = [
        RequestPrediction(index=0, prompt_tokens=8, cached_tokens=0),
        RequestPrediction(index=1, prompt_tokens=8, cached_tokens=4),
    ]
    ok = HitRatePrediction(
        block_size=4, queries_tokens=16, hits_tokens=4, hit_rate=0.25, per_request=per
    )
    assert ok.hits_prompt_tokens == 4
    with pytest.raises(ValidationError, match="not those of its requests"):
        HitRatePrediction(
            block_size=4, queries_tokens=16, hits_tokens=8, hit_rate=0.5, per_request=per
        )
    with pytest.raises(ValidationError, match="do not add up"):
        RequestPrediction(
            index=1,
            prompt_tokens=8,
            cached_tokens=4,
            cached_shared_prefix_tokens=4,
            cached_generated_tokens=4,
        )


# --------------------------------------------------------------------------- property


@st.composite
def _workloads(draw: st.DrawFn) -> tuple[list[dict[str, Any]], int]:
    """Token-id workloads: fresh prompts (some with a common system prefix) and later
    turns that extend an earlier one, with its generated ids or other tokens, sometimes
    altered; each request with or without its generated ids."""
    tokens = st.integers(0, 5)
    system = draw(st.lists(tokens, max_size=12))
    prompts: list[list[int]] = []
    generated: list[list[int] | None] = []
    for _ in range(draw(st.integers(1, 7))):
        if prompts and draw(st.booleans()):
            j = draw(st.integers(0, len(prompts) - 1))
            answer = generated[j] if generated[j] and draw(st.booleans()) else None
            if answer is None:
                answer = draw(st.lists(tokens, min_size=1, max_size=6))
            if draw(st.integers(0, 3)) == 0:  # the answer came back as other tokens
                answer = [*answer[:-1], (answer[-1] + 1) % 6]
            prompt = [*prompts[j], *answer, *draw(st.lists(tokens, min_size=1, max_size=5))]
        else:
            head = system if draw(st.booleans()) else []
            prompt = [*head, *draw(st.lists(tokens, min_size=1, max_size=10))]
        prompts.append(prompt[:60])
        generated.append(
            draw(st.lists(tokens, min_size=1, max_size=8)) if draw(st.booleans()) else None
        )
    reqs = [
        {"prompt": p, **({"generated_token_ids": g} if g else {})}
        for p, g in zip(prompts, generated, strict=True)
    ]
    return reqs, draw(st.sampled_from([1, 2, 3, 4, 5, 8, 16]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_workloads())
def test_headlines_are_the_aggregates_of_the_details_on_any_workload(
    case: tuple[list[dict[str, Any]], int],
) -> None:
    reqs, bs = case
    a = analyze_prefix(reqs, None, block_size=bs)
    _assert_headlines_are_the_details(a)
    prompts = [r["prompt"] for r in reqs]
    generated = [r.get("generated_token_ids") for r in reqs]
    got = [
        (x.cached_tokens, x.cached_shared_prefix_tokens, x.cached_generated_tokens)
        for x in a.prediction.per_request
    ]
    assert got == _oracle(prompts, generated, bs)
    assert a.shared_prefix_tokens == _lcp(*prompts)
    prev = _previous(prompts)
    assert a.generated_tokens_not_counted == sorted({j for j in prev.values() if not generated[j]})
    assert a.prediction.generated_tokens_counted == [i for i, g in enumerate(generated) if g]
