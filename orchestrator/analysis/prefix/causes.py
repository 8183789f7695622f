"""Why two rendered prompts differ where they do: the cause detectors of
:func:`classify` (reordered messages or tools, JSON key order, whitespace, volatile values,
user names), tried in that order, and the JSON and source-path helpers they share with
the rest of the prefix analysis.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from orchestrator.analysis.prefix.patterns import (
    FULL_NAME,
    LABELLED_HANDLE,
    NAME,
    NAME_CUE,
    RANDOM_ID,
    REQUEST_ID,
    TIMESTAMP,
    UUID,
    match_at,
    word_at,
)
from orchestrator.analysis.prefix.schemas import (
    CauseKind,
    PrefixRequest,
    RenderedPrompt,
    SourceLocation,
)


def canon_json(x: Any) -> str:
    """``x`` as JSON with sorted keys (equal for the same content in any key order)."""
    return json.dumps(x, sort_keys=True, ensure_ascii=False, default=str)


def raw_json(x: Any) -> str:
    """``x`` as JSON in its own key order."""
    return json.dumps(x, ensure_ascii=False, default=str)


def _key_order_path(a: Any, b: Any, path: str) -> str | None:
    """Path of the first object whose keys come in a different order in ``a`` and ``b``."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if list(a) != list(b) and set(a) == set(b):
            return path
        for k in a:
            if k in b:
                got = _key_order_path(a[k], b[k], f"{path}.{k}")
                if got:
                    return got
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            got = _key_order_path(x, y, f"{path}[{i}]")
            if got:
                return got
    return None


def _json_around(s: str, pos: int) -> tuple[int, Any, int] | None:
    """The innermost-first JSON object/array of ``s`` that starts before and covers ``pos``:
    (start, value, end)."""
    dec = json.JSONDecoder()
    tried = 0
    i = pos
    while i >= 0 and tried < 64:
        i = max(s.rfind("{", 0, i + 1), s.rfind("[", 0, i + 1))
        if i < 0:
            return None
        tried += 1
        try:
            val, end = dec.raw_decode(s, i)
        except ValueError:
            i -= 1
            continue
        if end > pos and isinstance(val, dict | list):
            return i, val, end
        i -= 1
    return None


def _source_string(req: PrefixRequest, source: str) -> str | None:
    """The string at ``source`` (``messages[k].content``, ``...arguments``, ``prompt``)."""
    if source == "prompt":
        return req.prompt
    m = re.fullmatch(r"messages\[(\d+)\]\.(.+)", source)
    if not m or req.messages is None:
        return None
    k = int(m.group(1))
    if k >= len(req.messages):
        return None
    cur: Any = req.messages[k]
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", m.group(2)):
        if part.startswith("["):
            idx = int(part[1:-1])
            cur = cur[idx] if isinstance(cur, list) and idx < len(cur) else None
        else:
            cur = cur.get(part) if isinstance(cur, Mapping) else None
        if cur is None:
            return None
    return cur if isinstance(cur, str) else None


def field_root(source: str) -> str:
    """``messages[0].content`` for ``messages[0].content``; the string-bearing field."""
    m = re.match(
        r"(messages\[\d+\]\.(?:content(?:\[\d+\]\.text)?|name|tool_calls\[\d+\]"
        r"\.function\.(?:arguments|name))|prompt_token_ids|prompt|tools\[\d+\])",
        source,
    )
    return m.group(1) if m else source


@dataclass
class Classified:
    """A cause found: its kind, the words for it and the two differing values."""

    cause: CauseKind
    detail: str
    values: tuple[str, str]
    spans: tuple[tuple[int, int], tuple[int, int]] | None = None  # rendered char ranges
    json_path: str | None = None
    message_index: int | None = None  # reordered_messages: the first message out of order


def classify(
    ra: RenderedPrompt,
    rb: RenderedPrompt,
    qa: PrefixRequest,
    qb: PrefixRequest,
    da: int,
    db: int,
    la: SourceLocation,
    lb: SourceLocation,
) -> Classified:
    """Why the two prompts diverge at rendered characters ``da`` / ``db`` (their source
    locations ``la`` / ``lb``): the first of the detectors below that recognises the
    difference, else ``other``."""
    ta, tb = ra.text, rb.text
    found = (
        _reordered_messages(ra, rb, qa, qb, la, lb)
        or _tools_differ(qa, qb, la, lb)
        or _whitespace(ta, tb, da, db)
        or _json_in_string(qa, qb, la, lb)
        or _volatile(ta, tb, da, db)
        or _user_name(qa, qb, la, lb, ta, tb, da, db)
    )
    return found or Classified("other", "the content differs", (ta[da : da + 40], tb[db : db + 40]))


