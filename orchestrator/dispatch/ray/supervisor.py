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
a watcher checks every part; if any process of a part's engine exits (once
the server is healthy, every process of each node's group is watched) or its
node is lost, the runs are stopped and fail with that node's error lines.
Every part is stopped when the job ends.

Every request record and every ``/metrics`` sample is kept in the supervisor as
soon as it was taken; ``records(since)`` and ``samples(since)`` hand out the new
ones, and the dispatcher writes them to the database every tick while the run goes.
Before that, the runner wrote each to the run's journal beside the engine log
(:mod:`jobs.run.journal`, on this node's disk within half a second), which the
dispatcher reads back when this supervisor dies (``kill -9``, an out-of-memory kill)
or the orchestrator is lost: what was measured survives both.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from jobs.engine.command import find_free_port
from jobs.engine.queries import resolve_model
from jobs.engine.server import EngineError, EngineServer, EngineStartError
from jobs.run.runner import execute_batch
from jobs.schemas import (
    BatchJob,
    EngineLaunch,
    MetricSample,
    NodePart,
    Progress,
    RequestRecord,
    RunResult,
)
from jobs.signals.gpus import (
    GpuReader,
    gpu_sample_values,
    resolve_visible,
    summarize_gpu_samples,
    visible_devices,
)

log = logging.getLogger(__name__)

NAMESPACE = "vlab"

# Ray sets these for its workers; the engine must pick its own thread layout.
_RAY_WORKER_ENV = ("OMP_NUM_THREADS",)

#: Seconds between checks of the follower parts of a multi-node launch.
PART_CHECK_INTERVAL_S = 1.0


def actor_name(run_id: str) -> str:
    return f"vlab-run-{run_id}"


def part_launch(
    launch: EngineLaunch, part: NodePart, nnodes: int, addr: str, port: int
) -> EngineLaunch:
    """``launch`` for ``part`` of an ``nnodes``-node launch with rendezvous ``addr:port``
    (with the part's own engine python, when it has one)."""
    log_path = Path(launch.log_path)
    if part.rank > 0:
        log_path = log_path.with_name(f"{log_path.stem}-rank{part.rank}{log_path.suffix}")
    return launch.model_copy(
        update={
            "engine_python": part.engine_python or launch.engine_python,
            "nnodes": nnodes,
            "node_rank": part.rank,
            "master_addr": addr,
            "master_port": port,
            "env": {**launch.env, **part.env},
            "log_path": str(log_path),
        }
    )


def ray_executor_launch(launch: EngineLaunch, pg: Any) -> EngineLaunch:
    """``launch`` for vLLM's Ray executor inside the run's own placement group ``pg``.

    vLLM (``vllm/v1/executor/ray_utils.py``, ``initialize_ray_cluster``) uses the
    placement group it finds with ``ray.util.get_current_placement_group()`` and
    creates a second one only when there is none; a second group would wait forever
    for the GPUs our group holds. ``vllm serve`` runs as a plain process (a new Ray
    driver), where that call returns ``None``, so the launcher
    (:mod:`jobs.launcher.vllm_launcher`) answers it with the group named by
    ``VLAB_RAY_PLACEMENT_GROUP_ID`` in every vLLM process. ``RAY_ADDRESS`` makes
    vLLM join this cluster instead of starting its own. The group has one-GPU
    bundles, as vLLM requires ("Placement group bundle cannot have more than 1 GPU").
    """
    context = ray.get_runtime_context()
    env = {
        **launch.env,
        "RAY_ADDRESS": str(context.gcs_address),
        RAY_PG_ENV: pg.id.hex(),
    }
    return launch.model_copy(update={"executor": "ray", "env": env, "nnodes": 1})


#: Environment variable naming the run's placement group for vLLM's Ray executor.
RAY_PG_ENV = "VLAB_RAY_PLACEMENT_GROUP_ID"


def held_devices(rank: int = 0, ranks_per_node: int | None = None) -> dict[str, Any]:
    """The GPUs this process holds through Ray, as the engine it starts will see them.

    Returns ``{"node_rank", "node_id", "cuda_visible_devices" (the variable as Ray
    set it, None when unset), "ray_gpu_ids" (Ray's accelerator ids), "gpus": [{"index"
    (physical), "uuid", "name", "memory_total_mib", "local_rank", "rank" (vLLM's
    global rank, None for a held GPU vLLM does not use)}], "telemetry" (``"nvml"``,
    ``"nvidia-smi"`` or None), "note"}``. On a CPU node ``gpus`` is empty with a note.
    """
    context = ray.get_runtime_context()
    ray_ids = [str(i) for i in (context.get_accelerator_ids() or {}).get("GPU", [])]
    entries = visible_devices()
    info: dict[str, Any] = {
        "node_rank": rank,
        "node_id": context.get_node_id(),
        "cuda_visible_devices": None if entries is None else ",".join(entries),
        "ray_gpu_ids": ray_ids,
        "gpus": [],
        "telemetry": None,
        "note": "",
    }
    if not ray_ids:
        info["note"] = "this process holds no GPU through Ray (CPU device kind)"
        return info
    reader = GpuReader()
    try:
        info["telemetry"] = reader.source
        readings: list[Any] = []
        # one read again: a read that failed once (an nvidia-smi call past its timeout
        # on a loaded node) must not leave the run's GPUs without their UUIDs
        for _ in range(2 if reader.source else 0):
            readings = resolve_visible(reader.devices(), entries or [])
            if len(readings) >= len(entries or []):
                break
    finally:
        reader.close()
    known = {r.index: r for r in readings}
    per_node = ranks_per_node if ranks_per_node is not None else len(entries or [])
    for local, entry in enumerate(entries or []):
        reading = known.get(int(entry)) if entry.isdigit() else None
        if reading is None:
            reading = next((r for r in readings if r.uuid.startswith(entry)), None)
        info["gpus"].append(
            {
                "index": reading.index if reading else (int(entry) if entry.isdigit() else None),
                "uuid": reading.uuid if reading else None,
                "name": reading.name if reading else None,
                "memory_total_mib": reading.memory_total_mib if reading else None,
                "local_rank": local,
                "rank": rank * per_node + local if local < per_node else None,
            }
        )
    if reader.source is None or len(readings) < len(entries or []):
        info["note"] = f"GPU UUIDs unknown: {reader.note}"
    return info


class GpuTelemetry:
    """Reads the GPUs this process holds for vLLM (``CUDA_VISIBLE_DEVICES``; the first
    ``used`` of them when the node holds more than vLLM computes on, as with exclusive
    nodes: idle reserved GPUs are not the run's energy)."""

    def __init__(self, used: int | None = None) -> None:
        self.reader = GpuReader()
        entries = visible_devices() or []
        self.entries = entries[:used] if used is not None else entries
        self.available = self.reader.source is not None and bool(self.entries)

    def read(self) -> list[Any]:
        """This node's held GPUs, in ``CUDA_VISIBLE_DEVICES`` order (``GpuReading``)."""
        if not self.available:
            return []
        return resolve_visible(self.reader.devices(), self.entries)

    def close(self) -> None:
        self.reader.close()


class EnginePart:
    """A follower node's headless vLLM process of a multi-node launch."""

    def __init__(self, launch: EngineLaunch, rank: int = 1, ranks_per_node: int = 1) -> None:
        for var in _RAY_WORKER_ENV:
            os.environ.pop(var, None)
        self.launch = launch
        self.rank = rank
        self.ranks_per_node = ranks_per_node
        self.server: Any = None
        self.telemetry: GpuTelemetry | None = None

    def start(self) -> dict[str, Any]:
        """Resolve the model on this node, start the process; returns its command, process
        group, the GPUs it holds and how the model resolved here."""
        launch, resolution = resolve_launch_model(self.launch)
        self.server = EngineServer(launch)
        held = held_devices(self.rank, self.ranks_per_node)
        if held["ray_gpu_ids"]:
            self.telemetry = GpuTelemetry(self.ranks_per_node)
        self.server.start()
        return {
            "command": list(self.server.command),
            "pgid": self.server.pgid,
            "gpu_assignment": held,
            **({"model_resolution": resolution} if resolution else {}),
        }

    def gpu_readings(self) -> list[Any]:
        """This node's held GPUs now (``jobs.signals.gpus.GpuReading``; empty without telemetry)."""
        return self.telemetry.read() if self.telemetry is not None else []

    def alive(self) -> bool:
        return self.server.death() is None

    def watch_members(self) -> int:
        """Note this node's engine processes (the run's server is healthy): from now on a
        process of them that exits fails the runs. Returns how many are watched."""
        return len(self.server.watch_members())

    def death(self) -> str | None:
        """Why this node's engine is dead (see ``EngineServer.death``), None while it runs."""
        return self.server.death() if self.server is not None else None

    def error_lines(self, n: int = 40) -> list[str]:
        # once watched, only what was logged since (never its start-up warnings)
        return self.server.run_error_lines(n)

    def log_text(self) -> str:
        return self.server.log_text()

    def stop(self) -> int | None:
        if self.telemetry is not None:
            self.telemetry.close()
        return self.server.stop() if self.server is not None else None


def resolve_launch_model(launch: EngineLaunch) -> tuple[EngineLaunch, dict[str, Any] | None]:
    """Resolve a model named by Hugging Face id in this node's HF cache.

    Returns ``launch`` unchanged (and None) for a directory or generated model.
    Otherwise runs :func:`jobs.engine.queries.resolve_model` here: with the weights in the
    cache the snapshot directory is served (exactly the files whose digests are
    recorded); without them the id is served with ``--revision <commit>`` and
    vLLM downloads the weights. With the Ray executor the id and commit are served
    too (vLLM's workers on other nodes resolve them in their own caches). Raises
    :class:`jobs.engine.server.EngineError` with the node's answer when the model cannot be
    resolved here.
    """
    if not launch.resolve_model_on_node:
        return launch, None
    doc = resolve_model(
        launch.engine_python, launch.model_dir, launch.model_revision, env=launch.env
    )
    resolution = {
        k: doc.get(k)
        for k in ("model", "source", "path", "revision", "hf_cache", "offline", "weights_cached")
    }
    resolution["files"] = doc.get("files") or []
    if doc.get("revision") and launch.model_revision and doc["revision"] != launch.model_revision:
        raise EngineStartError(
            f"model {launch.model_dir} resolved to revision {doc['revision']} on this node, "
            f"but the experiment was planned with {launch.model_revision}"
        )
    if doc.get("weights_cached") and launch.executor == "mp":
        update: dict[str, Any] = {
            "model_dir": str(doc["path"]),
            "resolve_model_on_node": False,
            "model_revision": None,
        }
    else:
        update = {
            "resolve_model_on_node": False,
            "model_revision": doc.get("revision"),
            "tokenizer_dir": str(doc["path"]),
        }
    return launch.model_copy(update=update), resolution


class RunSupervisor:
    """Runs :func:`jobs.run.runner.execute_batch` for one :class:`BatchJob`."""

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
        self._held: dict[str, Any] | None = None
        self._telemetry: GpuTelemetry | None = None
        #: every finished request's record so far, per run (``RequestRecord.model_dump()``)
        self._records: dict[str, list[dict[str, Any]]] = {}
        #: every ``/metrics`` sample so far, per run (``MetricSample.model_dump()``)
        self._samples: dict[str, list[dict[str, Any]]] = {}
        self._records_lock = threading.Lock()
        self._parts_watched = False

    def start(self) -> dict[str, Any]:
        """Start the job in a thread; returns the GPUs this launcher holds (see
        :func:`held_devices`)."""
        if self._thread is None:
            for var in _RAY_WORKER_ENV:
                os.environ.pop(var, None)
            nodes = max(1, len(self.job.nodes))
            args = self.job.launch.engine_args
            world = int(args.get("tensor_parallel_size") or 1) * int(
                args.get("pipeline_parallel_size") or 1
            )
            ranks = next((p.devices for p in self.job.nodes if p.rank == 0), world)
            if self.job.launch.executor == "ray":
                self._held = {
                    "node_rank": 0,
                    "gpus": [],
                    "note": "executor 'ray': vLLM's Ray workers hold one GPU bundle each of "
                    "the run's placement group; the launcher holds none",
                }
            else:
                self._held = held_devices(0, ranks if nodes > 1 else world)
                if self._held["ray_gpu_ids"]:
                    self._telemetry = GpuTelemetry(ranks if nodes > 1 else world)
            self._thread = threading.Thread(target=self._work, name="run-job", daemon=True)
            self._thread.start()
        return dict(self._held or {})

    def _gpu_values(self) -> dict[str, float]:
        """One telemetry reading of every GPU of the run: this node's, then each
        follower's, in rank order (keys of :func:`jobs.signals.gpus.gpu_sample_values`)."""
        readings = list(self._telemetry.read()) if self._telemetry is not None else []
        for _, actor in self._parts:
            readings.extend(ray.get(actor.gpu_readings.remote(), timeout=10))
        return gpu_sample_values(readings) if readings else {}

    def _finish_gpu_facts(self, results: list[RunResult]) -> list[RunResult]:
        """Add the GPU assignment per node and rank and the GPU telemetry summary."""
        assignment = [self._held or {}] + [p.get("gpu_assignment") or {} for p in self._parts_info]
        # the GPUs vLLM computes on (held GPUs without a vLLM rank are idle reservations)
        gpus = sum(1 for a in assignment for g in a.get("gpus") or [] if g.get("rank") is not None)
        for r in results:
            r.engine_info["gpu_assignment"] = assignment
            if self._telemetry is None:
                r.engine_info["gpu_telemetry"] = {
                    "available": False,
                    "note": (self._held or {}).get("note")
                    or "no GPU telemetry for this run (no GPU held by its launcher)",
                }
                continue
            tokens = r.metrics.get("total_output_tokens")
            summary, info = summarize_gpu_samples(
                r.samples,
                int(tokens) if tokens is not None else None,
                gpus,
                source=self._telemetry.reader.source,
            )
            r.metrics.update(summary)
            r.engine_info["gpu_telemetry"] = info
        return results

    def _on_progress(self, progress: Progress) -> None:
        self._progress = progress.model_dump()
        if progress.phase in ("warmup", "measuring") and self._parts and not self._parts_watched:
            # the run's server answers: every node's engine processes are up, watch them all
            self._parts_watched = True
            for _, actor in self._parts:
                actor.watch_members.remote()

    def _on_record(self, run_id: str, record: RequestRecord) -> None:
        with self._records_lock:
            self._records.setdefault(run_id, []).append(record.model_dump())

    def _on_sample(self, run_id: str, sample: MetricSample) -> None:
        with self._records_lock:
            self._samples.setdefault(run_id, []).append(sample.model_dump())

    def _work(self) -> None:
        resolution: dict[str, Any] | None = None
        try:
            try:
                launch, resolution = resolve_launch_model(self.job.launch)
            except EngineError as exc:
                raise RuntimeError(
                    f"model {self.job.launch.model_dir!r} could not be resolved on the rank 0 "
                    f"node: {exc}"
                ) from exc
            job = self.job.model_copy(update={"launch": launch})
            job = self._start_parts(job) if len(job.nodes) > 1 else job
            if self._part_failure is not None:
                raise RuntimeError(self._part_failure)
            watcher = None
            if self._parts:
                watcher = threading.Thread(target=self._watch_parts, daemon=True)
                watcher.start()
            telemetry = self._gpu_values if self._telemetry is not None else None
            self._result = execute_batch(
                job,
                self._on_progress,
                self._cancel,
                telemetry,
                on_record=self._on_record,
                on_sample=self._on_sample,
            )
            if self._part_failure is not None:
                self._result = [
                    r.model_copy(update={"status": "failed", "error": self._part_failure})
                    if r.status != "succeeded"
                    else r
                    for r in self._result
                ]
        except BaseException as exc:  # noqa: BLE001 - reported as the runs' error
            self._result = [
                RunResult(run_id=seg.run_id, status="failed", error=f"supervisor error: {exc}")
                for seg in self.job.segments
            ]
        finally:
            self._stop_parts()
            if self._result is not None:
                self._result = self._finish_gpu_facts(self._result)
                for r in self._result:
                    if resolution is not None:
                        r.engine_info["model_resolution"] = resolution
                    if self._parts_info:
                        r.engine_info["node_parts"] = self._parts_info
            if self._telemetry is not None:
                self._telemetry.close()
            self._done.set()

    # -- multi-node ----------------------------------------------------------------------

    def _start_parts(self, job: BatchJob) -> BatchJob:
        """Start every follower's headless part (holding its node's GPUs, resolving the
        model in its own HF cache); return the job for rank 0's server."""
        nodes = sorted(job.nodes, key=lambda p: p.rank)
        addr = nodes[0].ip
        port = find_free_port("0.0.0.0")
        pg = ray.util.get_current_placement_group()
        self._progress = {"phase": "starting", "message": f"starting {len(nodes) - 1} node parts"}
        for part in nodes[1:]:
            launch = part_launch(self.job.launch, part, len(nodes), addr, port)
            actor = EnginePartActor.options(  # type: ignore[attr-defined]
                num_gpus=part.gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=part.bundle_index
                )
                if pg is not None
                else None,
            ).remote(launch, part.rank, part.devices)
            self._parts.append((part, actor))
            info = ray.get(actor.start.remote(), timeout=120)
            self._parts_info.append({"rank": part.rank, "node_id": part.node_id, **info})
        return job.model_copy(
            update={"launch": part_launch(job.launch, nodes[0], len(nodes), addr, port)}
        )

    def _watch_parts(self) -> None:
        while not self._done.wait(PART_CHECK_INTERVAL_S):
            for part, actor in self._parts:
                where = f"node rank {part.rank} ({part.ip}, Ray node {part.node_id[:12]})"
                try:
                    death = ray.get(actor.death.remote(), timeout=30)
                except RayError as exc:
                    self._fail_parts(f"{where} was lost: {type(exc).__name__}: {exc}"[:2000])
                    return
                if death is not None:
                    try:
                        lines = ray.get(actor.error_lines.remote(), timeout=30)
                    except RayError:
                        lines = []
                    self._fail_parts(
                        f"the vLLM part on {where} died: {death}\n"
                        "--- its engine log (error lines) ---\n" + "\n".join(lines)
                    )
                    return

    def _fail_parts(self, message: str) -> None:
        log.warning("multi-node launch failed: %s", message)
        self._part_failure = message
        self._cancel.set()

    def _stop_parts(self) -> None:
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

    def records(self, since: dict[str, int] | None = None) -> dict[str, list[dict[str, Any]]]:
        """The request records each run got after the first ``since[run_id]`` (default 0),
        in the order the requests finished: ``{run_id: [RequestRecord.model_dump(), ...]}``
        (runs without new records are left out)."""
        return self._since(self._records, since or {})

    def samples(self, since: dict[str, int] | None = None) -> dict[str, list[dict[str, Any]]]:
        """The ``/metrics`` samples each run got after the first ``since[run_id]``, in the
        order they were taken: ``{run_id: [MetricSample.model_dump(), ...]}``."""
        return self._since(self._samples, since or {})

    def _since(
        self, kept: dict[str, list[dict[str, Any]]], since: dict[str, int]
    ) -> dict[str, list[dict[str, Any]]]:
        with self._records_lock:
            return {
                run_id: rows[since.get(run_id, 0) :]
                for run_id, rows in kept.items()
                if len(rows) > since.get(run_id, 0)
            }

    def cancel(self) -> bool:
        self._cancel.set()
        return True


RunSupervisorActor = ray.remote(num_cpus=0, max_concurrency=8)(RunSupervisor)  # type: ignore[call-overload]
EnginePartActor = ray.remote(num_cpus=0, max_concurrency=4)(EnginePart)  # type: ignore[call-overload]
