"""Replay files: the user's own OpenAI request bodies, one JSON object per line (JSONL).

A replay file holds chat-completions bodies (with ``messages``) or completions bodies (with
``prompt``, one string), one per line, in send order; blank lines and lines starting with
``#`` are skipped. Besides the OpenAI fields a body may carry ``timestamp`` (seconds, for
``arrival: trace``) and ``request_class`` (or ``class``), the class its measurements are
reported under. :func:`parse_jsonl` / :func:`load_jsonl` check every line and either return
all bodies or raise one :class:`ReplayFileError` listing the bad lines, so a file is never
half loaded. :func:`jobs.load.workload.build_requests` turns the bodies (``WorkloadSpec.replay``)
into the request list; :func:`body_tokens_estimate` sizes a body without a tokenizer.

An optional field given as JSON ``null`` counts as absent.
"""

from __future__ import annotations

import codecs
import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeGuard

__all__ = [
    "MAX_OUTPUT_TOKENS",
    "MAX_PROBLEMS",
    "ROLES",
    "ReplayFileError",
    "body_problems",
    "body_tokens_estimate",
    "load_jsonl",
    "parse_jsonl",
]

#: Most problems a :class:`ReplayFileError` lists (the rest are only counted).
MAX_PROBLEMS = 20

#: Largest ``max_tokens`` / ``max_completion_tokens`` accepted.
MAX_OUTPUT_TOKENS = 131_072

#: Message roles accepted in a chat body.
ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})

#: Problems reported per line at most (the first ones).
_PROBLEMS_PER_LINE = 3

#: A request class name: it becomes part of metric names (``"<class>.mean_ttft_ms"``).
_CLASS_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,50}$")

_NOT_A_BODY = "expected a JSON object with 'messages' (chat) or 'prompt' (completions)"


class ReplayFileError(ValueError):
    """A replay file with unusable lines; nothing of it was loaded.

    Attributes:
        problems: ``(line, message)`` pairs, lines 1-based and ascending, at most
            :data:`MAX_PROBLEMS` of them (line 0: the file as a whole).
        line: the line of the first problem.
        total: how many lines had problems (may exceed ``len(problems)``).

    ``str(error)`` lists the problems one per line, each as ``"line 7: <message>"``.
    """

    def __init__(self, problems: list[tuple[int, str]], total: int | None = None) -> None:
        if not problems:
            raise ValueError("ReplayFileError needs at least one problem")
        self.problems: list[tuple[int, str]] = list(problems[:MAX_PROBLEMS])
        self.total: int = max(total or 0, len(problems))
        self.line: int = self.problems[0][0]
        lines = [f"line {n}: {msg}" if n > 0 else msg for n, msg in self.problems]
        if self.total > len(self.problems):
            lines.append(f"... and {self.total - len(self.problems)} more bad lines")
        super().__init__("\n".join(lines))


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _message_problems(messages: Any) -> list[str]:
    if not isinstance(messages, list) or not messages:
        return ["'messages' must be a non-empty list of message objects"]
    out: list[str] = []
    for k, m in enumerate(messages):
        where = f"messages[{k}]"
        if not isinstance(m, dict):
            out.append(f"{where} must be an object with 'role' and 'content'")
            continue
        role = m.get("role")
        if not isinstance(role, str):
            out.append(f"{where}: 'role' must be a string")
            continue
        if role not in ROLES:
            out.append(
                f"{where}: unknown role {role!r} (expected one of {', '.join(sorted(ROLES))})"
            )
            continue
        content = m.get("content")
        if content is None:
            tool_calls = m.get("tool_calls")
            if not (role == "assistant" and isinstance(tool_calls, list) and tool_calls):
                out.append(
                    f"{where}: 'content' is missing (only an assistant message with "
                    "'tool_calls' may have none)"
                )
        elif isinstance(content, list):
            if not all(isinstance(part, dict) for part in content):
                out.append(f"{where}: 'content' as a list must hold content-part objects")
        elif not isinstance(content, str):
            out.append(f"{where}: 'content' must be a string or a list of content parts")
    return out


