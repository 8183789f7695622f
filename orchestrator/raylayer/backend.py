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
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from jobs.schemas import BatchJob, RunResult
from orchestrator.dispatcher import Poll
from orchestrator.raylayer.supervisor import NAMESPACE, RunSupervisorActor, actor_name
from orchestrator.settings import Settings

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


@dataclass
class _Active:
    actor: Any
    result_ref: Any
    pg: PlacementGroup | None


class RayRunBackend:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.resource = settings.orchestrator.device_resource
        self._runs: dict[str, _Active] = {}

    def resources(self) -> dict[str, float]:
        return {k: float(v) for k, v in ray.cluster_resources().items()}

    def total_devices(self) -> int:
        return int(ray.cluster_resources().get(self.resource, 0))

    def has_capacity(self, devices: int) -> bool:
        return ray.available_resources().get(self.resource, 0) >= devices

    def launch(self, run_id: str, job: BatchJob, devices: int) -> None:
        """Reserve the placement group, start the supervisor, begin the job.

        Raises ``TimeoutError`` if the group is not ready within
        ``placement_timeout_s`` (the group is removed first).
        """
        pg = placement_group(
            [{self.resource: 1} for _ in range(devices)],
            strategy="PACK",
            name=f"vlab-pg-{run_id}",
        )
        try:
            ray.get(pg.ready(), timeout=self.settings.orchestrator.placement_timeout_s)
        except GetTimeoutError as exc:
            remove_placement_group(pg)
            raise TimeoutError(
                f"placement group of {devices} x {self.resource} not ready in time"
            ) from exc
        actor = RunSupervisorActor.options(  # type: ignore[attr-defined]
            name=actor_name(run_id),
            namespace=NAMESPACE,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=0
            ),
        ).remote(job)
        ray.get(actor.start.remote(), timeout=120)
        self._runs[run_id] = _Active(actor=actor, result_ref=actor.result.remote(), pg=pg)

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
