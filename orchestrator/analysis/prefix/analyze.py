"""The analysis: render every request, find the shared prefix and the first divergence,
follow the causes along the prompts (simulate each advised change, re-render, compare
again), predict the hit rate before and after, and note what the rendering hides.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from orchestrator.analysis.prefix.causes import field_root
from orchestrator.analysis.prefix.changes import CHANGE_TEXT, rewrite
from orchestrator.analysis.prefix.divergence import find_divergence, partition
from orchestrator.analysis.prefix.inputs import coerce_sourced
from orchestrator.analysis.prefix.notes import analysis_notes, generated_not_counted
from orchestrator.analysis.prefix.prediction import predict_hit_rate, shared_prefix_length
from orchestrator.analysis.prefix.rendering import RequestError, load_tokenizer, render
from orchestrator.analysis.prefix.resend import (
    RETOKENIZATION,
    Resend,
    find_resends,
    resent_as_tokens,
)
from orchestrator.analysis.prefix.schemas import (
    DEFAULT_BLOCK_SIZE,
    Advice,
    Divergence,
    HitRatePrediction,
    NotCompared,
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
    where: Sequence[str] | None = None,
) -> list[RenderedPrompt]:
    """Render every request; errors name the request by where it is in the caller's list
    (``where[i]``: ``requests[n]`` with ``n`` the index before warm-ups were skipped)."""
    out = []
    for i, r in enumerate(reqs):
        try:
            out.append(render(r, tok, i, add_generation_prompt))
        except RequestError as exc:
            n = where[i] if where is not None and i < len(where) else f"requests[{i}]"
            raise ValueError(f"{n}: {exc.reason}") from exc.__cause__
    return out


def _predict(
    rendered: Sequence[RenderedPrompt], reqs: Sequence[PrefixRequest], block_size: int
) -> HitRatePrediction:
    """The predicted hit rate, the blocks of generated tokens counted where known."""
    return predict_hit_rate(
        [r.token_ids for r in rendered], block_size, [q.generated_token_ids for q in reqs]
    )


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
    if d.cause in RETOKENIZATION:  # where the merge reaches into the request, if it does
        named = [x.source for x in d.locations if x.source not in ("template", "end of prompt")]
        return field_root(named[0]) if named else d.locations[0].source
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
        *RETOKENIZATION,
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
) -> tuple[
    list[Divergence],
    list[Advice],
    HitRatePrediction | None,
    tuple[list[PrefixRequest], list[RenderedPrompt]],
]:
    """Every actionable cause along the prompts, in prompt order, each with its advice.

    Round by round: take the first actionable divergence (of the whole set, else of a
    cluster) not yet seen, rewrite the requests as its advice says (:func:`rewrite`),
    re-render, predict (cumulative: every earlier rewrite is kept) and look for the next
    divergence in the rewritten requests. A divergence whose change cannot be simulated is
    listed (prediction None) and the round tries the next candidate; the loop ends when no
    candidate is left (the prompts now diverge only in the last message or where one
    ends) or after :data:`MAX_CAUSE_ROUNDS` rounds. Returns the causes, the advice
    (changes that raise the hit rate first), the prediction with every simulated
    change applied (None when none could be), and the requests with those changes (and
    their renderings).
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
            changed, nxt = _simulate(cur, cur_rendered, d, tok, add_generation_prompt)
            if nxt is None or changed is None:
                if (d.cause, src) in listed:
                    continue
                listed.add((d.cause, src))
                causes.append(d)
                advice.append(
                    Advice(cause=d.cause, source=src, change=_change_text(d, src), step=len(advice))
                )
                continue
            after = _predict(nxt, changed, block_size)
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
    _mark_plan(advice, prediction)
    return causes, advice, (before if applied else None), (cur, cur_rendered)


def _simulate(
    cur: list[PrefixRequest],
    cur_rendered: list[RenderedPrompt],
    d: Divergence,
    tok: Any,
    add_generation_prompt: bool,
) -> tuple[list[PrefixRequest] | None, list[RenderedPrompt] | None]:
    """The requests rewritten as ``d``'s advice says and their renderings; a rendering
    None when the rewrite does not render or changes no token the engine sees, the
    requests None when the change cannot be simulated."""
    nxt: list[RenderedPrompt] | None = None
    changed = rewrite(cur, d)
    if changed is not None:
        try:
            nxt = _render_all(changed, tok, add_generation_prompt)
        except ValueError:  # the rewritten request does not render: not simulated
            nxt = None
        if nxt is not None and [r.token_ids for r in nxt] == [r.token_ids for r in cur_rendered]:
            nxt = None  # the rewrite changes nothing the engine sees
    return changed, nxt


