"""Token ids as text: decoding ids with per-token character ranges, and finding where two
token lists spell the same text with other tokens (re-tokenization).

Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen) merge whitespace runs: ``"\\n\\n"`` is one
token when the tokenizer encodes text, but a model may generate two ``"\\n"`` tokens; a
space before a word merges into the word (``"Ġword"``). vLLM's prefix cache hashes token
ids (``vllm/v1/core/kv_cache_utils.py``, ``request_block_hasher`` hashes
``request.all_token_ids``), so the same text under other tokens is a cache miss from the
first differing token on. PrimeIntellect-ai/prime-rl#1863 reports it on vLLM's chat API
(``"\\n"+"\\n"`` -> ``[198, 198]`` generated, ``"\\n\\n"`` -> ``[271]`` re-encoded);
kubernetes-sigs/inference-perf#649 measured 0 hits on the generated segment of a
text-append multi-turn benchmark on vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: Longest run of differing tokens :func:`same_text_run` follows before giving up.
MAX_RUN_TOKENS = 64
#: Tokens of context decoded before a token to get its text (SentencePiece drops a leading
#: space of a token decoded alone; byte-level BPE splits characters over tokens).
_CONTEXT = 4


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    if not ids:
        return ""
    try:
        out = tokenizer.decode(
            list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
    except TypeError:  # a decoder without those keywords
        out = tokenizer.decode(list(ids))
    return out if isinstance(out, str) else str(out)


def decode_with_offsets(
    tokenizer: Any, ids: Sequence[int], *, max_quadratic: int = 4096
) -> tuple[str, list[tuple[int, int]]]:
    """The text of ``ids`` (special tokens written out) and each token's character range.

    Fast path: the decoded text re-encodes (without special tokens added) to the same ids,
    so the tokenizer's own offset mapping applies. Otherwise each token's text is what
    decoding it after a few tokens of context adds; a token that ends inside a character
    (byte-level BPE splits UTF-8 bytes over tokens) gets an empty range and the token that
    completes the character gets it. When the pieces do not add up to the decoded text,
    offsets come from decoding every prefix (``len(decode(ids[:i + 1]))``; quadratic, for at
    most ``max_quadratic`` tokens, else the joined pieces are the text).

    Returns ``(text, offsets)``; ``offsets[i]`` is ``(start, end)`` in characters.
    """
    ids = [int(t) for t in ids]
    full = _decode(tokenizer, ids)
    try:
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        if [int(t) for t in enc["input_ids"]] == ids:
            return full, [(int(a), int(b)) for a, b in enc["offset_mapping"]]
    except Exception:  # slow tokenizers have no offsets; anything else: decode instead
        pass
    offsets: list[tuple[int, int]] = []
    pieces: list[str] = []
    pos = 0
    clean = 0  # first token after the last complete character
    for i in range(len(ids)):
        ctx = max(0, clean - _CONTEXT)
        base = _decode(tokenizer, ids[ctx:clean])
        seg = _decode(tokenizer, ids[ctx : i + 1])
        if seg.startswith(base) and (not seg.endswith("\ufffd") or i == len(ids) - 1):
            piece = seg[len(base) :]
            offsets.append((pos, pos + len(piece)))
            pieces.append(piece)
            pos += len(piece)
            clean = i + 1
        else:
            offsets.append((pos, pos))
    if "".join(pieces) == full:
        return full, offsets
    if len(ids) <= max_quadratic:
        ends = [len(_decode(tokenizer, ids[: i + 1])) for i in range(len(ids))]
        out: list[tuple[int, int]] = []
        prev = 0
        for e in ends:
            e = max(prev, min(e, len(full)))
            out.append((prev, e))
            prev = e
        return full, out
    return "".join(pieces), offsets


@dataclass
class SameTextRun:
    """Two token runs that spell the same text: ``a[start:end_a]`` and ``b[start:end_b]``.

    ``text``: what both spell (characters); ``pieces_a`` / ``pieces_b``: each token's text;
    ``ended``: one list ends inside the run (a prompt cut in the middle of what the
    tokenizer merges when text follows); ``whitespace``: the run's text holds whitespace
    (a merged whitespace run or a space merged into a word: the usual cause).
    """

    start: int
    end_a: int
    end_b: int
    text: str
    pieces_a: list[str]
    pieces_b: list[str]
    ended: bool

    @property
    def whitespace(self) -> bool:
        return any(ch.isspace() for ch in self.text)


def same_text_run(
    ids_a: Sequence[int],
    text_a: str,
    offsets_a: Sequence[tuple[int, int]],
    ids_b: Sequence[int],
    text_b: str,
    offsets_b: Sequence[tuple[int, int]],
    start: int,
) -> SameTextRun | None:
    """Whether the first differing tokens (at ``start``) of ``a`` and ``b`` spell the same
    text, i.e. the same characters were split into other tokens.

    Walks both lists from ``start``, one token at a time on the side whose covered text is
    shorter, while the covered texts agree. A run ends where both sides reach a token
    boundary at the same character; it counts when right after it the next tokens are
    equal again or one list ends (the two prompts go on alike), or when one list ends
    inside the other's token. Returns None when the texts differ (a content change), the
    lists do not realign within :data:`MAX_RUN_TOKENS` tokens, or a range is unknown.
    """
    if start >= len(ids_a) or start >= len(ids_b):
        return None
    ca, cb = offsets_a[start][0], offsets_b[start][0]
    i, j = start + 1, start + 1
    ra, rb = offsets_a[start][1] - ca, offsets_b[start][1] - cb
    while (i - start) + (j - start) <= 2 * MAX_RUN_TOKENS:
        m = min(ra, rb)
        if text_a[ca : ca + m] != text_b[cb : cb + m]:
            return None
        if ra == rb and ra > 0:
            done_a, done_b = i >= len(ids_a), j >= len(ids_b)
            if done_a or done_b or ids_a[i] == ids_b[j]:
                return _run(start, i, j, text_a, text_b, ra, offsets_a, offsets_b, done_a or done_b)
        if ra <= rb:
            if i >= len(ids_a):  # a ends inside b's token
                return (
                    _run(start, i, j, text_a, text_b, ra, offsets_a, offsets_b, True) if m else None
                )
            ra = max(ra, offsets_a[i][1] - ca)
            i += 1
        else:
            if j >= len(ids_b):
                return (
                    _run(start, i, j, text_a, text_b, rb, offsets_a, offsets_b, True) if m else None
                )
            rb = max(rb, offsets_b[j][1] - cb)
            j += 1
    return None


def _run(
    start: int,
    end_a: int,
    end_b: int,
    text_a: str,
    text_b: str,
    length: int,
    offsets_a: Sequence[tuple[int, int]],
    offsets_b: Sequence[tuple[int, int]],
    ended: bool,
) -> SameTextRun:
    ca = offsets_a[start][0]
    return SameTextRun(
        start=start,
        end_a=end_a,
        end_b=end_b,
        text=text_a[ca : ca + length],
        pieces_a=[text_a[a:b] for a, b in offsets_a[start:end_a]],
        pieces_b=[text_b[a:b] for a, b in offsets_b[start:end_b]],
        ended=ended,
    )
