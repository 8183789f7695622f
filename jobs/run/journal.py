"""An append-only journal of what a run measured, next to its engine log.

The runner (:mod:`jobs.run.runner`) hands every finished request's record and every
``/metrics`` sample to a :class:`Journal` the moment it has it; the journal writes one
JSON line per item to two files beside the engine log (``launch.log_path``):

- ``<stem>.records.jsonl``: ``{"run_id", "seq", "record": RequestRecord}``
- ``<stem>.samples.jsonl``: ``{"run_id", "seq", "sample": MetricSample}``

``seq`` counts the items of one run from 0 in the order they were handed in, the same
order in which the journal passes them on to its listeners (the run supervisor's
stream), so a reader can tell which of them a stream already delivered.

The files are truncated when a journal opens them and flushed to the operating system
at least every :data:`FLUSH_INTERVAL_S` seconds (a background thread), and on
:meth:`Journal.close`: an item is in the file, outside the process, within that bound
of being taken, whatever happens to the process afterwards (``kill -9`` or an
out-of-memory kill included; a crash of the machine is not covered, nothing is
``fsync``ed). Writing never fails a run: an error is logged once and counted.

:func:`read_journal` reads both files back (the orchestrator does when a run's
supervisor is lost). A line the process did not finish (it died mid-write: the file
ends without a newline) or that does not parse is skipped with a note, never an error.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel

from jobs.schemas import MetricSample, RequestRecord

logger = logging.getLogger(__name__)

#: Seconds at most between an item handed to the journal and its line in the file
#: (the flusher's period; a full write buffer goes out earlier).
FLUSH_INTERVAL_S = 0.5

RecordListener = Callable[[str, RequestRecord], None]
SampleListener = Callable[[str, MetricSample], None]


def journal_paths(log_path: str | Path) -> tuple[Path, Path]:
    """The records and samples journals of the engine log ``log_path``."""
    path = Path(log_path)
    return (
        path.with_name(f"{path.stem}.records.jsonl"),
        path.with_name(f"{path.stem}.samples.jsonl"),
    )


class Journal:
    """Writes one run batch's records and samples (see the module docstring).

    ``on_record`` / ``on_sample`` (optional) get every item right after it was
    written, in the caller's thread; their exceptions are logged and ignored. With
    ``log_path`` None nothing is written and the listeners still get every item.
    """

    def __init__(
        self,
        log_path: str | Path | None,
        on_record: RecordListener | None = None,
        on_sample: SampleListener | None = None,
    ) -> None:
        self.paths = journal_paths(log_path) if log_path else None
        self.on_record = on_record
        self.on_sample = on_sample
        self.errors = 0
        self._seq: dict[tuple[int, str], int] = {}
        self._files: list[IO[str]] | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._flusher: threading.Thread | None = None

    def record(self, run_id: str, record: RequestRecord) -> None:
        """Journal a finished request's record of run ``run_id``, then tell ``on_record``."""
        self._write(0, run_id, "record", record.model_dump_json(), self.on_record, record)

    def sample(self, run_id: str, sample: MetricSample) -> MetricSample:
        """Journal a ``/metrics`` sample of run ``run_id``, then tell ``on_sample``;
        returns ``sample``."""
        self._write(1, run_id, "sample", sample.model_dump_json(), self.on_sample, sample)
        return sample

    def _write(
        self,
        kind: int,
        run_id: str,
        key: str,
        body: str,
        listener: Callable[[str, Any], None] | None,
        item: Any,
    ) -> None:
        # the listener is told under the lock: it sees the items in ``seq`` order
        with self._lock:
            seq = self._seq.get((kind, run_id), 0)
            self._seq[(kind, run_id)] = seq + 1
            if self.paths is not None and not self._closed.is_set():
                line = f'{{"run_id":{json.dumps(run_id)},"seq":{seq},"{key}":{body}}}\n'
                try:
                    self._open()[kind].write(line)
                except (OSError, ValueError) as exc:
                    self._failed(exc)
            _tell(listener, run_id, item)

    def _open(self) -> list[IO[str]]:
        if self._files is None:
            assert self.paths is not None
            self.paths[0].parent.mkdir(parents=True, exist_ok=True)
            self._files = [p.open("w", encoding="utf-8") for p in self.paths]
            self._flusher = threading.Thread(target=self._flush_loop, name="journal", daemon=True)
            self._flusher.start()
        return self._files

    def _failed(self, exc: Exception) -> None:
        self.errors += 1
        if self.errors == 1:
            logger.warning("writing the run journal %s failed: %r", self.paths, exc)

    def flush(self) -> None:
        """Hand what was written to the operating system now."""
        with self._lock:
            for fh in [] if self._closed.is_set() else self._files or []:
                try:
                    fh.flush()
                except (OSError, ValueError) as exc:
                    self._failed(exc)

    def _flush_loop(self) -> None:
        while not self._closed.wait(FLUSH_INTERVAL_S):
            self.flush()

    def close(self) -> None:
        """Flush and close the files (idempotent); later items only reach the listeners."""
        self.flush()
        with self._lock:
            self._closed.set()
            for fh in self._files or []:
                try:
                    fh.close()
                except OSError as exc:
                    self._failed(exc)
        if self._flusher is not None and self._flusher is not threading.current_thread():
            self._flusher.join(timeout=5)


def _tell(listener: Callable[[str, Any], None] | None, run_id: str, item: Any) -> None:
    if listener is None:
        return
    try:
        listener(run_id, item)
    except Exception:
        logger.exception("journal listener failed")


@dataclass
class JournalContents:
    """What :func:`read_journal` found: per run, ``{seq: item}`` (``RequestRecord`` /
    ``MetricSample`` as dicts), and a note per line it skipped."""

    records: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)
    samples: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def read_journal(log_path: str | Path) -> JournalContents:
    """Read the journals of the engine log ``log_path`` (missing files: nothing found).

    Every line is validated (:class:`RequestRecord`, :class:`MetricSample`); a torn last
    line (no newline: the writer died mid-line) or a line that does not parse is
    skipped and noted; a repeated ``seq`` of a run keeps its first line.
    """
    found = JournalContents()
    kinds: list[tuple[str, type[BaseModel], dict[str, dict[int, dict[str, Any]]]]] = [
        ("record", RequestRecord, found.records),
        ("sample", MetricSample, found.samples),
    ]
    for path, (key, model, into) in zip(journal_paths(log_path), kinds, strict=True):
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            continue
        except OSError as exc:
            found.notes.append(f"{path.name}: not readable ({exc})")
            continue
        lines = data.split(b"\n")
        if lines[-1]:
            found.notes.append(
                f"{path.name}: torn last line skipped ({len(lines[-1])} bytes without a "
                "newline: the writer died mid-line)"
            )
        for number, line in enumerate(lines[:-1], start=1):
            try:
                doc = json.loads(line)
                run_id, seq = str(doc["run_id"]), int(doc["seq"])
                item = model.model_validate(doc[key]).model_dump()
            except (ValueError, KeyError, TypeError) as exc:
                found.notes.append(f"{path.name}: line {number} skipped ({exc!s:.200})")
                continue
            into.setdefault(run_id, {}).setdefault(seq, item)
    return found
