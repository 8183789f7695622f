"""Divergence: where two rendered prompts first differ (token position, rendered and
source location) and why (the cause kinds of :data:`CauseKind`), and the grouping of
requests by the token at a divergence.
"""

from __future__ import annotations

import difflib

from orchestrator.analysis.prefix.causes import Classified, classify, role_of
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


def _retokenized(run: SameTextRun, ra: RenderedPrompt, rb: RenderedPrompt) -> Classified:
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
    return Classified(
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
        return _prompt_ends(a, b, ra, rb, p, block_size)
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
        else classify(ra, rb, reqs[a], reqs[b], da, db, la, lb)
    )
    la, lb = _name_cause(c, ra, rb, p, la, lb, reqs[a], reqs[b])
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


def _prompt_ends(
    a: int, b: int, ra: RenderedPrompt, rb: RenderedPrompt, p: int, block_size: int
) -> Divergence:
    """The divergence where one prompt is a prefix of the other (not actionable)."""
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


def _name_cause(
    c: Classified,
    ra: RenderedPrompt,
    rb: RenderedPrompt,
    p: int,
    la: SourceLocation,
    lb: SourceLocation,
    qa: PrefixRequest,
    qb: PrefixRequest,
) -> tuple[SourceLocation, SourceLocation]:
    """The two locations with what the cause names: the volatile value's range, the
    message out of order, the JSON path."""
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
            la = la.model_copy(update={"message_index": k, "role": role_of((qa.messages or [])[k])})
        if lb.message_index is None and k < len(qb.messages or []):
            lb = lb.model_copy(update={"message_index": k, "role": role_of((qb.messages or [])[k])})
    if c.json_path:
        la = la.model_copy(
            update={"source": la.source if la.source.startswith(c.json_path) else c.json_path}
        )
        lb = lb.model_copy(
            update={"source": lb.source if lb.source.startswith(c.json_path) else c.json_path}
        )
    return la, lb