def _reordered_messages(
    ra: RenderedPrompt,
    rb: RenderedPrompt,
    qa: PrefixRequest,
    qb: PrefixRequest,
    la: SourceLocation,
    lb: SourceLocation,
) -> Classified | None:
    # reordered messages: the same messages (role and content) in another order. The
    #    divergence may fall in the message text or in what the template writes around it
    #    (a role header: "system" vs "user"); then the first message that differs counts.
    if qa.messages and qb.messages:
        ca = [canon_json(m) for m in qa.messages]
        cb = [canon_json(m) for m in qb.messages]
        first = next(
            (j for j in range(min(len(ca), len(cb))) if ca[j] != cb[j]), min(len(ca), len(cb))
        )
        if la.message_index is not None and lb.message_index is not None:
            k = la.message_index
        else:
            k = first
        if k < len(ca) and k < len(cb) and ca[k] != cb[k] and ca[k] in cb and cb[k] in ca:
            return Classified(
                "reordered_messages",
                f"message {k} of request {ra.index} ({role_of(qa.messages[k])}) is message "
                f"{cb.index(ca[k])} of request {rb.index}; the same messages come in "
                "another order",
                (f"messages[{k}]", f"messages[{k}]"),
                message_index=k,
            )
    return None


def _tools_differ(
    qa: PrefixRequest, qb: PrefixRequest, la: SourceLocation, lb: SourceLocation
) -> Classified | None:
    # tools: reordered, or same schema with another key order
    in_tools = la.source.startswith("tools[") or lb.source.startswith("tools[")
    tools_a, tools_b = qa.tools or [], qb.tools or []
    if (in_tools or la.source == "template") and [raw_json(t) for t in tools_a] != [
        raw_json(t) for t in tools_b
    ]:
        can_a, can_b = [canon_json(t) for t in tools_a], [canon_json(t) for t in tools_b]
        if can_a != can_b and sorted(can_a) == sorted(can_b):
            return Classified(
                "reordered_tools",
                "the same tools in another order",
                (", ".join(tool_names(tools_a)), ", ".join(tool_names(tools_b))),
            )
        i = (
            la.tool_index
            if la.tool_index is not None
            else next(
                (
                    j
                    for j in range(min(len(tools_a), len(tools_b)))
                    if raw_json(tools_a[j]) != raw_json(tools_b[j])
                ),
                None,
            )
        )
        if (
            i is not None
            and i < min(len(tools_a), len(tools_b))
            and (can_a[i] == can_b[i] and raw_json(tools_a[i]) != raw_json(tools_b[i]))
        ):
            path = _key_order_path(tools_a[i], tools_b[i], f"tools[{i}]") or f"tools[{i}]"
            return Classified(
                "json_key_order",
                f"{path}: {_key_order_desc(tools_a[i], tools_b[i], path)}",
                (_keys_at(tools_a[i], path), _keys_at(tools_b[i], path)),
                json_path=path,
            )
    return None


def _whitespace(ta: str, tb: str, da: int, db: int) -> Classified | None:
    # whitespace only
    if (da < len(ta) and ta[da].isspace()) or (db < len(tb) and tb[db].isspace()):
        sa = re.sub(r"\s+", "", ta[da : da + 400])
        sb = re.sub(r"\s+", "", tb[db : db + 400])
        n = min(len(sa), len(sb), 80)
        if sa[:n] == sb[:n]:
            wa = re.match(r"\s*", ta[da:])
            wb = re.match(r"\s*", tb[db:])
            return Classified(
                "whitespace",
                "the texts differ only in whitespace here",
                (repr(wa.group(0) if wa else ""), repr(wb.group(0) if wb else "")),
                (
                    (da, da + len(wa.group(0) if wa else "")),
                    (db, db + len(wb.group(0) if wb else "")),
                ),
            )
    return None


def _json_in_string(
    qa: PrefixRequest, qb: PrefixRequest, la: SourceLocation, lb: SourceLocation
) -> Classified | None:
    # JSON with another key order inside a string field (content, tool call arguments)
    if la.source_chars is not None and la.source == lb.source and la.source != "template":
        sa_s, sb_s = _source_string(qa, la.source), _source_string(qb, lb.source)
        if sa_s is not None and sb_s is not None and lb.source_chars is not None:
            ja = _json_around(sa_s, la.source_chars[0])
            jb = _json_around(sb_s, lb.source_chars[0])
            if ja and jb and ja[0] == jb[0] and canon_json(ja[1]) == canon_json(jb[1]):
                path = _key_order_path(ja[1], jb[1], la.source) or la.source
                return Classified(
                    "json_key_order",
                    f"{path}: {_key_order_desc(ja[1], jb[1], path, la.source)}",
                    (sa_s[ja[0] : ja[2]][:80], sb_s[jb[0] : jb[2]][:80]),
                    json_path=path,
                )
    return None