def body_problems(body: Any) -> list[str]:
    """Return what makes ``body`` unusable as a replayed request (``[]`` when it is fine).

    Checks: a JSON object with exactly one of ``messages`` (a non-empty list of objects
    with a ``role`` in :data:`ROLES` and a string or list ``content``; ``null`` only for an
    assistant message with ``tool_calls``) or ``prompt`` (a non-empty string; token-id
    lists and batches are refused); ``max_tokens`` / ``max_completion_tokens`` integers in
    ``1 .. 131072``; ``timestamp`` a finite number >= 0 (seconds); ``n`` 1; ``stream`` a
    boolean (requests are always streamed); a string ``request_class`` / ``class`` a name of
    1-50 letters, digits, ``_``, ``.`` or ``-`` (it becomes part of metric names; a
    non-string one is ignored). Fields given as ``null`` count as absent.
    """
    if not isinstance(body, dict):
        return [_NOT_A_BODY]
    has_messages = body.get("messages") is not None
    has_prompt = body.get("prompt") is not None
    if not has_messages and not has_prompt:
        return [_NOT_A_BODY]
    if has_messages and has_prompt:
        return ["has both 'messages' and 'prompt'; give exactly one"]
    out: list[str] = []
    if has_messages:
        out.extend(_message_problems(body["messages"]))
    else:
        prompt = body["prompt"]
        if isinstance(prompt, list):
            out.append(
                "'prompt' as a list (token ids or a batch of prompts) is not supported; "
                "give one string"
            )
        elif not isinstance(prompt, str) or not prompt:
            out.append("'prompt' must be a non-empty string")
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and not (_is_int(value) and 1 <= value <= MAX_OUTPUT_TOKENS):
            out.append(f"{key!r} must be an integer from 1 to {MAX_OUTPUT_TOKENS}, got {value!r}")
    ts = body.get("timestamp")
    if ts is not None and not (_is_number(ts) and math.isfinite(ts) and ts >= 0):
        out.append(f"'timestamp' must be a finite number of seconds >= 0, got {ts!r}")
    n = body.get("n")
    if n is not None and not (_is_int(n) and n == 1):
        out.append(f"'n' = {n!r} is not supported: one completion per request (use 1 or omit it)")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        out.append(f"'stream' must be true or false, got {stream!r}")
    tools = body.get("tools")
    if tools is not None and not (
        isinstance(tools, list)
        and all(isinstance(t, dict) and isinstance(t.get("type"), str) for t in tools)
    ):
        out.append("'tools' must be a list of tool objects, each with a 'type'")
    for key, kind in (
        ("temperature", "number"),
        ("top_p", "number"),
        ("seed", "integer"),
        ("stop", "string or list of strings"),
        ("response_format", "object"),
    ):
        value = body.get(key)
        ok = value is None or (
            (kind == "number" and _is_number(value))
            or (kind == "integer" and _is_int(value))
            or (
                kind.startswith("string")
                and (
                    isinstance(value, str)
                    or (isinstance(value, list) and all(isinstance(v, str) for v in value))
                )
            )
            or (kind == "object" and isinstance(value, dict))
        )
        if not ok:
            out.append(f"{key!r} must be a {kind}, got {value!r}")
    for key in ("request_class", "class"):
        cls = body.get(key)
        if isinstance(cls, str) and not _CLASS_NAME.match(cls):
            out.append(
                f"{key!r} must be a name of 1-50 letters, digits, '_', '.' or '-', got {cls!r}"
            )
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in JSON")


