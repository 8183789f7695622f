"""A run's engine log on disk, for a run whose log is not in the database yet."""

from __future__ import annotations

from pathlib import Path

from orchestrator.core.models import Run


def engine_log_from_disk(run: Run) -> str | None:
    """The engine log file of ``run`` (``engine_info["log_path"]``, noted at launch), for
    a run whose log is not in the database (still running, or lost before its end);
    None when there is none. Only ``*.log`` files are read."""
    path = (run.engine_info or {}).get("log_path")
    if not isinstance(path, str) or not path.endswith(".log"):
        return None
    try:
        return Path(path).read_bytes().decode("utf-8", "replace")
    except OSError:
        return None
