"""The texts of generated requests: fixed strings and corpus text cut to a token count.

Every text of :mod:`jobs.load.workload`'s request lists comes from here: the fixed strings
(:data:`SYSTEM_INSTRUCTIONS`, :data:`OUTPUT_FORMAT_INSTRUCTIONS`, the :data:`TOOLS`
JSON, the versioned document header) and text drawn from the shipped corpus
(:mod:`jobs.modelgen.corpus`) with the ``random.Random`` the caller passes, cut to a target
token count (:func:`truncate_to_tokens`; :func:`measure_tokens` counts with the
model's tokenizer, else :data:`CHARS_PER_TOKEN` characters a token).
:func:`source_text` gives the text of a ``template`` segment source
(``instructions``, ``tools``, ``document_header``, ``document``, ``passages``,
``question``, ``conversation_state``); :func:`shared_prefix_text` the system prompt
of a ``shared_prefix`` workload. Deterministic in the random state given.
"""

from __future__ import annotations

import json
import random
import re

from tokenizers import Tokenizer

from jobs.modelgen.corpus import sample_passage, sample_sentences, sample_text
from jobs.schemas import SegmentSource

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


def measure_tokens(text: str, tokenizer: Tokenizer | None) -> int:
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


def fill_text(
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


#: Output-format instruction that opens the ``tools`` segment of a ``template`` workload.
OUTPUT_FORMAT_INSTRUCTIONS = (
    "Output format: answer in plain text of at most five sentences, then a line 'Sources:' "
    "listing the document sections you quoted. To call a tool, reply with only a JSON object "
    '{"name": <tool name>, "arguments": {...}} whose arguments match the tool\'s parameters.'
)

_QUESTION_FORMS = (
    'What does the handbook mean by "{}"?',
    'Can you explain this line: "{}"?',
    'How does "{}" apply to our production services?',
    'Is this still correct: "{}"?',
    'Which section says "{}", and when does it apply?',
    'What should I check first, given that "{}"?',
)


def document_header(seed: int) -> str:
    """The versioned document header (``"Document: Operations Handbook v3.2 ..."``)."""
    doc_id = f"OPS-{1000 + seed % 9000:04d}"
    return (
        f"Document: Operations Handbook v{DOCUMENT_VERSION} ({doc_id}), "
        "Platform Engineering. Status: approved. Supersedes v3.1. "
        "Audience: on-call engineers and service owners.\n\n"
    )


def shared_prefix_text(seed: int, prefix_tokens: int, tokenizer: Tokenizer | None = None) -> str:
    """Return the shared system-prompt text of a ``shared_prefix`` workload.

    Layout: instructions, ``Tools:`` + the :data:`TOOLS` JSON (one line, ``sort_keys``),
    the document header, then a corpus passage drawn with ``random.Random(seed)``; the
    whole text is cut to about ``prefix_tokens`` tokens (for small targets the cut falls
    inside the instructions). ``prefix_tokens == 0`` gives ``""``.
    """
    tools_json = json.dumps(TOOLS, sort_keys=True, ensure_ascii=True)
    header = f"{SYSTEM_INSTRUCTIONS}\n\nTools:\n{tools_json}\n\n{document_header(seed)}"
    rng = random.Random(f"shared_prefix/prefix/{seed}")
    return fill_text(rng, header, prefix_tokens, tokenizer, passage=True)


# -- segment texts --------------------------------------------------------------------------


def _clip(text: str, max_chars: int) -> str:
    """``text`` cut to at most ``max_chars`` characters at a sentence end or a space."""
    if len(text) <= max_chars:
        return text
    end = text.rfind(". ", 0, max_chars)
    if end > max_chars // 2:
        return text[: end + 1]
    space = text.rfind(" ", 0, max_chars)
    return text[: space if space > 0 else max_chars]


def _question(rng: random.Random, max_chars: int | None = None) -> str:
    """A question quoting a corpus sentence ('Is this still correct: "..."?').

    ``max_chars`` clips the quoted sentence (at a space) to at most that many characters.
    """
    (sentence,) = sample_sentences(rng, 1)
    quote = sentence.rstrip(" .!?:;,")
    if max_chars is not None and len(quote) > max_chars:
        quote = _clip(quote, max_chars).rstrip(" .!?:;,")
    return rng.choice(_QUESTION_FORMS).format(quote)


def _question_text(rng: random.Random, target: int, tokenizer: Tokenizer | None) -> str:
    """Corpus sentences, a blank line and a question; about ``target`` tokens in all."""
    ask, n = "", 0
    for _ in range(8):
        ask = _question(rng)
        n = measure_tokens(ask, tokenizer)
        if n <= target:
            break
    if n >= target:
        return truncate_to_tokens(ask, target, tokenizer)
    raw = sample_text(rng, max(64, (target - n) * 6))
    budget = target - n - 1  # the "\n\n" before the question takes about one token
    while True:
        context = truncate_to_tokens(raw, budget, tokenizer)
        text = f"{context}\n\n{ask}" if context else ask
        if budget <= 0 or measure_tokens(text, tokenizer) <= target:
            return text
        budget -= 1


def _extra_tool(rng: random.Random, k: int) -> dict[str, object]:
    """A further tool definition described by corpus sentences."""
    what, arg = sample_sentences(rng, 2)
    words = re.findall(r"[a-z]{4,}", what.lower())[:2] or ["lookup"]
    return {
        "type": "function",
        "function": {
            "name": "_".join([*words, str(k + 1)]),
            "description": what,
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": arg},
                    "limit": {"type": "integer", "minimum": 1, "maximum": 100},
                },
                "required": ["query"],
            },
        },
    }


