"""A log's meaningful error lines: tracebacks, exception lines and their messages,
records that say a process died (and, for :func:`warning_and_error_lines`, every
record logged at ``WARNING`` or above). Never an HTTP access line (uvicorn's ``INFO:
127.0.0.1:45678 - "POST /v1/completions HTTP/1.1" 200 OK``): a request's log entry
says nothing about why an engine failed. Pure functions on text (no I/O); the lines an
engine error carries (:mod:`jobs.engine.server`). Re-exported by :mod:`jobs.signals.enginelog`.
"""

from __future__ import annotations

import re

__all__ = ["error_lines", "scan_error_lines", "warning_and_error_lines"]

# --- error lines ---------------------------------------------------------------------

_ERROR_MARKERS = re.compile(
    r"Traceback|Error|ERROR|Exception|CRITICAL|FATAL|Killed|error:|Not enough|not enough"
)
#: "(EngineCore pid=12) " worker prefixes vLLM puts before child-process lines.
_LOG_PREFIX = re.compile(r"^(\(\w+(?: \w+)* pid=\d+\)\s*)+")
#: The last line of a traceback: "pkg.SomeError: message" (or bare name).
_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)\b")
#: A log record's start: "INFO 11-29 ...", "WARNING ...", "[2026-..." or "2026-11-29 ...".
_LOG_RECORD = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b|^\[|^\d{4}-\d\d-\d\d")
#: At most this many lines after an exception line are kept as its message.
_EXC_MESSAGE_LINES = 12
#: A record logged below ERROR ("WARNING ...", "INFO: ..."): an error line only if it says
#: a process died or a resource ran out (vLLM's "engine core exited unexpectedly"), never
#: for the word "error" alone (vLLM's start-up warning "Found ulimit ... failed to
#: automatically increase with error ..." is no error of the engine).
_LOW_LEVEL_RECORD = re.compile(r"^(DEBUG|INFO|WARNING)\b")
_STRONG_WORDS = re.compile(
    r"died|exited unexpectedly|[Kk]illed|[Ff]atal|FATAL|CRITICAL|out of memory|"
    r"[Ss]egmentation fault|[Nn]ot enough"
)
#: A record logged at ``WARNING`` or above (kept by :func:`warning_and_error_lines`).
_WARNING_RECORD = re.compile(r"^(WARNING|WARN|ERROR|CRITICAL|FATAL)\b")
#: An HTTP access-log entry (uvicorn's, or the common log format's): never an error line.
_ACCESS_LINE = re.compile(r'"[A-Z]+ \S+ HTTP/[\d.]+"\s+\d{3}(?!\d)')


def scan_error_lines(text: str, n: int = 60, warnings: bool = False) -> tuple[list[str], bool]:
    """The last ``n`` meaningful lines of an engine log, and whether any is an error line.

    Meaningful: every line of a traceback (from ``Traceback`` to its exception
    line, and the message lines right after it up to the next log record:
    pydantic prints the field name and its error there) and lines that mention
    an error, except records logged below ``ERROR`` (``WARNING``, ``INFO``...)
    that do not say a process died or a resource ran out (with ``warnings``, every
    ``WARNING`` record is kept too); if there are none, the last ``n`` non-empty lines.
    HTTP access lines are left out everywhere (the fallback too). Progress bars
    (carriage-return rewrites) are reduced to their last state.
    """
    lines = [ln.rsplit("\r", 1)[-1].rstrip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln.strip() and not _ACCESS_LINE.search(ln)]
    keep: list[str] = []
    first_error: list[str] = []  # the first exception line of the log and its message
    collecting_first = False
    in_tb = False
    after_exc = 0  # lines after an exception line that still belong to its message
    for ln in lines:
        body = _LOG_PREFIX.sub("", ln)
        if after_exc and not _LOG_RECORD.match(body) and not body.startswith("Traceback"):
            keep.append(ln)
            if collecting_first:
                first_error.append(ln)
            after_exc -= 1
            continue
        after_exc = 0
        collecting_first = False
        if body.startswith("Traceback"):
            in_tb = True
        if (
            in_tb
            or (_ERROR_MARKERS.search(ln) and not _LOW_LEVEL_RECORD.match(body))
            or _STRONG_WORDS.search(body)
            or (warnings and _WARNING_RECORD.match(body))
        ):
            keep.append(ln)
        if _EXC_LINE.match(body):
            in_tb = False
            after_exc = _EXC_MESSAGE_LINES
            if not first_error:
                first_error.append(ln)
                collecting_first = True
    tail = (keep or lines)[-n:]
    if first_error and first_error[0] not in tail:
        # the root cause (often in the engine-core process) scrolled out of the tail
        return [
            "--- first error in the log ---",
            *first_error,
            "--- last error lines ---",
            *tail,
        ], True
    return tail, bool(keep)


def error_lines(text: str, n: int = 60) -> list[str]:
    """The last ``n`` meaningful lines of an engine log; see :func:`scan_error_lines`."""
    return scan_error_lines(text, n)[0]


def warning_and_error_lines(text: str, n: int = 60) -> list[str]:
    """The last ``n`` warning and error lines of ``text``: those of :func:`scan_error_lines`
    and every record logged at ``WARNING`` or above; never an ``INFO`` record (vLLM's
    stats lines) nor an access line. ``[]`` when there is none (no fallback)."""
    lines, found = scan_error_lines(text, n, warnings=True)
    return lines if found else []
