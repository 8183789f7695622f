"""What the prefix analysis says about a workload besides its figures: tools the chat
template ignores, a date the template writes itself, generated tokens the prediction
leaves out, requests not compared, a missing tokenizer.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

from orchestrator.analysis.prefix.causes import raw_json
from orchestrator.analysis.prefix.patterns import TEMPLATE_DATE
from orchestrator.analysis.prefix.rendering import render
from orchestrator.analysis.prefix.resend import previous_turns
from orchestrator.analysis.prefix.schemas import NotCompared, PrefixRequest, RenderedPrompt


def analysis_notes(
    reqs: list[PrefixRequest],
    rendered: list[RenderedPrompt],
    tok: Any,
    add_generation_prompt: bool,
    where: Sequence[str],
    left_out: list[int],
    skipped: Sequence[NotCompared],
) -> list[str]:
    """The notes on the prompts, the generated tokens left out, the requests not compared
    and a missing tokenizer."""
    notes = _notes(reqs, rendered, tok, add_generation_prompt) if tok is not None else []
    if left_out:
        notes.append(_left_out_note(left_out, where))
    if skipped:
        notes.append(
            f"{len(skipped)} request(s) could not be compared and are left out of every "
            "figure: " + "; ".join(f"{x.request}: {x.reason}" for x in skipped[:3])
        )
    if tok is None:
        notes.append(
            "No tokenizer: the prompts are compared as token ids only; causes are not "
            "classified (the text is unknown) and ids are not checked against a vocabulary."
        )
    return notes


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


def generated_not_counted(reqs: Sequence[PrefixRequest]) -> list[int]:
    """The requests whose answer the prediction leaves out although a later request builds
    on it: resent by a later chat turn, or extended by a later prompt (:func:`previous_turns`),
    and given without ``generated_token_ids``."""
    return sorted({j for j, _ in previous_turns(reqs).values() if not reqs[j].generated_token_ids})


def _left_out_note(left_out: list[int], where: Sequence[str]) -> str:
    shown = ", ".join(where[j] for j in left_out[:5]) + (
        f" and {len(left_out) - 5} more" if len(left_out) > 5 else ""
    )
    return (
        f"The predicted hit rate leaves out what {len(left_out)} request(s) generated "
        f"({shown}): a later request continues each (an assistant message after its "
        "messages, or a longer prompt), but its generated token ids were not given. The "
        "engine caches the blocks of what it generated too: where the continuation resends "
        "exactly those tokens, the later request hits more than predicted (give "
        "generated_token_ids, or a vLLM response with return_token_ids, to count them)."
    )
