"""Tests of :mod:`jobs.load.replay` (JSONL replay files of OpenAI request bodies)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from jobs.load.replay import (
    MAX_PROBLEMS,
    ReplayFileError,
    body_problems,
    body_tokens_estimate,
    load_jsonl,
    parse_jsonl,
)

CHAT = {
    "model": "m",
    "messages": [
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": [{"type": "text", "text": "What is APC?"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]},
        {"role": "tool", "content": "result", "tool_call_id": "1"},
    ],
    "max_tokens": 64,
    "stream": False,
    "n": 1,
    "timestamp": 0.5,
    "request_class": "chat.v2",
}
COMPLETION = {"prompt": "Once upon a time", "max_completion_tokens": 8, "timestamp": 3}


def _lines(*items: Any) -> str:
    return "\n".join(i if isinstance(i, str) else json.dumps(i) for i in items)


def test_parse_valid_file_skips_blanks_and_comments() -> None:
    text = _lines("# recorded 2024-05-01", CHAT, "", "   ", COMPLETION, "  # trailing note") + "\n"
    assert parse_jsonl(text) == [CHAT, COMPLETION]
    assert parse_jsonl(text.replace("\n", "\r\n")) == [CHAT, COMPLETION]
    # a JSON string may hold U+2028 (a line separator for str.splitlines, not for JSONL)
    odd = {"prompt": "a\u2028b"}
    assert parse_jsonl(json.dumps(odd, ensure_ascii=False)) == [odd]


def test_all_bad_lines_are_reported_together() -> None:
    text = _lines(
        CHAT,  # 1
        "{not json",  # 2
        [1, 2],  # 3
        {"input": "x"},  # 4
        {"messages": [{"role": "bot", "content": "x"}]},  # 5
        "# comment",  # 6
        {"prompt": [1, 2, 3]},  # 7
        {"prompt": "x", "max_tokens": 0, "timestamp": -1},  # 8
        {"prompt": "x", "n": 2},  # 9
        {"messages": [], "prompt": "x"},  # 10
        {"messages": []},  # 11
        {"messages": [{"role": "user", "content": None}]},  # 12
        {"prompt": "x", "stream": "yes", "request_class": "has space"},  # 13
        '{"prompt": "x", "timestamp": NaN}',  # 14
        COMPLETION,  # 15
    )
    with pytest.raises(ReplayFileError) as info:
        parse_jsonl(text)
    err = info.value
    assert isinstance(err, ValueError)
    assert [n for n, _ in err.problems] == [2, 3, 4, 5, 7, 8, 9, 10, 11, 12, 13, 14]
    assert err.line == 2 and err.total == 12
    msg = dict(err.problems)
    assert msg[2].startswith("not valid JSON")
    expected = "expected a JSON object with 'messages' (chat) or 'prompt' (completions)"
    assert msg[3] == msg[4] == expected
    assert "unknown role 'bot'" in msg[5]
    assert "token ids" in msg[7]
    assert "'max_tokens' must be an integer from 1 to 131072, got 0" in msg[8]
    assert "'timestamp' must be a finite number" in msg[8]
    assert "'n' = 2 is not supported" in msg[9]
    assert "both 'messages' and 'prompt'" in msg[10]
    assert "non-empty list" in msg[11]
    assert "'content' is missing" in msg[12]
    assert "'stream' must be true or false" in msg[13] and "'request_class'" in msg[13]
    assert "NaN" in msg[14]
    lines = str(err).splitlines()
    assert lines[0].startswith("line 2: not valid JSON")
    assert f"line 3: {expected}" in lines


def test_problem_list_is_capped_and_limits_apply() -> None:
    text = _lines(*([{"bad": 1}] * 25))
    with pytest.raises(ReplayFileError) as info:
        parse_jsonl(text)
    assert len(info.value.problems) == MAX_PROBLEMS and info.value.total == 25
    assert str(info.value).endswith("... and 5 more bad lines")
    with pytest.raises(ReplayFileError, match="line 3: more than 2 requests"):
        parse_jsonl(_lines(COMPLETION, COMPLETION, COMPLETION), max_requests=2)
    with pytest.raises(ReplayFileError, match="no request lines"):
        parse_jsonl("# only a comment\n\n")


def test_body_problems_accepts_null_optionals() -> None:
    body = {"prompt": "x", "max_tokens": None, "n": None, "timestamp": None, "class": 3}
    assert body_problems(body) == []
    assert body_problems(CHAT) == []
    assert body_problems("text") != []


def test_load_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "replay.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + _lines(CHAT, COMPLETION).encode())
    assert load_jsonl(path) == [CHAT, COMPLETION]
    path.write_bytes(_lines(COMPLETION, COMPLETION).encode() + b'\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ReplayFileError, match="line 3: not valid UTF-8") as info:
        load_jsonl(str(path))
    assert info.value.line == 3
    with pytest.raises(OSError):
        load_jsonl(tmp_path / "missing.jsonl")


def test_body_tokens_estimate() -> None:
    assert body_tokens_estimate({"prompt": "x" * 41}, default_max_tokens=5) == 11 + 5
    assert body_tokens_estimate(COMPLETION) == 4 + 8
    chat = {
        "messages": [
            {"role": "system", "content": "a" * 400},
            {"role": "user", "content": [{"type": "text", "text": "b" * 200}, {"type": "image"}]},
        ],
        "max_tokens": 10,
        "max_completion_tokens": 20,
    }
    assert body_tokens_estimate(chat, default_max_tokens=99) == 150 + 20
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert body_tokens_estimate({**chat, "tools": tools}) > 170


def test_replay_body_field_types_are_checked() -> None:
    from jobs.load.replay import body_problems

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert body_problems({**chat, "tools": [{"type": "function", "function": {"name": "f"}}]}) == []
    assert any("tools" in p for p in body_problems({**chat, "tools": "notalist"}))
    assert any("temperature" in p for p in body_problems({**chat, "temperature": "hot"}))
    assert any("stop" in p for p in body_problems({**chat, "stop": [1, 2]}))
