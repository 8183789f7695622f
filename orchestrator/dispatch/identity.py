"""An orchestrator's identity on its ``VLAB_HOME``: a lock file held while it lives.

Each orchestrator holds an ``flock`` on ``<home>/orchestrators/<id>.lock`` for as
long as its process lives, so a lock anyone can take is a dead one's, however it
died (``kill -9`` included): the reconcile loop's start-up turn takes over the runs
of those at once, without waiting for their heartbeat to go stale.
"""

from __future__ import annotations

import contextlib
import fcntl
from dataclasses import dataclass
from pathlib import Path
from typing import IO


@dataclass
class Identity:
    """The lock files of one home's orchestrators, seen from the one named ``orchestrator_id``."""

    home: Path
    orchestrator_id: str
    _held: IO[str] | None = None

    @property
    def folder(self) -> Path:
        return self.home / "orchestrators"

    @property
    def held(self) -> bool:
        return self._held is not None

    def hold(self) -> None:
        """Hold ``<home>/orchestrators/<id>.lock`` (``flock``) for as long as this process
        lives. Idempotent."""
        if self._held is not None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        # locked before it gets its name: no one ever sees it free while this one lives
        tmp = self.folder / f".{self.orchestrator_id}.tmp"
        fh = tmp.open("a+")
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        tmp.rename(self.folder / f"{self.orchestrator_id}.lock")
        self._held = fh

    def dead_predecessors(self) -> list[str]:
        """Ids of this home's orchestrators that died: their lock can be taken."""
        dead: list[str] = []
        folder = self.folder
        for path in sorted(folder.glob("*.lock")) if folder.is_dir() else []:
            if path.stem == self.orchestrator_id:
                continue
            with path.open("a+") as fh:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # alive
                dead.append(path.stem)
        return dead

    def forget(self, orchestrator_id: str) -> None:
        """Remove a dead orchestrator's lock file (its runs were taken over)."""
        with contextlib.suppress(OSError):
            (self.folder / f"{orchestrator_id}.lock").unlink()

    def release(self) -> None:
        """Give up this orchestrator's identity: its lock file goes."""
        if self._held is None:
            return
        self.forget(self.orchestrator_id)
        self._held.close()
        self._held = None
