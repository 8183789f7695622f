"""Helpers for the ``vlab`` commands' rich tables: no id or word split across lines."""

from __future__ import annotations

import dataclasses

from rich.errors import MarkupError
from rich.markup import escape
from rich.table import Table
from rich.text import Text


def keep_words(table: Table, width: int | None = None, cap: int = 30) -> Table:
    """``table`` with no word split across lines where it fits ``width``: each column at
    least as wide as its longest word (header included; up to ``cap``, past which a word
    folds), so cells wrap at spaces only. rich shrinks the widest columns first when a
    table is too wide, and would fold an id or a word there; a column marked ``no_wrap``
    (an id) is left as it is. Where those widths do not fit ``width`` (a narrow terminal)
    they are not imposed: rich folds words rather than cut the table at the edge; where
    they fit but rich's shrinking would go below them, the columns get fixed widths.
    ``width`` None: the minimums alone (the console's width unknown)."""
    wanted, natural = [], []
    for col in table.columns:
        texts = [_plain(c) for c in (col.header, *col._cells) if isinstance(c, str | Text)]
        natural.append(max([len(line) for t in texts for line in t.splitlines()] + [1]))
        if col.no_wrap:
            wanted.append(max(col.min_width or 0, natural[-1]))
            continue
        words = [len(word) for t in texts for word in t.split()]
        wanted.append(max(col.min_width or 0, min(max(words, default=0), cap)))
    padding = sum(table._get_padding_width(i) for i in range(len(table.columns)))
    room = 10**6 if width is None else width - padding - table._extra_width
    if sum(wanted) > room:
        return table
    widths = [max(n, w) for n, w in zip(natural, wanted, strict=True)]
    squeeze = sum(widths) > room  # rich's own shrinking would go below the minimums
    while sum(widths) > room:
        i = max(range(len(widths)), key=lambda k: widths[k] - wanted[k])
        widths[i] -= 1
    for col, least, fixed in zip(table.columns, wanted, widths, strict=True):
        if not col.no_wrap:
            col.min_width = least
        if squeeze:
            col.width = fixed
    return table


def _plain(cell: str | Text) -> str:
    if isinstance(cell, Text):
        return cell.plain
    try:
        return Text.from_markup(cell).plain
    except MarkupError:
        return cell


#: A verdict with a word longer than this (a run's id in the reason) is said in a note.
LONG_WORD = 20


def verdict_cell(verdict: str, notes: list[str]) -> str:
    """The verdict as the cell shows it: itself, or, when its reason holds a word too long
    for a column (a run's id), ``untrusted (note 2)`` with the whole verdict in ``notes``
    (``note 2: untrusted: variant run <id>: ...``), printed below the table; a verdict a
    row before it already put in a note (several metrics flagged for the same run) refers
    to that note instead of adding another."""
    text = _plain(verdict)
    if all(len(word) <= LONG_WORD for word in text.split()):
        return verdict
    said = [note.split(": ", 1)[1] for note in notes]
    if text not in said:
        notes.append(f"note {len(notes) + 1}: {text}")
    number = said.index(text) + 1 if text in said else len(notes)
    head = text.split(":")[0].split(" (")[0]
    return f"{escape(head)} (note {number})"


def split_columns(table: Table, width: int, keep: int = 2) -> list[Table]:
    """``table`` as one table, or, where its columns' minimum widths do not fit ``width``
    (a narrow terminal), as several: each repeats the first ``keep`` columns (the run and
    its status) and takes as many of the rest as fit, so no column is dropped or squeezed
    to nothing. The title goes on the first, the caption on the last."""
    padding = 2  # a space either side of each cell
    need = [max(c.width or 0, c.min_width or 0, 4) + padding + 1 for c in table.columns]
    if sum(need) + 1 <= width:
        return [table]
    groups: list[list[int]] = []
    for i in range(keep, len(table.columns)):
        if groups and sum(need[j] for j in [*range(keep), *groups[-1], i]) + 1 <= width:
            groups[-1].append(i)
        else:
            groups.append([i])
    parts = []
    for n, group in enumerate(groups):
        part = Table(
            title=table.title if n == 0 else None,
            title_justify=table.title_justify,
            caption=table.caption if n == len(groups) - 1 else None,
            box=table.box,
        )
        for i in [*range(keep), *group]:
            col = dataclasses.replace(table.columns[i])
            col._cells = list(table.columns[i]._cells)
            col._index = len(part.columns)
            part.columns.append(col)
        part.rows = list(table.rows)
        parts.append(part)
    return parts
