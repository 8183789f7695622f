"""Tests of :mod:`jobs.load.workload` (request lists) and :mod:`jobs.modelgen.corpus` (the shipped
text)."""

from __future__ import annotations

import json
import random
import statistics
from collections import Counter
from typing import Any

import pytest
from tokenizers import Tokenizer

from jobs.load.template import length_bounds, template_segments
from jobs.load.texts import (
    OUTPUT_FORMAT_INSTRUCTIONS,
    SYSTEM_INSTRUCTIONS,
    TOOLS,
    truncate_to_tokens,
)
from jobs.load.workload import (
    arrival_offsets,
    build_requests,
    longest_request_tokens,
    request_list_hash,
)
from jobs.modelgen import corpus
from jobs.modelgen.generator import render_chat
from jobs.schemas import (
    ChatRequest,
    LengthDist,
    MultiTurnSpec,
    RequestClassSpec,
    TemplateSegment,
    WorkloadSpec,
)

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


# -- template workloads ---------------------------------------------------------------------


def _n(tok: Tokenizer, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False).ids)


def _measured(reqs: list[ChatRequest]) -> list[ChatRequest]:
    return [r for r in reqs if not r.warmup]


def _seg(name: str, **kw: Any) -> TemplateSegment:
    return TemplateSegment(name=name, **kw)


def test_template_defaults(tiny_tokenizer: Tokenizer) -> None:
    spec = WorkloadSpec(kind="template", num_requests=6, warmup_requests=2, question_tokens=48)
    assert [(s.name, s.role, s.fixed, s.tokens.tokens) for s in template_segments(spec)] == [
        ("instructions", "system", True, 256),
        ("tools", "system", True, 512),
        ("document_header", "system", True, 256),
        ("question", "user", False, 48),
    ]
    reqs = build_requests(spec, tiny_tokenizer)
    assert [r.index for r in reqs] == list(range(-2, 6))
    assert all(r.arrival_s is None for r in reqs)
    measured = _measured(reqs)
    assert {r.request_class for r in measured} == {"default"}
    assert all(r.max_tokens == spec.output_tokens for r in reqs)
    assert all([m["role"] for m in r.messages] == ["system", "user"] for r in measured)
    systems = {r.messages[0]["content"] for r in measured}
    assert len(systems) == 1
    system = systems.pop()
    assert system.startswith(SYSTEM_INSTRUCTIONS)
    assert f"{OUTPUT_FORMAT_INSTRUCTIONS}\n\nTools:\n" in system
    assert json.dumps(TOOLS, sort_keys=True)[:300] in system
    assert "Document: Operations Handbook v3.2 (OPS-1000)" in system
    assert 1024 - 27 <= _n(tiny_tokenizer, system) <= 1024 + 4  # three segments, two joins
    questions = [r.messages[1]["content"] for r in measured]
    assert len(set(questions)) == len(questions)
    assert all(48 - 9 <= _n(tiny_tokenizer, q) <= 48 for q in questions)
    assert sum(q.endswith('"?') for q in questions) >= len(questions) // 2
    # the warm-ups are the same unrelated texts as for the other kinds
    warm = build_requests(WorkloadSpec(num_requests=1, warmup_requests=2, question_tokens=48))
    assert [r.messages for r in warm[:2]] == [r.messages for r in build_requests(spec)[:2]]
    # no prefix: no system message
    bare = build_requests(spec.model_copy(update={"prefix_tokens": 0}), tiny_tokenizer)
    assert all([m["role"] for m in r.messages] == ["user"] for r in bare)


def test_template_deterministic_and_seeded(tiny_tokenizer: Tokenizer) -> None:
    spec = WorkloadSpec(kind="template", num_requests=5, prefix_tokens=300, seed=3)
    a = build_requests(spec, tiny_tokenizer)
    assert request_list_hash(a) == request_list_hash(build_requests(spec, tiny_tokenizer))
    b = build_requests(spec.model_copy(update={"seed": 4}), tiny_tokenizer)
    assert request_list_hash(a) != request_list_hash(b)
    for x, y in zip(_measured(a), _measured(b), strict=True):
        assert x.messages[1] != y.messages[1]
    assert a[1].messages[0] != b[1].messages[0]  # fixed segments are seeded too


