"""Where the service's output goes: vlab's own lines on the terminal, everything in a log
file under ``VLAB_HOME``.

The service commands (``vlab up``, ``serve``, ``orchestrate``, ``migrate``, ``demo``) call
:func:`configure` first. Without ``--verbose``:

- the terminal shows the records of vlab's own loggers (``orchestrator``, ``api``,
  ``jobs``, ``web``) at ``terminal_level``, and the API server's (uvicorn's) errors;
  its start-up lines and one access line per request go to the log file only (the
  command prints where it listens);
- every record (third-party ones too: Ray, pgserver, alembic, urllib3, ...) and every
  Python warning (:func:`logging.captureWarnings`) goes to ``<home>/logs/vlab.log``;
- what is written to file descriptor 2 below Python (Ray's C++ core, the subprocesses
  this process starts, Python's own fatal-error output) goes to that file too: fd 2 is
  pointed at it, and Python's ``sys.stderr`` at a copy of the terminal's fd 2, so
  vlab's own error lines (``error: ...``, tracebacks) still reach the terminal;
- transformers' advisory warnings are off (``TRANSFORMERS_VERBOSITY=error``,
  ``TRANSFORMERS_NO_ADVISORY_WARNINGS=1``, unless set already), in this process and in
  those it starts.

Either way MLflow does not install a stderr handler of its own when imported
(``MLFLOW_CONFIGURE_LOGGING=false``, unless set already): its records (``Creating
initial MLflow database tables...``) go where every library's go.

With ``--verbose`` the terminal shows every record at DEBUG for vlab's loggers and INFO
for the others, and file descriptor 2 is left alone. With ``VLAB_LOG_TO_CONSOLE=true``
(:data:`CONSOLE_ENV`; the container image sets it: ``docker logs`` and ``kubectl logs``
read a container's stdout and stderr, not a file inside it) every record goes to the
terminal too, at INFO, and file descriptor 2 is left alone: Ray's, Postgres's and the
engines' output reach the container's log; vlab's loggers stay at INFO (``--verbose``
adds their DEBUG lines). The log file is written either way. The configuration is
:func:`logging.config.dictConfig`'s.
"""

from __future__ import annotations

import contextlib
import logging
import logging.config
import os
import sys
from pathlib import Path
from typing import Any

from orchestrator.cli.specfile import CliError

#: The top-level logger names shown on the terminal when not verbose.
OURS = ("orchestrator", "api", "jobs", "web", "__main__")
#: The API server's loggers: on the terminal from this level (its errors: a failed
#: start, an exception in a request), below it (start-up lines, access lines) in the file.
SERVER = ("uvicorn",)
SERVER_TERMINAL_LEVEL = logging.ERROR
#: The log file, under the home.
LOG_FILE = Path("logs") / "vlab.log"
#: Rotate the log file at this size, keeping this many old ones.
LOG_MAX_BYTES = 20 * 1024 * 1024
LOG_BACKUPS = 3
#: Loggers that install a handler of their own on import (and stop propagating), reset
#: by :func:`adopt_library_loggers` once their library is loaded.
SELF_HANDLED = ("ray", "transformers")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: The environment variable that sends every record and fd 2 to the terminal (stderr), as
#: a container's log wants; read here, before the settings, by :func:`to_console`.
CONSOLE_ENV = "VLAB_LOG_TO_CONSOLE"
#: The values of :data:`CONSOLE_ENV` that mean yes / no (case-insensitive).
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("", "0", "false", "no", "off")

#: The log file this process writes (set by :func:`configure`; None: not configured).
_log_path: Path | None = None
_verbose = False
_console = False


class ConsoleSettingError(CliError):
    """:data:`CONSOLE_ENV` holds neither a yes nor a no (one line, exit code 2)."""


def to_console() -> bool:
    """Whether :data:`CONSOLE_ENV` asks for everything on the terminal; a value that is
    neither yes nor no raises :class:`ConsoleSettingError` (a typo must not silently
    hide a container's log)."""
    value = os.environ.get(CONSOLE_ENV, "").strip().lower()
    if value in TRUE_WORDS:
        return True
    if value in FALSE_WORDS:
        return False
    raise ConsoleSettingError(
        f"invalid setting {CONSOLE_ENV}: {os.environ[CONSOLE_ENV]!r} is neither true nor "
        f"false ({', '.join(TRUE_WORDS)} / {', '.join(w for w in FALSE_WORDS if w)})"
    )


