"""The Ray run backend: placement groups and run supervisors.

Each run asks Ray for ``TP x PP`` one-device bundles (``{"CPU": 1}`` on a
CPU host, ``{"GPU": 1}`` on GPU clusters: the resource kind is the
``orchestrator.device_resource`` setting) as a placement group, and places its
supervisor actor in bundle 0. Ray errors are mapped to run errors here.

A supervisor that does not answer (its worker stopped by SIGSTOP, or hung) is given
``orchestrator.stale_after_s`` from its last answer, the age at which a run's heartbeat
marks it lost; then :meth:`RayRunBackend.poll` ends it (its worker SIGKILLed) and says
the run is done without a result, and the dispatcher fails the run keeping what it
measured. Each call to a supervisor waits at most :data:`CALL_TIMEOUT_S`, and one that has
not answered is waited for again without blocking, so a silent supervisor does not hold
up the dispatcher's tick (the other runs' polls, claims, schedules).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from jobs.engine.processes import process_title
from jobs.schemas import BatchJob, NodePart, RunResult
from orchestrator.cluster.parity_engineenv import engine_env_problem
from orchestrator.cluster.placement import (
    RAY_EXECUTOR_ON_CPU,
    NodeInventory,
    Placement,
    nodes_from_ray,
    plan_placement,
    reserved_devices,
    shape_problem,
)
from orchestrator.core.errors import RayClusterError
from orchestrator.core.settings import Settings, detect_device_resource
from orchestrator.dispatch.ray.join import ensure_nodes_ready, join_cluster
from orchestrator.dispatch.ray.join import forget as forget_joined_cluster
from orchestrator.dispatch.ray.layout import (
    actual_layout,
    engine_summary,
    planned_layout,
    record_engines,
)
from orchestrator.dispatch.ray.localray import start_local_ray
from orchestrator.dispatch.ray.nodereport import engine_report, nodes_report
from orchestrator.dispatch.ray.probe import engine_env_on_nodes, probe_on_nodes
from orchestrator.dispatch.ray.supervisor import (
    NAMESPACE,
    RunSupervisorActor,
    actor_name,
    ray_executor_launch,
)
from orchestrator.dispatch.run_backend import (
    LaunchBlocked,
    LaunchInfo,
    LaunchRefused,
    NoCapacity,
    Poll,
)

log = logging.getLogger(__name__)

#: Seconds a call to a run's supervisor (``progress``, ``records``, ``samples``) may take
#: before the supervisor counts as silent for this tick: a supervisor answers these from
#: memory in milliseconds; a stopped or hung one never does.
CALL_TIMEOUT_S = 2.0


def connect(settings: Settings) -> dict[str, Any]:
    """Join ``RAY_ADDRESS`` or start a local Ray; returns the cluster resources.

    An existing cluster is joined by :func:`orchestrator.dispatch.ray.join.join_cluster`
    (Ray Client refused, authentication failures in one line, what the nodes lack
    shipped with Ray's ``runtime_env`` or refused: :class:`RayClusterError`).
    """
    if not ray.is_initialized():
        address = (settings.ray_address or "").strip()
        if address and address != "local":
            report = join_cluster(settings)
            conflict = image_conflict(settings, report.runtime_env)
            if conflict is not None:
                disconnect()
                raise RayClusterError(conflict)
        else:
            # a Ray of our own, never one that runs on this host already (another user's
            # `ray start`, a test's cluster): joining one takes RAY_ADDRESS
            start_local_ray(settings)
    return dict(ray.cluster_resources())


def engine_runtime_env(settings: Settings) -> dict[str, Any] | None:
    """The Ray ``runtime_env`` of the engine's Ray tasks and actors: ``{"image_uri": ...}``
    with ``VLAB_ENGINE__IMAGE_URI`` (Ray runs them in that container image, with podman on
    the node), else None (they run in the node's Ray worker environment)."""
    image = settings.engine.image_uri
    return {"image_uri": image} if image else None


#: Fields Ray lets stand beside ``image_uri`` in one runtime_env
#: (``ray/_private/runtime_env/image_uri.py``, ``ImageURIPlugin.get_compatible_keys``).
_IMAGE_COMPATIBLE = frozenset({"image_uri", "config", "env_vars"})


def image_conflict(settings: Settings, job_env: dict[str, Any] | None) -> str | None:
    """Why the engine image cannot be used with what joining the cluster shipped, or None.

    A task's ``runtime_env`` is merged into the job's (per field), and Ray refuses
    ``image_uri`` together with ``py_modules`` or ``pip`` ("The 'image_uri' field
    currently cannot be used together with other fields of runtime_env"): with an
    image, vlab's code and requirements must be in the image.
    """
    if not settings.engine.image_uri or not job_env:
        return None
    extra = sorted(set(job_env) - _IMAGE_COMPATIBLE)
    if not extra:
        return None
    return (
        f"VLAB_ENGINE__IMAGE_URI={settings.engine.image_uri}: the cluster's nodes lack what "
        f"vlab's Ray tasks need, which vlab would ship with Ray's runtime_env "
        f"({', '.join(extra)}), and Ray cannot combine image_uri with those fields; install "
        "vlab in the nodes' Python (an image built from deploy/) so nothing is shipped, or "
        "unset VLAB_ENGINE__IMAGE_URI"
    )


def disconnect() -> None:
    """Leave the Ray cluster (stopping a local Ray this process started), if connected."""
    forget_joined_cluster()
    if ray.is_initialized():
        ray.shutdown()


@dataclass
class _Active:
    actor: Any
    result_ref: Any
    pg: PlacementGroup | None
    #: when the supervisor last answered (``time.monotonic()``; its launch or re-attach
    #: counts as an answer)
    answered: float = field(default_factory=time.monotonic)
    #: its ``progress`` call that has not answered yet (waited for again, not re-sent)
    pending: Any = None
    #: its last call did not answer: ``records`` and ``samples`` are not asked until it does
    silent: bool = False


class RayRunBackend:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        cluster = {k: float(v) for k, v in ray.cluster_resources().items()}
        self.resource, self.resource_source = detect_device_resource(
            settings.orchestrator.device_resource, cluster
        )
        log.info(
            "device kind: %s (%s; the cluster has %g GPU, %g CPU)",
            self.resource,
            "set by VLAB_ORCHESTRATOR__DEVICE_RESOURCE"
            if self.resource_source == "setting"
            else "detected from the Ray cluster",
            cluster.get("GPU", 0.0),
            cluster.get("CPU", 0.0),
        )
        self._runs: dict[str, _Active] = {}

    def resources(self) -> dict[str, float]:
        return {k: float(v) for k, v in ray.cluster_resources().items()}

    def nodes(self) -> list[NodeInventory]:
        """Live nodes with their total and available devices of the resource."""
        try:
            available = ray._private.state.available_resources_per_node()
        except Exception:  # noqa: BLE001 - private API: fall back to totals
            available = None
        return nodes_from_ray(ray.nodes(), available, self.resource)

    def launch(self, run_id: str, job: BatchJob, layout: dict[str, Any]) -> LaunchInfo:
        """Place the run, check node parity when it spans nodes, start its supervisor.

        1. plan TP x PP on the live nodes (:func:`orchestrator.cluster.placement.plan_placement`):
           raises :class:`LaunchRefused` for a shape the cluster can never hold (or the
           Ray executor without GPUs), :class:`NoCapacity` when it fits but the devices
           are busy;
        2. check the engine environment of every chosen node before anything is placed
           (:meth:`check_engine_envs`: each node's python from :meth:`engine_specs`, a
           stat on the node): a node without it raises :class:`LaunchBlocked` with the
           engine-environment report and the planned layout (``"planned": true``);
        3. reserve a placement group pinned to the chosen nodes (``node:<ip>``): on GPUs
           with the ``mp`` executor one bundle per node holding all of that node's GPUs
           (its launcher actor asks for them all, so Ray sets ``CUDA_VISIBLE_DEVICES``);
           otherwise one-device bundles (CPU cores; with ``executor: "ray"`` vLLM's own
           Ray workers take one GPU bundle each); then read back where Ray put each
           bundle: the recorded layout is what the run got, each node with its engine
           python (``engine_python``, ``engine_python_source``);
        4. on two or more nodes, probe every node in the engine environment
           (:func:`orchestrator.dispatch.ray.probe.probe_on_nodes`) and compare
           (:func:`orchestrator.cluster.parity.check_parity`): a blocking mismatch removes
           the group and raises :class:`LaunchBlocked` with the report;
        5. start the supervisor on the rank-0 node, holding that node's GPUs (what
           every node got is recorded in the runs' ``engine_info["gpu_assignment"]``),
           in the engine's container image when ``VLAB_ENGINE__IMAGE_URI`` is set (the
           supervisor's engine parts inherit its ``runtime_env``).

        Raises ``TimeoutError`` if the group is not ready within
        ``placement_timeout_s`` (the group is removed first).
        """
        executor = str(layout.get("executor") or "mp")
        plan = self._plan(layout, executor)
        # the engine environment of every chosen node, before anything is placed
        planned = [n.node_id for n in plan.nodes]
        engines = self.engine_specs(planned, default=job.launch.engine_python)
        shape = {"model": job.launch.model_dir, "tensor_parallel_size": plan.tp}
        shape["pipeline_parallel_size"] = plan.pp
        blocked = self.check_engine_envs(planned, engines, launch=shape)
        if blocked is not None:
            raise LaunchBlocked(
                blocked,
                planned_layout(
                    plan,
                    engines,
                    executor=executor,
                    resource=self.resource,
                    resource_source=self.resource_source,
                    engine_env=engine_summary(self.settings),
                ),
            )
        per_node = self.resource == "GPU" and executor == "mp"
        specs = plan.node_bundles(self.resource) if per_node else plan.bundles(self.resource)
        pg = placement_group(specs, strategy="PACK", name=f"vlab-pg-{run_id}")
        try:
            ray.get(pg.ready(), timeout=self.settings.orchestrator.placement_timeout_s)
        except GetTimeoutError as exc:
            remove_placement_group(pg)
            raise TimeoutError(
                f"placement group of {plan.reserved} x {self.resource} not ready in time"
            ) from exc
        try:
            ips = {n.node_id: n.ip for n in self.nodes()}
            parts, doc = actual_layout(
                pg, plan, specs, resource=self.resource, ips=ips, gpus_per_bundle=per_node
            )
            doc["executor"] = executor
            doc["device_kind_source"] = self.resource_source
            job, parts, parity = self._check_placed(job, parts, doc, engines, shape)
            actor = self._start_supervisor(run_id, job, parts, pg, executor)
        except BaseException:
            remove_placement_group(pg)
            raise
        self._runs[run_id] = _Active(actor=actor, result_ref=actor.result.remote(), pg=pg)
        return LaunchInfo(placement=doc, parity=parity)

    def _plan(self, layout: dict[str, Any], executor: str) -> Placement:
        """Step 1 of :meth:`launch`: TP x PP planned on the live nodes, each of them ready."""
        tp = int(layout.get("tensor_parallel_size", 1))
        pp = int(layout.get("pipeline_parallel_size", 1))
        devices = reserved_devices(layout)
        exclusive = bool(layout.get("exclusive_nodes", False))
        if executor == "ray" and self.resource != "GPU":
            raise LaunchRefused(RAY_EXECUTOR_ON_CPU)
        nodes = self.nodes()
        problem = shape_problem(nodes, tp, pp, devices, resource=self.resource)
        if problem is not None:
            raise LaunchRefused(problem)
        plan = plan_placement(nodes, tp, pp, devices=devices, exclusive=exclusive)
        if plan is None:
            raise NoCapacity(f"{tp}x{pp} on {devices} {self.resource} devices is busy")
        try:  # a node that joined after start-up is checked before anything is placed
            ensure_nodes_ready(
                [n.node_id for n in plan.nodes], self.settings.orchestrator.node_setup_timeout_s
            )
        except RayClusterError as exc:
            raise LaunchRefused(exc.detail) from exc
        return plan

    def _check_placed(
        self,
        job: BatchJob,
        parts: list[NodePart],
        doc: dict[str, Any],
        engines: dict[str, dict[str, Any]],
        shape: dict[str, Any],
    ) -> tuple[BatchJob, list[NodePart], dict[str, Any] | None]:
        """Steps 3 (end) and 4 of :meth:`launch` on the nodes Ray chose: their engine
        pythons recorded (and checked where Ray did not place as planned), their parity
        compared on two or more nodes. The job and parts with the engine pythons, and the
        parity report (None on one node). Raises :class:`LaunchBlocked`."""
        default_python = job.launch.engine_python
        unchecked = [p.node_id for p in parts if p.node_id not in engines]
        if unchecked:  # Ray put a bundle on another node than planned (shared IPs)
            engines.update(self.engine_specs(unchecked, default=default_python))
            ids = [p.node_id for p in parts]
            blocked = self.check_engine_envs(ids, engines, launch=shape)
            if blocked is not None:
                raise LaunchBlocked(blocked, doc)
        parts = [
            p.model_copy(update={"engine_python": engines[p.node_id]["python"]}) for p in parts
        ]
        record_engines(doc, parts, engines)
        launch = job.launch.model_copy(update={"engine_python": parts[0].engine_python})
        job = job.model_copy(update={"launch": launch})
        if len(parts) < 2:
            return job, parts, None
        parity = self.check_nodes(
            [p.node_id for p in parts],
            model_dir=job.launch.model_dir,
            engine_args=job.launch.engine_args,
            tp=shape["tensor_parallel_size"],
            pp=shape["pipeline_parallel_size"],
            revision=job.launch.model_revision,
            by_id=job.launch.resolve_model_on_node,
            env=job.launch.env,
            engine_python=default_python,
        )
        if parity.get("verdict") == "blocked":
            raise LaunchBlocked(parity, doc)
        return job, parts, parity

    def _start_supervisor(
        self, run_id: str, job: BatchJob, parts: list[NodePart], pg: PlacementGroup, executor: str
    ) -> Any:
        """Step 5 of :meth:`launch`: the run's supervisor actor on the rank-0 bundle, started."""
        if executor == "ray":
            job = job.model_copy(update={"launch": ray_executor_launch(job.launch, pg)})
        elif len(parts) > 1:
            job = job.model_copy(update={"nodes": parts})
        image = engine_runtime_env(self.settings)  # the engine parts inherit it
        actor = RunSupervisorActor.options(  # type: ignore[attr-defined]
            name=actor_name(run_id),
            namespace=NAMESPACE,
            num_gpus=parts[0].gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=parts[0].bundle_index
            ),
            **({"runtime_env": image} if image else {}),
        ).remote(job)
        ray.get(actor.start.remote(), timeout=120)
        return actor

    def engine_specs(
        self, node_ids: list[str], default: str | None = None
    ) -> dict[str, dict[str, Any]]:
        """Where the engine's python is on each node (from the settings; nothing is run).

        ``default``: the python of nodes no ``VLAB_ENGINE__PYTHON_BY_NODE`` entry matches
        (default: ``VLAB_ENGINE__PYTHON``, made absolute on this host unless it names the
        python inside ``VLAB_ENGINE__IMAGE_URI``). A node is matched by its Ray IP
        (``NodeManagerAddress``) and labels (``Labels``). Returns ``{node_id: {"kind":
        "path" | "image", "python", "source", "image_uri"?}}`` in the order given.
        """
        engine = self.settings.engine
        if default is None:
            default = str(engine.python if engine.image_uri else Path(engine.python).absolute())
        live = {str(n.get("NodeID")): n for n in ray.nodes() if n.get("Alive")}
        specs: dict[str, dict[str, Any]] = {}
        for node_id in dict.fromkeys(node_ids):
            node = live.get(node_id) or {}
            labels = node.get("Labels") or {}
            python, source = engine.python_for_node(node.get("NodeManagerAddress"), labels, default)
            spec: dict[str, Any] = {"kind": engine.kind, "python": python, "source": source}
            if engine.image_uri:
                spec["image_uri"] = engine.image_uri
            specs[node_id] = spec
        return specs

    def check_engine_envs(
        self,
        node_ids: list[str],
        engines: dict[str, dict[str, Any]] | None = None,
        *,
        launch: dict[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        """Is the engine environment on every node of ``node_ids``? (Before anything is placed.)

        One zero-CPU task per node (:func:`orchestrator.dispatch.ray.probe.engine_env_on_nodes`:
        a stat of its python, in the engine's image when there is one). Returns None when
        every node has it, else the parity report of the engine environments only
        (``verdict`` ``"blocked"``, rule ``engine_env`` naming each node and its python,
        ``stage`` ``"engine_env"``). Raises :class:`jobs.engine.nodeprobe.ProbeError` when a node
        does not answer.
        """
        engines = engines if engines is not None else self.engine_specs(node_ids)
        answers = engine_env_on_nodes(
            {n: engines[n] for n in node_ids},
            timeout_s=self.settings.orchestrator.node_setup_timeout_s,
            runtime_env=engine_runtime_env(self.settings),
        )
        fingerprints = [answers[n] for n in node_ids]
        if not any(engine_env_problem(fp.get("engine_env")) for fp in fingerprints):
            return None
        return engine_report(node_ids, fingerprints, launch or {})

    def digest_cache_path(self, node_id: str) -> str:
        """The model-file digest cache of one node (a file per node under the home)."""
        return str(self.settings.home.absolute() / f"model_digests-{node_id}.json")

    def check_nodes(
        self,
        node_ids: list[str] | None,
        *,
        model_dir: str | None,
        engine_args: dict[str, Any],
        tp: int = 1,
        pp: int = 1,
        revision: str | None = None,
        by_id: bool = False,
        env: dict[str, str] | None = None,
        engine_python: str | None = None,
    ) -> dict[str, Any]:
        """Probe ``node_ids`` (default: every live node) and compare their environments.

        ``by_id``: ``model_dir`` is a Hugging Face id that every node resolves in its own
        HF cache at ``revision`` (the snapshot commits and file digests are compared).
        ``env``: the launch's environment (``EngineLaunch.env``), which every node's engine
        gets on top of its Ray worker environment (the probe runs with it). The
        orchestrator's own environment is the launching side (``launch_env``): a
        communication variable set there but not in some node's Ray workers never
        reaches that node's engine, and blocks. Each node is probed with its own engine
        python (:meth:`engine_specs`; ``engine_python``: the default one) and reports it
        as ``engine_env``; when a node lacks it, the report compares the engine
        environments only (:func:`orchestrator.dispatch.ray.nodereport.engine_report`:
        the other fields were not probed there).

        Returns the :func:`orchestrator.cluster.parity.check_parity` report with the nodes
        in the given order, each named ``rank<i>:<hostname>`` and carrying the engine
        arguments it would launch with. Raises :class:`jobs.engine.nodeprobe.ProbeError` when
        a node's probe fails, ``ValueError`` for an unknown node id.
        """
        live = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        ids = list(node_ids) if node_ids else sorted(live)
        unknown = [i for i in ids if i not in live]
        if unknown:
            raise ValueError(f"no live Ray node {', '.join(unknown)}")
        engines = self.engine_specs(ids, default=engine_python)
        fingerprints = probe_on_nodes(
            ids,
            {n: str(spec["python"]) for n, spec in engines.items()},
            model_dir,
            self.digest_cache_path("{node_id}"),
            revision=(revision or "main") if by_id else None,
            env=env,
            engine_envs=engines,
            runtime_env=engine_runtime_env(self.settings),
        )
        return nodes_report(
            ids, fingerprints, model_dir=model_dir, engine_args=engine_args, tp=tp, pp=pp
        )

    def attach(self, run_id: str) -> bool:
        try:
            actor = ray.get_actor(actor_name(run_id), namespace=NAMESPACE)
        except ValueError:
            return False
        self._runs[run_id] = _Active(actor=actor, result_ref=actor.result.remote(), pg=None)
        return True

    def poll(self, run_id: str) -> Poll:
        """The run's result once its supervisor returned it (or died), else its progress.

        The ``progress`` call waits at most :data:`CALL_TIMEOUT_S`; one that did not answer
        is waited for again at the next poll without blocking (not sent twice). A poll
        without an answer is ``answered=False``; once the supervisor has not answered for
        ``orchestrator.stale_after_s`` it is lost: its worker is SIGKILLed
        (:meth:`_end_supervisor`) and the poll is done with the error that says so.
        """
        active = self._runs.get(run_id)
        if active is None:
            return Poll(done=True, error="no supervisor for this run in this orchestrator")
        ready, _ = ray.wait([active.result_ref], timeout=0)
        if ready:
            try:
                results: list[RunResult] = ray.get(active.result_ref)
                return Poll(done=True, results=results)
            except RayActorError as exc:
                return Poll(done=True, error=f"run supervisor died: {exc}")
            except RayError as exc:
                return Poll(done=True, error=f"ray error: {exc}")
        waiting = active.pending is not None
        ref = active.pending if waiting else active.actor.progress.remote()
        answer, _ = ray.wait([ref], timeout=0 if waiting else CALL_TIMEOUT_S)
        active.pending = None if answer else ref
        if answer:
            try:
                progress = ray.get(ref)
            except RayError:  # the worker died: its result says so at the next poll
                pass
            else:
                self._answered(active)
                return Poll(done=False, progress=progress)
        active.silent = True
        silent_s = time.monotonic() - active.answered
        limit = self.settings.orchestrator.stale_after_s
        if silent_s < limit:
            return Poll(done=False, answered=False)
        how = self._end_supervisor(active)
        log.warning(
            "run %s: its supervisor did not answer for %.1f s (stale_after_s %g s): %s",
            run_id,
            silent_s,
            limit,
            how,
        )
        return Poll(
            done=True,
            error=f"the run supervisor did not answer for {silent_s:.0f} s (stopped or hung; "
            f"VLAB_ORCHESTRATOR__STALE_AFTER_S={limit:g}); ended",
        )

    @staticmethod
    def _answered(active: _Active) -> None:
        active.answered = time.monotonic()
        active.silent = False

    @staticmethod
    def _end_supervisor(active: _Active) -> str:
        """End a supervisor that stopped answering; returns what was done.

        ``ray.kill`` ends its worker wherever it is, but a stopped worker cannot exit by
        itself and Ray SIGKILLs it only after its own grace (measured with Ray 2.60: 5.0 s
        for a SIGSTOPped worker, 3 kills); a worker on this machine (Ray's actor table
        gives its node and pid) is SIGKILLed here at once. Once it is gone its engine's
        lifetime guard ends the engine (within 0.5 s), and the dispatcher sweeps the
        engines no live run owns."""
        node_id, pid = "", 0
        with contextlib.suppress(Exception):  # private API: Ray's kill alone is the fallback
            table = ray._private.state.state.actor_table(active.actor._actor_id.hex())
            node_id = str((table.get("Address") or {}).get("NodeID") or "")
            pid = int(table.get("Pid") or 0)
        with contextlib.suppress(RayError, ValueError):
            ray.kill(active.actor)
        local = bool(node_id) and node_id == ray.get_runtime_context().get_node_id()
        if local and pid > 0 and process_title(pid).startswith("ray::"):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
            else:
                return f"ray.kill, and SIGKILL of its worker (pid {pid}) on this machine"
        where = f"pid {pid} on node {node_id[:12]}" if pid else "its worker"
        return f"ray.kill ({where}: Ray SIGKILLs it after its grace)"

    def records(self, run_id: str, since: dict[str, int]) -> dict[str, list[dict[str, Any]]]:
        """The request records the batch's runs finished after ``since[run_id]`` of them
        (:meth:`RunSupervisor.records`); ``{}`` when the supervisor does not answer (within
        :data:`CALL_TIMEOUT_S`) or did not answer its last call."""
        return self._stream_call(run_id, "records", since)

    def samples(self, run_id: str, since: dict[str, int]) -> dict[str, list[dict[str, Any]]]:
        """The ``/metrics`` samples the batch's runs took after ``since[run_id]`` of them
        (:meth:`RunSupervisor.samples`); ``{}`` when the supervisor does not answer."""
        return self._stream_call(run_id, "samples", since)

    def _stream_call(
        self, run_id: str, method: str, since: dict[str, int]
    ) -> dict[str, list[dict[str, Any]]]:
        active = self._runs.get(run_id)
        if active is None or active.silent:
            return {}
        try:
            found: dict[str, list[dict[str, Any]]] = ray.get(
                getattr(active.actor, method).remote(since), timeout=CALL_TIMEOUT_S
            )
        except (GetTimeoutError, RayError):
            active.silent = True
            return {}
        self._answered(active)
        return found

    def cancel(self, run_id: str) -> None:
        active = self._runs.get(run_id)
        if active is not None:
            try:
                active.actor.cancel.remote()
            except RayError:
                log.warning("cancel of run %s could not reach its supervisor", run_id)

    def release(self, run_id: str) -> None:
        active = self._runs.pop(run_id, None)
        if active is None:
            return
        with contextlib.suppress(RayError, ValueError):
            ray.kill(active.actor)
        if active.pg is not None:
            with contextlib.suppress(RayError, ValueError):
                remove_placement_group(active.pg)
