"""Build the deterministic request list of a run from its :class:`~jobs.schemas.WorkloadSpec`.

Kind ``shared_prefix`` (the only kind so far) models an assistant over a long reference
document, the case automatic prefix caching (APC) is meant for. Every measured request is a
chat of two messages:

* ``system``: the shared prefix, identical in every measured request: assistant
  instructions, a tool schema (JSON, serialized with sorted keys), a versioned document
  header ("Document: Operations Handbook v3.2 ...") and a document body drawn from the
  corpus (:mod:`jobs.corpus`), cut to about ``prefix_tokens`` tokens;
* ``user``: a question of about ``question_tokens`` tokens made of random corpus sentences,
  different for every request.

Token counts are measured on the message contents (without the chat template's few extra
tokens) with the model's tokenizer when one is given; without one, 4 characters count as
one token (:data:`CHARS_PER_TOKEN`).

Warm-up requests come first, with indices ``-warmup_requests .. -1`` and ``warmup=True``.
They are a single ``user`` message of about ``prefix_tokens + question_tokens`` tokens of
unrelated text, so their token sequences diverge from the measured ones right after the
BOS token: a warm-up never puts a block of the measured prefix into the prefix cache.
Measured requests follow with indices ``0 .. num_requests - 1``.

All text derives from ``random.Random`` instances seeded from ``spec.seed``: the same spec
and tokenizer give a byte-identical list (see :func:`request_list_hash`).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence

from tokenizers import Tokenizer

from jobs.corpus import sample_passage, sample_text
from jobs.schemas import ChatRequest, WorkloadSpec

#: Characters per token assumed when no tokenizer is given.
CHARS_PER_TOKEN = 4

#: Version string in the shared document header.
DOCUMENT_VERSION = "3.2"

SYSTEM_INSTRUCTIONS = (
    "You are Atlas, the operations assistant of the platform engineering team. "
    "Answer questions using only the reference document below. Quote the section you rely "
    "on, say so plainly when the document does not cover the question, and never invent "
    "commands, file paths or configuration values. Keep answers short and factual. When an "
    "action is required, call one of the tools described below instead of describing the "
    "action in prose."
)

#: Tool definitions in OpenAI function-calling form, embedded in the shared prefix.
TOOLS: list[dict[str, object]] = [
    {
        "type": "function",
        "function": {
            "name": "search_handbook",
            "description": "Full-text search over the operations handbook.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "search terms"},
                    "max_results": {"type": "integer", "minimum": 1, "maximum": 20},
                    "section": {"type": "string", "description": "restrict to one section"},
                },
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "open_ticket",
            "description": "Open an incident or change ticket for the on-call engineer.",
            "parameters": {
                "type": "object",
                "properties": {
                    "title": {"type": "string"},
                    "severity": {"type": "string", "enum": ["sev1", "sev2", "sev3", "sev4"]},
                    "service": {"type": "string"},
                    "details": {"type": "string"},
                },
                "required": ["title", "severity"],
            },
        },
    },
]


def _measure(text: str, tokenizer: Tokenizer | None) -> int:
    """Tokens in ``text``: with ``tokenizer`` (no special tokens), else ``ceil(len / 4)``."""
    if tokenizer is None:
        return -(-len(text) // CHARS_PER_TOKEN)
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


def truncate_to_tokens(text: str, max_tokens: int, tokenizer: Tokenizer | None = None) -> str:
    """Cut ``text`` to at most ``max_tokens`` tokens, preferring a word boundary.

    With a tokenizer the cut is just before the last token among the first ``max_tokens + 1``
    that starts a word (begins with whitespace), looking back at most 8 tokens, else after
    token ``max_tokens``; the result is right-stripped, so re-encoding it gives between
    ``max_tokens - 9`` and ``max_tokens`` tokens. Without one, the cut is at
    ``max_tokens * 4`` characters, moved back to a space within the last 16 characters.
    ``max_tokens <= 0`` gives ``""``; a text that already fits is returned unchanged.
    """
    if max_tokens <= 0:
        return ""
    if tokenizer is None:
        end = max_tokens * CHARS_PER_TOKEN
        if end >= len(text):
            return text
        space = max(text.rfind(" ", 0, end + 1), text.rfind("\n", 0, end + 1))
        if space >= max(1, end - 16):
            end = space
        return text[:end].rstrip()
    offsets = tokenizer.encode(text, add_special_tokens=False).offsets
    if len(offsets) <= max_tokens:
        return text
    end = offsets[max_tokens - 1][1]
    for j in range(max_tokens, max(0, max_tokens - 8), -1):
        start = offsets[j][0]
        if start < len(text) and text[start].isspace():
            end = start
            break
    return text[:end].rstrip()


def _fill(
    rng: random.Random,
    lead: str,
    target_tokens: int,
    tokenizer: Tokenizer | None,
    *,
    passage: bool,
) -> str:
    """``lead`` followed by corpus text, cut to about ``target_tokens`` tokens."""
    if target_tokens <= 0:
        return ""
    # Byte-level BPE on this corpus averages ~3-4 chars/token; draw generously, then cut.
    need_chars = max(64, target_tokens * 6)
    body = sample_passage(rng, need_chars) if passage else sample_text(rng, need_chars)
    return truncate_to_tokens(lead + body, target_tokens, tokenizer)


def shared_prefix_text(seed: int, prefix_tokens: int, tokenizer: Tokenizer | None = None) -> str:
    """Return the shared system-prompt text of a ``shared_prefix`` workload.

    Layout: instructions, ``Tools:`` + the :data:`TOOLS` JSON (one line, ``sort_keys``),
    the document header, then a corpus passage drawn with ``random.Random(seed)``; the
    whole text is cut to about ``prefix_tokens`` tokens (for small targets the cut falls
    inside the instructions). ``prefix_tokens == 0`` gives ``""``.
    """
    tools_json = json.dumps(TOOLS, sort_keys=True, ensure_ascii=True)
    doc_id = f"OPS-{1000 + seed % 9000:04d}"
    header = (
        f"{SYSTEM_INSTRUCTIONS}\n\n"
        f"Tools:\n{tools_json}\n\n"
        f"Document: Operations Handbook v{DOCUMENT_VERSION} ({doc_id}), "
        "Platform Engineering. Status: approved. Supersedes v3.1. "
        "Audience: on-call engineers and service owners.\n\n"
    )
    rng = random.Random(f"shared_prefix/prefix/{seed}")
    return _fill(rng, header, prefix_tokens, tokenizer, passage=True)


def build_requests(spec: WorkloadSpec, tokenizer: Tokenizer | None = None) -> list[ChatRequest]:
    """Build the full, ordered request list of ``spec``: warm-ups first, then measured.

    Args:
        spec: the workload; ``kind`` must be ``"shared_prefix"``.
        tokenizer: the served model's tokenizer (e.g. :func:`jobs.modelgen.load_tokenizer`)
            to size the texts in its tokens; ``None`` sizes them at 4 characters per token.

    Returns:
        ``spec.warmup_requests`` warm-up requests (``index`` ``-W .. -1``, ``warmup=True``)
        followed by ``spec.num_requests`` measured requests (``index`` ``0 .. N-1``), all
        with ``max_tokens = spec.output_tokens``. Measured requests are
        ``[{"role": "system", "content": <shared prefix>}, {"role": "user", "content":
        <question>}]`` (no system message when ``prefix_tokens == 0``); warm-ups are one
        ``user`` message of unrelated text. Deterministic in ``spec`` and the tokenizer.

    Raises:
        ValueError: for an unsupported ``spec.kind``.
    """
    if spec.kind != "shared_prefix":
        raise ValueError(f"unsupported workload kind {spec.kind!r}")
    out: list[ChatRequest] = []
    warm_rng = random.Random(f"shared_prefix/warmup/{spec.seed}")
    warm_tokens = spec.prefix_tokens + spec.question_tokens
    for i in range(spec.warmup_requests):
        text = _fill(warm_rng, "Warm-up. ", warm_tokens, tokenizer, passage=False)
        out.append(
            ChatRequest(
                index=i - spec.warmup_requests,
                messages=[{"role": "user", "content": text}],
                max_tokens=spec.output_tokens,
                warmup=True,
            )
        )
    prefix = shared_prefix_text(spec.seed, spec.prefix_tokens, tokenizer)
    q_rng = random.Random(f"shared_prefix/questions/{spec.seed}")
    doc_rng = random.Random(f"shared_prefix/long_documents/{spec.seed}")
    n_long = round(spec.num_requests * spec.long_fraction)
    long_at = set(
        random.Random(f"shared_prefix/classes/{spec.seed}").sample(range(spec.num_requests), n_long)
    )
    for i in range(spec.num_requests):
        # drawn for every request, long or short, so short requests never depend on the mix
        question = _fill(q_rng, "", spec.question_tokens, tokenizer, passage=False)
        request_class = "short"
        if i in long_at:
            request_class = "long"
            document = _fill(
                doc_rng, "Attached document:\n", spec.long_input_tokens, tokenizer, passage=True
            )
            question = f"{document}\n\nQuestion: {question}"
        messages = [{"role": "user", "content": question}]
        if prefix:
            messages.insert(0, {"role": "system", "content": prefix})
        out.append(
            ChatRequest(
                index=i,
                messages=messages,
                max_tokens=spec.output_tokens,
                request_class=request_class,
            )
        )
    return out


def request_list_hash(requests: Sequence[ChatRequest]) -> str:
    """Return the sha256 hex digest of ``requests`` (warm-ups included, in list order).

    The input is the canonical JSON of ``[r.model_dump(mode="json") for r in requests]`` with
    ``sort_keys=True``, ``separators=(",", ":")``, ``ensure_ascii=True``. Equal hashes mean
    two runs sent the same requests in the same order.
    """
    payload = json.dumps(
        [r.model_dump(mode="json") for r in requests],
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
    )
    return hashlib.sha256(payload.encode("ascii")).hexdigest()
