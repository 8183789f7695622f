""":mod:`orchestrator.analysis.prefix` on token ids: prompts given as ids (completions
``prompt: [int]``, batches, vLLM's ``prompt_token_ids`` and ``/inference/v1/generate``
``token_ids``), mixed text and ids with and without a tokenizer, and multi-turn resends
whose re-encoded text splits into other tokens than the engine generated (re-tokenization
/ whitespace merge).

The shapes are vLLM 0.32.0's (the engine environment, ``.engine-venv``):
``vllm/entrypoints/openai/completion/protocol.py`` l.52 (``CompletionRequest.prompt``:
``list[int] | list[list[int]] | str | list[str]``, ids ``ge=0``), l.171 / l.667
(``return_token_ids`` -> ``choices[i].token_ids``), ``chat_completion/protocol.py`` l.121
(the same for chat), ``inputs/llm.py`` l.114 (``TokensPrompt.prompt_token_ids``),
``entrypoints/scale_out/token_in_token_out/protocol.py`` l.171 (``GenerateRequest.token_ids``),
``renderers/base.py`` l.454 ("Token id N is out of vocabulary"),
``renderers/chat_utils.py`` l.208 (``prompt_embeds`` content parts).

Resends: PrimeIntellect-ai/prime-rl#1863 (vLLM chat API, ``"\\n"+"\\n"`` generated as
``[198, 198]``, re-encoded ``"\\n\\n"`` -> ``[271]``: prefix caching breaks silently),
NovaSky-AI/SkyRL#2092 (a generation prompt ending in ``"\\n"`` merged with an answer starting
with ``"\\n"`` into one ``"\\n\\n"`` token), kubernetes-sigs/inference-perf#649 (text-append
multi-turn on vLLM: 0 hits on the generated segment), raullenchai/Rapid-MLX#214 (the chat
template renders the assistant turn otherwise than the generation prompt). The tokenizer
with real whitespace merges is :mod:`tests.orchestrator.analysis.bpe_model`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from jobs.modelgen.generator import generate_model
from orchestrator.analysis.prefix import (
    analyze_prefix,
    load_tokenizer,
    predict_hit_rate,
    summarize,
)
from tests.orchestrator.analysis.bpe_model import build_bpe_model

CASES = Path(__file__).parent / "data" / "prefix"
SHARED_CASES = Path(__file__).resolve().parents[3].parent / "shared" / "cases" / "prefix"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_model(tmp_path_factory.mktemp("prefix-tok-models") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bpe_model(tmp_path_factory.mktemp("prefix-bpe") / "bpe")


def _case(name: str) -> dict[str, Any]:
    path = SHARED_CASES / name if (SHARED_CASES / name).exists() else CASES / name
    return json.loads(path.read_text())


def _ids(tok: Any, text: str) -> list[int]:
    return [int(t) for t in tok(text, add_special_tokens=False)["input_ids"]]


def _chat_ids(tok: Any, messages: list[dict[str, Any]]) -> list[int]:
    """What vLLM's chat endpoint makes of ``messages``: the template, then the tokenizer
    without special tokens (what a token-in/token-out client sends as ``prompt``)."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return _ids(tok, text)


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# --------------------------------------------------------------------------- ids in


@pytest.mark.parametrize("shape", ["prompt", "prompt_token_ids", "token_ids"])
def test_case_as_token_ids_matches_the_chat(tiny_dir: Path, shape: str) -> None:
    """The handed clock case, sent by a client that renders and tokenizes itself
    (completions ``prompt: [int]``, ``TokensPrompt.prompt_token_ids`` or the
    ``/inference/v1/generate`` ``token_ids``): the same tokens, so the same analysis, the
    divergence located in the decoded ids."""
    case = _case("clock_in_system_prompt.json")
    tok = load_tokenizer(tiny_dir)
    as_chat = analyze_prefix(case["requests"], tiny_dir)
    bodies = [{shape: _chat_ids(tok, r["messages"])} for r in case["requests"]]
    as_ids = analyze_prefix(bodies, tiny_dir)
    assert as_ids.prompt_tokens == as_chat.prompt_tokens
    assert as_ids.shared_prefix_tokens == as_chat.shared_prefix_tokens
    assert as_ids.prediction == as_chat.prediction
    d, dc = as_ids.divergence, as_chat.divergence
    assert d is not None and dc is not None
    assert d.token_position == dc.token_position
    assert d.cause == dc.cause == case["expected"]["divergence_cause"] == "timestamp"
    assert d.values == dc.values
    assert d.locations[0].source == "prompt_token_ids"
    assert as_ids.request_sources == ["requests[0]", "requests[1]", "requests[2]"]
    assert not as_ids.not_compared


