"""Patterns of volatile values in prompts: timestamps and dates, UUIDs, request / trace
ids, random ids, user names after a greeting or label, and the helpers that find the one
a character position falls in.
"""

from __future__ import annotations

import re

MONTH = (
    r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
    r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)"
)
WEEKDAY = r"(?:Mon|Tue(?:s)?|Wed(?:nes)?|Thu(?:rs)?|Fri|Sat(?:ur)?|Sun)(?:day)?"
TIME = (
    r"\d{1,2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:\s?(?:[AaPp][Mm]\b|[AaPp]\.[Mm]\.))?"
    r"(?:\s?(?:UTC|GMT|Z|[ECMP][SD]T|CES?T)\b)?"
)
TIMESTAMP = re.compile(
    "|".join(
        [
            rf"\b\d{{4}}-\d{{2}}-\d{{2}}(?:[T ]{TIME})?(?:Z|[+-]\d{{2}}:?\d{{2}})?",
            rf"\b(?:{WEEKDAY},?\s+)?{MONTH}\.?\s+\d{{1,2}}(?:st|nd|rd|th)?,?(?:\s+\d{{4}})?"
            rf"(?:,?\s+(?:at\s+)?{TIME})?",
            rf"\b(?:{WEEKDAY},?\s+)?\d{{1,2}}\s+{MONTH}\.?,?\s+\d{{4}}(?:,?\s+(?:at\s+)?{TIME})?",
            rf"\b\d{{1,2}}[/.]\d{{1,2}}[/.]\d{{2,4}}(?:,?\s+{TIME})?",
            rf"\b{TIME}",
            rf"\b{WEEKDAY}\b",
            r"\b1[5-9]\d{8}(?:\d{3})?\b",  # Unix time, seconds or milliseconds (2017..2033)
        ]
    )
)
UUID = re.compile(
    r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"
)
REQUEST_ID = re.compile(
    r"(?i:(?:request|req|trace|span|session|correlation|conversation|message|run|job)"
    r"[ _-]?id)\s*[:=#]?\s*[\"']?(?P<value>[A-Za-z0-9][A-Za-z0-9_.:-]{3,})"
    r"|\b(?P<prefixed>(?:req|request|trace|sess|chatcmpl|cmpl|call|msg|run|job|corr)"
    r"[-_][A-Za-z0-9][A-Za-z0-9_-]{5,})"
)
RANDOM_ID = re.compile(
    r"\b(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{8,}\b"
    r"|\b(?=[A-Za-z0-9]*\d)(?=[A-Za-z0-9]*[A-Za-z])[A-Za-z0-9]{20,}\b"
)
#: Text right before a user name, in three principled groups: a greeting or salutation
#: ("Hello ", "Dear "), a label naming a person ("User: ", "customer ", "the user's name
#: is ", "Mr. ") and a verb phrase whose object is the person ("talking to ", "I am ",
#: "on behalf of "). A capitalised word right after one is taken for a name.
PERSON = (
    r"(?:user|customer|client|patient|member|author|caller|student|guest|visitor|contact"
    r"|sender|recipient|employee|agent|applicant|buyer|owner)"
)
NAME_CUE = re.compile(
    r"(?:\b(?:hi|hello|hey|dear|greetings|welcome(?: back)?|thanks|thank you"
    r"|good (?:morning|afternoon|evening))[,!]?\s+(?:(?:this is|it's|it is)\s+)?"
    rf"|\b(?:{PERSON}(?:'s)?\s*(?:(?:first |last |full |display |user ?)?name)?"
    r"|(?:first |last |full |display |user ?)?name)\s*(?:[:=]|\bis\b)\s*"
    rf"|\b{PERSON}\s+(?:named\s+|called\s+)?"
    r"|\b(?:mr|mrs|ms|miss|mx|dr|prof)\.?\s+"
    r"|\bI am\s+|\bI'm\s+|\b(?:called|named)\s+"
    r"|\b(?:talking|speaking|chatting|writing|replying|responding)\s+(?:to|with)\s+"
    r"|\b(?:assisting|helping|serving|addressing|on behalf of)\s+)$",
    re.IGNORECASE,
)
NAME = re.compile(r"[A-Z][a-z]+(?:[-'][A-Z]?[a-z]+)*")
#: A name of up to three capitalised words ("Alice", "Mary-Jane O'Neil").
FULL_NAME = re.compile(
    r"[A-Z][a-z]+(?:[-'][A-Z]?[a-z]+)*(?: [A-Z][a-z]+(?:[-'][A-Z]?[a-z]+)*){0,2}"
)
LABELLED_HANDLE = re.compile(r"(?:user ?name|login|handle)\s*[:=]\s*$", re.IGNORECASE)


def full_name_at(s: str, start: int) -> tuple[int, int]:
    """The name (up to three capitalised words) that starts at ``start`` of ``s``."""
    m = FULL_NAME.match(s, start)
    return (start, m.end()) if m else (start, start)


def match_at(rx: re.Pattern[str], text: str, pos: int) -> tuple[int, int] | None:
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


def word_at(text: str, pos: int) -> tuple[int, int]:
    """The word (letters, digits, ``-_'``) around character ``pos`` of ``text``."""
    a = pos
    while a > 0 and (text[a - 1].isalnum() or text[a - 1] in "-_'."):
        a -= 1
    b = pos
    while b < len(text) and (text[b].isalnum() or text[b] in "-_'"):
        b += 1
    return a, b


#: A calendar date (not a bare time or weekday), as templates write them.
TEMPLATE_DATE = re.compile(
    rf"\b(?:\d{{4}}-\d{{2}}-\d{{2}}"
    rf"|(?:{WEEKDAY},?\s+)?{MONTH}\.?\s+\d{{1,2}}(?:st|nd|rd|th)?,?\s+\d{{4}}"
    rf"|(?:{WEEKDAY},?\s+)?\d{{1,2}}\s+{MONTH}\.?,?\s+\d{{4}}"
    r"|\d{1,2}[/.]\d{1,2}[/.]\d{4})(?!\d)"
)
