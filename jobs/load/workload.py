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

``template`` builds each request from ordered segments
(:func:`jobs.load.template.template_segments`; the defaults split ``prefix_tokens``
into instructions, tools and document header, then a ``question`` of
``question_tokens``). Fixed segments are drawn once and are byte-identical
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
from typing import Any

from tokenizers import Tokenizer

from jobs.load.replay import body_problems, body_tokens_estimate
from jobs.load.template import (
    check_template,
    template_longest,
    template_requests,
)
from jobs.load.texts import fill_text, shared_prefix_text
from jobs.schemas import (
    ChatRequest,
    WorkloadSpec,
)

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

# -- lengths and classes --------------------------------------------------------------------


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
        check_template(spec)  # fail before drawing any text
    arrivals = arrival_offsets(spec, _measured_count(spec))
    out = _warmups(spec, tokenizer)
    if spec.kind == "shared_prefix":
        measured = _shared_prefix_requests(spec, tokenizer)
    elif spec.kind == "template":
        measured = template_requests(spec, tokenizer)
    else:
        measured = [
            _replay_request(i, body, spec.output_tokens)
            for i, body in enumerate(_check_replay(spec))
        ]
    for request, arrival in zip(measured, arrivals, strict=True):
        request.arrival_s = arrival
    return out + measured


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
        measured = template_longest(spec)
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
