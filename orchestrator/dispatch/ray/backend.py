"""The Ray run backend: placement groups and run supervisors.

Each run asks Ray for ``TP x PP`` one-device bundles (``{"CPU": 1}`` on a
CPU host, ``{"GPU": 1}`` on GPU clusters: the resource kind is the
``orchestrator.device_resource`` setting) as a placement group, and places its
supervisor actor in bundle 0. Ray errors are mapped to run errors here.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from jobs.engine import render_engine_args
from jobs.schemas import BatchJob, NodePart, RunResult
from orchestrator.cluster.parity import check_parity
from orchestrator.cluster.placement import (
    RAY_EXECUTOR_ON_CPU,
    NodeInventory,
    Placement,
    cpu_thread_binding,
    nodes_from_ray,
    plan_placement,
    reserved_devices,
    shape_problem,
)
from orchestrator.core.settings import Settings, detect_device_resource
from orchestrator.dispatch.dispatcher import (
    LaunchBlocked,
    LaunchInfo,
    LaunchRefused,
    NoCapacity,
    Poll,
)
from orchestrator.dispatch.ray.probe import probe_on_nodes
from orchestrator.dispatch.ray.supervisor import (
    NAMESPACE,
    RunSupervisorActor,
    actor_name,
    ray_executor_launch,
)

log = logging.getLogger(__name__)


def connect(settings: Settings) -> dict[str, Any]:
    """Connect to ``RAY_ADDRESS`` or start a local Ray; returns the cluster resources."""
    if not ray.is_initialized():
        ray.init(
            address=settings.ray_address or None,
            namespace=NAMESPACE,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    return dict(ray.cluster_resources())


def disconnect() -> None:
    """Leave the Ray cluster (stopping a local Ray this process started), if connected."""
    if ray.is_initialized():
        ray.shutdown()


@dataclass
class _Active:
    actor: Any
    result_ref: Any
    pg: PlacementGroup | None


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
        2. reserve a placement group pinned to the chosen nodes (``node:<ip>``): on GPUs
           with the ``mp`` executor one bundle per node holding all of that node's GPUs
           (its launcher actor asks for them all, so Ray sets ``CUDA_VISIBLE_DEVICES``);
           otherwise one-device bundles (CPU cores; with ``executor: "ray"`` vLLM's own
           Ray workers take one GPU bundle each); then read back where Ray put each
           bundle: the recorded layout is what the run got;
        3. on two or more nodes, probe every node in the engine environment
           (:func:`orchestrator.dispatch.ray.probe.probe_on_nodes`) and compare
           (:func:`orchestrator.cluster.parity.check_parity`): a blocking mismatch removes
           the group and raises :class:`LaunchBlocked` with the report;
        4. start the supervisor on the rank-0 node, holding that node's GPUs (what
           every node got is recorded in the runs' ``engine_info["gpu_assignment"]``).

        Raises ``TimeoutError`` if the group is not ready within
        ``placement_timeout_s`` (the group is removed first).
        """
        tp = int(layout.get("tensor_parallel_size", 1))
        pp = int(layout.get("pipeline_parallel_size", 1))
        devices = reserved_devices(layout)
        exclusive = bool(layout.get("exclusive_nodes", False))
        executor = str(layout.get("executor") or "mp")
        if executor == "ray" and self.resource != "GPU":
            raise LaunchRefused(RAY_EXECUTOR_ON_CPU)
        nodes = self.nodes()
        problem = shape_problem(nodes, tp, pp, devices, resource=self.resource)
        if problem is not None:
            raise LaunchRefused(problem)
        plan = plan_placement(nodes, tp, pp, devices=devices, exclusive=exclusive)
        if plan is None:
            raise NoCapacity(f"{tp}x{pp} on {devices} {self.resource} devices is busy")
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
            parts, doc = self._actual_layout(pg, plan, specs, gpus_per_bundle=per_node)
            doc["executor"] = executor
            doc["device_kind_source"] = self.resource_source
            parity: dict[str, Any] | None = None
            if len(parts) > 1:
                parity = self.check_nodes(
                    [p.node_id for p in parts],
                    model_dir=job.launch.model_dir,
                    engine_args=job.launch.engine_args,
                    tp=tp,
                    pp=pp,
                    revision=job.launch.model_revision,
                    by_id=job.launch.resolve_model_on_node,
                )
                if parity.get("verdict") == "blocked":
                    raise LaunchBlocked(parity, doc)
            if executor == "ray":
                job = job.model_copy(update={"launch": ray_executor_launch(job.launch, pg)})
            elif len(parts) > 1:
                job = job.model_copy(update={"nodes": parts})
            actor = RunSupervisorActor.options(  # type: ignore[attr-defined]
                name=actor_name(run_id),
                namespace=NAMESPACE,
                num_gpus=parts[0].gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=parts[0].bundle_index
                ),
            ).remote(job)
            ray.get(actor.start.remote(), timeout=120)
        except BaseException:
            remove_placement_group(pg)
            raise
        self._runs[run_id] = _Active(actor=actor, result_ref=actor.result.remote(), pg=pg)
        return LaunchInfo(placement=doc, parity=parity)

    def _actual_layout(
        self,
        pg: PlacementGroup,
        plan: Placement,
        specs: list[dict[str, float]],
        *,
        gpus_per_bundle: bool = False,
    ) -> tuple[list[NodePart], dict[str, Any]]:
        """The node parts as Ray placed the bundles, and the layout document to record.

        ``gpus_per_bundle``: each node has one bundle with all its GPUs, which its
        launcher holds (``NodePart.gpus``).
        """
        table = placement_group_table(pg)
        by_bundle: dict[int, str] = {
            int(i): str(n) for i, n in (table.get("bundles_to_node_id") or {}).items()
        }
        ips = {n.node_id: n.ip for n in self.nodes()}
        order: list[str] = []
        bundles: dict[str, list[int]] = {}
        reserved: dict[str, int] = {}
        for i, spec in enumerate(specs):
            node_id = by_bundle.get(i, "")
            if node_id not in bundles:
                order.append(node_id)
                bundles[node_id] = []
                reserved[node_id] = 0
            bundles[node_id].append(i)
            reserved[node_id] += int(spec.get(self.resource, 0))
        per_node = plan.devices // max(1, len(order))
        parts: list[NodePart] = []
        first_core: dict[str, int] = {}
        for rank, node_id in enumerate(order):
            ip = ips.get(node_id, "")
            used = plan.devices if len(order) == 1 else per_node
            env: dict[str, str] = {}
            if self.resource == "CPU":
                # each node binds its own cores; nodes sharing a host (a test cluster) get
                # consecutive cores so their engines do not share one
                start = first_core.get(ip, 0)
                local = {"tensor_parallel_size": plan.tp, "devices": used}
                local["pipeline_parallel_size"] = plan.pp // len(order)
                env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(local, start)
                first_core[ip] = start + used
            parts.append(
                NodePart(
                    rank=rank,
                    node_id=node_id,
                    ip=ip,
                    bundle_index=bundles[node_id][0],
                    devices=used,
                    gpus=reserved[node_id] if gpus_per_bundle else 0,
                    env=env,
                )
            )
        doc = {
            "nodes": [
                {
                    "rank": p.rank,
                    "node_id": p.node_id,
                    "ip": p.ip,
                    "devices": p.devices,
                    "reserved": reserved[p.node_id],
                    "bundles": bundles[p.node_id],
                    "stages": list(
                        range(p.rank * plan.pp // len(order), (p.rank + 1) * plan.pp // len(order))
                    ),
                    **({"cpu_binding": p.env["VLLM_CPU_OMP_THREADS_BIND"]} if p.env else {}),
                }
                for p in parts
            ],
            "nnodes": len(parts),
            "exclusive": plan.exclusive,
            "policy": plan.policy,
            "resource": self.resource,
            "bundle_shape": "per_node" if gpus_per_bundle else "per_device",
            "tensor_parallel_size": plan.tp,
            "pipeline_parallel_size": plan.pp,
        }
        return parts, doc

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
    ) -> dict[str, Any]:
        """Probe ``node_ids`` (default: every live node) and compare their environments.

        ``by_id``: ``model_dir`` is a Hugging Face id that every node resolves in its own
        HF cache at ``revision`` (the snapshot commits and file digests are compared).

        Returns the :func:`orchestrator.cluster.parity.check_parity` report with the nodes
        in the given order, each named ``rank<i>:<hostname>`` and carrying the engine
        arguments it would launch with. Raises :class:`jobs.nodeprobe.ProbeError` when
        a node's probe fails, ``ValueError`` for an unknown node id.
        """
        live = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        ids = list(node_ids) if node_ids else sorted(live)
        unknown = [i for i in ids if i not in live]
        if unknown:
            raise ValueError(f"no live Ray node {', '.join(unknown)}")
        fingerprints = probe_on_nodes(
            ids,
            str(self.settings.engine.python),
            model_dir,
            self.digest_cache_path("{node_id}"),
            revision=(revision or "main") if by_id else None,
        )
        ordered = []
        for i, node_id in enumerate(ids):
            fp = dict(fingerprints[node_id])
            fp["node"] = f"rank{i}:{fp.get('hostname') or fp.get('ip') or node_id[:12]}"
            fp["engine_args"] = dict(engine_args)
            fp["launch_args"] = render_engine_args(engine_args)
            ordered.append(fp)
        report = check_parity(
            ordered,
            {"model": model_dir, "tensor_parallel_size": tp, "pipeline_parallel_size": pp},
        )
        report["node_ids"] = ids
        return report

    def attach(self, run_id: str) -> bool:
        try:
            actor = ray.get_actor(actor_name(run_id), namespace=NAMESPACE)
        except ValueError:
            return False
        self._runs[run_id] = _Active(actor=actor, result_ref=actor.result.remote(), pg=None)
        return True

    def poll(self, run_id: str) -> Poll:
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
        try:
            progress = ray.get(active.actor.progress.remote(), timeout=10)
        except (GetTimeoutError, RayError):
            progress = None
        return Poll(done=False, progress=progress)

    def records(self, run_id: str, since: dict[str, int]) -> dict[str, list[dict[str, Any]]]:
        """The request records the batch's runs finished after ``since[run_id]`` of them
        (:meth:`RunSupervisor.records`); ``{}`` when the supervisor does not answer."""
        active = self._runs.get(run_id)
        if active is None:
            return {}
        try:
            found: dict[str, list[dict[str, Any]]] = ray.get(
                active.actor.records.remote(since), timeout=10
            )
        except (GetTimeoutError, RayError):
            return {}
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
