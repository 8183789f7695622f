"""Multi-turn resends: a later turn sends an earlier answer back as text; the engine holds
the tokens it generated. Each resend is checked token by token against what the engine
held, and the reusable tokens are counted up to the first difference.

Why this breaks the prefix cache: vLLM caches the full blocks of a request's prompt *and*
generated tokens (``vllm/v1/request.py`` ``append_output_token_ids`` ->
``update_block_hashes``; ``vllm/v1/core/kv_cache_utils.py`` ``request_block_hasher``
hashes ``request.all_token_ids``), so a next turn that sends the same tokens reuses them.
A chat client sends the answer as *text*; the server renders it with the chat template and
encodes it again, and byte-level BPE may split the same text otherwise: two ``"\\n"``
tokens generated against one ``"\\n\\n"`` re-encoded (PrimeIntellect-ai/prime-rl#1863), a
generation prompt ending in ``"\\n"`` merged with an answer starting with ``"\\n"``
(NovaSky-AI/SkyRL#2092), or the template rendering the history otherwise than the
generation prompt (raullenchai/Rapid-MLX#214: ``<think>`` at the Qwen assistant boundary).
kubernetes-sigs/inference-perf#649 measured on vLLM: 0 hits on the generated segment.

Two ways to know what the engine held for the earlier request ``j``:

- ``generated_token_ids`` given with ``j`` (vLLM's ``return_token_ids``): ``j``'s prompt
  tokens followed by them; vLLM computes (so caches) all but the last
  (``kv_cache_manager.py``: at most ``num_tokens - 1`` tokens are looked up or computed);
- otherwise the tokenizer: for a chat, ``j``'s prompt tokens followed by the answer encoded
  on its own, ``encode(a) + encode(b)``, against the later turn's ``encode(a + b)`` (what
  the engine held *had the model generated the answer's own encoding*: the split at the
  turn boundary is what this shows); for a prompt, ``j``'s prompt tokens alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from orchestrator.analysis.prefix.causes import canon_json
from orchestrator.analysis.prefix.divergence import find_divergence
from orchestrator.analysis.prefix.prediction import shared_prefix_length
from orchestrator.analysis.prefix.rendering import RequestError, encode
from orchestrator.analysis.prefix.schemas import (
    PrefixRequest,
    RenderedPrompt,
    Resend,
    SourceSpan,
)
from orchestrator.analysis.prefix.tokens import decode_with_offsets

#: Causes of a resend whose tokens differ from the cached ones while the text is the same.
RETOKENIZATION = ("retokenization_whitespace_merge", "retokenization")
#: Earlier prompts compared with a later one sharing its first characters / ids (newest
#: first): bounds the work on large request lists that all share one system prompt.
MAX_CANDIDATES = 256
_HEAD = 64


def _role(m: Any) -> str | None:
    role = m.get("role") if isinstance(m, Mapping) else None
    return role if isinstance(role, str) else None


def previous_turns(reqs: Sequence[PrefixRequest]) -> dict[int, tuple[int, int | None]]:
    """``{k: (j, m)}``: request ``k`` resends the answer of the earlier request ``j``.

    Chat: ``k``'s messages start with all of ``j``'s (same content, same tools) followed by
    an assistant message at index ``m``; the latest such ``j`` wins. Prompt (text or token
    ids): ``k``'s prompt starts with ``j``'s and is longer (``m`` None); among the
    :data:`MAX_CANDIDATES` latest earlier prompts with the same beginning, the longest.
    """
    out: dict[int, tuple[int, int | None]] = {}
    chats: dict[tuple[str, ...], int] = {}
    heads: dict[Any, list[int]] = {}
    for k, r in enumerate(reqs):
        if r.messages is not None:
            msgs = [canon_json(m) for m in r.messages]
            tools = canon_json(r.tools or [])
            for m in range(len(msgs) - 1, 0, -1):
                if _role(r.messages[m]) == "assistant":
                    j = chats.get((tools, *msgs[:m]))
                    if j is not None:
                        out[k] = (j, m)
                        break
            chats[(tools, *msgs)] = k
            continue
        seq = _seq(r)
        kind = r.prompt is not None
        cands: list[int] = list(heads.get((kind, tuple(seq[:_HEAD])), [])[-MAX_CANDIDATES:])
        for n in range(1, min(_HEAD, len(seq))):  # earlier prompts shorter than the head
            cands += heads.get((kind, tuple(seq[:n])), [])[-MAX_CANDIDATES:]
        best: int | None = None
        for j in sorted(set(cands), reverse=True):
            other = _seq(reqs[j])
            longer = best is None or len(other) > len(_seq(reqs[best]))
            if longer and len(other) < len(seq) and seq[: len(other)] == other:
                best = j
        if best is not None:
            out[k] = (best, None)
        heads.setdefault((kind, tuple(seq[:_HEAD])), []).append(k)
    return out


def _seq(r: PrefixRequest) -> Sequence[Any]:
    return r.prompt if r.prompt is not None else r.prompt_token_ids or []


def _content_end(rk: RenderedPrompt, m: int) -> int | None:
    """End (rendered characters) of message ``m``'s content in ``rk``."""
    ends = [
        s.rendered_end
        for s in rk.spans
        if s.message_index == m and s.source.startswith(f"messages[{m}].content")
    ]
    return max(ends) if ends else None


