"""Use cases of the service: submit an experiment, cancel a run, record a result.

Services take a session and never commit; the caller's unit of work does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from jobs.schemas import EngineLaunch, RunJob, RunResult
from orchestrator.engine_catalog import EngineArgCatalog
from orchestrator.errors import NotFoundError, SpecInvalidError
from orchestrator.models import Experiment, Run
from orchestrator.repositories import ExperimentRepository, RunRepository
from orchestrator.settings import Settings
from orchestrator.spec import ExperimentSpec, PlannedRun, expand
from orchestrator.states import RunStatus, is_terminal

GENERATED_SHAPES = ("tiny", "small")


class ResolvedModel:
    """A model directory the engine can serve, with its identity."""

    def __init__(self, model_id: str, path: Path, digest: str, generated: bool) -> None:
        self.model_id = model_id
        self.path = path
        self.digest = digest
        self.generated = generated

    @property
    def max_position_embeddings(self) -> int | None:
        try:
            cfg = json.loads((self.path / "config.json").read_text())
        except (OSError, ValueError):
            return None
        value = cfg.get("max_position_embeddings")
        return int(value) if isinstance(value, int) else None


def resolve_model(settings: Settings, model: str) -> ResolvedModel:
    """Find (or generate) the model a spec names.

    ``tiny``/``small`` name generated Llama-shaped models (made under
    ``<home>/models`` on first use); otherwise a directory with a
    ``config.json``, given as a path or as a name under a configured model root.
    Raises :class:`SpecInvalidError` (loc ``model``) when nothing matches.
    """
    from jobs.modelgen import generate_model, model_digest

    if model in GENERATED_SHAPES:
        path = settings.models_dir / model
        if not (path / "config.json").exists():
            generate_model(path, model)
        return ResolvedModel(model, path.resolve(), model_digest(path), generated=True)
    candidates = [Path(model).expanduser()] + [root / model for root in settings.model_roots]
    for cand in candidates:
        if (cand / "config.json").is_file():
            return ResolvedModel(model, cand.resolve(), model_digest(cand), generated=False)
    raise SpecInvalidError(
        [
            {
                "loc": ["body", "model"],
                "msg": f"no model {model!r}: use a generated model name "
                f"({', '.join(GENERATED_SHAPES)}) or a directory holding config.json",
                "type": "unknown_model",
            }
        ]
    )


def explicit_engine_args(planned: PlannedRun, model: ResolvedModel) -> dict[str, Any]:
    """The engine arguments this run passes on vLLM's command line."""
    args: dict[str, Any] = {}
    if model.generated:
        args["load_format"] = "dummy"  # random weights, real compute (see DESIGN.md)
    args.update(planned.config.engine_args)
    args["tensor_parallel_size"] = planned.config.layout.tensor_parallel_size
    args["pipeline_parallel_size"] = planned.config.layout.pipeline_parallel_size
    return args


def validate_spec(
    spec: ExperimentSpec, catalog: EngineArgCatalog
) -> tuple[list[PlannedRun], list[dict[str, Any]]]:
    """Expand ``spec`` and check every run's engine arguments; return (runs, errors)."""
    runs, errors = expand(spec)
    errors = catalog.check(spec.baseline.engine_args, ["body", "baseline", "engine_args"]) + errors
    for i, variant in enumerate(spec.variants):
        for path, value in variant.changes.items():
            if path.startswith("engine_args."):
                name = path.split(".", 1)[1]
                for err in catalog.check({name: value}, []):
                    errors.append({**err, "loc": ["body", "variants", i, "changes", path]})
    return runs, errors


