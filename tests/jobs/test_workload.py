"""Tests of :mod:`jobs.workload` (request lists) and :mod:`jobs.corpus` (the shipped text)."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer

from jobs import corpus
from jobs.modelgen import render_chat
from jobs.schemas import ChatRequest, WorkloadSpec
from jobs.workload import TOOLS, build_requests, request_list_hash, truncate_to_tokens

BLOCK_SIZE = 16  # vLLM's default KV-cache block size; prefix caching works in whole blocks


def _ids(tok: Tokenizer, req: ChatRequest) -> list[int]:
    """Token ids of the prompt vLLM's chat endpoint builds for ``req``."""
    return tok.encode(render_chat(req.messages), add_special_tokens=False).ids


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# -- corpus ---------------------------------------------------------------------------------


def test_corpus_is_sizeable_english_prose() -> None:
    text = corpus.load_corpus()
    assert 100_000 < len(text) < 400_000
    assert text.isascii()
    assert len(corpus.paragraphs()) > 500
    assert len(corpus.sentences()) > 1000
    words = text.lower().split()
    assert words.count("the") > 0.03 * len(words)


def test_corpus_sampling_is_seeded() -> None:
    a = corpus.sample_passage(random.Random(3), 2000)
    assert a == corpus.sample_passage(random.Random(3), 2000)
    assert a != corpus.sample_passage(random.Random(4), 2000)
    assert len(a) >= 2000
    assert len(corpus.sample_passage(random.Random(0), 2 * len(corpus.load_corpus()))) > 0
    assert corpus.sample_passage(random.Random(0), 0) == ""
    s = corpus.sample_sentences(random.Random(5), 4)
    assert len(s) == 4 and s == corpus.sample_sentences(random.Random(5), 4)
    assert len(corpus.sample_text(random.Random(5), 300)) >= 300
    with pytest.raises(ValueError):
        corpus.sample_sentences(random.Random(0), -1)


# -- request lists --------------------------------------------------------------------------


def test_layout_indices_and_max_tokens(tiny_tokenizer: Tokenizer) -> None:
    spec = WorkloadSpec(num_requests=5, warmup_requests=2, output_tokens=7, prefix_tokens=1024)
    reqs = build_requests(spec, tiny_tokenizer)
    assert [r.index for r in reqs] == [-2, -1, 0, 1, 2, 3, 4]
    assert [r.warmup for r in reqs] == [True, True] + [False] * 5
    assert all(r.max_tokens == 7 for r in reqs)
    for r in reqs[2:]:
        assert [m["role"] for m in r.messages] == ["system", "user"]
    system = reqs[2].messages[0]["content"]
    assert system.startswith("You are Atlas")
    assert json.dumps(TOOLS, sort_keys=True) in system
    assert "Document: Operations Handbook v3.2" in system
    for r in reqs[:2]:
        assert [m["role"] for m in r.messages] == ["user"]


def test_deterministic_and_hash_stable(tiny_tokenizer: Tokenizer) -> None:
    spec = WorkloadSpec(num_requests=8, seed=11, prefix_tokens=512)
    a = build_requests(spec, tiny_tokenizer)
    b = build_requests(spec.model_copy(), tiny_tokenizer)
    dump = [r.model_dump_json() for r in a]
    assert dump == [r.model_dump_json() for r in b]
    h = request_list_hash(a)
    assert h == request_list_hash(b)
    assert len(h) == 64 and int(h, 16) >= 0
    assert request_list_hash(list(reversed(a))) != h  # order matters
    assert request_list_hash(a[1:]) != h  # warm-ups count too


def test_hash_golden_value() -> None:
    # Pins the request list of a spec across processes and versions (no tokenizer: depends only
    # on the shipped corpus and this code). Update deliberately if the workload text changes.
    reqs = build_requests(WorkloadSpec(num_requests=3, prefix_tokens=64, question_tokens=8))
    assert request_list_hash(reqs) == GOLDEN_HASH


def test_different_seeds_differ(tiny_tokenizer: Tokenizer) -> None:
    a = build_requests(WorkloadSpec(seed=1, num_requests=4), tiny_tokenizer)
    b = build_requests(WorkloadSpec(seed=2, num_requests=4), tiny_tokenizer)
    assert request_list_hash(a) != request_list_hash(b)
    assert a[1].messages[0] != b[1].messages[0]  # the document body differs
    for x, y in zip(a[1:], b[1:], strict=True):
        assert x.messages[1] != y.messages[1]