SEGMENTS = [
    _seg("policy", role="system", fixed=True, text="Answer in English. Cite sections."),
    _seg("instructions", role="system", fixed=True, source="instructions", tokens={"tokens": 120}),
    _seg("passages", source="passages", tokens=LengthDist(tokens=200, range_ratio=0.5)),
    _seg("state", source="conversation_state", tokens=LengthDist(tokens=120)),
    _seg("style", fixed=True, source="text", text="Keep it under five sentences."),
    _seg("question", source="question", tokens=LengthDist(tokens=40, range_ratio=0.25)),
]


def test_template_fixed_segments_identical_variable_ones_differ(tiny_tokenizer: Tokenizer) -> None:
    spec = WorkloadSpec(kind="template", num_requests=8, warmup_requests=0, segments=SEGMENTS)
    reqs = build_requests(spec, tiny_tokenizer)
    systems = {r.messages[0]["content"] for r in reqs}
    assert len(systems) == 1
    system = systems.pop()
    assert system.startswith("Answer in English. Cite sections.\n\nYou are Atlas")
    assert 120 - 9 <= _n(tiny_tokenizer, system.split("\n\n", 1)[1]) <= 120
    users = [r.messages[1]["content"] for r in reqs]
    assert len(set(users)) == len(users)
    for u in users:
        assert u.startswith("Retrieved passages:\n\n[Passage 1] (Operations Handbook v3.2")
        assert "\n\nConversation so far:\nUser: " in u
        assert "\nAssistant: " in u
        assert "\n\nKeep it under five sentences.\n\n" in u  # fixed user text, in template order
    # different requests start their passages differently
    assert len({u[:120] for u in users}) > 1


@pytest.mark.parametrize(
    ("source", "role", "fixed"),
    [
        ("instructions", "system", True),
        ("tools", "system", True),
        ("document_header", "system", True),
        ("document", "user", False),
        ("passages", "user", False),
        ("question", "user", False),
        ("conversation_state", "user", False),
    ],
)
def test_segment_lengths_within_range(
    tiny_tokenizer: Tokenizer, source: str, role: str, fixed: bool
) -> None:
    dist = LengthDist(tokens=100, range_ratio=0.0 if fixed else 0.4)
    low, high = length_bounds(dist)
    assert (low, high) == ((100, 100) if fixed else (60, 140))
    segments = [_seg("s", role=role, fixed=fixed, source=source, tokens=dist)]
    if role == "system":
        segments.append(_seg("q", source="question", tokens=LengthDist(tokens=8)))
    spec = WorkloadSpec(kind="template", num_requests=24, warmup_requests=0, segments=segments)
    reqs = build_requests(spec, tiny_tokenizer)
    texts = [r.messages[0]["content"] for r in reqs]
    lengths = [_n(tiny_tokenizer, t) for t in texts]
    assert all(low - 9 <= n <= high for n in lengths), lengths
    if fixed:
        assert len(set(texts)) == 1
    else:
        assert len(set(texts)) == len(texts)
        assert max(lengths) - min(lengths) > 30  # lengths are drawn, not fixed
    if source == "tools":
        assert texts[0].startswith(OUTPUT_FORMAT_INSTRUCTIONS[:100])
    if source == "question":
        assert sum(t.endswith('"?') for t in texts) >= len(texts) // 2


def test_long_targets_extend_the_fixed_sources(tiny_tokenizer: Tokenizer) -> None:
    segments = [
        _seg("tools", role="system", fixed=True, source="tools", tokens={"tokens": 1500}),
        _seg(
            "instructions", role="system", fixed=True, source="instructions", tokens={"tokens": 600}
        ),
        _seg("q", source="question", tokens=LengthDist(tokens=8)),
    ]
    spec = WorkloadSpec(kind="template", num_requests=1, warmup_requests=0, segments=segments)
    system = build_requests(spec, tiny_tokenizer)[0].messages[0]["content"]
    tools, instructions = system.split("\n\nYou are Atlas")
    assert json.dumps(TOOLS, sort_keys=True)[:-1] in tools  # the whole TOOLS list, then more
    assert 1500 - 9 <= _n(tiny_tokenizer, tools) <= 1500
    assert 600 - 9 <= _n(tiny_tokenizer, "You are Atlas" + instructions) <= 600


