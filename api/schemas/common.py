"""What the bodies of several resources share: a page of items, ISO 8601 date-times."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Generic, TypeVar

from pydantic import BaseModel, BeforeValidator

T = TypeVar("T")


def _iso_only(value: Any) -> Any:
    """Refuse numbers (and numeric strings) as date-times: the API takes ISO 8601 text, as
    its OpenAPI description says; pydantic alone reads ``0.5`` as a Unix time."""
    if isinstance(value, int | float) or (
        isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+(\.\d*)?\s*", value)
    ):
        raise ValueError("expected an ISO 8601 date-time, e.g. 2026-12-01T09:00:00Z")
    return value


#: A date-time given as ISO 8601 text only.
IsoDatetime = Annotated[datetime, BeforeValidator(_iso_only)]


class Page(BaseModel, Generic[T]):
    """One page of a list. ``total`` is how many items match (``total_estimated``: an
    estimate, where counting exactly would be slow); the next page is ``offset + limit``
    or, where the list gives one, ``next`` (its URL, with an opaque keyset ``cursor``:
    the same cost at any depth; None on the last page)."""

    items: list[T]
    total: int
    limit: int
    offset: int
    total_estimated: bool = False
    next_cursor: str | None = None
    next: str | None = None
