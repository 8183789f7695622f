"""Helpers for the ``vlab`` commands' rich tables: no id or word split across lines."""

from __future__ import annotations

from typing import Any

from rich.errors import MarkupError
from rich.markup import escape
from rich.table import Table
from rich.text import Text


def keep_words(table: Table, cap: int = 30) -> Table:
    """``table`` with no word split across lines: each column at least as wide as its
    longest word (header included; up to ``cap``, past which a word folds), so cells wrap
    at spaces only. rich shrinks the widest columns first when a table is too wide, and
    would fold an id or a word there; a column marked ``no_wrap`` (an id) is left as it
    is."""
    for col in table.columns:
        if col.no_wrap:
            continue
        cells: list[Any] = [col.header, *col._cells]
        words = [
            len(word)
            for cell in cells
            if isinstance(cell, str | Text)
            for word in _plain(cell).split()
        ]
        col.min_width = max(col.min_width or 0, min(max(words, default=0), cap))
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
    (``note 2: untrusted: variant run <id>: ...``), printed below the table."""
    text = _plain(verdict)
    if all(len(word) <= LONG_WORD for word in text.split()):
        return verdict
    notes.append(f"note {len(notes) + 1}: {text}")
    head = text.split(":")[0].split(" (")[0]
    return f"{escape(head)} (note {len(notes)})"
