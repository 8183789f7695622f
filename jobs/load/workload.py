"""Build the deterministic request list of a run from its :class:`~jobs.schemas.WorkloadSpec`.

All text comes from :mod:`jobs.load.texts` (the shipped corpus and a few fixed strings),
drawn with ``random.Random`` instances seeded from ``spec.seed`` (string seeds such
as ``"template/text/<seed>/<segment>/<request>"``): the same spec and tokenizer give a
byte-identical list (see :func:`request_list_hash`). Token counts are measured on the
message contents (without the chat template's few extra tokens) with the model's tokenizer
when one is given; without one, 4 characters count as one token
(:data:`jobs.load.texts.CHARS_PER_TOKEN`). A text of target ``t`` tokens is cut to between
``t - 9`` and ``t`` tokens (:func:`jobs.load.texts.truncate_to_tokens`).

Kinds:

``shared_prefix`` models an assistant over a long reference document, the case automatic
prefix caching (APC) is meant for. Every measured request is a chat of two messages:

* ``system``: the shared prefix, identical in every measured request: assistant
  instructions, a tool schema (JSON, serialized with sorted keys), a versioned document
  header ("Document: Operations Handbook v3.2 ...") and a document body drawn from the
  corpus, cut to about ``prefix_tokens`` tokens;
* ``user``: a question of about ``question_tokens`` tokens made of random corpus sentences,
  different for every request; ``round(num_requests * long_fraction)`` requests at seeded
  positions (class ``long``, the rest ``short``) put a unique document of about
  ``long_input_tokens`` tokens before it.

``template`` builds each request from ordered segments (:func:`template_segments`; the
defaults split ``prefix_tokens`` into instructions, tools and document header, then a
``question`` of ``question_tokens``). Fixed segments are drawn once and are byte-identical
in every request; variable ones are drawn per request (per conversation turn), their
length uniform in ``[floor(t * (1 - r)), ceil(t * (1 + r))]`` as ``vllm bench serve
--random-range-ratio``. All ``system`` segments, joined with ``"\\n\\n"`` in template order,
form the system message (omitted when empty); all ``user`` segments form the user message.
Segment sources (see :func:`build_requests` for the validation rules):

* ``instructions``: :data:`jobs.load.texts.SYSTEM_INSTRUCTIONS`, continued with corpus text for
  longer targets;
* ``tools``: :data:`jobs.load.texts.OUTPUT_FORMAT_INSTRUCTIONS`, then ``Tools:`` and the
  :data:`jobs.load.texts.TOOLS` JSON (``sort_keys``), with more corpus-described tools for longer
  targets;
* ``document_header``: the versioned document header, then a corpus document body;
* ``document``: ``Attached document:`` and a corpus passage;
* ``passages``: retrieved ``[Passage k]`` chunks of the corpus with their section;
* ``question``: corpus sentences, then a question quoting another corpus sentence;
* ``conversation_state``: prior ``User:`` / ``Assistant:`` lines of corpus text;
* ``text``: the segment's literal ``text``, verbatim (``tokens`` is ignored; fixed only).

Request classes (``classes``, default one class ``"default"``) are assigned per measured
request with exact counts (largest remainder of ``num_requests * weight / sum(weights)``)
at seeded positions; a class may override variable segments' lengths and the output length
(else ``output_tokens``). With ``multi_turn`` the ``num_requests`` requests are the turns
of ``ceil(num_requests / turns)`` conversations, listed turn by turn (every conversation's
turn 0, then turn 1 ...); turn ``k`` repeats the conversation's system message (variable
system segments are drawn once per conversation, with its turn 0's class), every earlier
user message and a seeded assistant answer of ``answer_tokens`` tokens after each, then its
new user message (variable user segments drawn per turn), and names the previous turn in
``after``.

``replay`` sends the user's own OpenAI bodies (``spec.replay``, checked as
:func:`jobs.load.replay.body_problems` does), all of them and in order: ``num_requests`` is
ignored. Chat bodies keep their ``messages``, completions bodies their ``prompt``;
``max_tokens`` comes from ``max_completion_tokens`` / ``max_tokens`` (else
``output_tokens``), the class from ``request_class`` / ``class`` (else ``"replay"``), and
every other field except :data:`REPLAY_DROPPED_FIELDS` goes to ``extra_body``.

Warm-up requests come first (every kind), with indices ``-warmup_requests .. -1`` and
``warmup=True``. They are a single ``user`` message of about ``prefix_tokens +
question_tokens`` tokens of unrelated text (for ``template`` and ``replay``, no longer
than the longest measured prompt), so their token sequences diverge from the
measured ones right after the BOS token: a warm-up never puts a block of the measured
prefix into the prefix cache. Measured requests follow with indices ``0 .. N - 1``.

Arrival (:func:`arrival_offsets`) sets the measured requests' ``arrival_s``: ``None`` for
``closed``; ``i / request_rate`` for ``constant``; for ``poisson`` the cumulative sum of
gamma gaps (shape ``burstiness``, mean ``1 / request_rate``, first request at 0) as ``vllm
bench serve``; for ``trace`` each replayed body's ``timestamp`` minus the smallest one.
Warm-ups never have one. :func:`longest_request_tokens` bounds a list's longest request
without building it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import random
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from tokenizers import Tokenizer

from jobs.load.replay import body_problems, body_tokens_estimate
from jobs.load.texts import CHARS_PER_TOKEN, fill_text, shared_prefix_text, source_text
from jobs.schemas import (
    ChatRequest,
    LengthDist,
    RequestClassSpec,
    SegmentSource,
    TemplateSegment,
    WorkloadSpec,
)

#: Class of every measured ``template`` request when ``classes`` is not given.
DEFAULT_CLASS = "default"

#: Class of a replayed request whose body names none.
REPLAY_CLASS = "replay"

#: Body fields of a replayed request that do not go to ``ChatRequest.extra_body`` (the load
#: generator sets model, streaming and the output length itself; the rest is replay metadata).
REPLAY_DROPPED_FIELDS = frozenset(
    {
        "messages",
        "prompt",
        "model",
        "stream",
        "stream_options",
        "timestamp",
        "max_tokens",
        "max_completion_tokens",
        "request_class",
        "class",
        "n",
    }
)

#: Default ``template`` segment lengths carved out of ``prefix_tokens`` (tokens).
_DEFAULT_INSTRUCTIONS_TOKENS = 256
_DEFAULT_TOOLS_TOKENS = 512

#: Tokens :func:`longest_request_tokens` allows for each ``"\n\n"`` join of two texts.
_JOIN_TOKENS = 2

# -- lengths and classes --------------------------------------------------------------------


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


def _check_kind_fields(spec: WorkloadSpec) -> None:
    """Refuse fields that do not apply to ``spec.kind`` (they would be silently ignored)."""
    if spec.kind not in ("shared_prefix", "template", "replay"):
        raise ValueError(f"unsupported workload kind {spec.kind!r}")
    if spec.kind != "template":
        for field in ("segments", "classes", "multi_turn"):
            if getattr(spec, field) is not None:
                raise ValueError(f"{field} applies to kind 'template' only, not {spec.kind!r}")
    if spec.kind != "replay" and spec.replay is not None:
        raise ValueError(f"replay applies to kind 'replay' only, not {spec.kind!r}")
    if spec.kind != "shared_prefix" and spec.long_fraction != 0:
        raise ValueError(f"long_fraction applies to kind 'shared_prefix' only, not {spec.kind!r}")


def _check_template(spec: WorkloadSpec) -> tuple[list[TemplateSegment], list[RequestClassSpec]]:
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


def _class_sequence(
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


# -- request lists --------------------------------------------------------------------------


def _warmups(spec: WorkloadSpec, tokenizer: Tokenizer | None) -> list[ChatRequest]:
    out: list[ChatRequest] = []
    warm_rng = random.Random(f"shared_prefix/warmup/{spec.seed}")
    warm_tokens = _warmup_tokens(spec)
    for i in range(spec.warmup_requests):
        text = fill_text(warm_rng, "Warm-up. ", warm_tokens, tokenizer, passage=False)
        out.append(
            ChatRequest(
                index=i - spec.warmup_requests,
                messages=[{"role": "user", "content": text}],
                max_tokens=spec.output_tokens,
                warmup=True,
            )
        )
    return out


def _shared_prefix_requests(spec: WorkloadSpec, tokenizer: Tokenizer | None) -> list[ChatRequest]:
    out: list[ChatRequest] = []
    prefix = shared_prefix_text(spec.seed, spec.prefix_tokens, tokenizer)
    q_rng = random.Random(f"shared_prefix/questions/{spec.seed}")
    doc_rng = random.Random(f"shared_prefix/long_documents/{spec.seed}")
    n_long = round(spec.num_requests * spec.long_fraction)
    long_at = set(
        random.Random(f"shared_prefix/classes/{spec.seed}").sample(range(spec.num_requests), n_long)
    )
    for i in range(spec.num_requests):
        # drawn for every request, long or short, so short requests never depend on the mix
        question = fill_text(q_rng, "", spec.question_tokens, tokenizer, passage=False)
        request_class = "short"
        if i in long_at:
            request_class = "long"
            document = fill_text(
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


class _Template:
    """Draws the parts of ``template`` requests; every draw is seeded by its own key."""

    def __init__(self, spec: WorkloadSpec, tokenizer: Tokenizer | None) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.segments, self.classes = _check_template(spec)
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


def _template_requests(spec: WorkloadSpec, tokenizer: Tokenizer | None) -> list[ChatRequest]:
    tpl = _Template(spec, tokenizer)
    seq = _class_sequence(spec.num_requests, tpl.classes, spec.seed)
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


def _check_replay(spec: WorkloadSpec) -> list[dict[str, Any]]:
    if not spec.replay:
        raise ValueError("kind 'replay' needs replay: a non-empty list of OpenAI request bodies")
    for k, body in enumerate(spec.replay):
        problems = body_problems(body)
        if problems:
            raise ValueError(f"replay[{k}]: {'; '.join(problems[:3])}")
    return spec.replay


def _replay_request(index: int, body: dict[str, Any], default_max_tokens: int) -> ChatRequest:
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    request_class = body.get("request_class")
    if not isinstance(request_class, str):
        request_class = body.get("class")
    prompt = body.get("prompt")
    return ChatRequest(
        index=index,
        messages=copy.deepcopy(body["messages"]) if prompt is None else [],
        prompt=prompt,
        max_tokens=default_max_tokens if max_tokens is None else max_tokens,
        request_class=request_class if isinstance(request_class, str) else REPLAY_CLASS,
        extra_body={k: copy.deepcopy(v) for k, v in body.items() if k not in REPLAY_DROPPED_FIELDS},
    )


def _measured_count(spec: WorkloadSpec) -> int:
    return len(spec.replay or []) if spec.kind == "replay" else spec.num_requests


def arrival_offsets(spec: WorkloadSpec, count: int) -> list[float | None]:
    """Return the ``arrival_s`` of ``count`` measured requests of ``spec`` (seconds).

    ``closed``: all ``None``. ``constant``: ``i / request_rate``. ``poisson``: 0 for the
    first request, then cumulative gamma gaps drawn with
    ``random.Random(f"arrival/{seed}").gammavariate(burstiness, 1 / (request_rate *
    burstiness))`` (mean gap ``1 / request_rate``; ``burstiness`` 1 is a Poisson process,
    lower is burstier), as ``vllm bench serve --request-rate --burstiness``. ``trace``: the
    first ``count`` replayed bodies' ``timestamp`` minus the smallest of them, in list order
    (timestamps need not be sorted).

    Raises:
        ValueError: ``constant`` or ``poisson`` without ``request_rate``; ``trace`` for a
            kind other than ``replay``, or a replayed body without a numeric ``timestamp``.
    """
    if spec.arrival == "closed":
        return [None] * count
    if spec.arrival == "trace":
        if spec.kind != "replay":
            raise ValueError(
                f"arrival 'trace' needs kind 'replay' (the replayed requests' timestamps), "
                f"not {spec.kind!r}"
            )
        stamps: list[float] = []
        for k, body in enumerate((spec.replay or [])[:count]):
            ts = body.get("timestamp")
            if not isinstance(ts, int | float) or isinstance(ts, bool) or not math.isfinite(ts):
                raise ValueError(
                    f"arrival 'trace': replay[{k}] has no numeric 'timestamp' (seconds)"
                )
            stamps.append(float(ts))
        base = min(stamps, default=0.0)
        return [ts - base for ts in stamps]
    rate = spec.request_rate
    if rate is None:
        raise ValueError(f"arrival {spec.arrival!r} needs request_rate (requests/s)")
    if spec.arrival == "constant":
        return [i / rate for i in range(count)]
    rng = random.Random(f"arrival/{spec.seed}")
    theta = 1.0 / (rate * spec.burstiness)
    out: list[float | None] = []
    t = 0.0
    for i in range(count):
        if i:
            t += rng.gammavariate(spec.burstiness, theta)
        out.append(t)
    return out


def build_requests(spec: WorkloadSpec, tokenizer: Tokenizer | None = None) -> list[ChatRequest]:
    """Build the full, ordered request list of ``spec``: warm-ups first, then measured.

    Args:
        spec: the workload (any ``kind``; see the module docstring for each).
        tokenizer: the served model's tokenizer (e.g.
            :func:`jobs.modelgen.generator.load_tokenizer`) to size the texts in its
            tokens; ``None`` sizes them at 4 characters per token.

    Returns:
        ``spec.warmup_requests`` warm-up requests (``index`` ``-W .. -1``, ``warmup=True``,
        one ``user`` message of unrelated text, ``max_tokens = spec.output_tokens``,
        ``arrival_s`` None) followed by the measured requests (``index`` ``0 .. N-1``;
        ``N = num_requests``, or the number of replayed bodies), with ``arrival_s`` from
        :func:`arrival_offsets`:

        - ``shared_prefix``: ``[{"role": "system", "content": <shared prefix>}, {"role":
          "user", "content": <question>}]`` (no system message when ``prefix_tokens == 0``),
          ``max_tokens = spec.output_tokens``, class ``short`` or ``long``;
        - ``template``: a system message (when the system segments give text), then for
          ``multi_turn`` the conversation's history, then the user message; class and
          ``max_tokens`` from the request's class; ``conversation``, ``turn`` and ``after``
          set for ``multi_turn``;
        - ``replay``: one request per body, in order.

        Deterministic in ``spec`` and the tokenizer.

    Raises:
        ValueError: naming the field, for: an unsupported ``kind``; ``segments``,
            ``classes`` or ``multi_turn`` on a kind other than ``template``, ``replay`` on
            one other than ``replay``, a non-zero ``long_fraction`` on one other than
            ``shared_prefix``; duplicate segment or class names, ``text`` on a variable
            segment, source ``text`` without ``text``, no ``user`` segment, a class's
            ``segment_tokens`` naming an unknown or fixed segment, a class whose user
            segments all have 0 tokens or whose ``output_tokens`` is 0; kind ``replay``
            without bodies or with a body failing :func:`jobs.load.replay.body_problems`; and
            the arrival errors of :func:`arrival_offsets`.
    """
    _check_kind_fields(spec)
    if spec.kind == "replay":
        _check_replay(spec)
    elif spec.kind == "template":
        _check_template(spec)  # fail before drawing any text
    arrivals = arrival_offsets(spec, _measured_count(spec))
    out = _warmups(spec, tokenizer)
    if spec.kind == "shared_prefix":
        measured = _shared_prefix_requests(spec, tokenizer)
    elif spec.kind == "template":
        measured = _template_requests(spec, tokenizer)
    else:
        measured = [
            _replay_request(i, body, spec.output_tokens)
            for i, body in enumerate(_check_replay(spec))
        ]
    for request, arrival in zip(measured, arrivals, strict=True):
        request.arrival_s = arrival
    return out + measured


def _template_longest(spec: WorkloadSpec) -> int:
    segments, classes = _check_template(spec)

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


def longest_request_tokens(spec: WorkloadSpec) -> int:
    """Return an upper estimate of the longest request of ``spec``'s list: prompt + output.

    No tokenizer is needed; chat-template tokens are not included (the caller adds them).
    Warm-ups count their prompt (:func:`_warmup_tokens`) plus ``output_tokens``. Measured
    requests:

    - ``shared_prefix``: ``prefix_tokens + question_tokens + output_tokens``, plus
      ``long_input_tokens`` (and 4 for the ``"Question: "`` join) when some request is
      ``long``;
    - ``template``: per class, the sum of each segment's largest length
      (``ceil(tokens * (1 + range_ratio))``; literal ``text`` at 4 characters per token)
      plus 2 per join, and the largest output; for ``multi_turn`` (up to
      ``min(turns, num_requests)`` turns) the history adds, per earlier turn, the largest
      user message of any class and ``answer_tokens``;
    - ``replay``: the largest :func:`jobs.load.replay.body_tokens_estimate` (characters / 4, so
      an estimate rather than a bound for code or non-English text).

    Returns:
        Tokens (>= 1).

    Raises:
        ValueError: for a spec :func:`build_requests` refuses for its fields (kind,
            template segments and classes); arrival and replay bodies are not checked.
    """
    _check_kind_fields(spec)
    measured = _measured_longest(spec)
    warmup = _warmup_tokens(spec) + spec.output_tokens
    return max(1, warmup if spec.warmup_requests else 0, measured)


def _warmup_tokens(spec: WorkloadSpec) -> int:
    """Prompt tokens of a warm-up request.

    ``prefix_tokens + question_tokens`` for ``shared_prefix``; for the other kinds
    no more than the longest measured prompt (at least 16), so a warm-up never
    needs a longer context than the requests it warms up for.
    """
    size = spec.prefix_tokens + spec.question_tokens
    if spec.kind == "shared_prefix":
        return size
    return min(size, max(16, _measured_longest(spec) - spec.output_tokens))


def _measured_longest(spec: WorkloadSpec) -> int:
    """Upper estimate of the longest measured request (prompt + output), in tokens."""
    if spec.kind == "shared_prefix":
        measured = spec.prefix_tokens + spec.question_tokens + spec.output_tokens
        if round(spec.num_requests * spec.long_fraction) > 0:
            measured += spec.long_input_tokens + 4
    elif spec.kind == "template":
        measured = _template_longest(spec)
    else:
        measured = max(
            (body_tokens_estimate(b, spec.output_tokens) for b in spec.replay or []), default=0
        )
    return measured


#: ChatRequest fields left out of :func:`request_list_hash` while they hold these defaults, so
#: lists without replay, open-loop or multi-turn fields hash as before those fields existed.
_HASH_OPTIONAL_FIELDS: dict[str, Any] = {
    "prompt": None,
    "arrival_s": None,
    "after": None,
    "conversation": None,
    "turn": None,
    "extra_body": {},
}


def _hash_doc(request: ChatRequest) -> dict[str, Any]:
    doc = request.model_dump(mode="json")
    for key, default in _HASH_OPTIONAL_FIELDS.items():
        if key in doc and doc[key] == default:
            del doc[key]
    return doc


def request_list_hash(requests: Sequence[ChatRequest]) -> str:
    """Return the sha256 hex digest of ``requests`` (warm-ups included, in list order).

    The input is the canonical JSON of ``[r.model_dump(mode="json") for r in requests]`` with
    ``sort_keys=True``, ``separators=(",", ":")``, ``ensure_ascii=True``, each request
    without the fields ``prompt``, ``arrival_s``, ``after``, ``conversation``, ``turn``
    (when None) and ``extra_body`` (when empty), so hashes of lists that do not use them
    are unchanged since those fields were added. Equal hashes mean two runs sent the same
    requests in the same order (at the same arrival offsets).
    """
    payload = json.dumps(
        [_hash_doc(r) for r in requests],
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
    )
    return hashlib.sha256(payload.encode("ascii")).hexdigest()
