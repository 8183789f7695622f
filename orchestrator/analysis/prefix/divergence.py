"""Divergence: where two rendered prompts first differ (token position, rendered and
source location) and why (the cause kinds of :data:`CauseKind`), and the grouping of
requests by the token at a divergence.
"""

from __future__ import annotations

import difflib
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
from orchestrator.analysis.prefix.prediction import shared_prefix_length
from orchestrator.analysis.prefix.schemas import (
    CauseKind,
    Divergence,
    PrefixRequest,
    RenderedPrompt,
    SourceLocation,
    SourceSpan,
)
from orchestrator.analysis.prefix.tokens import SameTextRun, same_text_run


def _locate(r: RenderedPrompt, token_pos: int, char: int, end_char: int) -> SourceLocation:
    best: SourceSpan | None = None
    for s in r.spans:
        if s.rendered_start <= char < s.rendered_end and (
            best is None
            or (s.rendered_end - s.rendered_start) < (best.rendered_end - best.rendered_start)
        ):
            best = s
    excerpt = r.text[max(0, char - 40) : char + 40]
    end_char = max(end_char, char)
    if best is None:
        return SourceLocation(
            request=r.index,
            token_position=token_pos,
            rendered_chars=(char, end_char),
            source="template",
            excerpt=excerpt,
        )
    fld: str | None = None
    if best.message_index is not None:
        fld = best.source.split(".", 1)[1] if "." in best.source else None
    a = best.source_start + (char - best.rendered_start)
    b = best.source_start + (min(end_char, best.rendered_end) - best.rendered_start)
    return SourceLocation(
        request=r.index,
        token_position=token_pos,
        rendered_chars=(char, end_char),
        source=best.source,
        message_index=best.message_index,
        role=best.role,
        field=fld,
        tool_index=best.tool_index,
        source_chars=(a, max(a, b)),
        excerpt=excerpt,
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
class _Classified:
    cause: CauseKind
    detail: str
    values: tuple[str, str]
    spans: tuple[tuple[int, int], tuple[int, int]] | None = None  # rendered char ranges
    json_path: str | None = None
    message_index: int | None = None  # reordered_messages: the first message out of order


def _classify(
    ra: RenderedPrompt,
    rb: RenderedPrompt,
    qa: PrefixRequest,
    qb: PrefixRequest,
    da: int,
    db: int,
    la: SourceLocation,
    lb: SourceLocation,
) -> _Classified:
    ta, tb = ra.text, rb.text
    # 1. reordered messages: the same messages (role and content) in another order. The
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
            return _Classified(
                "reordered_messages",
                f"message {k} of request {ra.index} ({_role(qa.messages[k])}) is message "
                f"{cb.index(ca[k])} of request {rb.index}; the same messages come in "
                "another order",
                (f"messages[{k}]", f"messages[{k}]"),
                message_index=k,
            )
    # 2. tools: reordered, or same schema with another key order
    in_tools = la.source.startswith("tools[") or lb.source.startswith("tools[")
    tools_a, tools_b = qa.tools or [], qb.tools or []
    if (in_tools or la.source == "template") and [raw_json(t) for t in tools_a] != [
        raw_json(t) for t in tools_b
    ]:
        can_a, can_b = [canon_json(t) for t in tools_a], [canon_json(t) for t in tools_b]
        if can_a != can_b and sorted(can_a) == sorted(can_b):
            return _Classified(
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
            return _Classified(
                "json_key_order",
                f"{path}: {_key_order_desc(tools_a[i], tools_b[i], path)}",
                (_keys_at(tools_a[i], path), _keys_at(tools_b[i], path)),
                json_path=path,
            )
    # 3. whitespace only
    if (da < len(ta) and ta[da].isspace()) or (db < len(tb) and tb[db].isspace()):
        sa = re.sub(r"\s+", "", ta[da : da + 400])
        sb = re.sub(r"\s+", "", tb[db : db + 400])
        n = min(len(sa), len(sb), 80)
        if sa[:n] == sb[:n]:
            wa = re.match(r"\s*", ta[da:])
            wb = re.match(r"\s*", tb[db:])
            return _Classified(
                "whitespace",
                "the texts differ only in whitespace here",
                (repr(wa.group(0) if wa else ""), repr(wb.group(0) if wb else "")),
                (
                    (da, da + len(wa.group(0) if wa else "")),
                    (db, db + len(wb.group(0) if wb else "")),
                ),
            )
    # 4. JSON with another key order inside a string field (content, tool call arguments)
    if la.source_chars is not None and la.source == lb.source and la.source != "template":
        sa_s, sb_s = _source_string(qa, la.source), _source_string(qb, lb.source)
        if sa_s is not None and sb_s is not None and lb.source_chars is not None:
            ja = _json_around(sa_s, la.source_chars[0])
            jb = _json_around(sb_s, lb.source_chars[0])
            if ja and jb and ja[0] == jb[0] and canon_json(ja[1]) == canon_json(jb[1]):
                path = _key_order_path(ja[1], jb[1], la.source) or la.source
                return _Classified(
                    "json_key_order",
                    f"{path}: {_key_order_desc(ja[1], jb[1], path, la.source)}",
                    (sa_s[ja[0] : ja[2]][:80], sb_s[jb[0] : jb[2]][:80]),
                    json_path=path,
                )
    # 5. volatile values at the first differing character
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
            return _Classified(kind, f"{_KIND_WORDS[kind]}: {va!r} vs {vb!r}", (va, vb), (ma, mb))
    # 6. user name: a message's name field, or a capitalised word after a greeting/label
    if la.field == "name" and lb.field == "name":
        va, vb = _source_string(qa, la.source) or "", _source_string(qb, lb.source) or ""
        return _Classified("user_name", f"the message's name field: {va!r} vs {vb!r}", (va, vb))
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
            return _Classified(
                "user_name",
                f"a user name after {before.strip()[-20:]!r}: {va!r} vs {vb!r}",
                (va, vb),
                (na, nb),
            )
    return _Classified("other", "the content differs", (ta[da : da + 40], tb[db : db + 40]))


def _role(m: Any) -> str:
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


def partition(members: list[int], toks: list[list[int]], p: int) -> list[list[int]]:
    """``members`` grouped by their token at position ``p`` (-1: the prompt ends there)."""
    groups: dict[int, list[int]] = {}
    for i in members:
        key = toks[i][p] if p < len(toks[i]) else -1
        groups.setdefault(key, []).append(i)
    return sorted(groups.values(), key=lambda g: g[0])


def _field_in_run(r: RenderedPrompt, p: int, loc: SourceLocation, end: int) -> SourceLocation:
    """``loc`` moved to the first character of the run that comes from the request (a
    message field) when the run starts in text the chat template wrote."""
    if loc.source != "template":
        return loc
    for c in range(loc.rendered_chars[0], min(end, len(r.text))):
        alt = _locate(r, p, c, end)
        if alt.source != "template":
            return alt
    return loc


def _retokenized(run: SameTextRun, ra: RenderedPrompt, rb: RenderedPrompt) -> _Classified:
    """A divergence where both token runs spell the same text (:func:`same_text_run`)."""
    kind: CauseKind = "retokenization_whitespace_merge" if run.whitespace else "retokenization"
    split = (
        f"{len(run.pieces_a)} token(s) {run.pieces_a!r} against {len(run.pieces_b)} "
        f"token(s) {run.pieces_b!r}"
    )
    detail = f"the same text {run.text!r} is split into other tokens: {split}"
    if run.ended:
        short = ra.index if run.end_a >= len(ra.token_ids) else rb.index
        detail += (
            f"; request {short}'s tokens end inside the run: its text stops where the tokenizer "
            "merges the text that follows in the other (a turn boundary)"
        )
    ca, cb = ra.offsets[run.start][0], rb.offsets[run.start][0]
    return _Classified(
        kind,
        detail,
        ("|".join(run.pieces_a), "|".join(run.pieces_b)),
        (
            (ca, ra.offsets[max(run.start, run.end_a - 1)][1]),
            (cb, rb.offsets[max(run.start, run.end_b - 1)][1]),
        ),
    )


def _ids_only(
    a: int, b: int, ra: RenderedPrompt, rb: RenderedPrompt, p: int, block_size: int
) -> Divergence:
    """The divergence of two prompts when one's text is unknown (token ids, no tokenizer):
    the position and the ids, nothing about the text."""

    def at(r: RenderedPrompt) -> SourceLocation:
        if r.text_known:
            return _locate(r, p, r.offsets[p][0], r.offsets[p][1])
        return SourceLocation(
            request=r.index,
            token_position=p,
            rendered_chars=(0, 0),
            source="prompt_token_ids",
            excerpt=f"token ids {r.token_ids[max(0, p - 3) : p + 4]} (from {max(0, p - 3)})",
        )

    va, vb = ra.token_ids[p : p + 8], rb.token_ids[p : p + 8]
    return Divergence(
        token_position=p,
        shared_prefix_blocks=p // block_size,
        requests=(a, b),
        locations=(at(ra), at(rb)),
        cause="other",
        detail=(
            f"the token ids differ from token {p} on ({va} vs {vb}); without the model's "
            "tokenizer the text behind them, hence the cause, is unknown"
        ),
        values=(str(va), str(vb)),
        actionable=True,
    )


def find_divergence(
    a: int, b: int, rendered: list[RenderedPrompt], reqs: list[PrefixRequest], block_size: int
) -> Divergence:
    """Where requests ``a`` and ``b`` first differ (tokens), located and classified."""
    ra, rb = rendered[a], rendered[b]
    p = shared_prefix_length([ra.token_ids, rb.token_ids])
    if p >= len(ra.token_ids) or p >= len(rb.token_ids):
        ends = a if p >= len(ra.token_ids) else b

        def at(r: RenderedPrompt) -> SourceLocation:
            if p >= len(r.token_ids):  # this prompt ends here
                n = len(r.text)
                return SourceLocation(
                    request=r.index,
                    token_position=p,
                    rendered_chars=(n, n),
                    source="end of prompt",
                    excerpt=r.text[-40:],
                )
            return _locate(r, p, r.offsets[p][0], r.offsets[p][1])

        return Divergence(
            token_position=p,
            shared_prefix_blocks=p // block_size,
            requests=(a, b),
            locations=(at(ra), at(rb)),
            cause="end_of_prompt",
            detail=f"request {ends}'s prompt ends here (a prefix of the other)",
            values=("", ""),
            actionable=False,
        )
    if not (ra.text_known and rb.text_known):
        return _ids_only(a, b, ra, rb, p, block_size)
    ca, cb = ra.offsets[p][0], rb.offsets[p][0]
    k = 0
    while ca + k < len(ra.text) and cb + k < len(rb.text) and ra.text[ca + k] == rb.text[cb + k]:
        k += 1
    da, db = ca + k, cb + k
    # end of the first differing token run (difflib on a window of tokens)
    w = 256
    sm = difflib.SequenceMatcher(
        None, ra.token_ids[p : p + w], rb.token_ids[p : p + w], autojunk=False
    )
    op = next((o for o in sm.get_opcodes() if o[0] != "equal"), None)
    ea = ra.offsets[min(p + max(op[2] if op else 1, 1), len(ra.offsets)) - 1][1]
    eb = rb.offsets[min(p + max(op[4] if op else 1, 1), len(rb.offsets)) - 1][1]
    run = same_text_run(ra.token_ids, ra.text, ra.offsets, rb.token_ids, rb.text, rb.offsets, p)
    if run is not None:  # the same characters split into other tokens: locate the run
        da, db = ca, cb
        ea = ra.offsets[max(p, run.end_a - 1)][1]
        eb = rb.offsets[max(p, run.end_b - 1)][1]
    la = _locate(ra, p, min(da, len(ra.text)), ea)
    lb = _locate(rb, p, min(db, len(rb.text)), eb)
    if run is not None:  # a run that starts in template text: name the field it reaches
        la, lb = _field_in_run(ra, p, la, ea), _field_in_run(rb, p, lb, eb)
    c = (
        _retokenized(run, ra, rb)
        if run is not None
        else _classify(ra, rb, reqs[a], reqs[b], da, db, la, lb)
    )
    if c.spans:  # the whole volatile value, as a range of the source string
        va = _locate(ra, p, c.spans[0][0], c.spans[0][1])
        vb = _locate(rb, p, c.spans[1][0], c.spans[1][1])
        if va.source == la.source:
            la = la.model_copy(update={"value_chars": va.source_chars})
        if vb.source == lb.source:
            lb = lb.model_copy(update={"value_chars": vb.source_chars})
    if c.message_index is not None:  # reordered messages: name the message out of order
        k = c.message_index
        if la.message_index is None:
            la = la.model_copy(
                update={"message_index": k, "role": _role((reqs[a].messages or [])[k])}
            )
        if lb.message_index is None and k < len(reqs[b].messages or []):
            lb = lb.model_copy(
                update={"message_index": k, "role": _role((reqs[b].messages or [])[k])}
            )
    if c.json_path:
        la = la.model_copy(
            update={"source": la.source if la.source.startswith(c.json_path) else c.json_path}
        )
        lb = lb.model_copy(
            update={"source": lb.source if lb.source.startswith(c.json_path) else c.json_path}
        )
    last = (
        reqs[a].messages is not None
        and reqs[b].messages is not None
        and la.message_index == len(reqs[a].messages or []) - 1
        and lb.message_index == len(reqs[b].messages or []) - 1
    )
    return Divergence(
        token_position=p,
        shared_prefix_blocks=p // block_size,
        requests=(a, b),
        locations=(la, lb),
        cause=c.cause,
        detail=c.detail,
        values=c.values,
        json_path=c.json_path,
        actionable=not last,
    )