def _mark_plan(advice: list[Advice], prediction: HitRatePrediction) -> None:
    """Mark the plan: the simulated steps up to the one with the best cumulative hit rate
    (a step that gains nothing alone may be needed for a later one: a clock before an id),
    when that beats the workload as it is."""
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


def _vocab_limit(model_dir: str | Path | None, tok: Any) -> int | None:
    """The largest token id vLLM accepts: ``max(tokenizer.max_token_id, vocab_size - 1)``
    (``vllm/renderers/base.py`` ``validate_token_ids``); None when neither is known."""
    sizes = []
    if tok is not None:
        with contextlib.suppress(TypeError):
            sizes.append(len(tok) - 1)
    if model_dir is not None:
        try:
            cfg = json.loads((Path(model_dir) / "config.json").read_text())
            vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
            if isinstance(vocab, int) and vocab > 0:
                sizes.append(vocab - 1)
        except (OSError, ValueError, AttributeError):
            pass
    return max(sizes) if sizes else None


def _check_ids(reqs: Sequence[PrefixRequest], where: Sequence[str], limit: int | None) -> None:
    """Refuse a token id vLLM refuses (its words: "Token id N is out of vocabulary")."""
    if limit is None:
        return
    for r, label in zip(reqs, where, strict=True):
        for name, ids in (
            ("prompt", r.prompt_token_ids),
            ("generated_token_ids", r.generated_token_ids),
        ):
            if ids and max(ids) > limit:
                raise ValueError(
                    f"{label}: {name}: Token id {max(ids)} is out of vocabulary (the model's "
                    f"largest token id is {limit}; vLLM refuses the request)"
                )


def _resend_advice(
    state0: list[PrefixRequest],
    state: tuple[list[PrefixRequest], list[RenderedPrompt]],
    resends: list[Any],
    causes: list[Divergence],
    advice: list[Advice],
    tok: Any,
    block_size: int,
) -> HitRatePrediction | None:
    """Advice for re-tokenized resends: the first such divergence joins ``causes`` (unless
    a cause of its kind is there already) and its advice gets the hit rate predicted with
    the resends sent as the tokens the engine held (:func:`resent_as_tokens`), on the
    requests with every earlier change applied (cumulative; ``state0``: the requests as
    given, whose ``resends`` are already checked). Returns that prediction."""
    first = next(
        (x.divergence for x, _ in resends if x.divergence and x.divergence.cause in RETOKENIZATION),
        None,
    )
    if first is None:
        return None
    cur, cur_rendered = state
    now = resends if cur is state0 else find_resends(cur, cur_rendered, tok, block_size)
    lists = resent_as_tokens(cur_rendered, now, tok)
    after = (
        predict_hit_rate(lists, block_size, [q.generated_token_ids for q in cur])
        if lists is not None
        else None
    )
    target = next((a for a in advice if a.cause in RETOKENIZATION), None)
    if target is None:
        src = _advice_source(first)
        causes.append(first)
        target = Advice(cause=first.cause, source=src, change=_change_text(first, src))
        target.step = len(advice)
        advice.append(target)
    if after is not None and target.predicted_hit_rate_after is None:
        target.predicted_hit_rate_after = after.hit_rate
        target.predicted_hits_tokens_after = after.hits_tokens
        return after
    return None


def _comparable(
    requests: Iterable[Any], model_dir: str | Path | None, tokenizer: Any, notes: list[str]
) -> tuple[list[PrefixRequest], list[str], list[NotCompared], Any]:
    """``(requests that can be compared, their sources, those that cannot, tokenizer)``.

    Raises:
        ValueError: no requests, or none that can be compared.
    """
    reqs, where, skipped = coerce_sourced(requests, notes)
    if not reqs and not skipped:
        raise ValueError("no requests to analyse")
    tok = tokenizer
    if tok is None and model_dir is not None:
        tok = load_tokenizer(model_dir)
    if tok is None:
        reqs, where = _token_ids_only(reqs, where, skipped)
    if not reqs:
        raise ValueError(
            "no request can be compared: "
            + "; ".join(f"{x.request}: {x.reason}" for x in skipped[:3])
            + (f" (and {len(skipped) - 3} more)" if len(skipped) > 3 else "")
        )
    return reqs, where, skipped, tok


def _plan(
    reqs: list[PrefixRequest],
    rendered: list[RenderedPrompt],
    first: tuple[Divergence | None, list[PrefixCluster]],
    prediction: HitRatePrediction,
    tok: Any,
    add_generation_prompt: bool,
    block_size: int,
) -> tuple[
    list[Divergence], list[Advice], HitRatePrediction | None, list[tuple[Resend, RenderedPrompt]]
]:
    """The causes along the prompts, the advice (the resends' included), the prediction
    after every simulated change, and the resends found."""
    causes, advice, after_all, state = _follow_causes(
        reqs, rendered, first, prediction, tok, add_generation_prompt, block_size
    )
    resends = find_resends(reqs, rendered, tok, block_size)
    after_resend = _resend_advice(reqs, state, resends, causes, advice, tok, block_size)
    if after_resend is not None:
        after_all = after_resend
        _mark_plan(advice, prediction)
    return causes, advice, after_all, resends