def test_class_mix_is_exact_with_per_class_lengths(tiny_tokenizer: Tokenizer) -> None:
    classes = [
        RequestClassSpec(name="chat", weight=1.0),
        RequestClassSpec(
            name="rag", weight=2.0, segment_tokens={"question": LengthDist(tokens=120)}
        ),
        RequestClassSpec(
            name="gen",
            weight=3.5,
            segment_tokens={"passages": LengthDist(tokens=0)},
            output_tokens=LengthDist(tokens=100, range_ratio=0.5),
        ),
    ]
    segments = [
        _seg("passages", source="passages", tokens=LengthDist(tokens=60)),
        _seg("question", source="question", tokens=LengthDist(tokens=20)),
    ]
    spec = WorkloadSpec(
        kind="template",
        num_requests=40,
        warmup_requests=0,
        output_tokens=9,
        segments=segments,
        classes=classes,
    )
    reqs = build_requests(spec, tiny_tokenizer)
    names = [r.request_class for r in reqs]
    # quotas 6.15, 12.31, 21.54: floors 6, 12, 21 and the one left over to the largest remainder
    assert Counter(names) == {"chat": 6, "rag": 12, "gen": 22}
    assert names != sorted(names, key=["chat", "rag", "gen"].index)  # seeded positions
    for seed in (1, 2):
        other = build_requests(spec.model_copy(update={"seed": seed}), tiny_tokenizer)
        assert Counter(r.request_class for r in other) == Counter(names)
    outputs = {r.request_class: set() for r in reqs}
    for r in reqs:
        outputs[r.request_class].add(r.max_tokens)
        user = r.messages[0]["content"]
        assert [m["role"] for m in r.messages] == ["user"]
        if r.request_class == "gen":
            assert "[Passage" not in user  # 0 tokens drops the segment
            assert 20 - 9 <= _n(tiny_tokenizer, user) <= 20
        elif r.request_class == "rag":
            assert user.startswith("Retrieved passages:")
            assert 60 + 120 - 18 <= _n(tiny_tokenizer, user) <= 60 + 120 + 2
        else:
            assert 60 + 20 - 18 <= _n(tiny_tokenizer, user) <= 60 + 20 + 2
    assert outputs["chat"] == outputs["rag"] == {9}
    assert all(50 <= n <= 150 for n in outputs["gen"]) and len(outputs["gen"]) > 5


