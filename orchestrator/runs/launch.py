"""A run's launch job: the :class:`jobs.schemas.BatchJob` the dispatcher hands to a run backend.

The engine arguments are the run's own (``Run.explicit_engine_args``, assembled once by
:func:`orchestrator.experiments.planner.explicit_engine_args` when the experiment was
planned) plus :data:`LAUNCH_ENGINE_ARGS`; :func:`jobs.engine.server.build_serve_command` turns
them into the ``vllm serve`` command line on the node.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jobs.capacity.search import CapacitySpec
from jobs.schemas import BatchJob, EngineLaunch, RunSegment, WorkloadSpec
from orchestrator.cluster.placement import cpu_thread_binding
from orchestrator.core.models import Run
from orchestrator.core.settings import Settings
from orchestrator.experiments.spec import GoodputSLOs

#: Engine arguments every launch adds unless the run sets them: cached prompt tokens per
#: request (``usage.prompt_tokens_details``); it changes nothing the engine computes.
LAUNCH_ENGINE_ARGS: dict[str, Any] = {"enable_prompt_tokens_details": True}


def _slos(run: Run) -> dict[str, float]:
    """The run's experiment's goodput SLOs as ``{"ttft"|"tpot"|"e2el": ms}`` ({} if none)."""
    doc = (run.experiment.spec or {}).get("slos") if run.experiment is not None else None
    return GoodputSLOs.model_validate(doc).as_loadgen() if doc else {}


def _capacity(run: Run) -> CapacitySpec | None:
    """The run's experiment's capacity search (the same for every run), or None."""
    doc = (run.experiment.spec or {}).get("capacity") if run.experiment is not None else None
    return CapacitySpec.model_validate(doc) if doc else None


def build_batch_job(settings: Settings, runs: list[Run], resource: str = "CPU") -> BatchJob:
    """The :class:`BatchJob` for ``runs`` (same server configuration), in order.

    The server is launched with the first run's configuration; each run is
    one segment with its own workload (and its experiment's goodput SLOs and capacity
    search, when set). ``resource`` is the device kind in force
    (``"CPU"``: the run's vLLM threads are bound to its cores).
    """
    first = runs[0]
    log_path = (settings.runs_dir / first.id / "engine.log").resolve()
    env: dict[str, str] = {
        "VLLM_CPU_KVCACHE_SPACE": str(settings.engine.kv_cache_space_gib),
        # marks every engine process of the batch (orphan checks scan /proc for it)
        "VLAB_RUN_ID": first.id,
    }
    if resource == "GPU":
        # CUDA numbers the devices of CUDA_VISIBLE_DEVICES in this order; Ray's GPU ids and
        # NVML/nvidia-smi indices are PCI bus order (CUDA's default is fastest first)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    if resource == "CPU":
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(first.layout)
    return BatchJob(
        launch=EngineLaunch(
            engine_python=str(Path(settings.engine.python).absolute()),
            # a model named by id is resolved again on each node that runs it, in its own
            # Hugging Face cache, at the commit the submission resolved it to
            model_dir=first.model_id if first.model_revision else first.model_path,
            model_revision=first.model_revision,
            resolve_model_on_node=first.model_revision is not None,
            served_model_name=first.model_id,
            engine_args={**LAUNCH_ENGINE_ARGS, **first.explicit_engine_args},
            env=env,
            startup_timeout_s=settings.engine.startup_timeout_s,
            log_path=str(log_path),
        ),
        segments=[
            RunSegment(
                run_id=r.id,
                workload=WorkloadSpec.model_validate(r.workload),
                goodput_slos_ms=_slos(r),
                capacity=_capacity(r),
            )
            for r in runs
        ],
        request_timeout_s=settings.engine.request_timeout_s,
    )