def _held(
    j: int,
    k: int,
    m: int | None,
    reqs: Sequence[PrefixRequest],
    rendered: Sequence[RenderedPrompt],
    tok: Any,
) -> tuple[RenderedPrompt, int, str] | None:
    """What the engine held for ``j`` as a prompt-like sequence, how many of its tokens it
    computed (cached), and how that is known; None when it cannot be built."""
    rj, rk = rendered[j], rendered[k]
    gen = reqs[j].generated_token_ids
    if gen:
        if tok is None or not rj.text_known:
            text, offsets, known = "", [(0, 0)] * len(gen), False
        else:
            text, offsets = decode_with_offsets(tok, gen)
            known = True
        base = len(rj.text)
        span = SourceSpan(
            rendered_start=base,
            rendered_end=base + len(text),
            source="generated_token_ids",
            source_start=0,
        )
        held = RenderedPrompt(
            index=j,
            text=rj.text + text,
            token_ids=[*rj.token_ids, *gen],
            offsets=[*rj.offsets, *((a + base, b + base) for a, b in offsets)],
            spans=[*rj.spans, span] if known else list(rj.spans),
            text_known=known and rj.text_known,
        )
        return held, len(held.token_ids) - 1, "generated_token_ids"
    if tok is None or not (rj.text_known and rk.text_known):
        return None
    if m is None or not rk.text.startswith(rj.text):
        return rj, len(rj.token_ids), "tokenizer"
    end = _content_end(rk, m)
    if end is None or end <= len(rj.text):
        return rj, len(rj.token_ids), "tokenizer"
    answer = rk.text[len(rj.text) : end]
    try:
        ids, offsets = encode(tok, answer, False)
    except RequestError:
        return None
    base = len(rj.text)
    span = SourceSpan(
        rendered_start=base,
        rendered_end=end,
        source=f"messages[{m}].content",
        source_start=0,
        message_index=m,
        role="assistant",
    )
    held = RenderedPrompt(
        index=j,
        text=rj.text + answer,
        token_ids=[*rj.token_ids, *ids],
        offsets=[*rj.offsets, *((a + base, b + base) for a, b in offsets)],
        spans=[*rj.spans, span],
    )
    # the answer's tokens are all computed; the stop token after them is not
    return held, len(held.token_ids), "tokenizer"


def check_resend(
    j: int,
    k: int,
    m: int | None,
    reqs: Sequence[PrefixRequest],
    rendered: Sequence[RenderedPrompt],
    tok: Any,
    block_size: int,
) -> tuple[Resend, RenderedPrompt] | None:
    """Request ``k`` against what the engine held for ``j`` (:class:`Resend`), and that
    held sequence; None when nothing can be said (text unknown)."""
    got = _held(j, k, m, reqs, rendered, tok)
    if got is None:
        return None
    held, cached, how = got
    rk = rendered[k]
    n_k = len(rk.token_ids)
    matching = shared_prefix_length([held.token_ids[:cached], rk.token_ids])
    reach = min(cached, n_k - 1)
    reusable = block_size * (max(0, min(matching, reach)) // block_size)
    if_stable: int | None = reusable
    divergence = None
    if matching < min(cached, n_k):
        divergence = find_divergence(0, 1, [held, rk], [reqs[j], reqs[k]], block_size)
        divergence = divergence.model_copy(update={"requests": (j, k)})
        cached_text = held.text[: held.offsets[cached - 1][1]] if cached else ""
        if held.text_known and rk.text_known and rk.text.startswith(cached_text):
            longer = len(rk.text) > len(cached_text)
            if_stable = block_size * ((cached if longer else cached - 1) // block_size)
        else:
            if_stable = None
    resend = Resend(
        request=k,
        previous=j,
        message_index=m,
        checked_with="generated_token_ids" if how == "generated_token_ids" else "tokenizer",
        cached_tokens=cached,
        matching_tokens=matching,
        reusable_tokens=reusable,
        reusable_tokens_if_stable=if_stable,
        lost_tokens=None if if_stable is None else max(0, if_stable - reusable),
        reusable_tokens_in_prediction=(
            reusable
            if how == "generated_token_ids"
            else min(reusable, block_size * (len(rendered[j].token_ids) // block_size))
        ),
        divergence=divergence,
    )
    return resend, held


def find_resends(
    reqs: Sequence[PrefixRequest],
    rendered: Sequence[RenderedPrompt],
    tok: Any,
    block_size: int,
) -> list[tuple[Resend, RenderedPrompt]]:
    """Every resend of the list (:func:`previous_turns`), checked (:func:`check_resend`),
    with what the engine held for its earlier turn; in request order."""
    out = []
    for k, (j, m) in sorted(previous_turns(reqs).items()):
        got = check_resend(j, k, m, reqs, rendered, tok, block_size)
        if got is not None:
            out.append(got)
    return out


def resent_as_tokens(
    rendered: Sequence[RenderedPrompt],
    resends: Sequence[tuple[Resend, RenderedPrompt]],
    tok: Any,
) -> list[list[int]] | None:
    """The prompts' token ids with every re-tokenized resend sent as the tokens the engine
    held (token in, token out): the held sequence, then the rest of the later turn's text
    encoded on its own. None when no resend can be rewritten so."""
    lists = [list(r.token_ids) for r in rendered]
    changed = False
    for resend, held in resends:
        d = resend.divergence
        if d is None or d.cause not in RETOKENIZATION or tok is None:
            continue
        rk = rendered[resend.request]
        if not rk.text.startswith(held.text):
            continue
        rest = rk.text[len(held.text) :]
        try:
            tail = encode(tok, rest, False)[0] if rest else []
        except RequestError:
            continue
        lists[resend.request] = [*held.token_ids, *tail]
        changed = True
    return lists if changed else None
