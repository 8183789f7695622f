"""Request intake: request-like items (OpenAI chat / completions bodies,
:class:`jobs.schemas.ChatRequest`, :class:`PrefixRequest`) checked and turned into
:class:`PrefixRequest` objects; what is wrong is said in plain words, ``requests[i]: ...``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ValidationError

from orchestrator.analysis.prefix.schemas import NotCompared, PrefixRequest


def coerce_requests(items: Iterable[Any]) -> list[PrefixRequest]:
    """Turn request-like items into :class:`PrefixRequest` objects, in order.

    Accepts :class:`PrefixRequest`, mappings (OpenAI chat / completions bodies: ``messages``,
    ``tools``, ``prompt``) and objects with ``model_dump`` such as
    :class:`jobs.schemas.ChatRequest` (``tools`` may sit in ``extra_body``; a non-empty
    ``prompt`` wins over an empty ``messages``). A completions ``prompt`` may be a string,
    a list of token ids, or a batch (a list of strings or of token id lists: one request
    each, in order, as vLLM's ``CompletionRequest.prompt`` allows); token ids also come as
    ``prompt_token_ids`` (vLLM's ``TokensPrompt``) or ``token_ids`` (vLLM's
    ``/inference/v1/generate``). The answer's token ids, when known, come as
    ``generated_token_ids``, ``output_token_ids`` or a vLLM response with
    ``return_token_ids`` (``response.choices[i].token_ids``). Items flagged ``warmup`` are
    skipped: they are not part of the measured workload. Requests that cannot be compared
    at all (prompt embeddings) are left out; :func:`coerce_sourced` says which.

    Raises:
        ValueError: an item is neither a chat nor a prompt, or malformed; the message
            starts with ``requests[i]: `` (``i``: the item's index in ``items``) and says
            what is wrong in plain words.
    """
    return coerce_sourced(items)[0]


def type_name(x: Any) -> str:
    """``x``'s JSON kind in words (``"a string"``, ``"null"``), for error messages."""
    if x is None:
        return "null"
    known = {str: "a string", list: "a list", dict: "an object", bool: "a boolean"}
    name = type(x).__name__
    return known.get(type(x), f"{'an' if name[:1] in 'aeiou' else 'a'} {name}")


def _is_token_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def token_ids_problem(ids: Any, name: str) -> str | None:
    """What is wrong with a list of token ids named ``name``, in plain words (None: nothing).

    vLLM takes whole numbers >= 0 (``CompletionRequest.prompt``:
    ``list[Annotated[int, Field(ge=0)]]``)."""
    if not isinstance(ids, list | tuple):
        return f'"{name}" must be a list of token ids, not {type_name(ids)}'
    if not ids:
        return f'"{name}" is an empty list of token ids'
    for j, t in enumerate(ids):
        if not _is_token_id(t):
            return f"{name}[{j}] must be a token id (a whole number >= 0), not {t!r}"
    return None


def _prompts(prompt: Any) -> tuple[list[str | list[int]], str | None]:
    """A completions ``prompt`` as a list of single prompts (text or token ids), and what
    is wrong with it. A batch (a list of strings or of token id lists) gives several."""
    if isinstance(prompt, str):
        return [prompt], None
    if not isinstance(prompt, list | tuple):
        return [], (
            '"prompt" must be a string, a list of token ids, or a batch (a list of strings '
            f"or of token id lists), not {type_name(prompt)}"
        )
    if not prompt:
        return [], '"prompt" is an empty list'
    if all(isinstance(p, str) for p in prompt):
        return list(prompt), None
    if all(isinstance(p, list | tuple) for p in prompt):
        for j, p in enumerate(prompt):
            problem = token_ids_problem(p, f"prompt[{j}]")
            if problem:
                return [], problem
        return [list(p) for p in prompt], None
    if any(isinstance(p, str | list | tuple) for p in prompt):
        return [], (
            '"prompt" mixes kinds: a batch is all strings or all token id lists, a single '
            "prompt all token ids"
        )
    problem = token_ids_problem(prompt, "prompt")
    return ([], problem) if problem else ([list(prompt)], None)


def _request_problem(messages: Any, tools: Any, prompt: Any) -> str | None:
    """What is wrong with a request's fields, in plain words (None: nothing)."""
    if prompt is not None:
        _, problem = _prompts(prompt)
        if problem:
            return problem
        if messages:
            return 'has both "messages" (chat) and "prompt" (completions): send one of them'
        if tools:
            return '"tools" needs "messages" (a chat request), not "prompt"'
        return None
    if messages is None:
        return 'needs "messages" (chat) or "prompt" (completions)'
    if not isinstance(messages, list | tuple):
        return f'"messages" must be a list of message objects, not {type_name(messages)}'
    if not messages:
        return '"messages" is empty: a chat request needs at least one message'
    for j, m in enumerate(messages):
        if not isinstance(m, Mapping):
            return f'messages[{j}] must be an object with "role" and "content", not {type_name(m)}'
        role = m.get("role")
        if not isinstance(role, str) or not role:
            return f'messages[{j}] needs a "role" (a string such as "system", "user", "assistant")'
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            return (
                f"messages[{j}].content must be a string or a list of content parts, "
                f"not {type_name(content)}"
            )
    if tools is not None and (
        not isinstance(tools, list | tuple) or any(not isinstance(t, Mapping) for t in tools)
    ):
        return '"tools" must be a list of tool objects'
    return None


def _embeds_part(messages: Any) -> str | None:
    """``messages[j].content[k]`` of the first prompt-embeddings content part (vLLM's
    ``ChatCompletionContentPartPromptEmbedsParam``, ``type: "prompt_embeds"``)."""
    for j, m in enumerate(messages or []):
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, list):
            for k, part in enumerate(content):
                if isinstance(part, Mapping) and part.get("type") == "prompt_embeds":
                    return f"messages[{j}].content[{k}]"
    return None


def _generated(data: Mapping[str, Any], n_prompts: int) -> tuple[list[Any | None], str | None]:
    """The generated token ids per prompt of an item, and what is wrong with them.

    From ``generated_token_ids`` / ``output_token_ids`` (one prompt), else from a vLLM
    response with ``return_token_ids`` (``response.choices[i].token_ids``, one choice per
    prompt, i.e. ``n = 1``)."""
    for name in ("generated_token_ids", "output_token_ids"):
        ids = data.get(name)
        if ids is None:
            continue
        if n_prompts != 1:
            return [None] * n_prompts, (
                f'"{name}" is one answer but the request is a batch of {n_prompts} prompts: '
                'give each its own (a vLLM response\'s "choices", one per prompt)'
            )
        problem = token_ids_problem(ids, name)
        return ([None], problem) if problem else ([list(ids)], None)
    response = data.get("response")
    if not isinstance(response, Mapping):
        return [None] * n_prompts, None
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices:
        return [None] * n_prompts, None
    if len(choices) != n_prompts:
        return [None] * n_prompts, (
            f'"response" has {len(choices)} choices for {n_prompts} prompt(s): the answer a '
            "later turn resends is ambiguous (n > 1); give one choice per prompt"
        )
    out: list[Any | None] = [None] * n_prompts
    for c, choice in enumerate(choices):
        ids = choice.get("token_ids") if isinstance(choice, Mapping) else None
        if ids is None:
            continue
        idx = choice.get("index", c) if isinstance(choice, Mapping) else c
        if not isinstance(idx, int) or not 0 <= idx < n_prompts:
            idx = c
        problem = token_ids_problem(ids, f"response.choices[{c}].token_ids")
        if problem:
            return [None] * n_prompts, problem
        out[idx] = list(ids)
    return out, None


_SURROGATE = re.compile("[\ud800-\udfff]")


def unicode_problem(req: PrefixRequest) -> str | None:
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


def coerce_sourced(
    items: Iterable[Any], notes: list[str] | None = None
) -> tuple[list[PrefixRequest], list[str], list[NotCompared]]:
    """:func:`coerce_requests` plus where each request is in ``items`` (``requests[i]``,
    ``requests[i].prompt[j]`` for a batch prompt; warm-ups skipped) and the requests left
    out because nothing of them can be compared (prompt embeddings).

    A body with ``prompt`` or ``messages`` AND ``prompt_token_ids``/``token_ids`` is read
    as vLLM 0.32 reads it: neither ``CompletionRequest`` nor ``ChatCompletionRequest``
    has such a field, so vLLM ignores it with a warning ("The following fields were
    present in the request but ignored", ``vllm/entrypoints/serve/engine/protocol.py``
    L73) and the prompt wins; a line saying so is appended to ``notes``."""
    out: list[PrefixRequest] = []
    where: list[str] = []
    skipped: list[NotCompared] = []
    for i, item in enumerate(items):
        label = f"requests[{i}]"
        if isinstance(item, PrefixRequest):
            if item.prompt_token_ids is None:
                problem = _request_problem(item.messages, item.tools, item.prompt)
                if problem:
                    raise ValueError(f"{label}: {problem}")
            out.append(item)
            where.append(label)
            continue
        data: Any = item.model_dump() if hasattr(item, "model_dump") else item
        if not isinstance(data, Mapping):
            raise ValueError(
                f'{label}: not a request: expected an object with "messages" (chat) '
                f'or "prompt" (completions), got {type_name(item)}'
            )
        if data.get("warmup"):
            continue
        extra = data.get("extra_body") or {}
        tools = data.get("tools") or (extra.get("tools") if isinstance(extra, Mapping) else None)
        prompt = data.get("prompt")
        messages = data.get("messages")
        if prompt is not None and not messages:  # ChatRequest keeps messages=[] for prompts
            messages = None
        prompt = _token_ids(label, data, prompt, messages, notes)
        not_compared = _not_compared(label, data, prompt, messages, tools)
        if not_compared is not None:
            skipped.append(not_compared)
            continue
        for req, source in _requests(label, data, prompt, messages, tools):
            out.append(req)
            where.append(source)
    return out, where, skipped


def _token_ids(
    label: str, data: Mapping[str, Any], prompt: Any, messages: Any, notes: list[str] | None
) -> Any:
    """The prompt, or the token ids given in ``prompt_token_ids``/``token_ids`` when there
    is neither a prompt nor messages (vLLM ignores those fields beside them: a note)."""
    ids_field = next(
        (k for k in ("prompt_token_ids", "token_ids") if data.get(k) is not None), None
    )
    both = data.get("prompt_token_ids") is not None and data.get("token_ids") is not None
    if both and data["prompt_token_ids"] != data["token_ids"]:
        raise ValueError(
            f'{label}: has both "prompt_token_ids" and "token_ids", with different ids: '
            "which one the engine reads depends on the entry point (vLLM's TokensPrompt "
            'reads "prompt_token_ids", /inference/v1/generate reads "token_ids"); give one'
        )
    if ids_field is not None and (prompt is not None or messages) and notes is not None:
        given = "prompt" if prompt is not None else "messages"
        notes.append(
            f'{label}: has both "{given}" and "{ids_field}"; vLLM has no '
            f'"{ids_field}" field on this request and ignores it (with a warning), so '
            f'"{given}" is compared and "{ids_field}" is not.'
        )
    if ids_field is not None and prompt is None and not messages:
        problem = token_ids_problem(data[ids_field], ids_field)
        if problem:
            raise ValueError(f"{label}: {problem}")
        prompt = list(data[ids_field])
    return prompt


def _not_compared(
    label: str, data: Mapping[str, Any], prompt: Any, messages: Any, tools: Any
) -> NotCompared | None:
    """Why a request given as prompt embeddings cannot be compared, None for any other.

    Raises:
        ValueError: a malformed request.
    """
    if prompt is None and not messages and data.get("prompt_embeds") is not None:
        return NotCompared(
            request=label,
            reason='the prompt is given as embeddings ("prompt_embeds"): embeddings '
            "are not token ids, so this request cannot be compared",
        )
    problem = _request_problem(messages, tools, prompt)
    if problem:
        raise ValueError(f"{label}: {problem}")
    embeds = _embeds_part(messages) if prompt is None else None
    if embeds:
        return NotCompared(
            request=label,
            reason=f'{embeds} is prompt embeddings (a "prompt_embeds" content part): '
            "embeddings are not token ids, so this request cannot be compared",
        )
    return None


def _requests(
    label: str, data: Mapping[str, Any], prompt: Any, messages: Any, tools: Any
) -> list[tuple[PrefixRequest, str]]:
    """The request (one per prompt of a batch prompt) with where each is in the input.

    Raises:
        ValueError: malformed generated token ids, or a request the schema refuses.
    """
    singles, _ = _prompts(prompt) if prompt is not None else ([], None)
    generated, problem = _generated(data, max(1, len(singles)))
    if problem:
        raise ValueError(f"{label}: {problem}")
    try:
        if prompt is None:
            chat = PrefixRequest(
                messages=[dict(m) for m in messages or []],
                tools=[dict(t) for t in tools] if tools else None,
                generated_token_ids=generated[0],
            )
            return [(chat, label)]
        out: list[tuple[PrefixRequest, str]] = []
        for j, single in enumerate(singles):
            if isinstance(single, str):
                req = PrefixRequest(prompt=single, generated_token_ids=generated[j])
            else:
                req = PrefixRequest(prompt_token_ids=single, generated_token_ids=generated[j])
            out.append((req, label if len(singles) == 1 else f"{label}.prompt[{j}]"))
    except ValidationError as exc:
        raise ValueError(f"{label}: {_plain_validation(exc)}") from None
    return out