def parse_jsonl(text: str, *, max_requests: int = 20_000) -> list[dict[str, Any]]:
    """Parse and check a replay file's text: one OpenAI request body per line.

    Lines are split on ``"\\n"`` (a trailing ``"\\r"`` is dropped); blank lines and lines
    whose first non-blank character is ``#`` are skipped. Every other line must be a JSON
    object passing :func:`body_problems`; ``NaN`` and ``Infinity`` are refused.

    Args:
        text: the file's text.
        max_requests: most request lines accepted.

    Returns:
        The bodies in file order (as parsed; nothing is added or removed).

    Raises:
        ReplayFileError: listing every bad line (up to :data:`MAX_PROBLEMS`, 1-based line
            numbers), also for more than ``max_requests`` request lines or for a file with
            no request at all; nothing is returned then.
    """
    bodies: list[dict[str, Any]] = []
    problems: list[tuple[int, str]] = []
    count = 0
    for number, raw in enumerate(text.split("\n"), start=1):
        line = raw.removesuffix("\r").strip()
        if not line or line.startswith("#"):
            continue
        count += 1
        if count == max_requests + 1:
            problems.append(
                (number, f"more than {max_requests} requests (the limit for one replay file)")
            )
        try:
            body = json.loads(line, parse_constant=_reject_constant)
        except json.JSONDecodeError as exc:
            problems.append((number, f"not valid JSON: {exc.msg} (column {exc.colno})"))
            continue
        except (ValueError, RecursionError) as exc:
            problems.append((number, f"not valid JSON: {exc}"))
            continue
        found = body_problems(body)
        if found:
            problems.append((number, "; ".join(found[:_PROBLEMS_PER_LINE])))
        elif count <= max_requests:
            bodies.append(body)
    if count == 0:
        problems.append((0, "the replay file has no request lines"))
    if problems:
        raise ReplayFileError(problems[:MAX_PROBLEMS], total=len(problems))
    return bodies


def load_jsonl(path: str | os.PathLike[str], *, max_requests: int = 20_000) -> list[dict[str, Any]]:
    """Read and check a UTF-8 replay file (a leading byte-order mark is ignored).

    See :func:`parse_jsonl` for the format, return value and ``max_requests``.

    Raises:
        ReplayFileError: for bad lines, or bytes that are not UTF-8 (naming their line).
        OSError: if the file cannot be read.
    """
    data = Path(path).read_bytes()
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8) :]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        bad = data[exc.start : exc.start + 1].hex()
        raise ReplayFileError(
            [(line, f"not valid UTF-8 (byte 0x{bad} at byte column {column})")]
        ) from exc
    return parse_jsonl(text, max_requests=max_requests)


def _text_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(
            len(part["text"])
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return 0


def body_tokens_estimate(body: Mapping[str, Any], default_max_tokens: int = 0) -> int:
    """Estimate the tokens one replayed request needs: prompt plus output, no tokenizer.

    The prompt counts ``ceil(chars / 4)`` of the ``prompt`` string or of every message's
    text (string contents and the ``text`` of content parts, plus the JSON of assistant
    ``tool_calls``), plus the JSON of ``tools`` when given (chat templates render it);
    non-text parts (images...) count nothing. Chat-template tokens are not included. The
    output counts ``max_completion_tokens``, else ``max_tokens``, else
    ``default_max_tokens``. Four characters per token fits English prose; code, JSON or
    non-Latin text can take more tokens.

    Returns:
        The estimate in tokens (>= 0). Malformed parts of ``body`` count nothing.
    """
    chars = 0
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        chars += len(prompt)
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if not isinstance(m, dict):
                continue
            chars += _text_chars(m.get("content"))
            if m.get("tool_calls"):
                chars += len(json.dumps(m["tool_calls"], default=str))
    if body.get("tools"):
        chars += len(json.dumps(body["tools"], default=str))
    output = default_max_tokens
    for key in ("max_tokens", "max_completion_tokens"):  # the latter wins, as in the mapping
        value = body.get(key)
        if _is_int(value):
            output = value
    return -(-chars // 4) + max(0, output)