def test_batch_prompts_are_one_request_each(tiny_dir: Path) -> None:
    """``prompt: [[ids], [ids]]`` and ``prompt: [str, str]``: vLLM runs each prompt of a
    batch as its own request, in order."""
    tok = load_tokenizer(tiny_dir)
    texts = [
        "Section 2: change management. Every production change needs a ticket.",
        "Section 2: change management. Every production change needs a reviewer.",
    ]
    ids = [[int(t) for t in tok(x)["input_ids"]] for x in texts]  # completions: BOS added
    by_ids = analyze_prefix([{"prompt": ids}], tiny_dir)
    by_text = analyze_prefix([{"prompt": texts}], tiny_dir)
    one_by_one = analyze_prefix([{"prompt": x} for x in texts], tiny_dir)
    for a in (by_ids, by_text):
        assert a.num_requests == 2
        assert a.request_sources == ["requests[0].prompt[0]", "requests[0].prompt[1]"]
        assert a.prompt_tokens == one_by_one.prompt_tokens
        assert a.shared_prefix_tokens == one_by_one.shared_prefix_tokens == _lcp(*ids)


def test_batch_with_a_vllm_response_gives_each_prompt_its_answer(bpe_dir: Path) -> None:
    """A completions batch answered with ``return_token_ids``: ``choices[i].token_ids`` is
    prompt ``i``'s answer; a later request extending prompt 1 with it reuses it all."""
    tok = load_tokenizer(bpe_dir)
    p0, p1 = _ids(tok, "Hello there. Here is the plan:"), _ids(tok, "The answer is")
    a0, a1 = _ids(tok, " Check the logs first."), _ids(tok, " yes.")
    body = {
        "prompt": [p0, p1],
        "response": {"choices": [{"index": 1, "token_ids": a1}, {"index": 0, "token_ids": a0}]},
    }
    a = analyze_prefix([body, {"prompt": [*p1, *a1, *_ids(tok, " Why?")]}], bpe_dir, block_size=2)
    (r,) = a.resends
    assert (r.request, r.previous) == (2, 1) and r.divergence is None
    assert r.cached_tokens == len(p1) + len(a1) - 1 == r.matching_tokens
    two_choices = {"prompt": p0, "response": {"choices": [{"token_ids": a0}, {"token_ids": a1}]}}
    with pytest.raises(ValueError, match=r"^requests\[0\]: \"response\" has 2 choices for 1"):
        analyze_prefix([two_choices], bpe_dir)