def _after_plan(advice: Sequence[Advice]) -> float | None:
    """The highest hit rate predicted after a change that raises it, None without one."""
    return max(
        (
            a.predicted_hit_rate_after
            for a in advice
            if a.raises_hit_rate and a.predicted_hit_rate_after is not None
        ),
        default=None,
    )


def _token_ids_only(
    reqs: list[PrefixRequest], where: list[str], skipped: list[NotCompared]
) -> tuple[list[PrefixRequest], list[str]]:
    """Without a tokenizer: the requests given as token ids (and their sources); the
    others appended to ``skipped``."""
    keep = [i for i, r in enumerate(reqs) if r.prompt_token_ids is not None]
    skipped += [
        NotCompared(
            request=where[i],
            reason="its text needs the model's tokenizer to become token ids, and no "
            "model was given: it cannot be compared with the prompts given as token ids",
        )
        for i in range(len(reqs))
        if i not in set(keep)
    ]
    return [reqs[i] for i in keep], [where[i] for i in keep]


def analyze_prefix(
    requests: Iterable[Any],
    model_dir: str | Path | None = None,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    add_generation_prompt: bool = True,
    tokenizer: Any = None,
) -> PrefixAnalysis:
    """Analyse the shared token prefix of a workload and what breaks it.

    Args:
        requests: the workload in the order sent (anything :func:`coerce_requests` takes;
            warm-up requests are skipped; a batch prompt is one request per prompt).
        model_dir: model directory whose tokenizer and chat template render the prompts;
            None with no ``tokenizer``: only prompts given as token ids are compared, the
            others are listed in ``not_compared``.
        block_size: KV cache block size of the engine (tokens; vLLM default 16).
        add_generation_prompt: passed to the chat template (vLLM's chat endpoint: True).
        tokenizer: an already loaded ``transformers`` tokenizer (else :func:`load_tokenizer`).

    Returns:
        :class:`PrefixAnalysis`: shared prefix (tokens and whole blocks), first divergence
        with its token position, source location and cause, clusters, every actionable
        cause along the prompts (found by simulating each change and comparing again), the
        predicted hit rate (see the package docstring for vLLM's counting), advice with the
        cumulative hit rate predicted after each change, the multi-turn resends checked
        token by token (:mod:`~orchestrator.analysis.prefix.resend`), and notes.

    Raises:
        ValueError: no requests, none that can be compared, a malformed request, a token
            id out of the model's vocabulary or a request that cannot be rendered (the
            message starts with ``requests[i]: ``, ``i`` its index in ``requests``), or
            ``block_size < 1``.
        FileNotFoundError: ``model_dir`` is not a directory.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    input_notes: list[str] = []
    reqs, where, skipped, tok = _comparable(requests, model_dir, tokenizer, input_notes)
    _check_ids(reqs, where, _vocab_limit(model_dir, tok))
    rendered = _render_all(reqs, tok, add_generation_prompt, where)
    lengths = [len(r.token_ids) for r in rendered]
    prediction = _predict(rendered, reqs, block_size)
    shared = prediction.shared_prefix_tokens  # headline and details: one computation
    divergence, clusters = _split(rendered, reqs, block_size)
    causes, advice, after_all, resends = _plan(
        reqs, rendered, (divergence, clusters), prediction, tok, add_generation_prompt, block_size
    )
    left_out = generated_not_counted(reqs)
    notes = [
        *input_notes,
        *analysis_notes(reqs, rendered, tok, add_generation_prompt, where, left_out, skipped),
    ]
    return PrefixAnalysis(
        model_dir=None if model_dir is None else str(model_dir),
        block_size=block_size,
        num_requests=len(reqs),
        request_sources=list(where),
        prompt_tokens=lengths,
        shared_prefix_tokens=shared,
        shared_prefix_blocks=shared // block_size,
        reusable_prefix_tokens=prediction.reusable_prefix_tokens,
        divergence=divergence,
        clusters=clusters,
        causes=causes,
        prediction=prediction,
        prediction_counts_generated_tokens=any(q.generated_token_ids for q in reqs),
        advice=advice,
        predicted_hit_rate_after_advice=after_all.hit_rate if after_all else None,
        predicted_hit_rate_after_plan=_after_plan(advice),
        resends=[x for x, _ in resends],
        generated_tokens_not_counted=left_out,
        not_compared=skipped,
        notes=notes,
    )
