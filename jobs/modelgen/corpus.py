"""An offline English text corpus shipped with the package, and seeded ways to draw from it.

The text lives in ``jobs/data/corpus.txt`` (about 250 KB of ASCII prose: Python
standard-library docstrings and common licence texts, built by ``scripts/build_corpus.py``),
one paragraph per line, paragraphs separated by a blank line. It feeds tokenizer training in
:mod:`jobs.modelgen.generator` and the request texts of :mod:`jobs.load.workload`, so neither ever
needs a download.

Every sampling helper takes a :class:`random.Random` (build one with ``random.Random(seed)``)
and draws only from it, so the same generator state always gives the same text.
"""

from __future__ import annotations

import random
import re
from functools import lru_cache
from importlib import resources

#: Name of the corpus file inside the ``jobs/data`` package-data folder.
CORPUS_FILE = "corpus.txt"

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")


@lru_cache(maxsize=1)
def load_corpus() -> str:
    """Return the whole corpus text (ASCII, paragraphs separated by ``"\\n\\n"``).

    Raises:
        FileNotFoundError: if the package data file is missing (a broken install).
    """
    return resources.files("jobs").joinpath("data", CORPUS_FILE).read_text(encoding="ascii")


@lru_cache(maxsize=1)
def _paragraphs() -> tuple[str, ...]:
    return tuple(p.strip() for p in load_corpus().split("\n\n") if p.strip())


@lru_cache(maxsize=1)
def _sentences() -> tuple[str, ...]:
    out: list[str] = []
    for para in _paragraphs():
        out.extend(s.strip() for s in _SENTENCE_END.split(para) if len(s.strip()) >= 20)
    return tuple(out)


def paragraphs() -> list[str]:
    """Return the corpus paragraphs in file order (each a single line without newlines)."""
    return list(_paragraphs())


def sentences() -> list[str]:
    """Return the corpus sentences in file order (split after ``.``/``!``/``?``; >= 20 chars)."""
    return list(_sentences())


def sample_passage(rng: random.Random, min_chars: int) -> str:
    """Draw a passage of consecutive paragraphs with at least ``min_chars`` characters.

    The passage starts at a paragraph chosen with ``rng`` and continues with the following
    paragraphs (wrapping around at the end of the corpus, so any length can be served;
    passages longer than the corpus repeat it). Paragraphs are joined with ``"\\n\\n"``.

    Args:
        rng: the random generator to draw the start from (one ``randrange`` call).
        min_chars: minimum length of the result in characters; ``<= 0`` gives ``""``.

    Returns:
        The passage; it may exceed ``min_chars`` by up to one paragraph.
    """
    if min_chars <= 0:
        return ""
    paras = _paragraphs()
    i = rng.randrange(len(paras))
    parts: list[str] = []
    size = 0
    while size < min_chars:
        para = paras[i % len(paras)]
        parts.append(para)
        size += len(para) + (2 if len(parts) > 1 else 0)
        i += 1
    return "\n\n".join(parts)


def sample_sentences(rng: random.Random, count: int) -> list[str]:
    """Draw ``count`` sentences independently and uniformly (with replacement) using ``rng``.

    Raises:
        ValueError: if ``count`` is negative.
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    sents = _sentences()
    return [sents[rng.randrange(len(sents))] for _ in range(count)]


def sample_text(rng: random.Random, min_chars: int) -> str:
    """Draw random sentences (joined by a space) until the text has at least ``min_chars`` chars.

    Unlike :func:`sample_passage`, consecutive sentences come from unrelated places of the
    corpus, so two draws almost never share a beginning. ``min_chars <= 0`` gives ``""``.
    """
    parts: list[str] = []
    size = 0
    while size < min_chars:
        (sent,) = sample_sentences(rng, 1)
        parts.append(sent)
        size += len(sent) + (1 if len(parts) > 1 else 0)
    return " ".join(parts)