class OursOnly(logging.Filter):
    """Pass the records of vlab's own loggers (:data:`OURS`), and the API server's
    (:data:`SERVER`) from :data:`SERVER_TERMINAL_LEVEL`."""

    def filter(self, record: logging.LogRecord) -> bool:
        top = record.name.split(".", 1)[0]
        return top in OURS or (top in SERVER and record.levelno >= SERVER_TERMINAL_LEVEL)


def log_path(home: Path) -> Path:
    """The log file of the service commands run on ``home``."""
    return home.resolve() / LOG_FILE


def configured_log_path() -> Path | None:
    """The log file :func:`configure` set up in this process, or None."""
    return _log_path


def logging_config(
    path: Path, *, verbose: bool, terminal_level: int, console: bool = False
) -> dict[str, Any]:
    """The :func:`logging.config.dictConfig` configuration (see the module's docstring);
    ``console``: every logger's records on the terminal (:data:`CONSOLE_ENV`)."""
    terminal: dict[str, Any] = {
        "class": "logging.StreamHandler",
        "stream": "ext://sys.stderr",
        "formatter": "plain",
        "level": logging.DEBUG if verbose else terminal_level,
    }
    if not verbose and not console:
        terminal["filters"] = ["ours"]
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"ours": {"()": OursOnly}},
        "formatters": {"plain": {"format": FORMAT}},
        "handlers": {
            "terminal": terminal,
            "file": {
                "class": "logging.handlers.RotatingFileHandler",
                "filename": str(path),
                "maxBytes": LOG_MAX_BYTES,
                "backupCount": LOG_BACKUPS,
                "encoding": "utf-8",
                "formatter": "plain",
                "level": logging.DEBUG,
            },
        },
        # vlab's own loggers at DEBUG when verbose; everything else at INFO
        "loggers": {
            name: {"level": logging.DEBUG if verbose else logging.INFO}
            for name in ("orchestrator", "api", "jobs", "web")
        },
        "root": {"level": logging.INFO, "handlers": ["terminal", "file"]},
    }


def configure(
    home: Path, *, verbose: bool = False, terminal_level: int = logging.INFO
) -> Path | None:
    """Configure logging for a service command on ``home``; returns the log file's path.
    ``terminal_level``: the least level of vlab's records shown on the terminal.

    In a process whose ``sys.stderr`` is not file descriptor 2 (the command run inside
    another program: a test runner's ``CliRunner`` captures it), nothing is changed and
    None is returned: that program's logging is its own."""
    global _log_path, _verbose, _console
    if _log_path is not None:
        return _log_path
    if not _stderr_is_fd2():
        return None
    console = to_console()
    path = log_path(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    # MLflow's records through the root's handlers, not a stderr handler of its own
    os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")
    if not verbose:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if not verbose and not console:
        _point_fd2_at(path)
    logging.config.dictConfig(
        logging_config(path, verbose=verbose, terminal_level=terminal_level, console=console)
    )
    logging.captureWarnings(True)
    _log_path, _verbose, _console = path, verbose, console
    adopt_library_loggers()
    return path


def adopt_library_loggers() -> None:
    """Make the loggers of :data:`SELF_HANDLED` propagate to the root's handlers instead of
    their own (Ray and transformers install a stderr handler when they are imported);
    call after importing them. No-op unless :func:`configure` ran in this process."""
    if _log_path is None:
        return
    for name in SELF_HANDLED:
        if name not in sys.modules:
            continue  # not loaded: nothing installed yet (called again once it is)
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        logger.propagate = True


def _stderr_is_fd2() -> bool:
    """Whether ``sys.stderr`` writes to file descriptor 2 (not a capture of it)."""
    try:
        return sys.stderr is not None and sys.stderr.fileno() == 2
    except (AttributeError, ValueError, OSError):
        return False


def _point_fd2_at(path: Path) -> None:
    """Point file descriptor 2 at the log file (appending) and ``sys.stderr`` at a copy
    of what fd 2 was (the terminal); no-op when ``sys.stderr`` is not fd 2 (a test
    runner's capture) or fd 2 was pointed already."""
    if _log_path is not None or not _stderr_is_fd2():
        return
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    terminal = os.dup(2)
    log_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.dup2(log_fd, 2)
    finally:
        os.close(log_fd)
    os.set_inheritable(terminal, False)
    old = sys.stderr
    sys.stderr = os.fdopen(
        terminal,
        "w",
        buffering=1,
        encoding=getattr(old, "encoding", None) or "utf-8",
        errors="backslashreplace",
    )


def is_verbose() -> bool:
    """Whether :func:`configure` showed everything on the terminal: ``verbose``, or
    :data:`CONSOLE_ENV` (no line then points at the log file for what is missing)."""
    return _verbose or _console
