"""What a run left on disk, for a run whose measurements are not in the database yet:
its engine log, and the journal of its request records and ``/metrics`` samples."""

from __future__ import annotations

from pathlib import Path

from jobs.run.journal import JournalContents, read_journal
from orchestrator.core.models import Run


def _log_path(run: Run) -> str | None:
    """``engine_info["log_path"]`` (noted at launch) when it names a ``*.log`` file."""
    path = (run.engine_info or {}).get("log_path")
    return path if isinstance(path, str) and path.endswith(".log") else None


def engine_log_from_disk(run: Run) -> str | None:
    """The engine log file of ``run`` (``engine_info["log_path"]``, noted at launch), for
    a run whose log is not in the database (still running, or lost before its end);
    None when there is none. Only ``*.log`` files are read."""
    path = _log_path(run)
    if path is None:
        return None
    try:
        return Path(path).read_bytes().decode("utf-8", "replace")
    except OSError:
        return None


def journal_from_disk(run: Run) -> JournalContents | None:
    """The run's journal beside its engine log (:mod:`jobs.run.journal`; every run of a batch
    shares it, each line names its run), when the log path is known; the files are
    there only when the run's first node is this machine (nothing found otherwise)."""
    path = _log_path(run)
    return None if path is None else read_journal(path)