def test_multi_turn_conversations_grow(tiny_tokenizer: Tokenizer) -> None:
    spec = WorkloadSpec(
        kind="template",
        num_requests=8,
        warmup_requests=1,
        prefix_tokens=200,
        question_tokens=30,
        multi_turn=MultiTurnSpec(turns=3, answer_tokens=40),
        arrival="constant",
        request_rate=4.0,
    )
    reqs = build_requests(spec, tiny_tokenizer)
    assert reqs[0].warmup and reqs[0].conversation is None and reqs[0].arrival_s is None
    measured = _measured(reqs)
    # 3 conversations, listed turn by turn, cut at 8 requests
    assert [(r.conversation, r.turn) for r in measured] == [
        (0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (0, 2), (1, 2)
    ]  # fmt: skip
    assert [r.after for r in measured] == [None, None, None, 0, 1, 2, 3, 4]
    assert [r.arrival_s for r in measured] == [i / 4.0 for i in range(8)]
    systems = {r.messages[0]["content"] for r in measured}
    assert len(systems) == 1 and all(r.messages[0]["role"] == "system" for r in measured)
    for r in measured:
        roles = [m["role"] for m in r.messages]
        assert roles == ["system"] + ["user", "assistant"] * (r.turn or 0) + ["user"]
        if r.after is not None:
            prev = measured[r.after]
            assert prev.conversation == r.conversation and prev.turn == (r.turn or 0) - 1
            assert r.messages[: len(prev.messages)] == prev.messages
            answer = r.messages[len(prev.messages)]["content"]
            assert 40 - 9 <= _n(tiny_tokenizer, answer) <= 40
            assert r.messages[-1] != prev.messages[-1]  # a new question every turn
    users = [m["content"] for r in measured for m in r.messages[-1:]]
    assert len(set(users)) == len(users)
    assert request_list_hash(reqs) == request_list_hash(build_requests(spec, tiny_tokenizer))


def test_template_validation_errors() -> None:
    base = WorkloadSpec(kind="template")
    question = _seg("question", source="question")

    def build(**update: Any) -> list[ChatRequest]:
        return build_requests(base.model_copy(update=update))

    with pytest.raises(ValueError, match="duplicate segment name 'question'"):
        build(segments=[question, question])
    with pytest.raises(ValueError, match=r"segments\[1\] \('v'\): 'text' is for fixed segments"):
        build(segments=[question, _seg("v", text="hello")])
    with pytest.raises(ValueError, match=r"segments\[0\] \('t'\): source 'text' needs 'text'"):
        build(segments=[_seg("t", fixed=True, source="text"), question])
    with pytest.raises(ValueError, match="no segment has role 'user'"):
        build(segments=[_seg("s", role="system", fixed=True, text="x")])
    fixed = _seg("rules", fixed=True, source="instructions")
    unknown = RequestClassSpec(name="a", weight=1, segment_tokens={"nope": LengthDist(tokens=3)})
    with pytest.raises(ValueError, match=r"classes\[0\] \('a'\).*unknown segment 'nope'"):
        build(segments=[fixed, question], classes=[unknown])
    on_fixed = RequestClassSpec(name="a", weight=1, segment_tokens={"rules": LengthDist(tokens=3)})
    with pytest.raises(ValueError, match="names fixed segment 'rules'"):
        build(segments=[fixed, question], classes=[on_fixed])
    empty = RequestClassSpec(name="a", weight=1, segment_tokens={"question": LengthDist(tokens=0)})
    with pytest.raises(ValueError, match="user message is empty"):
        build(segments=[question], classes=[empty])
    twice = RequestClassSpec(name="a", weight=1)
    with pytest.raises(ValueError, match="duplicate class name 'a'"):
        build(classes=[twice, twice])
    with pytest.raises(ValueError, match="long_fraction applies to kind 'shared_prefix'"):
        build(long_fraction=0.5)
    with pytest.raises(ValueError, match="segment"):
        longest_request_tokens(base.model_copy(update={"segments": [question, question]}))
    with pytest.raises(ValueError, match="multi_turn applies to kind 'template' only"):
        build_requests(WorkloadSpec().model_copy(update={"multi_turn": MultiTurnSpec()}))


# -- replay ---------------------------------------------------------------------------------

CHAT_BODY: dict[str, Any] = {
    "model": "gpt-x",
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Summarize the incident policy."},
    ],
    "max_completion_tokens": 50,
    "max_tokens": 10,
    "stream": False,
    "stream_options": {"include_usage": True},
    "n": 1,
    "temperature": 0.7,
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "timestamp": 12.5,
    "request_class": "support",
}
COMPLETION_BODY: dict[str, Any] = {"prompt": "def fib(n):", "max_tokens": 20, "class": "code"}


def test_replay_maps_bodies(tiny_tokenizer: Tokenizer) -> None:
    plain = {"messages": [{"role": "user", "content": "Hi"}], "class": 7, "top_p": 0.9}
    spec = WorkloadSpec(
        kind="replay",
        num_requests=1,  # ignored: every body is sent
        warmup_requests=2,
        prefix_tokens=40,
        question_tokens=8,
        output_tokens=33,
        replay=[CHAT_BODY, COMPLETION_BODY, plain],
    )
    reqs = build_requests(spec, tiny_tokenizer)
    assert [r.index for r in reqs] == [-2, -1, 0, 1, 2]
    for w in reqs[:2]:
        assert w.warmup and [m["role"] for m in w.messages] == ["user"]
        assert 48 - 9 <= _n(tiny_tokenizer, w.messages[0]["content"]) <= 48
    chat, completion, other = reqs[2:]
    assert chat.messages == CHAT_BODY["messages"] and chat.prompt is None
    assert chat.max_tokens == 50 and chat.request_class == "support"
    assert chat.extra_body == {"temperature": 0.7, "tools": CHAT_BODY["tools"]}
    assert completion.messages == [] and completion.prompt == "def fib(n):"
    assert completion.max_tokens == 20 and completion.request_class == "code"
    assert completion.extra_body == {}
    assert other.max_tokens == 33 and other.request_class == "replay"
    assert other.extra_body == {"top_p": 0.9}
    assert all(r.arrival_s is None and r.conversation is None for r in reqs)
    chat.messages[0]["content"] = "changed"
    chat.extra_body["tools"].append(1)
    assert CHAT_BODY["messages"][0]["content"] == "You are terse."  # the spec is not aliased
    assert len(CHAT_BODY["tools"]) == 1