@pytest.mark.parametrize("target", [64, 1024, 3000])
def test_measured_requests_share_the_prefix(tiny_tokenizer: Tokenizer, target: int) -> None:
    spec = WorkloadSpec(num_requests=6, warmup_requests=2, prefix_tokens=target, question_tokens=32)
    reqs = build_requests(spec, tiny_tokenizer)
    measured = [r for r in reqs if not r.warmup]
    systems = {r.messages[0]["content"] for r in measured}
    assert len(systems) == 1  # byte-identical shared prefix
    n_prefix = len(tiny_tokenizer.encode(systems.pop(), add_special_tokens=False).ids)
    assert target - 9 <= n_prefix <= target
    ids = [_ids(tiny_tokenizer, r) for r in measured]
    shared = min(_common_prefix(ids[0], x) for x in ids[1:])
    # The prompts share the whole system message (plus the template's header tokens) ...
    assert target - 9 <= shared <= target + 16
    # ... and no request is a prefix of another: every question starts differently.
    assert all(len(x) > shared for x in ids)
    # Warm-ups diverge from every measured prompt at the first role name (after BOS and
    # <|start_header_id|>): not even one KV-cache block is shared.
    for w in (r for r in reqs if r.warmup):
        wid = _ids(tiny_tokenizer, w)
        assert max(_common_prefix(wid, x) for x in ids) == 2 < BLOCK_SIZE


def test_questions_vary_with_target_length(tiny_tokenizer: Tokenizer) -> None:
    spec = WorkloadSpec(num_requests=20, question_tokens=48, prefix_tokens=128)
    measured = [r for r in build_requests(spec, tiny_tokenizer) if not r.warmup]
    questions = [r.messages[1]["content"] for r in measured]
    assert len(set(questions)) == len(questions)
    for q in questions:
        n = len(tiny_tokenizer.encode(q, add_special_tokens=False).ids)
        assert 48 - 9 <= n <= 48
    warm = build_requests(spec, tiny_tokenizer)[0].messages[0]["content"]
    n_warm = len(tiny_tokenizer.encode(warm, add_special_tokens=False).ids)
    assert 128 + 48 - 9 <= n_warm <= 128 + 48


def test_without_tokenizer_uses_four_chars_per_token() -> None:
    spec = WorkloadSpec(num_requests=3, prefix_tokens=500, question_tokens=20)
    reqs = build_requests(spec)
    system = reqs[1].messages[0]["content"]
    assert 4 * 500 - 16 <= len(system) <= 4 * 500
    assert all(4 * 20 - 16 <= len(r.messages[1]["content"]) <= 80 for r in reqs[1:])


def test_zero_prefix_and_no_warmup(tiny_tokenizer: Tokenizer) -> None:
    spec = WorkloadSpec(num_requests=2, warmup_requests=0, prefix_tokens=0)
    reqs = build_requests(spec, tiny_tokenizer)
    assert [r.index for r in reqs] == [0, 1]
    assert all([m["role"] for m in r.messages] == ["user"] for r in reqs)


def test_truncate_to_tokens(tiny_tokenizer: Tokenizer) -> None:
    text = corpus.sample_passage(random.Random(0), 4000)
    cut = truncate_to_tokens(text, 100, tiny_tokenizer)
    assert text.startswith(cut)
    assert 91 <= len(tiny_tokenizer.encode(cut, add_special_tokens=False).ids) <= 100
    assert truncate_to_tokens("short text", 100, tiny_tokenizer) == "short text"
    assert truncate_to_tokens(text, 0, tiny_tokenizer) == ""
    assert len(truncate_to_tokens(text, 10)) <= 40


GOLDEN_HASH = "1131a72e4e05983b2fb4fa7a591e005b7db2ff6623f6840a4a0b729ab2b58f67"


def test_long_fraction_mixes_classes_without_changing_the_short_requests(
    tiny_tokenizer: Tokenizer,
) -> None:
    short_only = build_requests(WorkloadSpec(num_requests=10, seed=4), tiny_tokenizer)
    mixed = build_requests(
        WorkloadSpec(num_requests=10, seed=4, long_fraction=0.4, long_input_tokens=300),
        tiny_tokenizer,
    )
    measured = [r for r in mixed if not r.warmup]
    longs = [r for r in measured if r.request_class == "long"]
    assert len(longs) == 4
    by_index = {r.index: r for r in short_only}
    for r in measured:
        if r.request_class == "short":
            assert r.messages == by_index[r.index].messages
        else:
            user = r.messages[-1]["content"]
            n = len(tiny_tokenizer.encode(user, add_special_tokens=False).ids)
            assert n >= 300 - 10
            assert r.messages[0] == by_index[r.index].messages[0]  # same shared prefix
    all_long = build_requests(
        WorkloadSpec(num_requests=5, seed=4, long_fraction=1.0, long_input_tokens=200),
        tiny_tokenizer,
    )
    assert {r.request_class for r in all_long if not r.warmup} == {"long"}
    assert len({r.messages[-1]["content"] for r in all_long if not r.warmup}) == 5
