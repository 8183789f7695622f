"""Request intake: request-like items (OpenAI chat / completions bodies,
:class:`jobs.schemas.ChatRequest`, :class:`PrefixRequest`) checked and turned into
:class:`PrefixRequest` objects; what is wrong is said in plain words, ``requests[i]: ...``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ValidationError

from orchestrator.analysis.prefix.schemas import PrefixRequest


def coerce_requests(items: Iterable[Any]) -> list[PrefixRequest]:
    """Turn request-like items into :class:`PrefixRequest` objects, in order.

    Accepts :class:`PrefixRequest`, mappings (OpenAI chat / completions bodies: ``messages``,
    ``tools``, ``prompt``) and objects with ``model_dump`` such as
    :class:`jobs.schemas.ChatRequest` (``tools`` may sit in ``extra_body``; a non-empty
    ``prompt`` wins over an empty ``messages``). Items flagged ``warmup`` are skipped: they
    are not part of the measured workload.

    Raises:
        ValueError: an item is neither a chat nor a prompt, or malformed; the message
            starts with ``requests[i]: `` (``i``: the item's index in ``items``) and says
            what is wrong in plain words.
    """
    return coerce_indexed(items)[0]


def type_name(x: Any) -> str:
    """``x``'s JSON kind in words (``"a string"``, ``"null"``), for error messages."""
    if x is None:
        return "null"
    known = {str: "a string", list: "a list", dict: "an object", bool: "a boolean"}
    name = type(x).__name__
    return known.get(type(x), f"{'an' if name[:1] in 'aeiou' else 'a'} {name}")


def _request_problem(messages: Any, tools: Any, prompt: Any) -> str | None:
    """What is wrong with a request's fields, in plain words (None: nothing)."""
    if prompt is not None:
        if not isinstance(prompt, str):
            return f'"prompt" must be a string, not {type_name(prompt)}'
        if messages:
            return 'has both "messages" (chat) and "prompt" (completions): send one of them'
        if tools:
            return '"tools" needs "messages" (a chat request), not "prompt"'
        return None
    if messages is None:
        return 'needs "messages" (chat) or "prompt" (completions)'
    if not isinstance(messages, list | tuple):
        return f'"messages" must be a list of message objects, not {type_name(messages)}'
    if not messages:
        return '"messages" is empty: a chat request needs at least one message'
    for j, m in enumerate(messages):
        if not isinstance(m, Mapping):
            return f'messages[{j}] must be an object with "role" and "content", not {type_name(m)}'
        role = m.get("role")
        if not isinstance(role, str) or not role:
            return f'messages[{j}] needs a "role" (a string such as "system", "user", "assistant")'
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            return (
                f"messages[{j}].content must be a string or a list of content parts, "
                f"not {type_name(content)}"
            )
    if tools is not None and (
        not isinstance(tools, list | tuple) or any(not isinstance(t, Mapping) for t in tools)
    ):
        return '"tools" must be a list of tool objects'
    return None


_SURROGATE = re.compile("[\ud800-\udfff]")


def unicode_problem(req: PrefixRequest) -> str | None:
    """``text is not valid Unicode (...)`` when a string of the request holds a lone
    surrogate (JSON ``"\\ud800"`` escapes decode to those; no tokenizer can encode them)."""

    def walk(x: Any, path: str) -> str | None:
        if isinstance(x, str):
            m = _SURROGATE.search(x)
            if m:
                return (
                    f"text is not valid Unicode (lone surrogate at {path}, character "
                    f"{m.start()}: U+{ord(m.group()):04X})"
                )
        elif isinstance(x, Mapping):
            for k, v in x.items():
                got = walk(k, f"{path} (a key)") or walk(v, f"{path}.{k}")
                if got:
                    return got
        elif isinstance(x, list | tuple):
            for i, v in enumerate(x):
                got = walk(v, f"{path}[{i}]")
                if got:
                    return got
        return None

    return (
        walk(req.prompt, "prompt")
        or walk(req.messages or [], "messages")
        or walk(req.tools or [], "tools")
    )


def _plain_validation(exc: ValidationError) -> str:
    parts = []
    for e in exc.errors(include_url=False):
        loc = ".".join(str(x) for x in e.get("loc", ()))
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request"


def coerce_indexed(items: Iterable[Any]) -> tuple[list[PrefixRequest], list[int]]:
    """:func:`coerce_requests` plus each request's index in ``items`` (warm-ups skipped)."""
    out: list[PrefixRequest] = []
    where: list[int] = []
    for i, item in enumerate(items):
        if isinstance(item, PrefixRequest):
            problem = _request_problem(item.messages, item.tools, item.prompt)
            if problem:
                raise ValueError(f"requests[{i}]: {problem}")
            out.append(item)
            where.append(i)
            continue
        data: Any = item.model_dump() if hasattr(item, "model_dump") else item
        if not isinstance(data, Mapping):
            raise ValueError(
                f'requests[{i}]: not a request: expected an object with "messages" (chat) '
                f'or "prompt" (completions), got {type_name(item)}'
            )
        if data.get("warmup"):
            continue
        extra = data.get("extra_body") or {}
        tools = data.get("tools") or (extra.get("tools") if isinstance(extra, Mapping) else None)
        prompt = data.get("prompt")
        messages = data.get("messages")
        if prompt is not None and not messages:  # ChatRequest keeps messages=[] for prompts
            messages = None
        problem = _request_problem(messages, tools, prompt)
        if problem:
            raise ValueError(f"requests[{i}]: {problem}")
        try:
            if prompt is not None:
                out.append(PrefixRequest(prompt=prompt))
            else:
                out.append(
                    PrefixRequest(
                        messages=[dict(m) for m in messages or []],
                        tools=[dict(t) for t in tools] if tools else None,
                    )
                )
        except ValidationError as exc:
            raise ValueError(f"requests[{i}]: {_plain_validation(exc)}") from None
        where.append(i)
    return out, where