def test_replay_errors() -> None:
    with pytest.raises(ValueError, match=r"replay\[1\]: expected a JSON object with 'messages'"):
        build_requests(WorkloadSpec(kind="replay", replay=[CHAT_BODY, {"input": "x"}]))
    with pytest.raises(ValueError, match=r"replay\[0\]: 'n' = 2 is not supported"):
        build_requests(WorkloadSpec(kind="replay", replay=[{**COMPLETION_BODY, "n": 2}]))
    with pytest.raises(ValueError, match="needs replay"):
        build_requests(
            WorkloadSpec(kind="replay", replay=[CHAT_BODY]).model_copy(update={"replay": []})
        )
    with pytest.raises(ValueError, match="replay applies to kind 'replay' only"):
        build_requests(WorkloadSpec().model_copy(update={"replay": [CHAT_BODY]}))


# -- arrival --------------------------------------------------------------------------------


def test_constant_arrival_is_exact() -> None:
    spec = WorkloadSpec(num_requests=5, warmup_requests=2, arrival="constant", request_rate=8.0)
    reqs = build_requests(spec)
    assert [r.arrival_s for r in reqs] == [None, None, 0.0, 0.125, 0.25, 0.375, 0.5]
    # the shared-prefix texts do not depend on the arrival
    closed = build_requests(WorkloadSpec(num_requests=5, warmup_requests=2))
    assert [r.messages for r in reqs] == [r.messages for r in closed]
    assert request_list_hash(reqs) != request_list_hash(closed)


def test_poisson_arrival_rate_and_burstiness() -> None:
    def gaps(burstiness: float) -> list[float]:
        spec = WorkloadSpec(arrival="poisson", request_rate=5.0, burstiness=burstiness, seed=7)
        times = arrival_offsets(spec, 2000)
        assert times[0] == 0.0 and times == arrival_offsets(spec, 2000)
        floats = [t for t in times if t is not None]
        assert len(floats) == 2000 and floats == sorted(floats)
        return [b - a for a, b in zip(floats, floats[1:], strict=False)]

    cv = {}
    for burstiness in (1.0, 0.25):
        g = gaps(burstiness)
        assert abs(statistics.fmean(g) - 0.2) <= 0.15 * 0.2
        cv[burstiness] = statistics.pstdev(g) / statistics.fmean(g)
    assert 0.85 <= cv[1.0] <= 1.15  # exponential gaps
    assert cv[0.25] > 1.5 * cv[1.0]  # gamma shape 0.25: CV 2
    spec = WorkloadSpec(num_requests=3, warmup_requests=1, arrival="poisson", request_rate=2.0)
    reqs = build_requests(spec)
    assert reqs[0].arrival_s is None and reqs[1].arrival_s == 0.0
    assert [r.arrival_s for r in reqs[1:]] == arrival_offsets(spec, 3)
    other = arrival_offsets(spec.model_copy(update={"seed": 1}), 3)
    assert other != arrival_offsets(spec, 3)


