"""Tests of :mod:`orchestrator.prefix`: the real cases, every cause kind, tokens vs strings,
clusters, the hit-rate prediction (by hand) and the measured-vs-predicted finding.

Prompts are rendered with a real tokenizer and chat template: the ``tiny`` model directory
of :mod:`jobs.modelgen` (Llama-3-style template, which ignores ``tools``), and a copy of it
whose template renders tools (``tojson``, in the system turn, as Qwen/Hermes-style
templates do) and message ``name`` fields.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from jobs.modelgen import generate_model, render_chat
from jobs.modelgen import load_tokenizer as load_raw_tokenizer
from jobs.schemas import ChatRequest
from orchestrator.prefix import (
    PrefixRequest,
    analyze_prefix,
    coerce_requests,
    hit_rate_finding,
    load_tokenizer,
    predict_hit_rate,
    render_request,
    shared_prefix_length,
)

DATA = Path(__file__).parent / "data" / "prefix"

#: A chat template that renders tools (one ``tojson`` line each, after the system prompt)
#: and a message's ``name`` before its content; otherwise the Llama-3 layout of modelgen.
TOOLS_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] | trim }}{{- '\\n\\n' }}"
    "{%- endif %}"
    "{{- 'You can call these tools:\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['name'] is defined %}{{- message['name'] + ': ' }}{%- endif %}"
    "{%- if message['content'] is string %}{{- message['content'] | trim }}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

HANDBOOK = (
    "Internal handbook, version 2026.3. Section 1: incident response. When a page fires, "
    "acknowledge within five minutes, open an incident channel, and assign a commander. "
    "Section 2: change management. Every production change needs a ticket, a reviewer, "
    "and a rollback plan. Section 3: data handling. Customer data never leaves the "
    "approved regions."
)

QUESTIONS = [
    "How fast must I acknowledge a page?",
    "Who approves a production change?",
    "Can customer data be copied to another region?",
    "What goes into a rollback plan?",
]


def _tool(name: str, description: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "description": "Search terms."}},
                "required": ["query"],
            },
        },
    }


TOOLS = [
    _tool("web_search", "Search the web for recent information."),
    _tool("wiki_lookup", "Look a page up in the internal wiki."),
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_model(tmp_path_factory.mktemp("prefix-models") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="module")
def tools_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("prefix-models-tools") / "tiny-tools"
    shutil.copytree(tiny_dir, dest)
    cfg_path = dest / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TOOLS_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return dest


def _case(name: str) -> dict[str, Any]:
    return json.loads((DATA / name).read_text())


def _chats(systems: list[str], questions: list[str] | None = None) -> list[dict[str, Any]]:
    questions = questions or QUESTIONS
    return [
        {"messages": [{"role": "system", "content": s}, {"role": "user", "content": q}]}
        for s, q in zip(systems, questions, strict=False)
    ]


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# --------------------------------------------------------------------------- real cases


def test_case_clock_in_system_prompt(tiny_dir: Path) -> None:
    case = _case("clock_in_system_prompt.json")
    reqs = case["requests"]
    a = analyze_prefix(reqs, tiny_dir)

    # Token prefix, computed independently: modelgen's own renderer + the tokenizers library.
    raw = load_raw_tokenizer(tiny_dir)
    ids = [raw.encode(render_chat(r["messages"]), add_special_tokens=False).ids for r in reqs]
    assert a.prompt_tokens == [len(t) for t in ids]
    shared = min(_lcp(ids[0], ids[1]), _lcp(ids[0], ids[2]))
    assert a.shared_prefix_tokens == shared
    assert a.shared_prefix_blocks == shared // 16
    assert a.reusable_prefix_tokens == 16 * (shared // 16)

    d = a.divergence
    assert d is not None
    assert d.cause == case["expected"]["divergence_cause"] == "timestamp"
    assert d.token_position == shared
    assert d.requests == (0, 1)  # request 0 vs the group of requests 1 and 2
    assert d.actionable
    loc0, loc1 = d.locations
    system = reqs[0]["messages"][0]["content"]
    assert (loc0.source, loc0.message_index, loc0.role, loc0.field) == (
        "messages[0].content",
        0,
        "system",
        "content",
    )
    assert loc1.source == "messages[0].content"
    # The differing characters are the minute digit; the whole value is the date and time.
    assert loc0.source_chars is not None and loc0.value_chars is not None
    assert system[loc0.source_chars[0]] == "1"
    assert reqs[1]["messages"][0]["content"][loc1.source_chars[0]] == "2"  # type: ignore[index]
    value = system[loc0.value_chars[0] : loc0.value_chars[1]]
    assert "9:41 AM" in value and "March 6, 2026" in value
    assert d.values[0].endswith("9:41 AM") and d.values[1].endswith("9:42 AM")
    # The shared prefix ends inside the minute digits, far before the handbook text.
    r0 = render_request(PrefixRequest(**reqs[0]), load_tokenizer(tiny_dir))
    start = r0.offsets[d.token_position][0]
    minutes = r0.text.index("9:41") + 2
    assert minutes <= start < minutes + 2
    handbook_token = next(
        i for i, (s, _) in enumerate(r0.offsets) if s >= r0.text.index("Internal handbook")
    )
    assert handbook_token - d.token_position > 16  # at least a whole block is lost

    # Requests 1 and 2 share the whole system prompt (same minute), differ in the user turn.
    assert [c.requests for c in a.clusters] == [[0], [1, 2]]
    c12 = a.clusters[1]
    assert c12.shared_prefix_tokens == _lcp(ids[1], ids[2]) > handbook_token
    assert c12.divergence is not None
    assert c12.divergence.locations[0].source == "messages[1].content"
    assert c12.divergence.locations[0].role == "user"
    assert not c12.divergence.actionable

    # Advice: move the clock after the fixed content, or keep only the date.
    assert [x.cause for x in a.causes] == ["timestamp"]
    (adv,) = a.advice
    assert adv.cause == "timestamp" and adv.source == "messages[0].content"
    assert "after the fixed content" in adv.change and "only the date" in adv.change
    assert adv.predicted_hit_rate_after is not None
    assert adv.predicted_hit_rate_after > a.prediction.hit_rate
    # With the clock moved to the last turn every request reuses the whole system prompt.
    moved = [
        {
            "messages": [
                {"role": "system", "content": system.replace("Friday, March 6, 2026 9:41 AM", "")},
                {"role": "user", "content": r["messages"][1]["content"] + "\n\n" + ts},
            ]
        }
        for r, ts in zip(
            reqs,
            ["Friday, March 6, 2026 9:41 AM", *["Friday, March 6, 2026 9:42 AM"] * 2],
            strict=True,
        )
    ]
    expected_after = analyze_prefix(moved, tiny_dir).prediction
    assert adv.predicted_hits_tokens_after == expected_after.hits_tokens
    assert a.predicted_hit_rate_after_advice == pytest.approx(expected_after.hit_rate)


def test_case_clock_block_size_changes_rounding(tiny_dir: Path) -> None:
    reqs = _case("clock_in_system_prompt.json")["requests"]
    a16 = analyze_prefix(reqs, tiny_dir, block_size=16)
    a32 = analyze_prefix(reqs, tiny_dir, block_size=32)
    assert a32.shared_prefix_tokens == a16.shared_prefix_tokens
    assert a32.shared_prefix_blocks == a16.shared_prefix_tokens // 32
    assert a32.reusable_prefix_tokens == 32 * (a16.shared_prefix_tokens // 32)
    assert a32.prediction.hits_tokens % 32 == 0


def test_case_tool_schema_key_order(tools_dir: Path) -> None:
    case = _case("tool_schema_key_order.json")
    reqs = case["requests"]
    a = analyze_prefix(reqs, tools_dir)
    d = a.divergence
    assert d is not None
    assert d.cause == case["expected"]["divergence_cause"] == "json_key_order"
    assert d.json_path == "tools[0].function.parameters"
    for loc in d.locations:
        assert loc.source.startswith("tools[0].function.parameters")
        assert loc.tool_index == 0 and loc.message_index is None
    assert d.values == ("type, properties, required", "type, required, properties")
    assert case["expected"]["equal_after_sorting_keys"]
    assert "equal after sorting keys" in d.detail

    # Reusable prefix: the tokens before the first differing token, in whole blocks.
    tok = load_tokenizer(tools_dir)
    raw = load_raw_tokenizer(tools_dir)
    texts = [
        tok.apply_chat_template(
            r["messages"], tools=r["tools"], tokenize=False, add_generation_prompt=True
        )
        for r in reqs
    ]
    ids = [raw.encode(t, add_special_tokens=False).ids for t in texts]
    lcp = _lcp(ids[0], ids[1])
    assert a.shared_prefix_tokens == d.token_position == lcp
    assert a.reusable_prefix_tokens == 16 * (lcp // 16)
    # The divergence lies in the rendered tools block, after the system prompt.
    r0 = render_request(PrefixRequest(**reqs[0]), tok)
    start = r0.offsets[lcp][0]
    assert r0.text.index("You can call these tools") < start < r0.text.index("<|eot_id|>")
    # Hand-computed prediction: request 1 reuses lcp // 16 whole blocks of request 0.
    assert a.prediction.hits_tokens == 16 * min(lcp // 16, (len(ids[1]) - 1) // 16)
    assert a.prediction.queries_tokens == len(ids[0]) + len(ids[1])

    (adv,) = a.advice
    assert adv.cause == "json_key_order"
    assert "sorted keys" in adv.change and "fixed separators" in adv.change
    assert adv.predicted_hit_rate_after is not None
    assert adv.predicted_hit_rate_after > a.prediction.hit_rate
    # After sorting keys both prompts are equal up to the user turn.
    canon = [dict(r, tools=json.loads(json.dumps(r["tools"], sort_keys=True))) for r in reqs]
    after = analyze_prefix(canon, tools_dir)
    assert after.divergence is not None and after.divergence.cause == "other"
    assert after.divergence.locations[0].source == "messages[1].content"
    assert adv.predicted_hits_tokens_after == after.prediction.hits_tokens


def test_case_tool_schema_key_order_template_without_tools(tiny_dir: Path) -> None:
    """Tokens decide: a template that does not render tools makes the key order harmless."""
    a = analyze_prefix(_case("tool_schema_key_order.json")["requests"], tiny_dir)
    assert a.divergence is not None
    assert a.divergence.cause == "other"
    assert a.divergence.locations[0].source == "messages[1].content"
    assert not a.divergence.actionable
    assert a.causes == [] and a.advice == []


# --------------------------------------------------------------------------- cause kinds


def _single_cause(a: Any, cause: str) -> Any:
    assert a.divergence is not None
    assert a.divergence.cause == cause, a.divergence.detail
    assert a.divergence.actionable
    assert [c.cause for c in a.causes] == [cause]
    return a.divergence


def test_uuid(tiny_dir: Path) -> None:
    ids = [
        "3f2b8c1e-9d4a-4e7b-a1c2-5d6e7f8a9b0c",
        "b7e1d2c3-4f5a-4b6c-8d9e-0a1b2c3d4e5f",
        "0c9d8e7f-6a5b-4c3d-9e2f-1a0b9c8d7e6f",
    ]
    systems = [f"Conversation {u}. You are the helpdesk assistant.\n\n{HANDBOOK}" for u in ids]
    a = analyze_prefix(_chats(systems), tiny_dir)
    d = _single_cause(a, "uuid")
    assert d.values == (ids[0], ids[1])
    loc = d.locations[0]
    assert loc.source == "messages[0].content" and loc.value_chars == (13, 13 + 36)
    assert a.advice[0].predicted_hit_rate_after is not None
    assert a.advice[0].predicted_hit_rate_after > a.prediction.hit_rate


def test_request_id(tiny_dir: Path) -> None:
    rids = ["req_8f3a9c2b7d41", "req_1c2d3e4f5a6b", "req_9e8d7c6b5a4f"]
    systems = [f"Request ID: {r}\nYou are the helpdesk assistant.\n\n{HANDBOOK}" for r in rids]
    a = analyze_prefix(_chats(systems), tiny_dir)
    d = _single_cause(a, "request_id")
    assert d.values[0] == rids[0] and d.values[1] == rids[1]
    assert "metadata" in a.advice[0].change


def test_random_hex_id(tiny_dir: Path) -> None:
    nonces = ["9f86d081884c7d65", "2c26b46b68ffc68f", "fcde2b2edba56bf4"]
    systems = [f"Cache buster {n}. You are the helpdesk assistant.\n\n{HANDBOOK}" for n in nonces]
    d = _single_cause(analyze_prefix(_chats(systems), tiny_dir), "random_id")
    assert d.values == (nonces[0], nonces[1])


def test_user_name_in_greeting(tiny_dir: Path) -> None:
    names = ["Alice", "Bob", "Mariam"]
    systems = [f"Hello {n}, welcome back to the helpdesk.\n\n{HANDBOOK}" for n in names]
    a = analyze_prefix(_chats(systems), tiny_dir)
    d = _single_cause(a, "user_name")
    assert d.values == ("Alice", "Bob")
    assert d.locations[0].value_chars == (6, 11)
    adv = a.advice[0]
    assert "name" in adv.change
    assert adv.predicted_hit_rate_after is not None
    assert adv.predicted_hit_rate_after > a.prediction.hit_rate


def test_user_name_label_and_name_field(tiny_dir: Path, tools_dir: Path) -> None:
    systems = [f"User: {n}\n\n{HANDBOOK}" for n in ("Priya", "Tomasz")]
    assert analyze_prefix(_chats(systems), tiny_dir).divergence.cause == "user_name"  # type: ignore[union-attr]
    # OpenAI `name` field, rendered by the template before the (shared) content.
    reqs = [
        {
            "messages": [
                {"role": "system", "content": "You are the helpdesk assistant."},
                {"role": "user", "name": name, "content": HANDBOOK + "\n\n" + q},
            ]
        }
        for name, q in (("alice", QUESTIONS[0]), ("bob", QUESTIONS[1]))
    ]
    d = analyze_prefix(reqs, tools_dir).divergence
    assert d is not None and d.cause == "user_name"
    assert d.locations[0].source == "messages[1].name"
    assert d.values == ("alice", "bob")


def test_capitalised_word_without_name_cue_is_not_a_user_name(tiny_dir: Path) -> None:
    systems = [
        f"Topic: {t}. You are the helpdesk assistant.\n\n{HANDBOOK}" for t in ("Kafka", "Redis")
    ]
    d = analyze_prefix(_chats(systems), tiny_dir).divergence
    assert d is not None and d.cause == "other" and d.actionable


def test_whitespace(tiny_dir: Path) -> None:
    systems = [
        f"You are the helpdesk assistant.\n\n{HANDBOOK}",
        f"You are the helpdesk  assistant.\n\n{HANDBOOK}",
        f"You are the helpdesk assistant.\n\n\n{HANDBOOK}",
    ]
    a = analyze_prefix(_chats(systems), tiny_dir)
    d = _single_cause(a, "whitespace")
    assert d.locations[0].source == "messages[0].content"
    adv = a.advice[0]
    assert "whitespace" in adv.change.lower()
    assert adv.predicted_hit_rate_after is not None
    assert adv.predicted_hit_rate_after > a.prediction.hit_rate


def test_json_key_order_inside_message_content(tiny_dir: Path) -> None:
    cfgs = [
        {"region": "eu-west", "tier": "gold", "language": "en"},
        {"tier": "gold", "region": "eu-west", "language": "en"},
    ]
    systems = [f"Account settings: {json.dumps(c)}\n\n{HANDBOOK}" for c in cfgs]
    a = analyze_prefix(_chats(systems), tiny_dir)
    d = _single_cause(a, "json_key_order")
    assert d.json_path == "messages[0].content"
    assert a.advice[0].predicted_hit_rate_after is not None
    assert a.advice[0].predicted_hit_rate_after > a.prediction.hit_rate


def test_reordered_messages(tiny_dir: Path) -> None:
    doc_a = {"role": "user", "content": "Context A: " + HANDBOOK}
    doc_b = {"role": "user", "content": "Context B: the on-call rota changes every Monday."}
    sys_m = {"role": "system", "content": "You are the helpdesk assistant."}
    reqs = [
        {"messages": [sys_m, doc_a, doc_b, {"role": "user", "content": QUESTIONS[0]}]},
        {"messages": [sys_m, doc_b, doc_a, {"role": "user", "content": QUESTIONS[1]}]},
        {"messages": [sys_m, doc_a, doc_b, {"role": "user", "content": QUESTIONS[2]}]},
    ]
    a = analyze_prefix(reqs, tiny_dir)
    # The set splits into [0, 2] (same order) and [1]; the reorder is the cause.
    assert [c.requests for c in a.clusters] == [[0, 2], [1]]
    d = _single_cause(a, "reordered_messages")
    assert d.locations[0].message_index == 1
    adv = a.advice[0]
    assert "order" in adv.change
    assert adv.predicted_hit_rate_after is not None
    assert adv.predicted_hit_rate_after > a.prediction.hit_rate


def test_reordered_tools(tools_dir: Path) -> None:
    reqs = [
        {
            "messages": [
                {"role": "system", "content": "You are a research assistant."},
                {"role": "user", "content": q},
            ],
            "tools": tools,
        }
        for q, tools in zip(QUESTIONS, [TOOLS, TOOLS[::-1], TOOLS], strict=False)
    ]
    a = analyze_prefix(reqs, tools_dir)
    d = _single_cause(a, "reordered_tools")
    assert d.values == ("web_search, wiki_lookup", "wiki_lookup, web_search")
    adv = a.advice[0]
    assert "fixed order" in adv.change
    assert adv.predicted_hit_rate_after is not None
    assert adv.predicted_hit_rate_after > a.prediction.hit_rate


# --------------------------------------------------------------------------- tokens vs strings


def test_tokens_not_strings(tiny_dir: Path) -> None:
    """The string prefix runs into the changed word; the token prefix stops before it."""
    base = "Section 2: change management. Every production change needs a ticket, a"
    prompts = [base + " information sheet.", base + " informal review."]
    a = analyze_prefix([{"prompt": p} for p in prompts], tiny_dir)
    raw = load_raw_tokenizer(tiny_dir)
    ids = [raw.encode(p).ids for p in prompts]  # completions: BOS added
    assert a.prompt_tokens == [len(t) for t in ids]
    assert a.shared_prefix_tokens == _lcp(ids[0], ids[1])
    # A string comparison would count " informa" as shared: more tokens than really are
    # (" information" is one token, " informal" is three).
    common_string = base + " informa"
    assert len(raw.encode(common_string).ids) > a.shared_prefix_tokens
    d = a.divergence
    assert d is not None and d.locations[0].source == "prompt"
    # The first differing token starts at the word, before the first differing character.
    tok = load_tokenizer(tiny_dir)
    r0 = render_request(PrefixRequest(prompt=prompts[0]), tok)
    token_start = r0.offsets[d.token_position][0]
    assert token_start == len(base) < len(common_string)
    assert d.locations[0].rendered_chars[0] == len(common_string)


def test_same_text_different_tokens_diverge(tiny_dir: Path) -> None:
    """Two prompts whose texts agree far longer than their tokens: only tokens count."""
    tok = load_tokenizer(tiny_dir)
    a_text = "The rollback plan is reviewed   before"
    b_text = "The rollback plan is reviewed   \nbefore"
    ra = render_request(PrefixRequest(prompt=a_text), tok)
    rb = render_request(PrefixRequest(prompt=b_text), tok)
    string_lcp = len("The rollback plan is reviewed   ")
    p = shared_prefix_length([ra.token_ids, rb.token_ids])
    # The whitespace run before the change is tokenized differently: the token prefix ends
    # before the first differing character.
    assert ra.offsets[p][0] < string_lcp
    a = analyze_prefix([{"prompt": a_text}, {"prompt": b_text}], tiny_dir)
    assert a.shared_prefix_tokens == p
    assert a.divergence is not None and a.divergence.cause == "whitespace"


# --------------------------------------------------------------------------- clusters


def test_clusters_share_longer_prefixes(tiny_dir: Path) -> None:
    sys_a = "You are the helpdesk assistant for the operations team.\n\n" + HANDBOOK
    sys_b = "You are the sales assistant. Quote list prices only, never discounts."
    questions = [*QUESTIONS, "Where is the price list?"]
    reqs = _chats([sys_a, sys_a, sys_b, sys_a, sys_b], questions)
    a = analyze_prefix(reqs, tiny_dir)
    assert [c.requests for c in a.clusters] == [[0, 1, 3], [2, 4]]
    for c in a.clusters:
        assert c.shared_prefix_tokens > a.shared_prefix_tokens
        assert c.shared_prefix_blocks == c.shared_prefix_tokens // 16
        assert c.divergence is not None
        assert c.divergence.locations[0].source == "messages[1].content"
        assert not c.divergence.actionable
    d = a.divergence
    assert d is not None and d.locations[0].source == "messages[0].content"
    assert d.cause == "other" and d.actionable
    (adv,) = a.advice
    assert adv.cause == "other" and adv.predicted_hit_rate_after is None
    # Each cluster reuses its own system prompt: 1 and 3 from 0, 4 from 2; request 2 (the
    # first sales prompt) shares less than a block with the helpdesk prompts.
    assert a.shared_prefix_tokens < 16
    reused = [p.reused_from for p in a.prediction.per_request]
    assert reused == [None, 0, None, 0, 2]


def test_identical_prompts_and_single_request(tiny_dir: Path) -> None:
    reqs = _chats(["You are the helpdesk assistant.\n\n" + HANDBOOK] * 2, [QUESTIONS[0]] * 2)
    a = analyze_prefix(reqs, tiny_dir)
    n = a.prompt_tokens[0]
    assert a.divergence is None and a.shared_prefix_tokens == n
    # The engine never caches the last token of a prompt: at most (n - 1) // 16 blocks hit.
    assert a.reusable_prefix_tokens == 16 * ((n - 1) // 16)
    assert a.prediction.hits_tokens == 16 * ((n - 1) // 16)
    one = analyze_prefix(reqs[:1], tiny_dir)
    assert one.divergence is None and one.prediction.hits_tokens == 0


# --------------------------------------------------------------------------- prediction


def test_predict_hit_rate_by_hand() -> None:
    blk = 4
    r0 = list(range(1, 11))  # 10 tokens: nothing cached yet; caches blocks [1-4], [5-8]
    r1 = list(range(1, 9)) + [50, 51, 52, 53, 54]  # 13: hits 2 blocks, caches [50-53]
    r2 = list(range(1, 9))  # 8 tokens, all cached, but the last token is never a hit: 1 block
    r3 = [1, 2, 3, 4, 99, 5, 6, 7, 8, 1]  # shares one block with r0
    r4 = [7, 7, 7]  # shorter than a block
    got = predict_hit_rate([r0, r1, r2, r3, r4], blk)
    assert [p.cached_tokens for p in got.per_request] == [0, 8, 4, 4, 0]
    assert [p.reused_from for p in got.per_request] == [None, 0, 0, 0, None]
    assert got.queries_tokens == 44 and got.hits_tokens == 16
    assert got.hit_rate == pytest.approx(16 / 44)
    # A block-aligned identical repeat: 8 tokens, (8 - 1) // 4 = 1 block -> r1's 3rd block too
    again = predict_hit_rate([r1, r1], blk)
    assert again.per_request[1].cached_tokens == 12  # 13 tokens: (13 - 1) // 4 = 3 blocks
    assert predict_hit_rate([], blk).hit_rate == 0.0
    with pytest.raises(ValueError):
        predict_hit_rate([r0], 0)


def test_predicted_hit_rate_small_workload(tiny_dir: Path) -> None:
    """analyze_prefix's prediction equals the formula applied to the real token ids."""
    reqs = _chats(["You are the helpdesk assistant.\n\n" + HANDBOOK] * 3)
    a = analyze_prefix(reqs, tiny_dir)
    raw = load_raw_tokenizer(tiny_dir)
    ids = [raw.encode(render_chat(r["messages"]), add_special_tokens=False).ids for r in reqs]
    hits = [0] + [
        16 * min(max(_lcp(ids[j], ids[i]) for i in range(j)) // 16, (len(ids[j]) - 1) // 16)
        for j in (1, 2)
    ]
    assert [p.cached_tokens for p in a.prediction.per_request] == hits
    assert a.prediction.hit_rate == pytest.approx(sum(hits) / sum(len(t) for t in ids))
    assert a.causes == []  # only the questions differ: nothing to advise


# --------------------------------------------------------------------------- misc


def test_coerce_requests_from_chat_requests() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    items = [
        ChatRequest(index=-1, messages=msgs, max_tokens=4, warmup=True),
        ChatRequest(index=0, messages=msgs, max_tokens=4, extra_body={"tools": TOOLS}),
        ChatRequest(index=1, prompt="raw text", max_tokens=4),
        {"messages": msgs},
    ]
    got = coerce_requests(items)
    assert len(got) == 3
    assert got[0].tools == TOOLS and got[1].prompt == "raw text" and got[2].messages == msgs
    with pytest.raises(ValueError):
        coerce_requests([{"messages": msgs, "prompt": "both"}])
    with pytest.raises(ValueError):
        coerce_requests([42])


def test_errors(tiny_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        analyze_prefix([], tiny_dir)
    with pytest.raises(ValueError):
        analyze_prefix([{"prompt": "x"}], tiny_dir, block_size=0)
    with pytest.raises(FileNotFoundError):
        analyze_prefix([{"prompt": "x"}], tmp_path / "missing")


def test_result_is_json_safe(tiny_dir: Path) -> None:
    a = analyze_prefix(_case("clock_in_system_prompt.json")["requests"], tiny_dir)
    again = type(a).model_validate_json(a.model_dump_json())
    assert again == a


def test_hit_rate_finding() -> None:
    assert hit_rate_finding(0.5, 0.45) is None
    low = hit_rate_finding(0.6, 0.2)
    assert low is not None and low.code == "hit_rate_below_prediction"
    assert low.evidence["difference"] == pytest.approx(-0.4)
    high = hit_rate_finding(0.1, 0.5)
    assert high is not None and high.code == "hit_rate_above_prediction"
    assert "preempted" in high.message


def test_prompt_that_is_a_prefix_of_another(tiny_dir: Path) -> None:
    base = "Section 2: change management. Every production change needs a ticket."
    a = analyze_prefix([{"prompt": base}, {"prompt": base + " And a reviewer."}], tiny_dir)
    d = a.divergence
    assert d is not None and d.cause == "end_of_prompt" and not d.actionable
    assert d.token_position == a.prompt_tokens[0]
    assert d.locations[0].source == "end of prompt" and d.locations[1].source == "prompt"


def test_template_error_is_a_value_error(tiny_dir: Path) -> None:
    # modelgen's template concatenates the role: a message without one cannot be rendered.
    with pytest.raises(ValueError, match="request 1: the chat template failed"):
        analyze_prefix([{"prompt": "x"}, {"messages": [{"content": "no role"}]}], tiny_dir)
