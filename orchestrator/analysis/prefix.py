"""Prompt-prefix analyser: how much of a workload's prompts the prefix cache (APC) can reuse.

Pure module: no database, no Ray, no HTTP. Input is a list of requests (OpenAI chat
``messages`` with optional ``tools``, or raw completion ``prompt`` strings) and a model
directory; output is a JSON-safe :class:`PrefixAnalysis`. Units: positions and lengths of
prompts are **tokens** unless named ``*_chars`` (characters of a string) or ``*_blocks``
(KV cache blocks of ``block_size`` tokens); hit rates are fractions in ``[0, 1]``.

What it does, in order:

1. **Render** every request the way vLLM's OpenAI server does: chat requests through the
   model's chat template (``transformers`` ``apply_chat_template(messages, tools=tools,
   tokenize=False, add_generation_prompt=True)``), then tokenized *without* adding special
   tokens (the template writes BOS itself; vLLM's chat endpoint defaults to
   ``add_special_tokens=False``); raw prompts are tokenized *with* special tokens (the
   completions endpoint's default). Every token keeps its character range in the rendered
   text (offset mapping) and every rendered character is mapped back to its source: a
   message field (``messages[1].content``), a tool schema path
   (``tools[0].function.parameters.required``) or text the template itself wrote
   (``template``).
2. **Compare tokens, not strings**: the shared prefix is the longest common prefix of the
   token id lists. A string comparison overstates it: a word whose tail changed is a
   different token from its first character on (or earlier, when a whitespace run merges
   differently), and vLLM hashes token ids.
3. **Cluster** requests by the token at the first divergence (each cluster shares a longer
   prefix) and **classify** each divergence: ``timestamp``, ``uuid``, ``request_id``,
   ``random_id`` (random hex / base62), ``user_name``, ``json_key_order``, ``whitespace``,
   ``reordered_messages``, ``reordered_tools``, ``end_of_prompt`` (one prompt is a prefix of
   the other) or ``other``.
4. **Predict** the prefix cache hit rate of the workload sent in order, and re-predict it
   after each advised change (the volatile span moved to the end of the last message, JSON
   keys sorted, tools sorted, whitespace normalised, messages kept in one order).
5. **Follow the prefix**: a prompt often holds several volatile values (an id, then a
   clock). The change for the first cause is simulated on the requests, which are
   re-rendered and compared again to find the next cause, and so on (at most
   ``MAX_CAUSE_ROUNDS`` rounds, until the prompts differ only in the last message). Each
   advice carries the hit rate predicted with its change and every earlier one applied
   (cumulative) and whether that raises the hit rate; changes that do not (e.g. moving a
   clock that already sits at the end of the shared text) are listed after the others.
6. **Note** what the rendering hides: tools the chat template does not render (they do
   not reach the prompt, so they cannot break the prefix), a date the template writes
   itself.

Malformed requests raise :class:`ValueError` whose message starts with ``requests[i]: ``
(``i``: the index in the list given) and says what is wrong in plain words.

How vLLM (V1 engine; checked against the vLLM 0.32 sources of the engine environment)
counts prefix cache hits, which :func:`predict_hit_rate` reproduces:

- Only **full blocks** are hashed and cached; a block's hash chains its parent's hash and
  its ``block_size`` token ids (``vllm/v1/core/kv_cache_utils.py``, docs
  ``design/prefix_caching.md``: "we only cache full blocks").
- ``KVCacheManager.get_computed_blocks`` (``vllm/v1/core/kv_cache_manager.py``) looks up
  at most ``request.num_tokens - 1`` tokens: "When all tokens hit the cache, we must
  recompute the last token to obtain logits", and ``find_longest_cache_hit``
  (``vllm/v1/core/single_type_kv_cache_manager.py``) walks at most ``max_length //
  block_size`` whole blocks. So a request of ``n`` prompt tokens can hit at most
  ``block_size * ((n - 1) // block_size)`` tokens.
- ``PrefixCacheStats.record`` (``vllm/v1/metrics/stats.py``) adds ``num_tokens`` to
  ``queries`` and the hit tokens to ``hits`` per scheduled request; the Prometheus
  counters ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` are these, in
  tokens. vLLM 0.32 books re-scheduled preempted requests separately
  (``preempted_queries``/``preempted_hits``); older versions counted them again, so a
  run with preemptions can *measure* more hits than any prompt layout explains (see
  :func:`hit_rate_finding`).

The prediction assumes an unbounded cache (no eviction) and requests admitted one after
another in list order; only prompt blocks are counted (blocks filled by generated tokens
can only add hits in multi-turn workloads whose replayed answers equal the generated ones).
It is therefore the best hit rate the engine can reach for this request list.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "Advice",
    "CauseKind",
    "Divergence",
    "HitRatePrediction",
    "PrefixAnalysis",
    "PrefixCluster",
    "PrefixFinding",
    "PrefixRequest",
    "RenderedPrompt",
    "RequestPrediction",
    "SourceLocation",
    "SourceSpan",
    "analyze_prefix",
    "coerce_requests",
    "hit_rate_finding",
    "load_tokenizer",
    "predict_hit_rate",
    "render_request",
    "shared_prefix_length",
]

#: vLLM's default KV cache block size (tokens per block) on GPU and CPU.
DEFAULT_BLOCK_SIZE = 16

CauseKind = Literal[
    "timestamp",
    "uuid",
    "request_id",
    "random_id",
    "user_name",
    "json_key_order",
    "whitespace",
    "reordered_messages",
    "reordered_tools",
    "end_of_prompt",
    "other",
]

# --------------------------------------------------------------------------- schemas


class PrefixRequest(BaseModel):
    """One request of the workload: a chat (``messages`` + optional ``tools``) or a ``prompt``.

    ``messages`` is an OpenAI chat-completions list (``role``, ``content`` as a string or a
    list of ``{"type": "text", "text": ...}`` parts, optional ``name`` and ``tool_calls``);
    ``tools`` the OpenAI ``tools`` list. Exactly one of ``messages`` and ``prompt`` is set.
    """

    model_config = ConfigDict(extra="ignore")

    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    prompt: str | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> PrefixRequest:
        if self.messages is None and self.prompt is None:
            raise ValueError('needs "messages" (chat) or "prompt" (completions)')
        if self.messages is not None and self.prompt is not None:
            raise ValueError('has both "messages" (chat) and "prompt" (completions): send one')
        if self.prompt is not None and self.tools:
            raise ValueError('"tools" needs "messages" (a chat request), not "prompt"')
        return self


class SourceSpan(BaseModel):
    """A range of the rendered text that comes from one place of the request.

    ``rendered_start``/``rendered_end``: character range in the rendered prompt text.
    ``source``: where it comes from, e.g. ``messages[0].content``, ``messages[2].name``,
    ``messages[1].tool_calls[0].function.arguments``, ``tools[0].function.parameters``,
    ``prompt``. ``source_start``: character offset of ``rendered_start`` in the source
    string (for tool schemas: in the schema's JSON serialisation as rendered).
    """

    rendered_start: int
    rendered_end: int
    source: str
    source_start: int
    message_index: int | None = None
    role: str | None = None
    tool_index: int | None = None


class RenderedPrompt(BaseModel):
    """A request rendered and tokenized as the engine sees it.

    ``token_ids[i]`` covers ``text[offsets[i][0]:offsets[i][1]]`` (characters; special
    tokens added by the tokenizer have an empty range). ``spans`` map rendered characters
    to the request (characters in no span were written by the chat template).
    """

    index: int
    text: str
    token_ids: list[int]
    offsets: list[tuple[int, int]]
    spans: list[SourceSpan]


class SourceLocation(BaseModel):
    """Where a token position falls, in the rendered text and in the request.

    ``token_position``: index of the token (tokens). ``rendered_chars``: the character
    range of the first *differing characters* in the rendered text (start inclusive, end
    exclusive). ``source``: ``messages[i].<field>``, ``tools[i].<json path>``, ``prompt``
    or ``template`` (text the chat template wrote). ``source_chars``: the same characters
    as a range of the source string (for tools: of the tool's rendered JSON); None for
    ``template``. ``value_chars``: source-string range of the whole volatile value the
    divergence falls in (the timestamp, id or name), when the cause is one.
    ``excerpt``: rendered text around the divergence (about 40 characters
    either side), for humans.
    """

    request: int
    token_position: int
    rendered_chars: tuple[int, int]
    source: str
    message_index: int | None = None
    role: str | None = None
    field: str | None = None
    tool_index: int | None = None
    source_chars: tuple[int, int] | None = None
    value_chars: tuple[int, int] | None = None
    excerpt: str = ""


class Divergence(BaseModel):
    """The first token where two groups of requests differ, and why.

    ``token_position`` (tokens) equals the length of their shared token prefix;
    ``shared_prefix_blocks`` is that in whole KV blocks (``token_position // block_size``).
    ``requests``: the two representatives compared (one of each group);
    ``locations``: the divergence in each of them. ``cause`` is the kind of content that
    differs and ``values`` the differing values (e.g. ``["9:41 AM", "9:42 AM"]``).
    ``json_path``: for ``json_key_order``, the object whose keys are ordered differently.
    ``actionable`` is False when the divergence is where prompts are expected to differ
    (inside the last message, i.e. the new turn) or where one prompt simply ends.
    """

    token_position: int
    shared_prefix_blocks: int
    requests: tuple[int, int]
    locations: tuple[SourceLocation, SourceLocation]
    cause: CauseKind
    detail: str
    values: tuple[str, str]
    json_path: str | None = None
    actionable: bool


class PrefixCluster(BaseModel):
    """Requests that share a longer token prefix than the whole set.

    ``shared_prefix_tokens`` (tokens) / ``shared_prefix_blocks`` (whole KV blocks) is the
    prefix common to every member; ``divergence`` is where the members split further
    (None for a single request or identical prompts).
    """

    requests: list[int]
    shared_prefix_tokens: int
    shared_prefix_blocks: int
    divergence: Divergence | None = None


class RequestPrediction(BaseModel):
    """Predicted prefix cache use of one request: ``prompt_tokens`` queried, ``cached_tokens``
    hit (whole blocks, tokens), ``reused_from``: the earlier request whose blocks it reuses."""

    index: int
    prompt_tokens: int
    cached_tokens: int
    reused_from: int | None = None


class HitRatePrediction(BaseModel):
    """Predicted ``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries`` (tokens) of a
    workload sent in order to a fresh engine with an unbounded cache; ``hit_rate`` in [0, 1]."""

    block_size: int
    queries_tokens: int
    hits_tokens: int
    hit_rate: float
    per_request: list[RequestPrediction]


class Advice(BaseModel):
    """A change for one ``cause`` found at ``source`` (the ``step``-th cause of
    :attr:`PrefixAnalysis.causes`, prompt order).

    ``predicted_hit_rate_after`` (fraction) / ``predicted_hits_tokens_after`` (tokens):
    the prediction re-run on the requests rewritten as this change *and every earlier
    cause's change* (steps ``0..step``) say, i.e. cumulative (None when the change cannot
    be simulated, e.g. text the chat template inserts). ``raises_hit_rate``: the change
    is part of the plan that raises the predicted hit rate: the simulated steps up to the
    one with the best cumulative hit rate, when that beats the workload as it is. A step
    that gains nothing alone but is needed for a later one (a clock before an id) is
    part of it; a change that cannot raise it (a clock already at the end of the shared
    text) or cannot be simulated is not.
    """

    cause: CauseKind
    source: str
    change: str
    step: int = 0
    predicted_hit_rate_after: float | None = None
    predicted_hits_tokens_after: int | None = None
    raises_hit_rate: bool = False


class PrefixAnalysis(BaseModel):
    """Result of :func:`analyze_prefix`.

    ``prompt_tokens``: per request (tokens). ``shared_prefix_tokens``: token prefix common
    to all requests; ``shared_prefix_blocks``: in whole KV blocks;
    ``reusable_prefix_tokens``: what APC can reuse of it, ``block_size *
    (min(shared, shortest - 1) // block_size)`` tokens. ``divergence``: the first divergence
    of the whole set (None for one request or identical prompts). ``clusters``: the groups
    the set splits into at that divergence. ``causes``: every actionable divergence found
    along the prompts, in prompt order: the first one, then (after simulating its change
    on the requests, re-rendering and comparing again) the next one, and so on, at most
    ``MAX_CAUSE_ROUNDS`` rounds (divergences of clusters are included when the set's own
    divergence cannot be changed). ``prediction``: the best hit rate for the workload as
    it is; ``advice``: one change per cause, with the cumulative hit rate predicted after
    it, in prompt order; ``raises_hit_rate`` marks the plan (the steps to make together).
    ``predicted_hit_rate_after_advice``: with every simulated change applied.
    ``notes``: facts about the rendering worth knowing (tools the chat template does not
    render, a date the chat template writes itself).
    """

    model_dir: str
    block_size: int
    num_requests: int
    prompt_tokens: list[int]
    shared_prefix_tokens: int
    shared_prefix_blocks: int
    reusable_prefix_tokens: int
    divergence: Divergence | None
    clusters: list[PrefixCluster]
    causes: list[Divergence]
    prediction: HitRatePrediction
    advice: list[Advice]
    predicted_hit_rate_after_advice: float | None = None
    notes: list[str] = Field(default_factory=list)


class PrefixFinding(BaseModel):
    """A finding on a run: measured prefix cache hit rate far from the predicted one.

    ``evidence`` holds ``predicted_hit_rate``, ``measured_hit_rate`` (fractions) and
    ``difference`` (measured - predicted).
    """

    code: Literal["hit_rate_below_prediction", "hit_rate_above_prediction"]
    severity: Literal["info", "warning"]
    message: str
    evidence: dict[str, Any] = Field(default_factory=dict)


# --------------------------------------------------------------------------- input


def coerce_requests(items: Iterable[Any]) -> list[PrefixRequest]:
    """Turn request-like items into :class:`PrefixRequest` objects, in order.

    Accepts :class:`PrefixRequest`, mappings (OpenAI chat / completions bodies: ``messages``,
    ``tools``, ``prompt``) and objects with ``model_dump`` such as
    :class:`jobs.schemas.ChatRequest` (``tools`` may sit in ``extra_body``; a non-empty
    ``prompt`` wins over an empty ``messages``). Items flagged ``warmup`` are skipped: they
    are not part of the measured workload.

    Raises:
        ValueError: an item is neither a chat nor a prompt, or malformed; the message
            starts with ``requests[i]: `` (``i``: the item's index in ``items``) and says
            what is wrong in plain words.
    """
    return _coerce(items)[0]


def _type_name(x: Any) -> str:
    if x is None:
        return "null"
    known = {str: "a string", list: "a list", dict: "an object", bool: "a boolean"}
    name = type(x).__name__
    return known.get(type(x), f"{'an' if name[:1] in 'aeiou' else 'a'} {name}")


def _request_problem(messages: Any, tools: Any, prompt: Any) -> str | None:
    """What is wrong with a request's fields, in plain words (None: nothing)."""
    if prompt is not None:
        if not isinstance(prompt, str):
            return f'"prompt" must be a string, not {_type_name(prompt)}'
        if messages:
            return 'has both "messages" (chat) and "prompt" (completions): send one of them'
        if tools:
            return '"tools" needs "messages" (a chat request), not "prompt"'
        return None
    if messages is None:
        return 'needs "messages" (chat) or "prompt" (completions)'
    if not isinstance(messages, list | tuple):
        return f'"messages" must be a list of message objects, not {_type_name(messages)}'
    if not messages:
        return '"messages" is empty: a chat request needs at least one message'
    for j, m in enumerate(messages):
        if not isinstance(m, Mapping):
            return f'messages[{j}] must be an object with "role" and "content", not {_type_name(m)}'
        role = m.get("role")
        if not isinstance(role, str) or not role:
            return f'messages[{j}] needs a "role" (a string such as "system", "user", "assistant")'
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            return (
                f"messages[{j}].content must be a string or a list of content parts, "
                f"not {_type_name(content)}"
            )
    if tools is not None and (
        not isinstance(tools, list | tuple) or any(not isinstance(t, Mapping) for t in tools)
    ):
        return '"tools" must be a list of tool objects'
    return None


_SURROGATE = re.compile("[\ud800-\udfff]")


def _unicode_problem(req: PrefixRequest) -> str | None:
    """``text is not valid Unicode (...)`` when a string of the request holds a lone
    surrogate (JSON ``"\\ud800"`` escapes decode to those; no tokenizer can encode them)."""

    def walk(x: Any, path: str) -> str | None:
        if isinstance(x, str):
            m = _SURROGATE.search(x)
            if m:
                return (
                    f"text is not valid Unicode (lone surrogate at {path}, character "
                    f"{m.start()}: U+{ord(m.group()):04X})"
                )
        elif isinstance(x, Mapping):
            for k, v in x.items():
                got = walk(k, f"{path} (a key)") or walk(v, f"{path}.{k}")
                if got:
                    return got
        elif isinstance(x, list | tuple):
            for i, v in enumerate(x):
                got = walk(v, f"{path}[{i}]")
                if got:
                    return got
        return None

    return (
        walk(req.prompt, "prompt")
        or walk(req.messages or [], "messages")
        or walk(req.tools or [], "tools")
    )


def _plain_validation(exc: ValidationError) -> str:
    parts = []
    for e in exc.errors(include_url=False):
        loc = ".".join(str(x) for x in e.get("loc", ()))
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request"


def _coerce(items: Iterable[Any]) -> tuple[list[PrefixRequest], list[int]]:
    """:func:`coerce_requests` plus each request's index in ``items`` (warm-ups skipped)."""
    out: list[PrefixRequest] = []
    where: list[int] = []
    for i, item in enumerate(items):
        if isinstance(item, PrefixRequest):
            problem = _request_problem(item.messages, item.tools, item.prompt)
            if problem:
                raise ValueError(f"requests[{i}]: {problem}")
            out.append(item)
            where.append(i)
            continue
        data: Any = item.model_dump() if hasattr(item, "model_dump") else item
        if not isinstance(data, Mapping):
            raise ValueError(
                f'requests[{i}]: not a request: expected an object with "messages" (chat) '
                f'or "prompt" (completions), got {_type_name(item)}'
            )
        if data.get("warmup"):
            continue
        extra = data.get("extra_body") or {}
        tools = data.get("tools") or (extra.get("tools") if isinstance(extra, Mapping) else None)
        prompt = data.get("prompt")
        messages = data.get("messages")
        if prompt is not None and not messages:  # ChatRequest keeps messages=[] for prompts
            messages = None
        problem = _request_problem(messages, tools, prompt)
        if problem:
            raise ValueError(f"requests[{i}]: {problem}")
        try:
            if prompt is not None:
                out.append(PrefixRequest(prompt=prompt))
            else:
                out.append(
                    PrefixRequest(
                        messages=[dict(m) for m in messages or []],
                        tools=[dict(t) for t in tools] if tools else None,
                    )
                )
        except ValidationError as exc:
            raise ValueError(f"requests[{i}]: {_plain_validation(exc)}") from None
        where.append(i)
    return out, where


# --------------------------------------------------------------------------- tokenizer


@functools.lru_cache(maxsize=8)
def _load_tokenizer_cached(path: str, stamp: tuple[tuple[str, float], ...]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def load_tokenizer(model_dir: str | Path) -> Any:
    """Load (and cache per directory and file mtimes) a model directory's tokenizer.

    Uses ``transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)``,
    which also reads the chat template (``tokenizer_config.json`` / ``chat_template.jinja``).
    Never downloads.

    Raises:
        FileNotFoundError: ``model_dir`` is not a directory.
    """
    root = Path(model_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    root = root.resolve()
    stamp = tuple(
        sorted(
            (p.name, p.stat().st_mtime)
            for p in root.iterdir()
            if p.is_file() and (p.name.startswith("tokenizer") or "template" in p.name)
        )
    )
    return _load_tokenizer_cached(str(root), stamp)


# --------------------------------------------------------------------------- JSON spans


def _json_with_spans(
    obj: Any, indent: int | None, path: str
) -> tuple[str, list[tuple[int, int, str]]] | None:
    """``json.dumps(obj, ensure_ascii=False, indent=indent)`` plus ``(start, end, path)`` of
    every value and ``"key": value`` entry; None if the text cannot be reproduced."""
    parts: list[str] = []
    spans: list[tuple[int, int, str]] = []
    pos = 0
    item_sep = "," if indent is not None else ", "

    def emit(s: str) -> None:
        nonlocal pos
        parts.append(s)
        pos += len(s)

    def newline(level: int) -> None:
        if indent is not None:
            emit("\n" + " " * (indent * level))

    def walk(o: Any, p: str, level: int) -> None:
        start = pos
        if isinstance(o, dict) and o:
            emit("{")
            for i, (k, v) in enumerate(o.items()):
                if i:
                    emit(item_sep)
                newline(level + 1)
                entry = pos
                emit(json.dumps(k if isinstance(k, str) else str(k), ensure_ascii=False) + ": ")
                walk(v, f"{p}.{k}", level + 1)
                spans.append((entry, pos, f"{p}.{k}"))
            newline(level)
            emit("}")
        elif isinstance(o, list | tuple) and o:
            emit("[")
            for i, v in enumerate(o):
                if i:
                    emit(item_sep)
                newline(level + 1)
                walk(v, f"{p}[{i}]", level + 1)
            newline(level)
            emit("]")
        else:
            emit(json.dumps(o, ensure_ascii=False))
        spans.append((start, pos, p))

    try:
        walk(obj, path, 0)
        expected = json.dumps(obj, ensure_ascii=False, indent=indent)
    except (TypeError, ValueError):
        return None
    text = "".join(parts)
    return (text, spans) if text == expected else None


# --------------------------------------------------------------------------- rendering


def _content_parts(content: Any) -> list[tuple[str, str]]:
    """(field, text) of a message content: a string, or text parts of a list."""
    if isinstance(content, str):
        return [("content", content)]
    out: list[tuple[str, str]] = []
    if isinstance(content, list):
        for j, part in enumerate(content):
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                out.append((f"content[{j}].text", part["text"]))
    return out


def _find_string(text: str, s: str, cursor: int) -> tuple[int, int, int] | None:
    """Where ``s`` (or ``s.strip()``, templates often trim) is in ``text``, searching from
    ``cursor`` first, then from 0: (rendered position, offset inside ``s``, length)."""
    stripped = s.strip()
    if not stripped:
        return None
    lead = len(s) - len(s.lstrip())
    for cand, off in ((s, 0), (stripped, lead)):
        for start in (cursor, 0):
            i = text.find(cand, start)
            if i >= 0:
                return i, off, len(cand)
    return None


def _source_spans(req: PrefixRequest, text: str) -> list[SourceSpan]:
    spans: list[SourceSpan] = []
    if req.prompt is not None:
        return _prompt_span(req.prompt, text)
    cursor = 0
    for k, msg in enumerate(req.messages or []):
        role = msg.get("role")
        role_s = role if isinstance(role, str) else None
        msg_start = cursor
        for fld, s in _content_parts(msg.get("content")):
            hit = _find_string(text, s, cursor)
            if hit is None:
                continue
            pos, off, n = hit
            spans.append(
                SourceSpan(
                    rendered_start=pos,
                    rendered_end=pos + n,
                    source=f"messages[{k}].{fld}",
                    source_start=off,
                    message_index=k,
                    role=role_s,
                )
            )
            cursor = pos + n
        spans.extend(
            _whole_span(text, msg.get("name"), msg_start, f"messages[{k}].name", k, role_s)
        )
        for c, call in enumerate(msg.get("tool_calls") or []):
            if not isinstance(call, Mapping):
                continue
            fn = call.get("function") or {}
            base = f"messages[{k}].tool_calls[{c}].function"
            spans.extend(_whole_span(text, fn.get("name"), msg_start, f"{base}.name", k, role_s))
            args = fn.get("arguments")
            spans.extend(
                _json_source_spans(
                    text, args, f"{base}.arguments", msg_start, message_index=k, role=role_s
                )
            )
    for i, tool in enumerate(req.tools or []):
        found = _json_source_spans(text, tool, f"tools[{i}]", 0, tool_index=i)
        if not found and isinstance(tool, Mapping) and isinstance(tool.get("function"), Mapping):
            found = _json_source_spans(
                text, tool["function"], f"tools[{i}].function", 0, tool_index=i
            )
        if not found:
            found = _leaf_spans(text, tool, f"tools[{i}]", i)
        spans.extend(found)
    return spans


def _whole_span(
    text: str, value: Any, start: int, source: str, message_index: int, role: str | None
) -> list[SourceSpan]:
    """The span of a string ``value`` (a name) found whole in ``text`` from ``start``;
    nothing when it is not a non-empty string or not found."""
    if not isinstance(value, str) or not value:
        return []
    i = text.find(value, start)
    if i < 0:
        return []
    return [
        SourceSpan(
            rendered_start=i,
            rendered_end=i + len(value),
            source=source,
            source_start=0,
            message_index=message_index,
            role=role,
        )
    ]


def _prompt_span(prompt: str, text: str) -> list[SourceSpan]:
    i = text.find(prompt)
    if i < 0:
        return []
    return [
        SourceSpan(rendered_start=i, rendered_end=i + len(prompt), source="prompt", source_start=0)
    ]


def _json_source_spans(
    text: str,
    value: Any,
    path: str,
    start: int,
    *,
    message_index: int | None = None,
    role: str | None = None,
    tool_index: int | None = None,
) -> list[SourceSpan]:
    """Spans of a JSON value (dict, or a string holding JSON) found in ``text``."""
    candidates: list[tuple[str, list[tuple[int, int, str]]]] = []
    obj = value
    if isinstance(value, str):
        candidates.append((value, [(0, len(value), path)]))
        try:
            obj = json.loads(value)
        except ValueError:
            obj = None
    if obj is not None and not isinstance(obj, str):
        for indent in (None, 2, 4):
            got = _json_with_spans(obj, indent, path)
            if got is not None:
                candidates.append(got)
    for serial, inner in candidates:
        if not serial:
            continue
        i = text.find(serial, start)
        if i < 0:
            i = text.find(serial)
        if i < 0:
            continue
        return [
            SourceSpan(
                rendered_start=i + a,
                rendered_end=i + b,
                source=p,
                source_start=a,
                message_index=message_index,
                role=role,
                tool_index=tool_index,
            )
            for a, b, p in inner
        ]
    return []


def _leaf_spans(text: str, obj: Any, path: str, tool_index: int) -> list[SourceSpan]:
    """Fallback for templates that render tool fields one by one: string leaves found."""
    out: list[SourceSpan] = []

    def walk(o: Any, p: str) -> None:
        if isinstance(o, Mapping):
            for k, v in o.items():
                walk(v, f"{p}.{k}")
        elif isinstance(o, list):
            for j, v in enumerate(o):
                walk(v, f"{p}[{j}]")
        elif isinstance(o, str) and len(o) >= 3:
            i = text.find(o)
            if i >= 0:
                out.append(
                    SourceSpan(
                        rendered_start=i,
                        rendered_end=i + len(o),
                        source=p,
                        source_start=0,
                        tool_index=tool_index,
                    )
                )

    walk(obj, path)
    return out


def _offsets_by_decoding(tokenizer: Any, ids: list[int], text: str) -> list[tuple[int, int]]:
    """Character ranges from cumulative decoding (slow tokenizers without offset mapping)."""
    out: list[tuple[int, int]] = []
    prev = 0
    for i in range(len(ids)):
        n = min(len(tokenizer.decode(ids[: i + 1])), len(text))
        out.append((prev, max(prev, n)))
        prev = max(prev, n)
    return out


def render_request(
    request: PrefixRequest,
    tokenizer: Any,
    *,
    index: int = 0,
    add_generation_prompt: bool = True,
) -> RenderedPrompt:
    """Render one request as vLLM's OpenAI server does and tokenize it with offsets.

    Chat: ``tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
    add_generation_prompt=...)`` then ``tokenizer(text, add_special_tokens=False)`` (vLLM's
    chat endpoint default); prompt: ``tokenizer(prompt, add_special_tokens=True)`` (the
    completions endpoint default, BOS added). ``tokenizer`` is a ``transformers`` tokenizer
    (see :func:`load_tokenizer`).

    Returns:
        :class:`RenderedPrompt` with token ids, per-token character ranges and the source
        spans of the rendered text.

    Raises:
        ValueError: the request cannot be rendered or tokenized (a string with a lone
            surrogate, a chat template or tokenizer error); the message starts with
            ``requests[index]: ``.
    """
    try:
        return _render(request, tokenizer, index, add_generation_prompt)
    except _RequestError as exc:
        raise ValueError(f"requests[{index}]: {exc.reason}") from exc.__cause__


class _RequestError(ValueError):
    """A request that cannot be rendered; ``reason`` in plain words, no request index."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _render(
    request: PrefixRequest, tokenizer: Any, index: int, add_generation_prompt: bool
) -> RenderedPrompt:
    problem = _unicode_problem(request)
    if problem:
        raise _RequestError(problem)
    if request.prompt is not None:
        text, add_special = request.prompt, True
    else:
        try:
            text = tokenizer.apply_chat_template(
                request.messages,
                tools=request.tools or None,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        except Exception as exc:  # jinja2 TemplateError, missing template, bad message shape
            raise _RequestError(f"the chat template failed: {_exc_text(exc)}") from exc
        if not isinstance(text, str):
            raise _RequestError(
                f"the chat template returned {_type_name(text)}, not the prompt text"
            )
        add_special = False
    try:
        try:
            enc = tokenizer(text, add_special_tokens=add_special, return_offsets_mapping=True)
            ids = [int(t) for t in enc["input_ids"]]
            offsets = [(int(a), int(b)) for a, b in enc["offset_mapping"]]
        except NotImplementedError:  # slow (Python) tokenizers have no offset mapping
            ids = [int(t) for t in tokenizer(text, add_special_tokens=add_special)["input_ids"]]
            offsets = _offsets_by_decoding(tokenizer, ids, text)
    except Exception as exc:
        raise _RequestError(f"the tokenizer failed: {_exc_text(exc)}") from exc
    return RenderedPrompt(
        index=index, text=text, token_ids=ids, offsets=offsets, spans=_source_spans(request, text)
    )


def _exc_text(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


# --------------------------------------------------------------------------- prediction


def shared_prefix_length(token_lists: Sequence[Sequence[int]]) -> int:
    """Length (tokens) of the longest token prefix common to every list (0 for none)."""
    if not token_lists:
        return 0
    first = token_lists[0]
    n = min(len(t) for t in token_lists)
    for i in range(n):
        tok = first[i]
        if any(t[i] != tok for t in token_lists):
            return i
    return n


def predict_hit_rate(
    token_lists: Sequence[Sequence[int]], block_size: int = DEFAULT_BLOCK_SIZE
) -> HitRatePrediction:
    """Predict vLLM APC hits for prompts sent in order to a fresh engine.

    Reproduces ``KVCacheManager.get_computed_blocks`` (vLLM V1): request ``j`` of ``n_j``
    prompt tokens hits the longest chain of whole blocks, at most ``(n_j - 1) //
    block_size`` of them, already cached by an earlier request; then its ``n_j //
    block_size`` full prompt blocks are cached. ``queries`` adds ``n_j``, ``hits`` the hit
    tokens (``PrefixCacheStats.record``). The cache is unbounded (no eviction). Blocks are
    keyed by (parent block, exact token ids), so no hash collisions.

    Args:
        token_lists: prompt token ids per request, in the order sent.
        block_size: tokens per KV cache block (vLLM ``--block-size``, default 16).

    Returns:
        :class:`HitRatePrediction` (tokens; ``hit_rate`` = hits / queries, 0 when empty).

    Raises:
        ValueError: ``block_size < 1``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    nodes: dict[tuple[int, tuple[int, ...]], int] = {}
    owner: list[int] = []
    per: list[RequestPrediction] = []
    for j, toks in enumerate(token_lists):
        n = len(toks)
        parent = -1
        hit_blocks = 0
        reused: int | None = None
        for b in range(max(0, (n - 1)) // block_size):
            node = nodes.get((parent, tuple(toks[b * block_size : (b + 1) * block_size])))
            if node is None:
                break
            parent = node
            hit_blocks += 1
            reused = owner[node]
        parent = -1
        for b in range(n // block_size):
            key = (parent, tuple(toks[b * block_size : (b + 1) * block_size]))
            node = nodes.get(key)
            if node is None:
                node = len(owner)
                nodes[key] = node
                owner.append(j)
            parent = node
        per.append(
            RequestPrediction(
                index=j, prompt_tokens=n, cached_tokens=hit_blocks * block_size, reused_from=reused
            )
        )
    queries = sum(p.prompt_tokens for p in per)
    hits = sum(p.cached_tokens for p in per)
    return HitRatePrediction(
        block_size=block_size,
        queries_tokens=queries,
        hits_tokens=hits,
        hit_rate=hits / queries if queries else 0.0,
        per_request=per,
    )


# --------------------------------------------------------------------------- patterns

_MONTH = (
    r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
    r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)"
)
_WEEKDAY = r"(?:Mon|Tue(?:s)?|Wed(?:nes)?|Thu(?:rs)?|Fri|Sat(?:ur)?|Sun)(?:day)?"
_TIME = (
    r"\d{1,2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:\s?(?:[AaPp][Mm]\b|[AaPp]\.[Mm]\.))?"
    r"(?:\s?(?:UTC|GMT|Z|[ECMP][SD]T|CES?T)\b)?"
)
_TIMESTAMP = re.compile(
    "|".join(
        [
            rf"\b\d{{4}}-\d{{2}}-\d{{2}}(?:[T ]{_TIME})?(?:Z|[+-]\d{{2}}:?\d{{2}})?",
            rf"\b(?:{_WEEKDAY},?\s+)?{_MONTH}\.?\s+\d{{1,2}}(?:st|nd|rd|th)?,?(?:\s+\d{{4}})?"
            rf"(?:,?\s+(?:at\s+)?{_TIME})?",
            rf"\b(?:{_WEEKDAY},?\s+)?\d{{1,2}}\s+{_MONTH}\.?,?\s+\d{{4}}(?:,?\s+(?:at\s+)?{_TIME})?",
            rf"\b\d{{1,2}}[/.]\d{{1,2}}[/.]\d{{2,4}}(?:,?\s+{_TIME})?",
            rf"\b{_TIME}",
            rf"\b{_WEEKDAY}\b",
            r"\b1[5-9]\d{8}(?:\d{3})?\b",  # Unix time, seconds or milliseconds (2017..2033)
        ]
    )
)
_UUID = re.compile(
    r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"
)
_REQUEST_ID = re.compile(
    r"(?i:(?:request|req|trace|span|session|correlation|conversation|message|run|job)"
    r"[ _-]?id)\s*[:=#]?\s*[\"']?(?P<value>[A-Za-z0-9][A-Za-z0-9_.:-]{3,})"
    r"|\b(?P<prefixed>(?:req|request|trace|sess|chatcmpl|cmpl|call|msg|run|job|corr)"
    r"[-_][A-Za-z0-9][A-Za-z0-9_-]{5,})"
)
_RANDOM_ID = re.compile(
    r"\b(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{8,}\b"
    r"|\b(?=[A-Za-z0-9]*\d)(?=[A-Za-z0-9]*[A-Za-z])[A-Za-z0-9]{20,}\b"
)
#: Text right before a user name, in three principled groups: a greeting or salutation
#: ("Hello ", "Dear "), a label naming a person ("User: ", "customer ", "the user's name
#: is ", "Mr. ") and a verb phrase whose object is the person ("talking to ", "I am ",
#: "on behalf of "). A capitalised word right after one is taken for a name.
_PERSON = (
    r"(?:user|customer|client|patient|member|author|caller|student|guest|visitor|contact"
    r"|sender|recipient|employee|agent|applicant|buyer|owner)"
)
_NAME_CUE = re.compile(
    r"(?:\b(?:hi|hello|hey|dear|greetings|welcome(?: back)?|thanks|thank you"
    r"|good (?:morning|afternoon|evening))[,!]?\s+(?:(?:this is|it's|it is)\s+)?"
    rf"|\b(?:{_PERSON}(?:'s)?\s*(?:(?:first |last |full |display |user ?)?name)?"
    r"|(?:first |last |full |display |user ?)?name)\s*(?:[:=]|\bis\b)\s*"
    rf"|\b{_PERSON}\s+(?:named\s+|called\s+)?"
    r"|\b(?:mr|mrs|ms|miss|mx|dr|prof)\.?\s+"
    r"|\bI am\s+|\bI'm\s+|\b(?:called|named)\s+"
    r"|\b(?:talking|speaking|chatting|writing|replying|responding)\s+(?:to|with)\s+"
    r"|\b(?:assisting|helping|serving|addressing|on behalf of)\s+)$",
    re.IGNORECASE,
)
_NAME = re.compile(r"[A-Z][a-z]+(?:[-'][A-Z]?[a-z]+)*")
#: A name of up to three capitalised words ("Alice", "Mary-Jane O'Neil").
_FULL_NAME = re.compile(
    r"[A-Z][a-z]+(?:[-'][A-Z]?[a-z]+)*(?: [A-Z][a-z]+(?:[-'][A-Z]?[a-z]+)*){0,2}"
)
_LABELLED_HANDLE = re.compile(r"(?:user ?name|login|handle)\s*[:=]\s*$", re.IGNORECASE)


def _full_name_at(s: str, start: int) -> tuple[int, int]:
    """The name (up to three capitalised words) that starts at ``start`` of ``s``."""
    m = _FULL_NAME.match(s, start)
    return (start, m.end()) if m else (start, start)


def _match_at(rx: re.Pattern[str], text: str, pos: int) -> tuple[int, int] | None:
    """The match of ``rx`` (or of its matched named group) that contains character ``pos``."""
    lo = max(0, pos - 160)
    for m in rx.finditer(text, lo, min(len(text), pos + 160)):
        if m.start() > pos:
            break
        groups: list[str | None] = [g for g in m.groupdict() if m.group(g) is not None]
        for g in groups or [None]:
            a, b = (m.start(g), m.end(g)) if g else (m.start(), m.end())
            if a <= pos < b:
                return a, b
    return None


def _word_at(text: str, pos: int) -> tuple[int, int]:
    a = pos
    while a > 0 and (text[a - 1].isalnum() or text[a - 1] in "-_'."):
        a -= 1
    b = pos
    while b < len(text) and (text[b].isalnum() or text[b] in "-_'"):
        b += 1
    return a, b


# --------------------------------------------------------------------------- divergence


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


def _canon(x: Any) -> str:
    return json.dumps(x, sort_keys=True, ensure_ascii=False, default=str)


def _raw(x: Any) -> str:
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


def _field_root(source: str) -> str:
    """``messages[0].content`` for ``messages[0].content``; the string-bearing field."""
    m = re.match(
        r"(messages\[\d+\]\.(?:content(?:\[\d+\]\.text)?|name|tool_calls\[\d+\]"
        r"\.function\.(?:arguments|name))|prompt|tools\[\d+\])",
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
        ca = [_canon(m) for m in qa.messages]
        cb = [_canon(m) for m in qb.messages]
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
    if (in_tools or la.source == "template") and [_raw(t) for t in tools_a] != [
        _raw(t) for t in tools_b
    ]:
        can_a, can_b = [_canon(t) for t in tools_a], [_canon(t) for t in tools_b]
        if can_a != can_b and sorted(can_a) == sorted(can_b):
            return _Classified(
                "reordered_tools",
                "the same tools in another order",
                (", ".join(_tool_names(tools_a)), ", ".join(_tool_names(tools_b))),
            )
        i = (
            la.tool_index
            if la.tool_index is not None
            else next(
                (
                    j
                    for j in range(min(len(tools_a), len(tools_b)))
                    if _raw(tools_a[j]) != _raw(tools_b[j])
                ),
                None,
            )
        )
        if (
            i is not None
            and i < min(len(tools_a), len(tools_b))
            and (can_a[i] == can_b[i] and _raw(tools_a[i]) != _raw(tools_b[i]))
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
            if ja and jb and ja[0] == jb[0] and _canon(ja[1]) == _canon(jb[1]):
                path = _key_order_path(ja[1], jb[1], la.source) or la.source
                return _Classified(
                    "json_key_order",
                    f"{path}: {_key_order_desc(ja[1], jb[1], path, la.source)}",
                    (sa_s[ja[0] : ja[2]][:80], sb_s[jb[0] : jb[2]][:80]),
                    json_path=path,
                )
    # 5. volatile values at the first differing character
    volatile: tuple[tuple[CauseKind, re.Pattern[str]], ...] = (
        ("uuid", _UUID),
        ("request_id", _REQUEST_ID),
        ("timestamp", _TIMESTAMP),
        ("random_id", _RANDOM_ID),
    )
    for kind, rx in volatile:
        ma = _match_at(rx, ta, da)
        mb = _match_at(rx, tb, db)
        if ma and mb:
            va, vb = ta[ma[0] : ma[1]], tb[mb[0] : mb[1]]
            return _Classified(kind, f"{_KIND_WORDS[kind]}: {va!r} vs {vb!r}", (va, vb), (ma, mb))
    # 6. user name: a message's name field, or a capitalised word after a greeting/label
    if la.field == "name" and lb.field == "name":
        va, vb = _source_string(qa, la.source) or "", _source_string(qb, lb.source) or ""
        return _Classified("user_name", f"the message's name field: {va!r} vs {vb!r}", (va, vb))
    na, nb = _word_at(ta, da), _word_at(tb, db)
    if na[0] == nb[0] and na[1] > na[0] and nb[1] > nb[0]:
        before = ta[max(0, na[0] - 40) : na[0]].split("\n")[-1]
        va, vb = ta[na[0] : na[1]], tb[nb[0] : nb[1]]
        cue = _NAME_CUE.search(before)
        names = _NAME.fullmatch(va) and _NAME.fullmatch(vb)
        fa, fb = _FULL_NAME.match(ta, na[0]), _FULL_NAME.match(tb, nb[0])
        if cue and names and fa and fb:  # a full name: "Alice Smith"
            na, nb = (na[0], max(na[1], fa.end())), (nb[0], max(nb[1], fb.end()))
            va, vb = ta[na[0] : na[1]], tb[nb[0] : nb[1]]
        handles = (
            _LABELLED_HANDLE.search(before)
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


def _tool_names(tools: list[dict[str, Any]]) -> list[str]:
    out = []
    for t in tools:
        fn = t.get("function") if isinstance(t, Mapping) else None
        out.append(str(fn.get("name")) if isinstance(fn, Mapping) else _canon(t)[:30])
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


def _partition(members: list[int], toks: list[list[int]], p: int) -> list[list[int]]:
    groups: dict[int, list[int]] = {}
    for i in members:
        key = toks[i][p] if p < len(toks[i]) else -1
        groups.setdefault(key, []).append(i)
    return sorted(groups.values(), key=lambda g: g[0])


def _divergence(
    a: int, b: int, rendered: list[RenderedPrompt], reqs: list[PrefixRequest], block_size: int
) -> Divergence:
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
    la = _locate(ra, p, min(da, len(ra.text)), ea)
    lb = _locate(rb, p, min(db, len(rb.text)), eb)
    c = _classify(ra, rb, reqs[a], reqs[b], da, db, la, lb)
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


# --------------------------------------------------------------------------- advice

_CHANGE = {
    "timestamp": (
        "Move the clock after the fixed content (into the last user turn), or keep "
        "only the date: the prompt changes with the clock at {src}, so every token "
        "after it is recomputed."
    ),
    "uuid": (
        "Keep per-request ids out of the shared prefix (send them as request metadata, "
        "e.g. a header or the OpenAI 'user' field) or put them after the fixed content; "
        "a UUID at {src} breaks the prefix."
    ),
    "request_id": (
        "Keep request/trace/session ids out of the shared prefix (send them as "
        "metadata) or put them after the fixed content; an id at {src} breaks the "
        "prefix."
    ),
    "random_id": (
        "Keep random ids/nonces out of the shared prefix or put them after the fixed "
        "content; a random id at {src} breaks the prefix."
    ),
    "user_name": (
        "Put the user's name after the fixed content (e.g. in the last user turn) "
        "instead of at {src}, before text every user shares."
    ),
    "json_key_order": (
        "Serialize JSON canonically (sorted keys, fixed separators, e.g. "
        "json.dumps(obj, sort_keys=True, separators=(', ', ': '))) before "
        "rendering the prompt: {src} has the same keys in another order."
    ),
    "whitespace": (
        "Normalise whitespace (strip, collapse runs of spaces, fixed newlines) "
        "before building the prompt: the same words tokenize differently with "
        "other whitespace at {src}."
    ),
    "reordered_messages": (
        "Keep one message order: fixed messages first, always in the same "
        "order, new turns appended at the end ({src})."
    ),
    "reordered_tools": (
        "Send the tools in one fixed order (e.g. sorted by function name); "
        "the same tools come in another order ({src})."
    ),
    "other": ("Put the content that varies between requests ({src}) after the content they share."),
}

_VOLATILE: dict[str, re.Pattern[str]] = {
    "timestamp": _TIMESTAMP,
    "uuid": _UUID,
    "request_id": _REQUEST_ID,
    "random_id": _RANDOM_ID,
}


def _sort_keys(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {k: _sort_keys(x[k]) for k in sorted(x, key=str)}
    if isinstance(x, list):
        return [_sort_keys(v) for v in x]
    return x


def _canonical_json_in(s: str) -> str:
    """Re-serialise every top-level JSON object/array of ``s`` with sorted keys."""
    dec = json.JSONDecoder()
    out: list[str] = []
    i = 0
    while i < len(s):
        if s[i] in "{[":
            try:
                val, end = dec.raw_decode(s, i)
            except ValueError:
                val, end = None, i
            if end > i and isinstance(val, dict | list):
                out.append(json.dumps(_sort_keys(val), ensure_ascii=False))
                i = end
                continue
        out.append(s[i])
        i += 1
    return "".join(out)


def _set_source(req: PrefixRequest, source: str, fn: Callable[[str], str]) -> None:
    if source == "prompt":
        if req.prompt is not None:
            req.prompt = fn(req.prompt)
        return
    m = re.fullmatch(r"messages\[(\d+)\]\.(.+)", source)
    if not m or not req.messages or int(m.group(1)) >= len(req.messages):
        return
    parts = re.findall(r"[^.\[\]]+|\[\d+\]", m.group(2))
    cur: Any = req.messages[int(m.group(1))]
    for part in parts[:-1]:
        cur = (
            (cur[int(part[1:-1])] if isinstance(cur, list) and int(part[1:-1]) < len(cur) else None)
            if part.startswith("[")
            else (cur.get(part) if isinstance(cur, Mapping) else None)
        )
        if cur is None:
            return
    last = parts[-1]
    if isinstance(cur, dict) and isinstance(cur.get(last), str):
        cur[last] = fn(cur[last])


def _append_to_end(req: PrefixRequest, text: str) -> None:
    if req.prompt is not None:
        req.prompt = req.prompt + "\n\n" + text
    elif req.messages:
        last = req.messages[-1]
        if isinstance(last.get("content"), str):
            last["content"] = last["content"] + "\n\n" + text


def _rewrite(reqs: list[PrefixRequest], d: Divergence) -> list[PrefixRequest] | None:
    """The requests changed as the advice for ``d`` says; None when it cannot be simulated."""
    out = [r.model_copy(deep=True) for r in reqs]
    src = _field_root(d.locations[0].source)
    if d.cause in _VOLATILE or d.cause == "user_name":
        if src == "template" or d.locations[0].source_chars is None:
            return None
        if src.endswith(".name") and d.cause == "user_name":
            for r in out:  # a constant name field (the name goes into the last turn)
                _set_source(r, src, lambda s: "user")
            return out
        anchor = d.locations[0].source_chars[0]
        rx = _VOLATILE.get(d.cause)
        for r in out:
            moved: list[str] = []

            def cut(s: str, moved: list[str] = moved) -> str:
                spans = (
                    [(m.start(), m.end()) for m in rx.finditer(s)]
                    if rx is not None
                    else [
                        _full_name_at(s, m.start())
                        for m in _NAME.finditer(s)
                        if _NAME_CUE.search(s[max(0, m.start() - 40) : m.start()])
                    ]
                )
                if not spans:
                    return s
                a, b = min(spans, key=lambda ab: abs(ab[0] - anchor))
                moved.append(s[a:b])
                return s[:a] + s[b:]

            _set_source(r, src, cut)
            if moved:
                _append_to_end(r, moved[0])
        return out
    if d.cause == "json_key_order":
        for r in out:
            if r.tools:
                r.tools = [_sort_keys(t) for t in r.tools]
            for m in r.messages or []:
                for call in m.get("tool_calls") or []:
                    fn = call.get("function") if isinstance(call, dict) else None
                    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                        fn["arguments"] = _canonical_json_in(fn["arguments"])
            if not src.startswith("tools["):
                _set_source(r, src, _canonical_json_in)
        return out
    if d.cause == "reordered_tools":
        for r in out:
            if r.tools:
                r.tools = sorted(r.tools, key=lambda t: (_tool_names([t])[0], _canon(t)))
        return out
    if d.cause == "whitespace":
        if src == "template" or src.startswith("tools["):
            return None

        def norm(s: str) -> str:
            s = re.sub(r"[ \t]+", " ", s)
            s = re.sub(r" *\n *", "\n", s)
            return re.sub(r"\n{3,}", "\n\n", s).strip()

        for r in out:
            _set_source(r, src, norm)
        return out
    if d.cause == "reordered_messages":
        ref = [_canon(m) for m in reqs[d.requests[0]].messages or []]
        for r in out:
            if not r.messages:
                continue
            known = sorted(
                (m for m in r.messages if _canon(m) in ref), key=lambda m: ref.index(_canon(m))
            )
            r.messages = known + [m for m in r.messages if _canon(m) not in ref]
        return out
    return None


# --------------------------------------------------------------------------- analysis


#: At most this many causes are followed along the prompts (one re-render per round).
MAX_CAUSE_ROUNDS = 8


def _render_all(
    reqs: list[PrefixRequest],
    tok: Any,
    add_generation_prompt: bool,
    where: Sequence[int] | None = None,
) -> list[RenderedPrompt]:
    """Render every request; errors name the request by its index in the caller's list
    (``where[i]``, the index before warm-ups were skipped)."""
    out = []
    for i, r in enumerate(reqs):
        try:
            out.append(_render(r, tok, i, add_generation_prompt))
        except _RequestError as exc:
            n = where[i] if where is not None and i < len(where) else i
            raise ValueError(f"requests[{n}]: {exc.reason}") from exc.__cause__
    return out


def _split(
    rendered: list[RenderedPrompt], reqs: list[PrefixRequest], block_size: int
) -> tuple[Divergence | None, list[PrefixCluster]]:
    """The first divergence of the whole set and the clusters it splits the set into
    (each with its own next divergence)."""
    toks = [r.token_ids for r in rendered]
    shared = shared_prefix_length(toks)
    members = list(range(len(rendered)))
    if len(rendered) < 2 or len({tuple(t) for t in toks}) < 2:
        return None, [
            PrefixCluster(
                requests=members,
                shared_prefix_tokens=shared,
                shared_prefix_blocks=shared // block_size,
            )
        ]
    groups = _partition(members, toks, shared)
    divergence = _divergence(groups[0][0], groups[1][0], rendered, reqs, block_size)
    clusters = []
    for g in groups:
        gp = shared_prefix_length([toks[i] for i in g])
        gd: Divergence | None = None
        if len(g) > 1 and len({tuple(toks[i]) for i in g}) > 1:
            sub = _partition(g, toks, gp)
            gd = _divergence(sub[0][0], sub[1][0], rendered, reqs, block_size)
        clusters.append(
            PrefixCluster(
                requests=g,
                shared_prefix_tokens=gp,
                shared_prefix_blocks=gp // block_size,
                divergence=gd,
            )
        )
    return divergence, clusters


def _advice_source(d: Divergence) -> str:
    """Where the advice for ``d`` applies: the message out of order, the JSON object with
    another key order, else the string field (``messages[0].content``, ``tools[1]``…)."""
    if d.cause == "reordered_messages" and d.locations[0].message_index is not None:
        return f"messages[{d.locations[0].message_index}]"
    return d.json_path or _field_root(d.locations[0].source)


def _change_text(d: Divergence, src: str) -> str:
    if d.cause == "other" and d.locations[0].source == "template":
        return (
            "The chat template writes different text here (other roles, message counts or "
            "template variables before the shared content): give every request the same "
            "message structure up to the content they share."
        )
    change = _CHANGE.get(d.cause, _CHANGE["other"]).format(src=src)
    if d.locations[0].source == "template" and d.cause not in (
        "reordered_messages",
        "reordered_tools",
        "json_key_order",
    ):
        change += " The chat template itself writes it: pass a fixed value to the template."
    return change


def _follow_causes(
    reqs: list[PrefixRequest],
    rendered: list[RenderedPrompt],
    first: tuple[Divergence | None, list[PrefixCluster]],
    prediction: HitRatePrediction,
    tok: Any,
    add_generation_prompt: bool,
    block_size: int,
) -> tuple[list[Divergence], list[Advice], HitRatePrediction | None]:
    """Every actionable cause along the prompts, in prompt order, each with its advice.

    Round by round: take the first actionable divergence (of the whole set, else of a
    cluster) not yet seen, rewrite the requests as its advice says (:func:`_rewrite`),
    re-render, predict (cumulative: every earlier rewrite is kept) and look for the next
    divergence in the rewritten requests. A divergence whose change cannot be simulated is
    listed (prediction None) and the round tries the next candidate; the loop ends when no
    candidate is left (the prompts now diverge only in the last message or where one
    ends) or after :data:`MAX_CAUSE_ROUNDS` rounds. Returns the causes, the advice
    (changes that raise the hit rate first) and the prediction with every simulated
    change applied (None when none could be).
    """
    causes: list[Divergence] = []
    advice: list[Advice] = []
    seen: set[tuple[str, str, tuple[str, str]]] = set()
    listed: set[tuple[str, str]] = set()
    cur, cur_rendered, (div, clusters) = reqs, rendered, first
    before = prediction
    applied = False
    for _ in range(MAX_CAUSE_ROUNDS):
        candidates = [
            d for d in [div, *(c.divergence for c in clusters)] if d is not None and d.actionable
        ]
        progressed = False
        for d in candidates:
            src = _advice_source(d)
            key = (d.cause, src, d.values)
            if key in seen:
                continue
            seen.add(key)
            nxt: list[RenderedPrompt] | None = None
            changed = _rewrite(cur, d)
            if changed is not None:
                try:
                    nxt = _render_all(changed, tok, add_generation_prompt)
                except ValueError:  # the rewritten request does not render: not simulated
                    nxt = None
                if nxt is not None and [r.token_ids for r in nxt] == [
                    r.token_ids for r in cur_rendered
                ]:
                    nxt = None  # the rewrite changes nothing the engine sees
            if nxt is None or changed is None:
                if (d.cause, src) in listed:
                    continue
                listed.add((d.cause, src))
                causes.append(d)
                advice.append(
                    Advice(cause=d.cause, source=src, change=_change_text(d, src), step=len(advice))
                )
                continue
            after = predict_hit_rate([r.token_ids for r in nxt], block_size)
            listed.add((d.cause, src))
            causes.append(d)
            advice.append(
                Advice(
                    cause=d.cause,
                    source=src,
                    change=_change_text(d, src),
                    step=len(advice),
                    predicted_hit_rate_after=after.hit_rate,
                    predicted_hits_tokens_after=after.hits_tokens,
                    raises_hit_rate=after.hit_rate > before.hit_rate + 1e-12,
                )
            )
            before, applied = after, True
            cur, cur_rendered = changed, nxt
            div, clusters = _split(cur_rendered, cur, block_size)
            progressed = True
            break
        if not progressed:
            break
    # The plan: the simulated steps up to the one with the best cumulative hit rate (a
    # step that gains nothing alone may be needed for a later one: a clock before an id).
    simulated = [a for a in advice if a.predicted_hit_rate_after is not None]
    best = max(simulated, key=lambda a: (a.predicted_hit_rate_after or 0.0, -a.step), default=None)
    gain = (
        best is not None
        and best.predicted_hit_rate_after is not None
        and best.predicted_hit_rate_after > prediction.hit_rate + 1e-12
    )
    for a in advice:
        a.raises_hit_rate = bool(
            gain
            and best is not None
            and a.predicted_hit_rate_after is not None
            and a.step <= best.step
        )
    return causes, advice, before if applied else None


def _notes(
    reqs: list[PrefixRequest], rendered: list[RenderedPrompt], tok: Any, add_generation_prompt: bool
) -> list[str]:
    """Facts about the rendering: tools the template ignores, a date it writes itself."""
    notes: list[str] = []
    with_tools = [i for i, r in enumerate(reqs) if r.tools]
    if with_tools:
        distinct: dict[str, int] = {}
        for i in with_tools:
            distinct.setdefault(_raw(reqs[i].tools), i)
        ignored = True
        for i in list(distinct.values())[:4]:
            try:
                bare = _render(
                    PrefixRequest(messages=reqs[i].messages), tok, i, add_generation_prompt
                )
            except ValueError:
                ignored = False
                break
            if bare.text != rendered[i].text:
                ignored = False
                break
        if ignored:
            what = (
                f"the tools differ between requests ({len(distinct)} different tool lists)"
                if len(distinct) > 1
                else f"{len(with_tools)} of {len(reqs)} requests carry tools"
            )
            notes.append(
                f"{what[0].upper()}{what[1:]}, but the model's chat template does not render "
                "tools: they are not part of the prompt the engine sees, so they do not affect "
                "the prefix (nor does the model see them)."
            )
    dates: dict[str, list[int]] = {}
    for r in rendered[:64]:
        covered = [(s.rendered_start, s.rendered_end) for s in r.spans]
        for m in _TEMPLATE_DATE.finditer(r.text):
            if not any(a <= m.start() < b for a, b in covered):
                dates.setdefault(m.group(), []).append(r.index)
    if dates:
        today = _today_strings()
        shown = ", ".join(repr(v) for v in list(dates)[:3])
        note = (
            f"The chat template writes a date into the prompt itself ({shown}; not from the "
            "requests)"
        )
        if len(dates) > 1:
            note += ": it differs between requests and breaks the shared prefix there"
        elif any(v in today or any(t in v for t in today) for v in dates):
            note += (
                ": it is today's date, so the rendered prompts (and the prefix they share) "
                "change every day; pass a fixed date to the template (e.g. its date variable) "
                "if it should not move"
            )
        notes.append(note + ".")
    return notes


#: A calendar date (not a bare time or weekday), as templates write them.
_TEMPLATE_DATE = re.compile(
    rf"\b(?:\d{{4}}-\d{{2}}-\d{{2}}"
    rf"|(?:{_WEEKDAY},?\s+)?{_MONTH}\.?\s+\d{{1,2}}(?:st|nd|rd|th)?,?\s+\d{{4}}"
    rf"|(?:{_WEEKDAY},?\s+)?\d{{1,2}}\s+{_MONTH}\.?,?\s+\d{{4}}"
    r"|\d{1,2}[/.]\d{1,2}[/.]\d{4})(?!\d)"
)


def _today_strings() -> set[str]:
    import datetime as _dt

    now = _dt.datetime.now()
    fmts = ("%Y-%m-%d", "%d %b %Y", "%d %B %Y", "%b %d, %Y", "%B %d, %Y", "%m/%d/%Y", "%d/%m/%Y")
    out = {now.strftime(f) for f in fmts}
    return out | {x.lstrip("0") for x in out} | {x.replace(" 0", " ") for x in out}


def analyze_prefix(
    requests: Iterable[Any],
    model_dir: str | Path,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    add_generation_prompt: bool = True,
    tokenizer: Any = None,
) -> PrefixAnalysis:
    """Analyse the shared token prefix of a workload and what breaks it.

    Args:
        requests: the workload in the order sent (anything :func:`coerce_requests` takes;
            warm-up requests are skipped).
        model_dir: model directory whose tokenizer and chat template render the prompts.
        block_size: KV cache block size of the engine (tokens; vLLM default 16).
        add_generation_prompt: passed to the chat template (vLLM's chat endpoint: True).
        tokenizer: an already loaded ``transformers`` tokenizer (else :func:`load_tokenizer`).

    Returns:
        :class:`PrefixAnalysis`: shared prefix (tokens and whole blocks), first divergence
        with its token position, source location and cause, clusters, every actionable
        cause along the prompts (found by simulating each change and comparing again), the
        predicted hit rate (see the module docstring for vLLM's counting), advice with the
        cumulative hit rate predicted after each change, and notes.

    Raises:
        ValueError: no requests, a malformed request or one that cannot be rendered (the
            message starts with ``requests[i]: ``, ``i`` its index in ``requests``), or
            ``block_size < 1``.
        FileNotFoundError: ``model_dir`` is not a directory.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    reqs, where = _coerce(requests)
    if not reqs:
        raise ValueError("no requests to analyse")
    tok = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
    rendered = _render_all(reqs, tok, add_generation_prompt, where)
    toks = [r.token_ids for r in rendered]
    lengths = [len(t) for t in toks]
    shared = shared_prefix_length(toks)
    prediction = predict_hit_rate(toks, block_size)
    divergence, clusters = _split(rendered, reqs, block_size)
    causes, advice, after_all = _follow_causes(
        reqs, rendered, (divergence, clusters), prediction, tok, add_generation_prompt, block_size
    )
    reusable = block_size * (min(shared, min(lengths) - 1) // block_size) if lengths else 0
    return PrefixAnalysis(
        model_dir=str(model_dir),
        block_size=block_size,
        num_requests=len(reqs),
        prompt_tokens=lengths,
        shared_prefix_tokens=shared,
        shared_prefix_blocks=shared // block_size,
        reusable_prefix_tokens=max(0, reusable),
        divergence=divergence,
        clusters=clusters,
        causes=causes,
        prediction=prediction,
        advice=advice,
        predicted_hit_rate_after_advice=after_all.hit_rate if after_all else None,
        notes=_notes(reqs, rendered, tok, add_generation_prompt),
    )


# --------------------------------------------------------------------------- findings


def hit_rate_finding(
    predicted: float, measured: float, *, tolerance: float = 0.1
) -> PrefixFinding | None:
    """Compare a run's measured prefix cache hit rate with the analyser's prediction.

    Both are fractions in [0, 1]; ``measured`` is delta ``vllm:prefix_cache_hits`` / delta
    ``vllm:prefix_cache_queries`` over the run (tokens). A gap larger than ``tolerance``
    (absolute) is a finding:

    - ``hit_rate_below_prediction`` (warning): the cache evicted shared blocks (KV cache
      too small for the concurrency), requests were admitted together before their shared
      prefix was cached, or the prefix cache was off / reset during the run.
    - ``hit_rate_above_prediction`` (warning): the counters include work the prompts do
      not explain: preempted requests re-hitting their own blocks (counted as hits before
      vLLM split out ``preempted_hits``), warm-up or earlier runs' blocks left in the cache,
      or generated tokens reused by later turns.

    Returns None when the two agree within ``tolerance``.
    """
    diff = measured - predicted
    if abs(diff) <= tolerance:
        return None
    evidence = {
        "predicted_hit_rate": predicted,
        "measured_hit_rate": measured,
        "difference": diff,
        "tolerance": tolerance,
    }
    if diff < 0:
        return PrefixFinding(
            code="hit_rate_below_prediction",
            severity="warning",
            evidence=evidence,
            message=(
                f"Measured prefix cache hit rate {measured:.1%} is far below the "
                f"{predicted:.1%} the prompts allow: shared blocks were evicted (KV cache "
                "too small for the concurrency) or requests arrived before their shared "
                "prefix was cached."
            ),
        )
    return PrefixFinding(
        code="hit_rate_above_prediction",
        severity="warning",
        evidence=evidence,
        message=(
            f"Measured prefix cache hit rate {measured:.1%} is far above the "
            f"{predicted:.1%} the prompts allow: the counters include preempted "
            "requests' re-computed tokens, or blocks cached before the run (warm-up, "
            "an earlier run, generated tokens)."
        ),
    )


def summarize(analysis: PrefixAnalysis) -> dict[str, Any]:
    """The part of an analysis a run keeps (``engine_info.prefix_analysis``), JSON-safe:
    ``predicted_hit_rate`` (0-1), ``queries_tokens``/``hits_tokens`` (predicted),
    ``shared_prefix_tokens``/``shared_prefix_blocks``/``reusable_prefix_tokens``,
    ``block_size``, ``num_requests``, ``cause`` (the cause of the plan's last change, else
    the first actionable cause), ``causes`` (every cause found, prompt order),
    ``divergence`` (the first actionable divergence, else the first), ``advice`` (in words,
    the plan: the change, or the changes to make together, that raise the predicted hit
    rate; None when no change does; the advisor shows it as the change to make first),
    ``advice_all`` (every change with its cumulative predicted hit rate and
    ``raises_hit_rate``), ``predicted_hit_rate_after_advice`` and ``notes``."""
    first = analysis.causes[0] if analysis.causes else analysis.divergence
    plan = [a for a in analysis.advice if a.raises_hit_rate]
    best = plan[-1] if plan else None
    text: str | None = None
    if len(plan) == 1:
        text = plan[0].change
    elif plan:
        text = (
            f"Make these {len(plan)} changes together (the predicted hit rate assumes all): "
            + " ".join(f"({i}) {a.change}" for i, a in enumerate(plan, 1))
        )
    cause = (
        best.cause if best is not None else (first.cause if first and first.actionable else None)
    )
    return {
        "predicted_hit_rate": analysis.prediction.hit_rate,
        "queries_tokens": analysis.prediction.queries_tokens,
        "hits_tokens": analysis.prediction.hits_tokens,
        "shared_prefix_tokens": analysis.shared_prefix_tokens,
        "shared_prefix_blocks": analysis.shared_prefix_blocks,
        "reusable_prefix_tokens": analysis.reusable_prefix_tokens,
        "block_size": analysis.block_size,
        "num_requests": analysis.num_requests,
        "cause": cause,
        "causes": [c.cause for c in analysis.causes],
        "divergence": first.model_dump(mode="json") if first else None,
        "advice": text,
        "advice_all": [a.model_dump(mode="json") for a in analysis.advice],
        "predicted_hit_rate_after_advice": analysis.predicted_hit_rate_after_advice,
        "notes": list(analysis.notes),
    }