def create_experiment(
    session: Session, settings: Settings, spec: ExperimentSpec, catalog: EngineArgCatalog
) -> Experiment:
    """Validate ``spec`` and store the experiment with its runs (all ``queued``).

    Raises :class:`SpecInvalidError` listing every problem; nothing is stored then.
    """
    from jobs.modelgen import load_tokenizer
    from jobs.workload import build_requests, request_list_hash

    planned, errors = validate_spec(spec, catalog)
    if errors:
        raise SpecInvalidError(errors)
    model = resolve_model(settings, spec.model)
    tokenizer = load_tokenizer(model.path)
    hashes: dict[str, str] = {}
    experiment = Experiment(
        name=spec.name,
        description=spec.description,
        spec=spec.model_dump(mode="json"),
        model_id=model.model_id,
        model_digest=model.digest,
        request_list_hash="",
    )
    ExperimentRepository(session).add(experiment)
    baseline_id: str | None = None
    for p in planned:
        workload_key = p.config.workload.model_dump_json()
        if workload_key not in hashes:
            hashes[workload_key] = request_list_hash(build_requests(p.config.workload, tokenizer))
        explicit = explicit_engine_args(p, model)
        resolved = catalog.resolve(explicit)
        run = Run(
            experiment_id=experiment.id,
            name=p.name,
            position=p.position,
            is_baseline=p.is_baseline,
            reference_run_id=None if p.is_baseline else baseline_id,
            changes=p.changes,
            status=RunStatus.QUEUED.value,
            progress={},
            engine_args=resolved,
            explicit_engine_args=explicit,
            layout=p.config.layout.model_dump(mode="json"),
            workload=p.config.workload.model_dump(mode="json"),
            model_id=model.model_id,
            model_path=str(model.path),
            model_digest=model.digest,
            max_model_len=explicit.get("max_model_len") or model.max_position_embeddings,
            seed=p.config.workload.seed,
            request_list_hash=hashes[workload_key],
            vllm_version=catalog.vllm_version,
            engine_info={},
            timings={},
        )
        session.add(run)
        session.flush()
        if p.is_baseline:
            baseline_id = run.id
    experiment.request_list_hash = hashes[planned[0].config.workload.model_dump_json()]
    session.flush()
    return experiment


def get_experiment(session: Session, experiment_id: str) -> Experiment:
    exp = ExperimentRepository(session).get(experiment_id)
    if exp is None:
        raise NotFoundError(f"no experiment {experiment_id}", code_hint="experiment_not_found")
    return exp


def get_run(session: Session, run_id: str, *, for_update: bool = False) -> Run:
    run = RunRepository(session).get(run_id, for_update=for_update)
    if run is None:
        raise NotFoundError(f"no run {run_id}", code_hint="run_not_found")
    return run


def request_cancel(session: Session, run_id: str) -> Run:
    """Cancel a run: a queued run ends now; an active one is stopped by its orchestrator."""
    repo = RunRepository(session)
    run = get_run(session, run_id, for_update=True)
    if is_terminal(run.status):
        return run
    if run.status == RunStatus.QUEUED.value:
        repo.transition(run, RunStatus.CANCELLED, "cancelled before it started")
    else:
        run.cancel_requested = True
        session.flush()
    return run


def build_job(settings: Settings, run: Run) -> RunJob:
    """The :class:`RunJob` a supervisor executes for ``run``."""
    from jobs.schemas import WorkloadSpec

    log_path = (settings.runs_dir / run.id / "engine.log").resolve()
    env: dict[str, str] = {
        "VLLM_CPU_KVCACHE_SPACE": str(settings.engine.kv_cache_space_gib),
        # marks every engine process of the run (orphan checks scan /proc for it)
        "VLAB_RUN_ID": run.id,
    }
    return RunJob(
        run_id=run.id,
        launch=EngineLaunch(
            engine_python=str(Path(settings.engine.python).absolute()),
            model_dir=run.model_path,
            served_model_name=run.model_id,
            engine_args=dict(run.explicit_engine_args),
            env=env,
            startup_timeout_s=settings.engine.startup_timeout_s,
            log_path=str(log_path),
        ),
        workload=WorkloadSpec.model_validate(run.workload),
        request_timeout_s=settings.engine.request_timeout_s,
    )


def record_result(session: Session, run: Run, result: RunResult) -> None:
    """Store a finished run's result and end it, in the caller's transaction."""
    repo = RunRepository(session)
    repo.save_measurements(
        run.id,
        metrics=result.metrics,
        samples=[s.model_dump() for s in result.samples],
        requests=[r.model_dump() for r in result.requests],
        engine_log=result.engine_log,
    )
    run.engine_info = result.engine_info
    run.timings = result.timings
    run.error = result.error
    if result.engine_info.get("vllm_version"):
        run.vllm_version = str(result.engine_info["vllm_version"])
    status = RunStatus(result.status)
    if status == RunStatus.SUCCEEDED and run.status == RunStatus.PREPARING.value:
        repo.transition(run, RunStatus.RUNNING)
    repo.transition(run, status, result.error if status != RunStatus.SUCCEEDED else None)
