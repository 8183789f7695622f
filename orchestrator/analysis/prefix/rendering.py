"""Rendering: a request turned into the prompt text and token ids vLLM's OpenAI server
sends to the engine (chat template, tokenizer, offsets), every rendered character mapped
back to its source (a message field, a tool schema path, or the template itself).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from orchestrator.analysis.prefix.inputs import type_name, unicode_problem
from orchestrator.analysis.prefix.schemas import PrefixRequest, RenderedPrompt, SourceSpan
from orchestrator.analysis.prefix.tokens import decode_with_offsets

# --------------------------------------------------------------------------- tokenizer


@functools.lru_cache(maxsize=8)
def _load_tokenizer_cached(path: str, stamp: tuple[tuple[str, float], ...]) -> Any:
    # deferred: transformers is heavy and only needed once a model directory is analysed
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
    completions endpoint default, BOS added); token ids: as given (decoded for the text).
    ``tokenizer`` is a ``transformers`` tokenizer (see :func:`load_tokenizer`), or None for
    token ids only.

    Returns:
        :class:`RenderedPrompt` with token ids, per-token character ranges and the source
        spans of the rendered text.

    Raises:
        ValueError: the request cannot be rendered or tokenized (a string with a lone
            surrogate, a chat template or tokenizer error); the message starts with
            ``requests[index]: ``.
    """
    try:
        return render(request, tokenizer, index, add_generation_prompt)
    except RequestError as exc:
        raise ValueError(f"requests[{index}]: {exc.reason}") from exc.__cause__


class RequestError(ValueError):
    """A request that cannot be rendered; ``reason`` in plain words, no request index."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def render(
    request: PrefixRequest, tokenizer: Any, index: int, add_generation_prompt: bool
) -> RenderedPrompt:
    """:func:`render_request` without the ``requests[index]: `` prefix: raises
    :class:`RequestError` (the caller names the request by its own index).

    A prompt given as token ids is taken as is (vLLM adds no special tokens to it); its
    text is the tokenizer's decoding (:func:`decode_with_offsets`), or unknown
    (``text_known`` False) when ``tokenizer`` is None. Text needs a tokenizer."""
    if request.prompt_token_ids is not None:
        ids = [int(t) for t in request.prompt_token_ids]
        if tokenizer is None:
            return RenderedPrompt(
                index=index,
                text="",
                token_ids=ids,
                offsets=[(0, 0)] * len(ids),
                spans=[],
                text_known=False,
            )
        try:
            text, offsets = decode_with_offsets(tokenizer, ids)
        except Exception as exc:
            raise RequestError(
                f"the tokenizer cannot decode the token ids: {_exc_text(exc)}"
            ) from exc
        span = SourceSpan(
            rendered_start=0, rendered_end=len(text), source="prompt_token_ids", source_start=0
        )
        return RenderedPrompt(index=index, text=text, token_ids=ids, offsets=offsets, spans=[span])
    if tokenizer is None:
        raise RequestError("text needs the model's tokenizer to become token ids")
    problem = unicode_problem(request)
    if problem:
        raise RequestError(problem)
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
            raise RequestError(f"the chat template failed: {_exc_text(exc)}") from exc
        if not isinstance(text, str):
            raise RequestError(f"the chat template returned {type_name(text)}, not the prompt text")
        add_special = False
    ids, offsets = encode(tokenizer, text, add_special)
    return RenderedPrompt(
        index=index, text=text, token_ids=ids, offsets=offsets, spans=_source_spans(request, text)
    )


def encode(tokenizer: Any, text: str, add_special: bool) -> tuple[list[int], list[tuple[int, int]]]:
    """``text`` tokenized as vLLM does (special tokens added or not), with each token's
    character range. Raises :class:`RequestError` when the tokenizer fails."""
    try:
        try:
            enc = tokenizer(text, add_special_tokens=add_special, return_offsets_mapping=True)
            ids = [int(t) for t in enc["input_ids"]]
            offsets = [(int(a), int(b)) for a, b in enc["offset_mapping"]]
        except NotImplementedError:  # slow (Python) tokenizers have no offset mapping
            ids = [int(t) for t in tokenizer(text, add_special_tokens=add_special)["input_ids"]]
            offsets = _offsets_by_decoding(tokenizer, ids, text)
    except Exception as exc:
        raise RequestError(f"the tokenizer failed: {_exc_text(exc)}") from exc
    return ids, offsets


def _exc_text(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
