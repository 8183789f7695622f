""":mod:`orchestrator.analysis.prefix`: the real cases, every cause kind, tokens vs strings,
clusters, the hit-rate prediction (by hand) and the measured-vs-predicted finding.

Prompts are rendered with a real tokenizer and chat template: the ``tiny`` model directory
of :mod:`jobs.modelgen.generator` (Llama-3-style template, which ignores ``tools``), and a copy of
it whose template renders tools (``tojson``, in the system turn, as Qwen/Hermes-style
templates do) and message ``name`` fields.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from jobs.modelgen.generator import generate_model, render_chat
from jobs.modelgen.generator import load_tokenizer as load_raw_tokenizer
from jobs.schemas import ChatRequest
from orchestrator.analysis.prefix import (
    PrefixRequest,
    analyze_prefix,
    coerce_requests,
    hit_rate_finding,
    load_tokenizer,
    predict_hit_rate,
    render_request,
    shared_prefix_length,
    summarize,
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
    # A message without a role cannot be rendered (modelgen's template concatenates it):
    # said in plain words before the template runs.
    with pytest.raises(ValueError, match=r'^requests\[1\]: messages\[0\] needs a "role"'):
        analyze_prefix([{"prompt": "x"}, {"messages": [{"content": "no role"}]}], tiny_dir)


# --------------------------------------------------------------------------- several causes

UUIDS = [
    "3f2b8c1e-9d4a-4e7b-a1c2-5d6e7f8a9b0c",
    "b7e1d2c3-4f5a-4b6c-8d9e-0a1b2c3d4e5f",
    "0c9d8e7f-6a5b-4c3d-9e2f-1a0b9c8d7e6f",
    "9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d",
]
CLOCKS = [f"2026-11-30T19:21:0{i}Z" for i in range(4)]


def _moved(reqs: list[dict[str, Any]], values: list[list[str]]) -> list[dict[str, Any]]:
    """``reqs`` with ``values[i]`` cut from request i's system prompt and appended, in
    order, to its last message (as the advice says and the analyser simulates)."""
    out = []
    for r, vals in zip(reqs, values, strict=True):
        system, user = r["messages"][0]["content"], r["messages"][-1]["content"]
        for v in vals:
            system = system.replace(v, "", 1)
            user = user + "\n\n" + v
        out.append(
            {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
        )
    return out


def test_every_cause_along_the_prefix(tiny_dir: Path) -> None:
    """A request id and a clock: both are found, in prompt order, with cumulative
    predictions (the id alone gains little: the clock breaks the prefix right after)."""
    systems = [
        f"Request id: {u}. Current time: {c}. You are the helpdesk assistant.\n\n{HANDBOOK}"
        for u, c in zip(UUIDS, CLOCKS, strict=True)
    ]
    reqs = _chats(systems)
    a = analyze_prefix(reqs, tiny_dir)
    assert a.divergence is not None and a.divergence.cause == "uuid"  # the first one, as is
    assert [c.cause for c in a.causes] == ["uuid", "timestamp"]
    assert a.causes[0] == a.divergence
    assert [c.values for c in a.causes] == [(UUIDS[0], UUIDS[1]), (CLOCKS[0], CLOCKS[1])]
    # the clock is found in the requests rewritten for the id: its token position is
    # beyond the id's one
    assert a.causes[1].token_position > a.causes[0].token_position
    assert [(x.cause, x.step) for x in sorted(a.advice, key=lambda x: x.step)] == [
        ("uuid", 0),
        ("timestamp", 1),
    ]
    by_cause = {x.cause: x for x in a.advice}
    only_id = analyze_prefix(_moved(reqs, [[u] for u in UUIDS]), tiny_dir).prediction
    both = analyze_prefix(
        _moved(reqs, [[u, c] for u, c in zip(UUIDS, CLOCKS, strict=True)]), tiny_dir
    )
    assert by_cause["uuid"].predicted_hits_tokens_after == only_id.hits_tokens
    assert by_cause["timestamp"].predicted_hits_tokens_after == both.prediction.hits_tokens
    assert a.predicted_hit_rate_after_advice == pytest.approx(both.prediction.hit_rate)
    assert both.prediction.hit_rate > 2 * only_id.hit_rate
    assert a.predicted_hit_rate_after_advice > 0.4 > a.prediction.hit_rate
    # after both changes the requests differ only in the new turn
    assert both.causes == [] and both.divergence is not None
    assert both.divergence.locations[0].source == "messages[1].content"
    s = summarize(a)
    assert s["causes"] == ["uuid", "timestamp"]
    assert s["predicted_hit_rate_after_advice"] == a.predicted_hit_rate_after_advice


def test_a_change_that_does_not_raise_the_hit_rate_is_not_the_change_to_make(
    tiny_dir: Path,
) -> None:
    """A clock at the END of the system prompt: moving it gains no block and adds tokens."""
    systems = [f"You are the helpdesk assistant.\n\n{HANDBOOK}\nCurrent time: {c}" for c in CLOCKS]
    a = analyze_prefix(_chats(systems), tiny_dir)
    (adv,) = a.advice
    assert adv.cause == "timestamp" and adv.predicted_hit_rate_after is not None
    assert adv.predicted_hit_rate_after <= a.prediction.hit_rate
    assert not adv.raises_hit_rate
    s = summarize(a)
    assert s["advice"] is None  # nothing to show as the change to make first
    assert s["cause"] == "timestamp" and s["advice_all"][0]["raises_hit_rate"] is False


def test_a_step_needed_for_a_later_gain_is_part_of_the_plan(tiny_dir: Path) -> None:
    """A clock right before an id: moving the clock alone gains nothing (the id still
    breaks the prefix within the first block); moving the id too does. Both are the plan,
    in prompt order (a new-user trial was told to move the id first and gained nothing)."""
    systems = [f"Time {c} {u}\n\n{HANDBOOK}" for u, c in zip(UUIDS, CLOCKS, strict=True)]
    a = analyze_prefix(_chats(systems), tiny_dir)
    assert [c.cause for c in a.causes] == ["timestamp", "uuid"]
    assert [(x.cause, x.step, x.raises_hit_rate) for x in a.advice] == [
        ("timestamp", 0, True),
        ("uuid", 1, True),
    ]
    clock, uid = a.advice
    assert clock.predicted_hit_rate_after is not None and uid.predicted_hit_rate_after is not None
    assert clock.predicted_hit_rate_after <= a.prediction.hit_rate < uid.predicted_hit_rate_after
    s = summarize(a)
    assert s["cause"] == "uuid"
    assert s["advice"].startswith("Make these 2 changes together")
    assert f"(1) {clock.change}" in s["advice"] and f"(2) {uid.change}" in s["advice"]
    assert [x["cause"] for x in s["advice_all"]] == ["timestamp", "uuid"]


def test_rounds_are_bounded(tiny_dir: Path) -> None:
    """Ten ids in a row: at most MAX_CAUSE_ROUNDS of them are followed."""
    from orchestrator.analysis.prefix import MAX_CAUSE_ROUNDS

    systems = [
        " ".join(f"id{k}: {u[:-2]}{k:02d}".replace(u[:8], f"{j:08x}") for k in range(10))
        + f"\n\n{HANDBOOK}"
        for j, u in enumerate(UUIDS)
    ]
    a = analyze_prefix(_chats(systems), tiny_dir)
    assert len(a.causes) == MAX_CAUSE_ROUNDS
    assert {c.cause for c in a.causes} == {"uuid"}


# --------------------------------------------------------------------------- user names


@pytest.mark.parametrize(
    "template",
    [
        "You are talking to {n}.",
        "Dear {n}, thank you for writing.",
        "The customer's name is {n}.",
        "Customer: {n}",
        "You are assisting {n} today.",
        "Hi, I am {n}.",
    ],
)
def test_user_name_cues(tiny_dir: Path, template: str) -> None:
    systems = [template.format(n=n) + f"\n\n{HANDBOOK}" for n in ("Alice", "Bob", "Mariam")]
    a = analyze_prefix(_chats(systems), tiny_dir)
    d = _single_cause(a, "user_name")
    assert d.values == ("Alice", "Bob")
    adv = a.advice[0]
    assert adv.raises_hit_rate and adv.predicted_hit_rate_after is not None
    assert adv.predicted_hit_rate_after > a.prediction.hit_rate


@pytest.mark.parametrize("template", ["Topic: {n}.", "About {n} and more.", "Use {n} here."])
def test_capitalised_word_without_a_name_context_is_other(tiny_dir: Path, template: str) -> None:
    systems = [template.format(n=n) + f"\n\n{HANDBOOK}" for n in ("Alice", "Bob")]
    d = analyze_prefix(_chats(systems), tiny_dir).divergence
    assert d is not None and d.cause == "other"


def test_full_name_is_one_cause(tiny_dir: Path) -> None:
    names = ["Alice Smith", "Bob Jones", "Mariam Khan"]
    systems = [f"You are talking to {n}.\n\n{HANDBOOK}" for n in names]
    a = analyze_prefix(_chats(systems), tiny_dir)
    d = _single_cause(a, "user_name")
    assert d.values == ("Alice Smith", "Bob Jones")
    assert d.locations[0].value_chars == (19, 19 + len("Alice Smith"))


def test_user_name_in_an_earlier_user_turn(tiny_dir: Path) -> None:
    reqs = [
        {
            "messages": [
                {"role": "system", "content": "You are the helpdesk assistant."},
                {"role": "user", "content": f"Hi, I am {n}. Please read this.\n\n{HANDBOOK}"},
                {"role": "assistant", "content": "Read it."},
                {"role": "user", "content": q},
            ]
        }
        for n, q in zip(("Alice", "Bob", "Mariam"), QUESTIONS, strict=False)
    ]
    a = analyze_prefix(reqs, tiny_dir)
    d = _single_cause(a, "user_name")
    assert d.locations[0].source == "messages[1].content" and d.locations[0].role == "user"
    # In the last (new) turn the name is where prompts are expected to differ.
    last = analyze_prefix([{"messages": r["messages"][1:2]} for r in reqs], tiny_dir)
    assert last.divergence is not None and last.divergence.cause == "user_name"
    assert not last.divergence.actionable and last.causes == []


# --------------------------------------------------------------------------- reordered roles


def test_messages_swapped_between_roles(tiny_dir: Path) -> None:
    """[system S, user U] vs [user U, system S]: the template's role header differs
    first, but the cause is the order of the same messages."""
    s_msg = {"role": "system", "content": "You are the helpdesk assistant.\n\n" + HANDBOOK}
    u_msg = {"role": "user", "content": "Context: the on-call rota changes every Monday."}
    reqs = [
        {"messages": [s_msg, u_msg, {"role": "user", "content": QUESTIONS[0]}]},
        {"messages": [u_msg, s_msg, {"role": "user", "content": QUESTIONS[1]}]},
        {"messages": [s_msg, u_msg, {"role": "user", "content": QUESTIONS[2]}]},
    ]
    a = analyze_prefix(reqs, tiny_dir)
    d = _single_cause(a, "reordered_messages")
    assert d.locations[0].source == "template"  # the role header "system" vs "user"
    assert d.locations[0].message_index == 0 and d.locations[0].role == "system"
    assert d.locations[1].role == "user"
    (adv,) = a.advice
    assert adv.source == "messages[0]"
    assert "template" not in adv.change and "order" in adv.change
    assert adv.raises_hit_rate and adv.predicted_hit_rate_after is not None
    assert adv.predicted_hit_rate_after > a.prediction.hit_rate
    # Two messages only, swapped: still the order, and the advice makes them equal.
    two = analyze_prefix([{"messages": [s_msg, u_msg]}, {"messages": [u_msg, s_msg]}], tiny_dir)
    d2 = _single_cause(two, "reordered_messages")
    assert d2.actionable
    assert two.predicted_hit_rate_after_advice is not None
    assert two.predicted_hit_rate_after_advice > two.prediction.hit_rate


# --------------------------------------------------------------------------- notes


def test_note_tools_not_rendered(tiny_dir: Path, tools_dir: Path) -> None:
    reqs = _case("tool_schema_key_order.json")["requests"]
    (note,) = analyze_prefix(reqs, tiny_dir).notes
    assert "tools differ between requests" in note and "does not render" in note
    assert analyze_prefix(reqs, tools_dir).notes == []  # this template renders them
    same = [dict(r, tools=TOOLS) for r in reqs]
    (note,) = analyze_prefix(same, tiny_dir).notes
    assert "2 of 2 requests carry tools" in note and "does not render" in note
    assert summarize(analyze_prefix(same, tiny_dir))["notes"] == [note]


def _with_template(src: Path, dest: Path, template: str) -> Path:
    shutil.copytree(src, dest)
    cfg_path = dest / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return dest


def test_note_date_the_template_writes(tiny_dir: Path, tmp_path: Path) -> None:
    import datetime as dt

    header = "{{- bos_token }}<|start_header_id|>system<|end_header_id|>\n\nToday Date: "
    rest = (
        "<|eot_id|>{%- for message in messages %}"
        "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
        "{{- message['content'] | trim }}{{- '<|eot_id|>' }}{%- endfor %}"
    )
    today = _with_template(
        tiny_dir, tmp_path / "today", header + "{{ strftime_now('%d %b %Y') }}" + rest
    )
    fixed = _with_template(tiny_dir, tmp_path / "fixed", header + "26 Jul 2024" + rest)
    reqs = _chats(["You are the helpdesk assistant. " + HANDBOOK] * 2)
    (note,) = analyze_prefix(reqs, today).notes
    assert dt.datetime.now().strftime("%d %b %Y") in note and "today's date" in note
    (note,) = analyze_prefix(reqs, fixed).notes
    assert "'26 Jul 2024'" in note and "today" not in note
    # A date in the request's own text is not the template's.
    assert analyze_prefix(_case("clock_in_system_prompt.json")["requests"], tiny_dir).notes == []


# --------------------------------------------------------------------------- input errors


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"foo": 1}, 'needs "messages" (chat) or "prompt" (completions)'),
        ({}, 'needs "messages" (chat) or "prompt" (completions)'),
        ({"messages": []}, '"messages" is empty'),
        ({"messages": "hello"}, '"messages" must be a list of message objects, not a string'),
        ({"messages": ["hello"]}, "messages[0] must be an object"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content must be a string"),
        ({"prompt": 7}, '"prompt" must be a string, a list of token ids, or a batch'),
        ({"prompt": [1, -2]}, "prompt[1] must be a token id (a whole number >= 0), not -2"),
        ({"prompt": [1, "a"]}, '"prompt" mixes kinds'),
        ({"prompt": []}, '"prompt" is an empty list'),
        ({"prompt_token_ids": [True]}, "prompt_token_ids[0] must be a token id"),
        ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "has both"),
        ({"prompt": "x", "tools": TOOLS}, '"tools" needs "messages"'),
        ({"messages": [{"role": "user", "content": "y"}], "tools": "all"}, '"tools" must be'),
        (42, "not a request"),
    ],
)
def test_malformed_request_says_what_is_wrong(tiny_dir: Path, bad: Any, message: str) -> None:
    good = [{"prompt": "x"}, {"messages": [{"role": "user", "content": "hi"}]}, {"prompt": "y"}]
    with pytest.raises(ValueError) as err:
        analyze_prefix([*good, bad], tiny_dir)
    text = str(err.value)
    assert text.startswith("requests[3]: ") and message in text, text
    assert "pydantic" not in text and "http" not in text and "validation error" not in text


def test_lone_surrogate_is_a_value_error(tiny_dir: Path) -> None:
    with pytest.raises(
        ValueError, match=r"^requests\[1\]: text is not valid Unicode \(lone surrogate at prompt"
    ):
        analyze_prefix([{"prompt": "fine"}, {"prompt": "bad \ud800 x"}], tiny_dir)
    chat = {"messages": [{"role": "user", "content": "bad \udfff"}]}
    with pytest.raises(
        ValueError, match=r"^requests\[0\]: .*lone surrogate at messages\[0\]\.content"
    ):
        analyze_prefix([chat], tiny_dir)
    tok = load_tokenizer(tiny_dir)
    with pytest.raises(ValueError, match=r"^requests\[5\]: text is not valid Unicode"):
        render_request(PrefixRequest(prompt="bad \ud800"), tok, index=5)


def test_errors_name_the_index_in_the_input_list(tiny_dir: Path) -> None:
    """Warm-up requests are skipped from the analysis but still count in ``requests[i]``."""
    msgs = [{"role": "user", "content": "hi"}]
    items: list[Any] = [
        ChatRequest(index=-1, messages=msgs, max_tokens=4, warmup=True),
        {"messages": msgs},
        {"prompt": "bad \ud800"},
    ]
    with pytest.raises(ValueError, match=r"^requests\[2\]: text is not valid Unicode"):
        analyze_prefix(items, tiny_dir)


def test_template_and_tokenizer_failures_are_wrapped(tiny_dir: Path, tmp_path: Path) -> None:
    broken = _with_template(tiny_dir, tmp_path / "broken", "{{ raise_exception('only users') }}")
    with pytest.raises(ValueError, match=r"^requests\[1\]: the chat template failed: only users"):
        analyze_prefix([{"prompt": "x"}, {"messages": [{"role": "user", "content": "hi"}]}], broken)

    class Failing:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
            return self.inner.apply_chat_template(*args, **kwargs)

        def __call__(self, text: str, **kwargs: Any) -> Any:
            raise RuntimeError("encoder exploded")

    with pytest.raises(ValueError, match=r"^requests\[0\]: the tokenizer failed: encoder exploded"):
        analyze_prefix([{"prompt": "x"}], tiny_dir, tokenizer=Failing(load_tokenizer(tiny_dir)))


def test_prompt_wins_over_prompt_token_ids_as_in_vllm() -> None:
    """vLLM 0.32's CompletionRequest has no prompt_token_ids field: an extra field is
    ignored with "The following fields were present in the request but ignored"
    (vllm/entrypoints/serve/engine/protocol.py L73), so ``prompt`` is what is compared,
    and the answer says the ids were not (issue #16 trial)."""
    base = list(range(10, 60))
    out = analyze_prefix(
        [{"prompt": [*base, 9], "prompt_token_ids": [*base, 1]}, {"prompt": [*base, 9]}],
        None,
        block_size=16,
    )
    assert out.shared_prefix_tokens == len(base) + 1
    assert any('"prompt_token_ids"' in n and "ignores it" in n for n in out.notes)