def test_trace_arrival_uses_the_timestamps() -> None:
    bodies = [
        {**COMPLETION_BODY, "timestamp": 10.5},
        {**COMPLETION_BODY, "timestamp": 10},
        {**COMPLETION_BODY, "timestamp": 12.25},
    ]
    spec = WorkloadSpec(kind="replay", replay=bodies, arrival="trace", warmup_requests=1)
    reqs = build_requests(spec)
    assert [r.arrival_s for r in reqs] == [None, 0.5, 0.0, 2.25]
    assert [r.index for r in reqs] == [-1, 0, 1, 2]  # list order kept
    missing = spec.model_copy(update={"replay": [bodies[0], COMPLETION_BODY]})
    with pytest.raises(ValueError, match=r"replay\[1\] has no numeric 'timestamp'"):
        build_requests(missing)


def test_arrival_errors() -> None:
    for arrival in ("constant", "poisson"):
        spec = WorkloadSpec().model_copy(update={"arrival": arrival})
        with pytest.raises(ValueError, match=f"arrival '{arrival}' needs request_rate"):
            build_requests(spec)
    spec = WorkloadSpec(kind="template").model_copy(update={"arrival": "trace"})
    with pytest.raises(ValueError, match="arrival 'trace' needs kind 'replay'"):
        build_requests(spec)


# -- longest request ------------------------------------------------------------------------


def _request_tokens(tok: Tokenizer, r: ChatRequest) -> int:
    prompt = _n(tok, r.prompt) if r.prompt is not None else 0
    return prompt + sum(_n(tok, m["content"]) for m in r.messages) + r.max_tokens


def test_longest_request_tokens_shared_prefix() -> None:
    assert longest_request_tokens(WorkloadSpec()) == 1024 + 32 + 16
    assert longest_request_tokens(WorkloadSpec(long_fraction=0.5)) == 1024 + 32 + 16 + 1536 + 4
    # round(16 * 0.01) == 0: no long request
    assert longest_request_tokens(WorkloadSpec(long_fraction=0.01)) == 1024 + 32 + 16


@pytest.mark.parametrize("turns", [None, 3])
def test_longest_request_tokens_bounds_template(
    tiny_tokenizer: Tokenizer, turns: int | None
) -> None:
    segments = [s for s in SEGMENTS if s.text is None]  # literal text counts 4 chars a token
    classes = [
        RequestClassSpec(name="small", weight=1.0),
        RequestClassSpec(
            name="big",
            weight=1.0,
            segment_tokens={"passages": LengthDist(tokens=400, range_ratio=0.2)},
            output_tokens=LengthDist(tokens=64, range_ratio=0.5),
        ),
    ]
    spec = WorkloadSpec(
        kind="template",
        num_requests=12,
        warmup_requests=0,
        segments=segments,
        classes=classes,
        multi_turn=MultiTurnSpec(turns=turns, answer_tokens=50) if turns else None,
    )
    longest = longest_request_tokens(spec)
    actual = max(_request_tokens(tiny_tokenizer, r) for r in build_requests(spec, tiny_tokenizer))
    assert actual <= longest <= 1.3 * actual + 20
    # warm-ups count too, but are never longer than the measured prompts
    with_warmup = spec.model_copy(update={"warmup_requests": 1, "prefix_tokens": 5000})
    assert longest_request_tokens(with_warmup) == longest


def test_longest_request_tokens_replay() -> None:
    long_prompt = {"prompt": "x" * 4000}
    spec = WorkloadSpec(
        kind="replay", warmup_requests=0, output_tokens=7, replay=[COMPLETION_BODY, long_prompt]
    )
    assert longest_request_tokens(spec) == 1000 + 7
    # a warm-up is no longer than the longest replayed prompt
    assert longest_request_tokens(spec.model_copy(update={"warmup_requests": 1})) == 1000 + 7


def test_replay_warmups_are_no_longer_than_the_replayed_prompts() -> None:
    spec = WorkloadSpec(
        kind="replay",
        replay=[{"messages": [{"role": "user", "content": "Name three prime numbers."}]}],
        output_tokens=8,
    )
    assert spec.warmup_requests == 1 and spec.prefix_tokens + spec.question_tokens > 1000
    assert longest_request_tokens(spec) < 100  # not the default 1k-token warm-up
    warm = build_requests(spec)[0]
    assert warm.warmup and len(warm.messages[0]["content"]) <= 4 * 100
