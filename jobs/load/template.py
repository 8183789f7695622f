"""The ``template`` workload: segments, request classes, the requests built from them.

:func:`template_segments` (the spec's segments, or the default ones carved out of
``prefix_tokens``), :func:`check_template`, :func:`template_requests` (one list, each
class's parts drawn from its length distributions) and :func:`template_longest` (its
longest request without building it). The other kinds and the arrivals:
:mod:`jobs.load.workload`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from tokenizers import Tokenizer

from jobs.load.texts import CHARS_PER_TOKEN, fill_text, source_text
from jobs.schemas import (
    ChatRequest,
    LengthDist,
    RequestClassSpec,
    SegmentSource,
    TemplateSegment,
    WorkloadSpec,
)

__all__ = [
    "DEFAULT_CLASS",
    "check_template",
    "class_sequence",
    "length_bounds",
    "template_longest",
    "template_requests",
    "template_segments",
]

#: Class of every measured ``template`` request when ``classes`` is not given.
DEFAULT_CLASS = "default"

#: Default ``template`` segment lengths carved out of ``prefix_tokens`` (tokens).
_DEFAULT_INSTRUCTIONS_TOKENS = 256
_DEFAULT_TOOLS_TOKENS = 512

#: Tokens :func:`template_longest` allows for each ``"\n\n"`` join of two texts.
_JOIN_TOKENS = 2


def length_bounds(dist: LengthDist) -> tuple[int, int]:
    """Return ``(low, high)`` token bounds of ``dist``, both inclusive.

    ``low = floor(tokens * (1 - range_ratio))``, ``high = ceil(tokens * (1 + range_ratio))``,
    as ``vllm bench serve``'s random dataset computes them.
    """
    low = math.floor(dist.tokens * (1 - dist.range_ratio))
    high = math.ceil(dist.tokens * (1 + dist.range_ratio))
    return low, high


def _draw_length(rng: random.Random, dist: LengthDist) -> int:
    low, high = length_bounds(dist)
    return low if low == high else rng.randint(low, high)


def template_segments(spec: WorkloadSpec) -> list[TemplateSegment]:
    """Return the segments of a ``template`` workload: ``spec.segments`` or the defaults.

    Defaults (when ``spec.segments`` is None), in order: ``instructions`` (system, fixed,
    ``min(256, prefix_tokens)`` tokens), ``tools`` (system, fixed, the next up to 512
    tokens of ``prefix_tokens``), ``document_header`` (system, fixed, the rest of
    ``prefix_tokens``) and ``question`` (user, variable, ``question_tokens``); fixed
    defaults that get 0 tokens are left out, so the system part is about
    ``prefix_tokens`` tokens as in a ``shared_prefix`` workload.
    """
    if spec.segments is not None:
        return list(spec.segments)
    instructions = min(_DEFAULT_INSTRUCTIONS_TOKENS, spec.prefix_tokens)
    tools = min(_DEFAULT_TOOLS_TOKENS, spec.prefix_tokens - instructions)
    header = spec.prefix_tokens - instructions - tools
    fixed: list[tuple[SegmentSource, int]] = [
        ("instructions", instructions),
        ("tools", tools),
        ("document_header", header),
    ]
    out = [
        TemplateSegment(
            name=source, role="system", fixed=True, source=source, tokens=LengthDist(tokens=n)
        )
        for source, n in fixed
        if n > 0
    ]
    out.append(
        TemplateSegment(
            name="question",
            role="user",
            fixed=False,
            source="question",
            tokens=LengthDist(tokens=spec.question_tokens),
        )
    )
    return out


def _segment_dist(seg: TemplateSegment, cls: RequestClassSpec) -> LengthDist:
    return seg.tokens if seg.fixed else cls.segment_tokens.get(seg.name, seg.tokens)


def check_template(spec: WorkloadSpec) -> tuple[list[TemplateSegment], list[RequestClassSpec]]:
    """The segments and classes of a ``template`` spec, after checking them."""
    segments = template_segments(spec)
    by_name: dict[str, TemplateSegment] = {}
    for k, seg in enumerate(segments):
        where = f"segments[{k}] ({seg.name!r})"
        if seg.name in by_name:
            raise ValueError(f"segments: duplicate segment name {seg.name!r}")
        by_name[seg.name] = seg
        if seg.text is not None and not seg.fixed:
            raise ValueError(
                f"{where}: 'text' is for fixed segments only; a variable segment draws its "
                "text from its 'source'"
            )
        if seg.source == "text" and seg.text is None:
            raise ValueError(
                f"{where}: source 'text' needs 'text' (the literal text); or pick another source"
            )
    if not any(seg.role == "user" for seg in segments):
        raise ValueError("segments: no segment has role 'user'; a chat request needs one")
    classes = spec.classes or [RequestClassSpec(name=DEFAULT_CLASS, weight=1.0)]
    seen: set[str] = set()
    for j, cls in enumerate(classes):
        where = f"classes[{j}] ({cls.name!r})"
        if cls.name in seen:
            raise ValueError(f"classes: duplicate class name {cls.name!r}")
        seen.add(cls.name)
        for name in cls.segment_tokens:
            named = by_name.get(name)
            if named is None:
                raise ValueError(
                    f"{where}: segment_tokens names unknown segment {name!r} "
                    f"(segments: {', '.join(by_name)})"
                )
            if named.fixed:
                raise ValueError(
                    f"{where}: segment_tokens names fixed segment {name!r}; only variable "
                    "segments can change length by class"
                )
        if cls.output_tokens is not None and cls.output_tokens.tokens < 1:
            raise ValueError(f"{where}: output_tokens.tokens must be at least 1")
        if not any(
            (seg.text if seg.text is not None else length_bounds(_segment_dist(seg, cls))[1])
            for seg in segments
            if seg.role == "user"
        ):
            raise ValueError(f"{where}: every user segment has 0 tokens; the user message is empty")
    return segments, classes


def class_sequence(
    count: int, classes: Sequence[RequestClassSpec], seed: int
) -> list[RequestClassSpec]:
    """``count`` classes with exact largest-remainder counts, in seeded order."""
    weights = [Fraction(c.weight) for c in classes]  # exact: the counts always sum to count
    quotas = [count * w / sum(weights) for w in weights]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(classes)), key=lambda j: (counts[j] - quotas[j], j))
    for j in by_remainder[: count - sum(counts)]:
        counts[j] += 1
    seq = [c for c, n in zip(classes, counts, strict=True) for _ in range(n)]
    random.Random(f"template/classes/{seed}").shuffle(seq)
    return seq


class _Template:
    """Draws the parts of ``template`` requests; every draw is seeded by its own key."""

    def __init__(self, spec: WorkloadSpec, tokenizer: Tokenizer | None) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.segments, self.classes = check_template(spec)
        self.fixed: dict[str, str] = {}
        for seg in self.segments:
            if seg.fixed:
                rng = random.Random(f"template/fixed/{spec.seed}/{seg.name}")
                self.fixed[seg.name] = self._text(seg, _draw_length(rng, seg.tokens), rng)

    def _text(self, seg: TemplateSegment, target: int, rng: random.Random) -> str:
        if seg.text is not None:
            return seg.text
        return source_text(seg.source, rng, target, self.tokenizer, self.spec.seed)

    def part(self, role: str, cls: RequestClassSpec, key: str) -> str:
        """The ``role`` message text of request ``key`` of class ``cls``."""
        seed = self.spec.seed
        texts: list[str] = []
        for seg in self.segments:
            if seg.role != role:
                continue
            if seg.fixed:
                texts.append(self.fixed[seg.name])
                continue
            length_rng = random.Random(f"template/length/{seed}/{seg.name}/{key}")
            target = _draw_length(length_rng, _segment_dist(seg, cls))
            texts.append(
                self._text(seg, target, random.Random(f"template/text/{seed}/{seg.name}/{key}"))
            )
        return "\n\n".join(t for t in texts if t)

    def max_tokens(self, cls: RequestClassSpec, key: str) -> int:
        if cls.output_tokens is None:
            return self.spec.output_tokens
        rng = random.Random(f"template/output/{self.spec.seed}/{key}")
        return max(1, _draw_length(rng, cls.output_tokens))

    def answer(self, conversation: int, turn: int) -> str:
        assert self.spec.multi_turn is not None
        rng = random.Random(f"template/answer/{self.spec.seed}/{conversation}/{turn}")
        return fill_text(rng, "", self.spec.multi_turn.answer_tokens, self.tokenizer, passage=True)


def template_requests(spec: WorkloadSpec, tokenizer: Tokenizer | None) -> list[ChatRequest]:
    tpl = _Template(spec, tokenizer)
    seq = class_sequence(spec.num_requests, tpl.classes, spec.seed)
    out: list[ChatRequest] = []
    if spec.multi_turn is None:
        for i, cls in enumerate(seq):
            key = str(i)
            system = tpl.part("system", cls, key)
            messages = [{"role": "system", "content": system}] if system else []
            messages.append({"role": "user", "content": tpl.part("user", cls, key)})
            out.append(
                ChatRequest(
                    index=i,
                    messages=messages,
                    max_tokens=tpl.max_tokens(cls, key),
                    request_class=cls.name,
                )
            )
        return out
    turns = spec.multi_turn.turns
    conversations = -(-spec.num_requests // turns)
    order = [(c, t) for t in range(turns) for c in range(conversations)][: spec.num_requests]
    history: dict[int, list[dict[str, Any]]] = {}
    previous: dict[int, int] = {}
    for i, (c, t) in enumerate(order):
        cls = seq[i]
        if t == 0:
            system = tpl.part("system", cls, f"c{c}")
            history[c] = [{"role": "system", "content": system}] if system else []
        else:
            history[c].append({"role": "assistant", "content": tpl.answer(c, t - 1)})
        key = f"c{c}t{t}"
        history[c].append({"role": "user", "content": tpl.part("user", cls, key)})
        out.append(
            ChatRequest(
                index=i,
                messages=[dict(m) for m in history[c]],
                max_tokens=tpl.max_tokens(cls, key),
                request_class=cls.name,
                conversation=c,
                turn=t,
                after=previous.get(c),
            )
        )
        previous[c] = i
    return out


def template_longest(spec: WorkloadSpec) -> int:
    segments, classes = check_template(spec)

    def seg_max(seg: TemplateSegment, cls: RequestClassSpec) -> int:
        if seg.text is not None:
            return -(-len(seg.text) // CHARS_PER_TOKEN)
        return length_bounds(_segment_dist(seg, cls))[1]

    def part_max(role: str, cls: RequestClassSpec) -> int:
        sizes = [seg_max(s, cls) for s in segments if s.role == role]
        sizes = [n for n in sizes if n > 0]
        return sum(sizes) + _JOIN_TOKENS * max(0, len(sizes) - 1)

    def output_max(cls: RequestClassSpec) -> int:
        if cls.output_tokens is None:
            return spec.output_tokens
        return max(1, length_bounds(cls.output_tokens)[1])

    if spec.multi_turn is None:
        return max(part_max("system", c) + part_max("user", c) + output_max(c) for c in classes)
    turns = min(spec.multi_turn.turns, spec.num_requests)
    history = (turns - 1) * (
        max(part_max("user", c) for c in classes) + spec.multi_turn.answer_tokens
    )
    system = max(part_max("system", c) for c in classes)
    return system + history + max(part_max("user", c) + output_max(c) for c in classes)