def _tools_text(rng: random.Random, target: int) -> str:
    head = f"{OUTPUT_FORMAT_INSTRUCTIONS}\n\nTools:\n"
    tools = list(TOOLS)
    size = len(head) + len(json.dumps(tools, sort_keys=True, ensure_ascii=True))
    while size < max(64, target * 6):
        tool = _extra_tool(rng, len(tools) - len(TOOLS))
        tools.append(tool)
        size += len(json.dumps(tool, sort_keys=True, ensure_ascii=True)) + 2
    return head + json.dumps(tools, sort_keys=True, ensure_ascii=True)


def _passages_text(rng: random.Random, target: int) -> str:
    parts = ["Retrieved passages:"]
    size = len(parts[0])
    while size < max(64, target * 6):
        section = f"{rng.randint(1, 12)}.{rng.randint(1, 20)}"
        chunk = _clip(sample_passage(rng, 300), 1200)
        part = (
            f"[Passage {len(parts)}] (Operations Handbook v{DOCUMENT_VERSION}, "
            f"section {section})\n{chunk}"
        )
        parts.append(part)
        size += len(part) + 2
    return "\n\n".join(parts)


def _conversation_text(rng: random.Random, target: int) -> str:
    lines = ["Conversation so far:"]
    size = len(lines[0])
    while size < max(64, target * 6):
        user = f"User: {_question(rng, 120)}"
        answer = f"Assistant: {sample_text(rng, rng.randint(120, 480))}"
        lines += [user, answer]
        size += len(user) + len(answer) + 2
    return "\n".join(lines)


def source_text(
    source: SegmentSource, rng: random.Random, target: int, tokenizer: Tokenizer | None, seed: int
) -> str:
    """Text of ``source`` cut to about ``target`` tokens (``""`` for ``target <= 0``)."""
    if target <= 0:
        return ""
    if source == "instructions":
        return fill_text(rng, f"{SYSTEM_INSTRUCTIONS}\n\n", target, tokenizer, passage=True)
    if source == "tools":
        return truncate_to_tokens(_tools_text(rng, target), target, tokenizer)
    if source == "document_header":
        return fill_text(rng, document_header(seed), target, tokenizer, passage=True)
    if source == "document":
        return fill_text(rng, "Attached document:\n", target, tokenizer, passage=True)
    if source == "passages":
        return truncate_to_tokens(_passages_text(rng, target), target, tokenizer)
    if source == "question":
        return _question_text(rng, target, tokenizer)
    if source == "conversation_state":
        return truncate_to_tokens(_conversation_text(rng, target), target, tokenizer)
    raise ValueError(f"source {source!r} has no generated text; give 'text'")
