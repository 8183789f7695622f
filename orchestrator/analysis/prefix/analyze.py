"""The analysis: render every request, find the shared prefix and the first divergence,
follow the causes along the prompts (simulate each advised change, re-render, compare
again), predict the hit rate before and after, and note what the rendering hides.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from orchestrator.analysis.prefix.changes import CHANGE_TEXT, rewrite
from orchestrator.analysis.prefix.divergence import field_root, find_divergence, partition, raw_json
from orchestrator.analysis.prefix.inputs import coerce_indexed
from orchestrator.analysis.prefix.patterns import TEMPLATE_DATE
from orchestrator.analysis.prefix.prediction import predict_hit_rate, shared_prefix_length
from orchestrator.analysis.prefix.rendering import RequestError, load_tokenizer, render
from orchestrator.analysis.prefix.schemas import (
    DEFAULT_BLOCK_SIZE,
    Advice,
    Divergence,
    HitRatePrediction,
    PrefixAnalysis,
    PrefixCluster,
    PrefixRequest,
    RenderedPrompt,
)

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
            out.append(render(r, tok, i, add_generation_prompt))
        except RequestError as exc:
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
    groups = partition(members, toks, shared)
    divergence = find_divergence(groups[0][0], groups[1][0], rendered, reqs, block_size)
    clusters = []
    for g in groups:
        gp = shared_prefix_length([toks[i] for i in g])
        gd: Divergence | None = None
        if len(g) > 1 and len({tuple(toks[i]) for i in g}) > 1:
            sub = partition(g, toks, gp)
            gd = find_divergence(sub[0][0], sub[1][0], rendered, reqs, block_size)
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
    return d.json_path or field_root(d.locations[0].source)


def _change_text(d: Divergence, src: str) -> str:
    if d.cause == "other" and d.locations[0].source == "template":
        return (
            "The chat template writes different text here (other roles, message counts or "
            "template variables before the shared content): give every request the same "
            "message structure up to the content they share."
        )
    change = CHANGE_TEXT.get(d.cause, CHANGE_TEXT["other"]).format(src=src)
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
    cluster) not yet seen, rewrite the requests as its advice says (:func:`rewrite`),
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
            changed = rewrite(cur, d)
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
            distinct.setdefault(raw_json(reqs[i].tools), i)
        ignored = True
        for i in list(distinct.values())[:4]:
            try:
                bare = render(
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
        for m in TEMPLATE_DATE.finditer(r.text):
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


def _today_strings() -> set[str]:
    now = datetime.datetime.now()
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
        predicted hit rate (see the package docstring for vLLM's counting), advice with the
        cumulative hit rate predicted after each change, and notes.

    Raises:
        ValueError: no requests, a malformed request or one that cannot be rendered (the
            message starts with ``requests[i]: ``, ``i`` its index in ``requests``), or
            ``block_size < 1``.
        FileNotFoundError: ``model_dir`` is not a directory.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    reqs, where = coerce_indexed(requests)
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
