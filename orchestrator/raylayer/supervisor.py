"""The run supervisor and the engine parts of multi-node launches.

One supervisor per batch of runs that share a vLLM server (usually one run),
a named actor (``vlab-run-<first run id>`` in namespace ``vlab``) placed in
the batch's placement group, on the node of rank 0. ``start()`` begins the
job in a thread and returns at once; ``result()`` blocks until the job ends
and returns one :class:`RunResult` per run (so a restarted orchestrator can
re-attach by name and wait again); ``progress()`` and ``cancel()`` answer
while the job runs (the actor allows concurrent calls).

Multi-node (``job.nodes`` has two or more parts): before the runs start, the
supervisor picks the rendezvous port on its own node and starts one
:class:`EnginePart` actor per follower node, in a bundle on that node, each
running ``vllm serve ... --nnodes N --node-rank r --master-addr <rank 0 IP>
--master-port P --headless`` with the same engine arguments; rank 0's
process is the batch's own server (it serves the API). While the runs go,
a watcher checks every part; if a part's process exits or its node is lost,
the runs are stopped and fail with that node's error lines. Every part is
stopped when the job ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path
from typing import Any

import ray

from jobs.schemas import BatchJob, EngineLaunch, NodePart, Progress, RunResult

log = logging.getLogger(__name__)

NAMESPACE = "vlab"

# Ray sets these for its workers; the engine must pick its own thread layout.
_RAY_WORKER_ENV = ("OMP_NUM_THREADS",)

#: Seconds between checks of the follower parts of a multi-node launch.
PART_CHECK_INTERVAL_S = 2.0


def actor_name(run_id: str) -> str:
    return f"vlab-run-{run_id}"


def part_launch(
    launch: EngineLaunch, part: NodePart, nnodes: int, addr: str, port: int
) -> EngineLaunch:
    """``launch`` for ``part`` of an ``nnodes``-node launch with rendezvous ``addr:port``."""
    log_path = Path(launch.log_path)
    if part.rank > 0:
        log_path = log_path.with_name(f"{log_path.stem}-rank{part.rank}{log_path.suffix}")
    return launch.model_copy(
        update={
            "nnodes": nnodes,
            "node_rank": part.rank,
            "master_addr": addr,
            "master_port": port,
            "env": {**launch.env, **part.env},
            "log_path": str(log_path),
        }
    )


class EnginePart:
    """A follower node's headless vLLM process of a multi-node launch."""

    def __init__(self, launch: EngineLaunch) -> None:
        from jobs.engine import EngineServer

        for var in _RAY_WORKER_ENV:
            os.environ.pop(var, None)
        self.launch = launch
        self.server = EngineServer(launch)

    def start(self) -> dict[str, Any]:
        """Start the process; returns its command and process group."""
        self.server.start()
        return {"command": list(self.server.command), "pgid": self.server.pgid}

    def alive(self) -> bool:
        return self.server.returncode is None

    def error_lines(self, n: int = 40) -> list[str]:
        return self.server.error_lines(n)

    def log_text(self) -> str:
        return self.server.log_text()

    def stop(self) -> int | None:
        return self.server.stop()


class RunSupervisor:
    """Runs :func:`jobs.runner.execute_batch` for one :class:`BatchJob`."""

    def __init__(self, job: BatchJob) -> None:
        self.job = job
        self._cancel = threading.Event()
        self._done = threading.Event()
        self._progress: dict[str, Any] = {"phase": "starting"}
        self._result: list[RunResult] | None = None
        self._thread: threading.Thread | None = None
        self._parts: list[tuple[NodePart, Any]] = []
        self._part_failure: str | None = None
        self._parts_info: list[dict[str, Any]] = []

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
            job = self._start_parts() if len(self.job.nodes) > 1 else self.job
            if self._part_failure is not None:
                raise RuntimeError(self._part_failure)
            watcher = None
            if self._parts:
                watcher = threading.Thread(target=self._watch_parts, daemon=True)
                watcher.start()
            self._result = execute_batch(job, self._on_progress, self._cancel)
            if self._part_failure is not None:
                self._result = [
                    r.model_copy(update={"status": "failed", "error": self._part_failure})
                    if r.status != "succeeded"
                    else r
                    for r in self._result
                ]
            if self._parts_info:
                for r in self._result:
                    r.engine_info["node_parts"] = self._parts_info
        except BaseException as exc:  # noqa: BLE001 - reported as the runs' error
            self._result = [
                RunResult(run_id=seg.run_id, status="failed", error=f"supervisor error: {exc}")
                for seg in self.job.segments
            ]
        finally:
            self._stop_parts()
            self._done.set()

    # -- multi-node ----------------------------------------------------------------------

    def _start_parts(self) -> BatchJob:
        """Start every follower's headless part; return the job for rank 0's server."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from jobs.engine import find_free_port

        nodes = sorted(self.job.nodes, key=lambda p: p.rank)
        addr = nodes[0].ip
        port = find_free_port("0.0.0.0")
        pg = ray.util.get_current_placement_group()
        self._progress = {"phase": "starting", "message": f"starting {len(nodes) - 1} node parts"}
        for part in nodes[1:]:
            launch = part_launch(self.job.launch, part, len(nodes), addr, port)
            actor = EnginePartActor.options(  # type: ignore[attr-defined]
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=part.bundle_index
                )
                if pg is not None
                else None,
            ).remote(launch)
            self._parts.append((part, actor))
            info = ray.get(actor.start.remote(), timeout=120)
            self._parts_info.append({"rank": part.rank, "node_id": part.node_id, **info})
        return self.job.model_copy(
            update={"launch": part_launch(self.job.launch, nodes[0], len(nodes), addr, port)}
        )

    def _watch_parts(self) -> None:
        from ray.exceptions import RayError

        while not self._done.wait(PART_CHECK_INTERVAL_S):
            for part, actor in self._parts:
                where = f"node rank {part.rank} ({part.ip}, Ray node {part.node_id[:12]})"
                try:
                    alive = ray.get(actor.alive.remote(), timeout=30)
                except RayError as exc:
                    self._fail_parts(f"{where} was lost: {type(exc).__name__}: {exc}"[:2000])
                    return
                if not alive:
                    try:
                        lines = ray.get(actor.error_lines.remote(), timeout=30)
                    except RayError:
                        lines = []
                    self._fail_parts(
                        f"the vLLM part on {where} exited\n--- its engine log (error lines) ---\n"
                        + "\n".join(lines)
                    )
                    return

    def _fail_parts(self, message: str) -> None:
        log.warning("multi-node launch failed: %s", message)
        self._part_failure = message
        self._cancel.set()

    def _stop_parts(self) -> None:
        from ray.exceptions import RayError

        for _, actor in self._parts:
            with contextlib.suppress(RayError):
                ray.get(actor.stop.remote(), timeout=60)
            with contextlib.suppress(RayError, ValueError):
                ray.kill(actor)

    # -- queries -------------------------------------------------------------------------

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
EnginePartActor = ray.remote(num_cpus=0, max_concurrency=4)(EnginePart)  # type: ignore[call-overload]