def test_mixed_text_and_ids_with_a_tokenizer_are_compared_as_tokens(tiny_dir: Path) -> None:
    """A chat and the same chat sent as ids are the same prompt to the engine."""
    case = _case("clock_in_system_prompt.json")
    tok = load_tokenizer(tiny_dir)
    chat = case["requests"][1]
    a = analyze_prefix([chat, {"prompt": _chat_ids(tok, chat["messages"])}], tiny_dir)
    assert a.prompt_tokens[0] == a.prompt_tokens[1] == a.shared_prefix_tokens
    assert a.divergence is None
    n = a.prompt_tokens[0]
    assert a.prediction.hits_tokens == 16 * ((n - 1) // 16)


def test_mixed_without_a_tokenizer_says_which_could_not_be_compared(tiny_dir: Path) -> None:
    tok = load_tokenizer(tiny_dir)
    base = _ids(tok, "Section 1: incident response. When a page fires, acknowledge it.")
    reqs = [
        {"prompt": [*base, *_ids(tok, " Then open a channel.")]},
        {"messages": [{"role": "user", "content": "hi"}]},
        {"prompt": [*base, *_ids(tok, " Then assign a commander.")]},
        {"prompt": "plain text"},
    ]
    a = analyze_prefix(reqs, None)
    assert a.model_dir is None
    assert a.num_requests == 2 and a.request_sources == ["requests[0]", "requests[2]"]
    assert [x.request for x in a.not_compared] == ["requests[1]", "requests[3]"]
    assert all("tokenizer" in x.reason for x in a.not_compared)
    assert any("could not be compared" in n for n in a.notes)
    assert any("token ids only" in n for n in a.notes)
    ids0, ids2 = reqs[0]["prompt"], reqs[2]["prompt"]
    assert a.shared_prefix_tokens == _lcp(ids0, ids2)  # type: ignore[arg-type]
    d = a.divergence
    assert d is not None and d.cause == "other" and "tokenizer" in d.detail
    assert d.locations[0].source == "prompt_token_ids"
    with pytest.raises(ValueError, match=r"^no request can be compared: requests\[0\]: "):
        analyze_prefix([{"prompt": "only text"}], None)


def test_token_id_out_of_vocabulary_is_refused_as_vllm_does(bpe_dir: Path) -> None:
    """vLLM 0.32 ``renderers/base.py`` ``validate_token_ids`` refuses an id above
    ``max(tokenizer.max_token_id, vocab_size - 1)``: "Token id N is out of vocabulary"."""
    vocab = json.loads((bpe_dir / "config.json").read_text())["vocab_size"]
    with pytest.raises(ValueError, match=rf"^requests\[1\]: prompt: Token id {vocab} is out of"):
        analyze_prefix([{"prompt": [1, 2, 3]}, {"prompt": [1, vocab]}], bpe_dir)


def test_prompt_embeddings_are_left_out_with_the_reason(bpe_dir: Path) -> None:
    """Chat ``prompt_embeds`` content parts and completions ``prompt_embeds``: not tokens."""
    part = {"type": "prompt_embeds", "data": "AAAA"}
    reqs = [
        {"messages": [{"role": "user", "content": "Hello there"}]},
        {"messages": [{"role": "user", "content": [part]}]},
        {"prompt_embeds": "AAAA"},
    ]
    a = analyze_prefix(reqs, bpe_dir)
    assert a.num_requests == 1
    assert [x.request for x in a.not_compared] == ["requests[1]", "requests[2]"]
    assert "messages[0].content[0] is prompt embeddings" in a.not_compared[0].reason


# --------------------------------------------------------------------------- resends


def _tid(tok: Any, piece: str) -> int:
    """The id of one byte-level token spelled as text (``"\\n"`` -> ``"Ċ"``)."""
    spelled = piece.replace(" ", "Ġ").replace("\n", "Ċ")
    tid = tok.convert_tokens_to_ids(spelled)
    assert isinstance(tid, int) and tid != tok.unk_token_id, piece
    return tid


TURN1 = [{"role": "user", "content": "The user asks about the incident"}]


def _turns(answer: str, question: str = "Check the logs first") -> list[dict[str, Any]]:
    return [
        *TURN1,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": question},
    ]


def test_resend_of_two_generated_newlines_is_a_whitespace_merge(bpe_dir: Path) -> None:
    """PrimeIntellect-ai/prime-rl#1863: the model generated ``"\\n"`` twice; the next turn
    sends the answer as text and the server encodes ``"\\n\\n"`` as one token. The resend
    reuses the prompt and the generated tokens up to the newlines, not after."""
    tok = load_tokenizer(bpe_dir)
    nl = _tid(tok, "\n")
    assert _ids(tok, "\n\n") == [_tid(tok, "\n\n")]  # the tokenizer merges the run
    head, tail = "Here is the plan", "Restart the service and watch the queue"
    generated = [
        *_ids(tok, head),
        nl,
        nl,
        *_ids(tok, tail),
        tok.convert_tokens_to_ids("<|im_end|>"),
    ]
    answer = tok.decode(generated, skip_special_tokens=True)
    assert answer == f"{head}\n\n{tail}"
    reqs = [
        {"messages": TURN1, "response": {"choices": [{"index": 0, "token_ids": generated}]}},
        {"messages": _turns(answer)},
    ]
    bs = 4
    a = analyze_prefix(reqs, bpe_dir, block_size=bs)
    p0 = _chat_ids(tok, TURN1)
    p1 = _chat_ids(tok, reqs[1]["messages"])
    held = [*p0, *generated]
    pos = len(p0) + len(_ids(tok, head))
    assert _lcp(held, p1) == pos  # computed without the analyser

    (r,) = a.resends
    assert (r.request, r.previous, r.message_index) == (1, 0, 1)
    assert r.checked_with == "generated_token_ids"
    assert r.cached_tokens == len(held) - 1  # the last sampled token is never computed
    assert r.matching_tokens == pos
    assert r.reusable_tokens == bs * (pos // bs)
    assert r.reusable_tokens_if_stable == bs * ((len(held) - 1) // bs)
    assert r.lost_tokens == r.reusable_tokens_if_stable - r.reusable_tokens > 0
    d = r.divergence
    assert d is not None
    assert d.cause == "retokenization_whitespace_merge"
    assert d.label == "re-tokenization / whitespace merge"
    assert d.values == ("\n|\n", "\n\n") and d.token_position == pos
    assert d.locations[0].source == "generated_token_ids"
    assert d.locations[1].source == "messages[1].content" and d.locations[1].role == "assistant"
    assert d.actionable

    # The engine held the generated blocks: the prediction counts them (vLLM hashes
    # all_token_ids), and request 1 hits exactly the reusable tokens.
    assert a.prediction_counts_generated_tokens
    assert a.prediction.per_request[1].cached_tokens == r.reusable_tokens
    assert a.prediction == predict_hit_rate([p0, p1], bs, [generated, None])
    # The cause and its advice: send the held tokens back; predicted with that change.
    assert [c.cause for c in a.causes] == ["retokenization_whitespace_merge"]
    (adv,) = a.advice
    assert "token ids" in adv.change and adv.raises_hit_rate
    resent = [*held, *_ids(tok, "\n<|im_start|>user\nCheck the logs first<|im_end|>\n")]
    resent += _ids(tok, "<|im_start|>assistant\n")
    expected = predict_hit_rate([p0, resent], bs, [generated, None])
    assert adv.predicted_hits_tokens_after == expected.hits_tokens
    assert adv.predicted_hit_rate_after == pytest.approx(expected.hit_rate)
    assert expected.per_request[1].cached_tokens == r.reusable_tokens_if_stable
    s = summarize(a)
    assert s["resends"]["retokenized"] == 1 and s["resends"]["lost_tokens"] == r.lost_tokens
    assert s["cause"] == "retokenization_whitespace_merge"


def test_resend_with_a_leading_space_generated_alone(bpe_dir: Path) -> None:
    """The ``"Ġ"`` merge: the model generated a bare space token then ``"Hello"``; the
    tokenizer makes ``" Hello"`` one token."""
    tok = load_tokenizer(bpe_dir)
    generated = [*_ids(tok, "Sure."), _tid(tok, " "), _tid(tok, "Hello"), *_ids(tok, " Alice")]
    answer = tok.decode(generated)
    assert answer == "Sure. Hello Alice" and _ids(tok, " Hello") == [_tid(tok, " Hello")]
    reqs = [
        {"messages": TURN1, "generated_token_ids": generated},
        {"messages": _turns(answer)},
    ]
    a = analyze_prefix(reqs, bpe_dir, block_size=4)
    (r,) = a.resends
    d = r.divergence
    assert d is not None and d.cause == "retokenization_whitespace_merge"
    assert d.values == (" |Hello", " Hello")
    assert r.matching_tokens == len(_chat_ids(tok, TURN1)) + len(_ids(tok, "Sure."))


def test_generation_prompt_newline_merges_with_the_answer(bpe_dir: Path) -> None:
    """NovaSky-AI/SkyRL#2092: no generated ids given; the tokenizer shows the turn boundary
    is not stable: ``encode("...assistant\\n") + encode("\\nHello there")`` ends the prompt
    with ``"\\n"`` where ``encode("...assistant\\n\\nHello there")`` has ``"\\n\\n"``."""
    tok = load_tokenizer(bpe_dir)
    reqs = [{"messages": TURN1}, {"messages": _turns("\nHello there")}]
    bs = 4
    a = analyze_prefix(reqs, bpe_dir, block_size=bs)
    p0, p1 = _chat_ids(tok, TURN1), _chat_ids(tok, reqs[1]["messages"])
    assert _lcp(p0, p1) == len(p0) - 1
    (r,) = a.resends
    assert r.checked_with == "tokenizer"
    assert r.matching_tokens == len(p0) - 1
    assert r.reusable_tokens == bs * ((len(p0) - 1) // bs)
    d = r.divergence
    assert d is not None and d.cause == "retokenization_whitespace_merge"
    assert d.values == ("\n|\n", "\n\n") and d.token_position == len(p0) - 1
    # The set-level divergence says the same (turn 1's prompt ends inside the merge), where
    # a text comparison would see one prompt continuing the other.
    sd = a.divergence
    assert sd is not None and sd.cause == "retokenization_whitespace_merge"
    assert "end inside the run" in sd.detail
    assert sd.token_position == len(p0) - 1
    assert a.prediction.per_request[1].cached_tokens == bs * ((len(p0) - 1) // bs)
    # The merge reaches into the answer: that is where the advice points.
    assert [(x.cause, x.source) for x in a.advice] == [
        ("retokenization_whitespace_merge", "messages[1].content")
    ]
    assert "template" not in a.advice[0].change
    again = type(a).model_validate_json(a.model_dump_json())
    assert again == a and again.resends[0].divergence == r.divergence


def test_stable_resend_reuses_everything_held(bpe_dir: Path) -> None:
    """The answer the tokenizer itself would produce, generated and resent: no divergence,
    every held block reused; prompts and generated blocks both counted."""
    tok = load_tokenizer(bpe_dir)
    answer = "Here is the plan.\n\nCheck the logs first."
    generated = [*_ids(tok, answer), tok.convert_tokens_to_ids("<|im_end|>")]
    reqs = [
        {"messages": TURN1, "output_token_ids": generated},
        {"messages": _turns(answer, "Restart the service")},
    ]
    a = analyze_prefix(reqs, bpe_dir, block_size=4)
    (r,) = a.resends
    assert r.divergence is None and r.lost_tokens == 0
    held = len(_chat_ids(tok, TURN1)) + len(generated) - 1
    assert r.cached_tokens == held and r.matching_tokens == held
    assert r.reusable_tokens == 4 * (held // 4) == a.prediction.per_request[1].cached_tokens
    assert not a.causes and not a.advice
    without = analyze_prefix([{"messages": TURN1}, reqs[1]], bpe_dir, block_size=4)
    assert without.resends[0].divergence is None  # the tokenizer check agrees
    assert without.prediction.hits_tokens < a.prediction.hits_tokens  # prompt blocks only


def test_resent_answer_with_other_text_is_not_a_retokenization(bpe_dir: Path) -> None:
    """The client dropped the generated trailing newline (templates and SDKs strip): the
    text differs, so no tokenization could match; what a resend keeping the tokens would
    have reused is unknown, not guessed."""
    tok = load_tokenizer(bpe_dir)
    generated = [*_ids(tok, "Here is the plan.\n"), tok.convert_tokens_to_ids("<|im_end|>")]
    reqs = [
        {"messages": TURN1, "generated_token_ids": generated},
        {"messages": _turns("Here is the plan.")},
    ]
    a = analyze_prefix(reqs, bpe_dir, block_size=4)
    (r,) = a.resends
    d = r.divergence
    assert d is not None and d.cause == "whitespace"
    assert r.reusable_tokens_if_stable is None and r.lost_tokens is None
    assert not any(c.cause.startswith("retokenization") for c in a.causes)


def test_resend_of_token_id_prompts(bpe_dir: Path) -> None:
    """Text-append multi-turn over completions (kubernetes-sigs/inference-perf#649), sent as
    ids: the client re-encoded the answer text instead of appending the generated ids."""
    tok = load_tokenizer(bpe_dir)
    nl = _tid(tok, "\n")
    p0 = _ids(tok, "User: The user asks about the incident\nAssistant:")
    generated = [*_ids(tok, " Check the logs first"), nl, nl, *_ids(tok, "Hello there")]
    text1 = tok.decode([*p0, *generated]) + "\nUser: Thanks"
    p1 = _ids(tok, text1)
    reqs = [{"prompt": p0, "generated_token_ids": generated}, {"prompt": p1}]
    a = analyze_prefix(reqs, bpe_dir, block_size=4)
    (r,) = a.resends
    assert r.checked_with == "generated_token_ids" and r.message_index is None
    assert r.matching_tokens == _lcp([*p0, *generated], p1)
    d = r.divergence
    assert d is not None and d.cause == "retokenization_whitespace_merge"
    # Without a tokenizer the same ids are compared, and the cause is not guessed.
    bare = analyze_prefix(reqs, None, block_size=4)
    (rb,) = bare.resends
    assert rb.matching_tokens == r.matching_tokens and rb.reusable_tokens == r.reusable_tokens
    assert rb.divergence is not None and rb.divergence.cause == "other"
    assert rb.reusable_tokens_if_stable is None


def test_handed_cases_have_no_resends(tiny_dir: Path) -> None:
    """The handed cases are single-turn: nothing is taken for a resend."""
    for name in ("clock_in_system_prompt.json", "tool_schema_key_order.json"):
        a = analyze_prefix(_case(name)["requests"], tiny_dir)
        assert a.resends == [] and not a.prediction_counts_generated_tokens


def test_two_id_fields_that_disagree_are_refused_equal_ones_read() -> None:
    """A body with ``prompt_token_ids`` (vLLM's TokensPrompt) and ``token_ids``
    (``/inference/v1/generate``'s GenerateRequest) that differ: which one the engine
    reads depends on the entry point, so no hit rate is made from either (trial of
    2026-12-04: the shorter field won and the hit rate was 0)."""
    ids = list(range(100, 164))
    with pytest.raises(ValueError, match='both "prompt_token_ids" and "token_ids"'):
        analyze_prefix([{"token_ids": ids, "prompt_token_ids": ids[:10]}, {"token_ids": ids}])
    same = analyze_prefix([{"token_ids": ids, "prompt_token_ids": ids}, {"token_ids": ids}])
    assert same.prompt_tokens == [64, 64] and same.shared_prefix_tokens == 64
