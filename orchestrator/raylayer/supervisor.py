"""The run supervisor: a plain class, wrapped with ``ray.remote`` in one place.

One supervisor per batch of runs that share a vLLM server (usually one run),
a named actor (``vlab-run-<first run id>`` in namespace ``vlab``) placed in
the batch's placement group. ``start()`` begins the job in a thread and
returns at once; ``result()`` blocks until the job ends and returns one
:class:`RunResult` per run (so a restarted orchestrator can re-attach by
name and wait again); ``progress()`` and ``cancel()`` answer while the job
runs (the actor allows concurrent calls).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import ray

from jobs.schemas import BatchJob, Progress, RunResult

NAMESPACE = "vlab"

# Ray sets these for its workers; the engine must pick its own thread layout.
_RAY_WORKER_ENV = ("OMP_NUM_THREADS",)


def actor_name(run_id: str) -> str:
    return f"vlab-run-{run_id}"


class RunSupervisor:
    """Runs :func:`jobs.runner.execute_batch` for one :class:`BatchJob`."""

    def __init__(self, job: BatchJob) -> None:
        self.job = job
        self._cancel = threading.Event()
        self._done = threading.Event()
        self._progress: dict[str, Any] = {"phase": "starting"}
        self._result: list[RunResult] | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        if self._thread is None:
            for var in _RAY_WORKER_ENV:
                os.environ.pop(var, None)
            self._thread = threading.Thread(target=self._work, name="run-job", daemon=True)
            self._thread.start()
        return True

    def _on_progress(self, progress: Progress) -> None:
        self._progress = progress.model_dump()

    def _work(self) -> None:
        from jobs.runner import execute_batch

        try:
            self._result = execute_batch(self.job, self._on_progress, self._cancel)
        except BaseException as exc:  # noqa: BLE001 - reported as the runs' error
            self._result = [
                RunResult(run_id=seg.run_id, status="failed", error=f"supervisor error: {exc!r}")
                for seg in self.job.segments
            ]
        finally:
            self._done.set()

    def result(self) -> list[RunResult]:
        self._done.wait()
        assert self._result is not None
        return self._result

    def progress(self) -> dict[str, Any]:
        return dict(self._progress)

    def cancel(self) -> bool:
        self._cancel.set()
        return True


RunSupervisorActor = ray.remote(num_cpus=0, max_concurrency=8)(RunSupervisor)  # type: ignore[call-overload]
