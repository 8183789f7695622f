"""The changes the analyser advises, per cause: their wording and their simulation on the
requests (the volatile value moved to the end of the last message, JSON keys sorted, tools
sorted, whitespace normalised, messages kept in one order).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from orchestrator.analysis.prefix.causes import canon_json, field_root, tool_names
from orchestrator.analysis.prefix.patterns import (
    NAME,
    NAME_CUE,
    RANDOM_ID,
    REQUEST_ID,
    TIMESTAMP,
    UUID,
    full_name_at,
)
from orchestrator.analysis.prefix.schemas import Divergence, PrefixRequest

CHANGE_TEXT = {
    "timestamp": (
        "Move the clock after the fixed content (into the last user turn), or keep "
        "only the date: the prompt changes with the clock at {src}, so every token "
        "after it is recomputed."
    ),
    "uuid": (
        "Keep per-request ids out of the shared prefix (send them as request metadata, "
        "e.g. a header or the OpenAI 'user' field) or put them after the fixed content; "
        "a UUID at {src} breaks the prefix."
    ),
    "request_id": (
        "Keep request/trace/session ids out of the shared prefix (send them as "
        "metadata) or put them after the fixed content; an id at {src} breaks the "
        "prefix."
    ),
    "random_id": (
        "Keep random ids/nonces out of the shared prefix or put them after the fixed "
        "content; a random id at {src} breaks the prefix."
    ),
    "user_name": (
        "Put the user's name after the fixed content (e.g. in the last user turn) "
        "instead of at {src}, before text every user shares."
    ),
    "json_key_order": (
        "Serialize JSON canonically (sorted keys, fixed separators, e.g. "
        "json.dumps(obj, sort_keys=True, separators=(', ', ': '))) before "
        "rendering the prompt: {src} has the same keys in another order."
    ),
    "whitespace": (
        "Normalise whitespace (strip, collapse runs of spaces, fixed newlines) "
        "before building the prompt: the same words tokenize differently with "
        "other whitespace at {src}."
    ),
    "reordered_messages": (
        "Keep one message order: fixed messages first, always in the same "
        "order, new turns appended at the end ({src})."
    ),
    "reordered_tools": (
        "Send the tools in one fixed order (e.g. sorted by function name); "
        "the same tools come in another order ({src})."
    ),
    "retokenization_whitespace_merge": (
        "Send the next turn the tokens the engine already holds: keep each turn's prompt "
        "and generated token ids and send the next prompt as token ids (completions "
        "'prompt': [ids], the held ids followed by the new turn's), or keep the text from "
        "splitting otherwise (no leading or extra newlines where one turn's text meets the "
        "next): re-encoding the text at {src} merges whitespace into other tokens than the "
        "cached ones, and every token after them is recomputed."
    ),
    "retokenization": (
        "Send the next turn the tokens the engine already holds (keep the prompt and "
        "generated token ids; send the next prompt as token ids): re-encoding the same text "
        "at {src} gives other tokens than the cached ones, and every token after them is "
        "recomputed."
    ),
    "other": ("Put the content that varies between requests ({src}) after the content they share."),
}

_VOLATILE: dict[str, re.Pattern[str]] = {
    "timestamp": TIMESTAMP,
    "uuid": UUID,
    "request_id": REQUEST_ID,
    "random_id": RANDOM_ID,
}


def _sort_keys(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {k: _sort_keys(x[k]) for k in sorted(x, key=str)}
    if isinstance(x, list):
        return [_sort_keys(v) for v in x]
    return x


def _canonical_json_in(s: str) -> str:
    """Re-serialise every top-level JSON object/array of ``s`` with sorted keys."""
    dec = json.JSONDecoder()
    out: list[str] = []
    i = 0
    while i < len(s):
        if s[i] in "{[":
            try:
                val, end = dec.raw_decode(s, i)
            except ValueError:
                val, end = None, i
            if end > i and isinstance(val, dict | list):
                out.append(json.dumps(_sort_keys(val), ensure_ascii=False))
                i = end
                continue
        out.append(s[i])
        i += 1
    return "".join(out)


def _set_source(req: PrefixRequest, source: str, fn: Callable[[str], str]) -> None:
    if source == "prompt":
        if req.prompt is not None:
            req.prompt = fn(req.prompt)
        return
    m = re.fullmatch(r"messages\[(\d+)\]\.(.+)", source)
    if not m or not req.messages or int(m.group(1)) >= len(req.messages):
        return
    parts = re.findall(r"[^.\[\]]+|\[\d+\]", m.group(2))
    cur: Any = req.messages[int(m.group(1))]
    for part in parts[:-1]:
        cur = (
            (cur[int(part[1:-1])] if isinstance(cur, list) and int(part[1:-1]) < len(cur) else None)
            if part.startswith("[")
            else (cur.get(part) if isinstance(cur, Mapping) else None)
        )
        if cur is None:
            return
    last = parts[-1]
    if isinstance(cur, dict) and isinstance(cur.get(last), str):
        cur[last] = fn(cur[last])


def _append_to_end(req: PrefixRequest, text: str) -> None:
    if req.prompt is not None:
        req.prompt = req.prompt + "\n\n" + text
    elif req.messages:
        last = req.messages[-1]
        if isinstance(last.get("content"), str):
            last["content"] = last["content"] + "\n\n" + text


def rewrite(reqs: list[PrefixRequest], d: Divergence) -> list[PrefixRequest] | None:
    """The requests changed as the advice for ``d`` says; None when it cannot be simulated."""
    out = [r.model_copy(deep=True) for r in reqs]
    src = field_root(d.locations[0].source)
    if d.cause in _VOLATILE or d.cause == "user_name":
        if src == "template" or d.locations[0].source_chars is None:
            return None
        if src.endswith(".name") and d.cause == "user_name":
            for r in out:  # a constant name field (the name goes into the last turn)
                _set_source(r, src, lambda s: "user")
            return out
        anchor = d.locations[0].source_chars[0]
        rx = _VOLATILE.get(d.cause)
        for r in out:
            moved: list[str] = []

            def cut(s: str, moved: list[str] = moved) -> str:
                spans = (
                    [(m.start(), m.end()) for m in rx.finditer(s)]
                    if rx is not None
                    else [
                        full_name_at(s, m.start())
                        for m in NAME.finditer(s)
                        if NAME_CUE.search(s[max(0, m.start() - 40) : m.start()])
                    ]
                )
                if not spans:
                    return s
                a, b = min(spans, key=lambda ab: abs(ab[0] - anchor))
                moved.append(s[a:b])
                return s[:a] + s[b:]

            _set_source(r, src, cut)
            if moved:
                _append_to_end(r, moved[0])
        return out
    if d.cause == "json_key_order":
        for r in out:
            if r.tools:
                r.tools = [_sort_keys(t) for t in r.tools]
            for m in r.messages or []:
                for call in m.get("tool_calls") or []:
                    fn = call.get("function") if isinstance(call, dict) else None
                    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                        fn["arguments"] = _canonical_json_in(fn["arguments"])
            if not src.startswith("tools["):
                _set_source(r, src, _canonical_json_in)
        return out
    if d.cause == "reordered_tools":
        for r in out:
            if r.tools:
                r.tools = sorted(r.tools, key=lambda t: (tool_names([t])[0], canon_json(t)))
        return out
    if d.cause == "whitespace":
        if src == "template" or src.startswith("tools["):
            return None

        def norm(s: str) -> str:
            s = re.sub(r"[ \t]+", " ", s)
            s = re.sub(r" *\n *", "\n", s)
            return re.sub(r"\n{3,}", "\n\n", s).strip()

        for r in out:
            _set_source(r, src, norm)
        return out
    if d.cause == "reordered_messages":
        ref = [canon_json(m) for m in reqs[d.requests[0]].messages or []]
        for r in out:
            if not r.messages:
                continue
            known = sorted(
                (m for m in r.messages if canon_json(m) in ref),
                key=lambda m: ref.index(canon_json(m)),
            )
            r.messages = known + [m for m in r.messages if canon_json(m) not in ref]
        return out
    return None