def _volatile(ta: str, tb: str, da: int, db: int) -> Classified | None:
    # volatile values at the first differing character
    volatile: tuple[tuple[CauseKind, re.Pattern[str]], ...] = (
        ("uuid", UUID),
        ("request_id", REQUEST_ID),
        ("timestamp", TIMESTAMP),
        ("random_id", RANDOM_ID),
    )
    for kind, rx in volatile:
        ma = match_at(rx, ta, da)
        mb = match_at(rx, tb, db)
        if ma and mb:
            va, vb = ta[ma[0] : ma[1]], tb[mb[0] : mb[1]]
            return Classified(kind, f"{_KIND_WORDS[kind]}: {va!r} vs {vb!r}", (va, vb), (ma, mb))
    return None


def _user_name(
    qa: PrefixRequest,
    qb: PrefixRequest,
    la: SourceLocation,
    lb: SourceLocation,
    ta: str,
    tb: str,
    da: int,
    db: int,
) -> Classified | None:
    # user name: a message's name field, or a capitalised word after a greeting/label
    if la.field == "name" and lb.field == "name":
        va, vb = _source_string(qa, la.source) or "", _source_string(qb, lb.source) or ""
        return Classified("user_name", f"the message's name field: {va!r} vs {vb!r}", (va, vb))
    na, nb = word_at(ta, da), word_at(tb, db)
    if na[0] == nb[0] and na[1] > na[0] and nb[1] > nb[0]:
        before = ta[max(0, na[0] - 40) : na[0]].split("\n")[-1]
        va, vb = ta[na[0] : na[1]], tb[nb[0] : nb[1]]
        cue = NAME_CUE.search(before)
        names = NAME.fullmatch(va) and NAME.fullmatch(vb)
        fa, fb = FULL_NAME.match(ta, na[0]), FULL_NAME.match(tb, nb[0])
        if cue and names and fa and fb:  # a full name: "Alice Smith"
            na, nb = (na[0], max(na[1], fa.end())), (nb[0], max(nb[1], fb.end()))
            va, vb = ta[na[0] : na[1]], tb[nb[0] : nb[1]]
        handles = (
            LABELLED_HANDLE.search(before)
            and re.fullmatch(r"[\w.-]+", va)
            and re.fullmatch(r"[\w.-]+", vb)
        )
        if (cue and names) or handles:
            return Classified(
                "user_name",
                f"a user name after {before.strip()[-20:]!r}: {va!r} vs {vb!r}",
                (va, vb),
                (na, nb),
            )
    return None


def role_of(m: Any) -> str:
    role = m.get("role") if isinstance(m, Mapping) else None
    return role if isinstance(role, str) else "?"


_KIND_WORDS = {
    "uuid": "a UUID",
    "request_id": "a request/trace/session id",
    "timestamp": "a timestamp or date",
    "random_id": "a random hex/base62 id",
}


def tool_names(tools: list[dict[str, Any]]) -> list[str]:
    """Each tool's function name (else the start of its JSON)."""
    out = []
    for t in tools:
        fn = t.get("function") if isinstance(t, Mapping) else None
        out.append(str(fn.get("name")) if isinstance(fn, Mapping) else canon_json(t)[:30])
    return out


def _get_path(obj: Any, path: str, root: str) -> Any:
    rest = path[len(root) :]
    cur = obj
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", rest):
        if part.startswith("["):
            cur = cur[int(part[1:-1])] if isinstance(cur, list) else None
        else:
            cur = cur.get(part) if isinstance(cur, Mapping) else None
    return cur


def _keys_at(obj: Any, path: str, root: str | None = None) -> str:
    if root is None:
        m = re.match(r"tools\[\d+\]", path)
        root = m.group(0) if m else ""
    got = _get_path(obj, path, root)
    return ", ".join(map(str, got)) if isinstance(got, Mapping) else ""


def _key_order_desc(a: Any, b: Any, path: str, root: str | None = None) -> str:
    return (
        f"keys ({_keys_at(a, path, root)}) vs ({_keys_at(b, path, root)}); equal after sorting keys"
    )
