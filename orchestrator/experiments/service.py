"""Use cases of the service: submit an experiment, cancel a run, record a result.

Services take a session and never commit; the caller's unit of work does. The
exceptions are :func:`submit_experiment` and :func:`submit_variant` (the API's
submissions): they commit the caller's transaction once, after their reads,
because vLLM's configuration check (6-80 s cold) must run with no database
connection held; they store the result in a new transaction of the same session.
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import copy
import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session

from jobs.schemas import BatchJob, EngineLaunch, RunResult, RunSegment, WorkloadSpec
from orchestrator.cluster.placement import NodeInventory
from orchestrator.core.db import release_connection
from orchestrator.core.errors import (
    ConflictError,
    EngineUnavailableError,
    NotFoundError,
    SpecInvalidError,
)
from orchestrator.core.models import Experiment, Run
from orchestrator.core.repositories import (
    ExperimentRepository,
    OrchestratorRepository,
    RunRepository,
)
from orchestrator.core.settings import Settings
from orchestrator.core.states import RunStatus, is_terminal
from orchestrator.experiments.config_check import gate_for
from orchestrator.experiments.engine_catalog import EngineArgCatalog, parse_human_int
from orchestrator.experiments.planner import Plan, PlannedRun, Resolver, plan_experiment
from orchestrator.experiments.spec import (
    ExperimentSpec,
    GoodputSLOs,
    PlannedVariant,
    Variant,
    expand,
)

log = logging.getLogger(__name__)

GENERATED_SHAPES = ("tiny", "small")


class ResolvedModel:
    """A model the engine can serve, with its identity.

    ``path`` is a directory on this (API) host with the model's ``config.json`` and
    tokenizer: the model itself for directories and generated models, the metadata
    files a node sent for a model named by Hugging Face id (``revision`` is then the
    snapshot commit it resolved to and ``by_id`` is True; the weights stay on the
    nodes).
    """

    def __init__(
        self,
        model_id: str,
        path: Path,
        digest: str,
        generated: bool,
        revision: str | None = None,
        resolution: dict[str, Any] | None = None,
    ) -> None:
        self.model_id = model_id
        self.path = path
        self.digest = digest
        self.generated = generated
        self.revision = revision
        self.resolution = resolution or {}

    @property
    def by_id(self) -> bool:
        return self.revision is not None

    @property
    def max_position_embeddings(self) -> int | None:
        try:
            cfg = json.loads((self.path / "config.json").read_text())
        except (OSError, ValueError):
            return None
        value = cfg.get("max_position_embeddings")
        return int(value) if isinstance(value, int) else None


#: Resolves a model id on a node that will run it: ``(settings, model, revision) -> the
#: document of ``jobs/vllm_launcher.py resolve-model``; raises ``EngineError`` with the
#: node's answer. The orchestrator's Ray layer installs one that runs on a cluster node
#: (:func:`orchestrator.dispatch.ray.models.locate_on_cluster`); without it the model is
#: resolved on this host with the engine environment.
ModelLocator = Callable[[Settings, str, str | None], dict[str, Any]]
_locator: ModelLocator | None = None
_located: dict[tuple[str, str | None], tuple[float, dict[str, Any]]] = {}
_located_lock = threading.Lock()
#: Seconds a node's answer for a model id is reused (a submission asks twice).
LOCATE_CACHE_S = 60.0
_generate_lock = threading.Lock()
_HF_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


@dataclass
class _Remembered:
    answers: dict[str, dict[str, Any]] = field(default_factory=dict)
    models: dict[tuple[str, str | None], ResolvedModel] = field(default_factory=dict)


_remembered: contextvars.ContextVar[_Remembered | None] = contextvars.ContextVar(
    "vlab_remembered_checks", default=None
)


@contextlib.contextmanager
def remembered_checks() -> Iterator[None]:
    """Within the block, vLLM's answers (per model directory and configuration) and
    resolved models are remembered and reused: a check done outside a transaction is
    not redone (holding a database connection) when the same spec is checked again
    inside one."""
    token = _remembered.set(_Remembered())
    try:
        yield
    finally:
        _remembered.reset(token)


def set_model_locator(locator: ModelLocator | None) -> None:
    """Install (or remove) the process-wide model locator."""
    global _locator
    _locator = locator
    with _located_lock:
        _located.clear()


def _locate_here(settings: Settings, model: str, revision: str | None) -> dict[str, Any]:
    from jobs.engine import resolve_model as resolve_on_this_host

    return resolve_on_this_host(
        str(settings.engine.python),
        model,
        revision,
        model_roots=[str(r) for r in settings.model_roots],
        timeout_s=settings.engine.model_resolve_timeout_s,
    )


def locate_model(settings: Settings, model: str, revision: str | None) -> dict[str, Any]:
    """The node's resolution of ``model`` at ``revision`` (cached for a minute)."""
    key = (model, revision)
    now = time.monotonic()
    with _located_lock:
        hit = _located.get(key)
        if hit is not None and now - hit[0] < LOCATE_CACHE_S:
            return hit[1]
    # a node's model look-up is bounded like vLLM's checks (an API submission holds a
    # slot already; background work waits for one)
    with gate_for(settings).slot(patient=True):
        doc = (_locator or _locate_here)(settings, model, revision)
    with _located_lock:
        _located[key] = (now, doc)
    return doc


def _store_meta(settings: Settings, doc: dict[str, Any]) -> Path:
    """Write the config and tokenizer files a node sent under ``<home>/model_meta``."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "--", str(doc.get("model")))
    folder = settings.home.absolute() / "model_meta" / safe / str(doc.get("revision"))
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in (doc.get("meta_files") or {}).items():
        target = (folder / name).resolve()
        if folder.resolve() not in target.parents:
            continue  # a name that leaves the folder is never written
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(base64.b64decode(content))
    if doc.get("config") and not (folder / "config.json").exists():
        (folder / "config.json").write_text(json.dumps(doc["config"]))
    return folder


def _files_digest(files: list[dict[str, Any]]) -> str:
    """SHA-256 over the sorted ``(path, size, sha256)`` of a model's files."""
    rows = sorted((str(f.get("path")), f.get("size"), f.get("sha256")) for f in files)
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


_NO_REVISION = (
    "'revision' applies to a model named by Hugging Face id, but {model!r} is {what}; "
    "drop the revision, or rename the directory so the id is looked up in the cache"
)


def _unknown_model(msg: str) -> SpecInvalidError:
    return SpecInvalidError([{"loc": ["body", "model"], "msg": msg, "type": "unknown_model"}])


def resolve_model(settings: Settings, model: str, revision: str | None = None) -> ResolvedModel:
    """Find (or generate) the model a spec names, the way vLLM names models.

    Within :func:`remembered_checks`, a model already resolved there is reused.

    - ``tiny``/``small``: generated Llama-shaped models (made under
      ``<home>/models`` on first use);
    - a directory with a ``config.json``, given as a path or as a name under a
      configured model root (on this host);
    - a Hugging Face id (``org/name``) at ``revision`` (default ``main``): resolved
      on a node that will run it, in that node's Hugging Face cache
      (:func:`locate_model`); the node sends the snapshot commit, every file's
      digest and the config and tokenizer files, kept under ``<home>/model_meta``.

    Raises :class:`SpecInvalidError` (loc ``model``) when nothing matches, with the
    node's answer for an id.
    """
    memo = _remembered.get()
    if memo is not None and (model, revision) in memo.models:
        return memo.models[(model, revision)]
    found = _resolve_model(settings, model, revision)
    if memo is not None:
        memo.models[(model, revision)] = found
    return found


def _resolve_model(settings: Settings, model: str, revision: str | None) -> ResolvedModel:
    from jobs.engine import EngineError
    from jobs.modelgen import generate_model, model_digest
    from orchestrator.experiments.pathpolicy import model_name_problem, policy_from_settings

    if problem := model_name_problem(model):  # before the file system sees it
        err = {"loc": ["body", "model"], "msg": problem, "type": "bad_model_name"}
        raise SpecInvalidError([err])
    if model in GENERATED_SHAPES:
        if revision is not None:
            raise _unknown_model(_NO_REVISION.format(model=model, what="a generated model"))
        path = settings.models_dir / model
        if not (path / "config.json").exists():
            with _generate_lock:  # concurrent first submissions generate it once
                if not (path / "config.json").exists():
                    generate_model(path, model)
        return ResolvedModel(model, path.resolve(), model_digest(path), generated=True)
    candidates = [Path(model).expanduser()] + [root / model for root in settings.model_roots]
    for cand in candidates:
        with contextlib.suppress(OSError):
            if (cand / "config.json").is_file():
                if revision is not None:  # vLLM too prefers a directory of that name
                    raise _unknown_model(
                        _NO_REVISION.format(model=model, what=f"a directory here ({cand})")
                    )
                roots = [*settings.model_roots, settings.models_dir]
                if outside := policy_from_settings(settings).model_dir_problem(cand, roots):
                    err = {"loc": ["body", "model"], "msg": outside, "type": "path_not_allowed"}
                    raise SpecInvalidError([err])
                return ResolvedModel(model, cand.resolve(), model_digest(cand), generated=False)
    if not _HF_ID.match(model) or ".." in model:
        raise _unknown_model(
            f"no model {model!r}: use a Hugging Face id (org/name), a directory holding "
            f"config.json, or a generated model name ({', '.join(GENERATED_SHAPES)})"
        )
    try:
        doc = locate_model(settings, model, revision)
    except EngineError as exc:
        raise _unknown_model(f"model {model!r} could not be resolved: {exc}") from exc
    if not doc.get("revision"):
        # the node found a directory of that name (a model root there): serve it as is
        raise _unknown_model(
            f"model {model!r} is a directory on the node ({doc.get('path')}), not on this "
            "host: add its folder to VLAB_MODEL_ROOTS here too, or name it by Hugging Face id"
        )
    files = list(doc.get("files") or [])
    resolution = {
        k: doc.get(k)
        for k in ("source", "revision", "requested_revision", "hf_cache", "offline")
        if doc.get(k) is not None
    }
    resolution.update(
        {
            "node_path": doc.get("path"),
            "node": doc.get("node"),
            "weights_cached": doc.get("weights_cached"),
            "files": len(files),
            "bytes": sum(int(f.get("size") or 0) for f in files),
        }
    )
    return ResolvedModel(
        model,
        _store_meta(settings, doc),
        _files_digest(files),
        generated=False,
        revision=str(doc["revision"]),
        resolution=resolution,
    )


def engine_resolver(settings: Settings) -> Resolver | None:
    """vLLM's own configuration resolution, when enabled (``VLAB_ENGINE__RESOLVE_CONFIGS``).

    Each call takes a slot of the process-wide
    :func:`orchestrator.experiments.config_check.gate_for`
    (the API's submissions hold one already; other callers wait for one, 503
    ``submissions_busy`` when none frees up in time) and asks the warm vLLM process
    (:func:`orchestrator.experiments.config_check.resolve_configs`). Within
    :func:`remembered_checks`, configurations already answered are not asked again.
    """
    if not settings.engine.resolve_configs:
        return None

    def resolve(model_dir: str, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        from jobs.engine import EngineError
        from orchestrator.experiments import config_check

        memo = _remembered.get()
        keys = [json.dumps([model_dir, c], sort_keys=True, default=str) for c in configs]
        if memo is not None and all(k in memo.answers for k in keys):
            return [memo.answers[k] for k in keys]
        with gate_for(settings).slot(patient=True):  # re-entered by API submissions
            try:
                doc = config_check.resolve_configs(settings, model_dir, configs)
            except EngineError as exc:
                raise EngineUnavailableError(
                    f"vLLM could not resolve the configurations: {exc}"
                ) from exc
        results: list[dict[str, Any]] = doc["results"]
        if memo is not None:
            memo.answers.update(zip(keys, results, strict=True))
        return results

    return resolve


def parse_spec(body: Any, settings: Settings, catalog: EngineArgCatalog) -> ExperimentSpec:
    """Validate a submitted spec document; on failure report every problem at once.

    Schema problems (pydantic), unknown or ill-typed engine arguments found in
    the raw document, and an unknown model are collected together into one
    :class:`SpecInvalidError` (locations start with ``body``).
    """
    try:
        return ExperimentSpec.model_validate(body)
    except ValidationError as exc:
        errors = SpecInvalidError.from_validation(exc).errors
    if not isinstance(body, dict):
        raise SpecInvalidError(errors)
    baseline = body.get("baseline")
    if isinstance(baseline, dict) and isinstance(baseline.get("engine_args"), dict):
        errors += catalog.check(baseline["engine_args"], ["body", "baseline", "engine_args"])
    variants = body.get("variants")
    for i, v in enumerate(variants if isinstance(variants, list) else []):
        changes = v.get("changes") if isinstance(v, dict) else None
        for path, value in (changes if isinstance(changes, dict) else {}).items():
            if isinstance(path, str) and path.startswith("engine_args."):
                for err in catalog.check({path.split(".", 1)[1]: value}, []):
                    errors.append({**err, "loc": ["body", "variants", i, "changes", path]})
    revision_bad = any(e.get("loc", [])[:2] == ["body", "revision"] for e in errors)
    if isinstance(body.get("model"), str) and body["model"] and not revision_bad:
        revision = body.get("revision") if isinstance(body.get("revision"), str) else None
        try:
            resolve_model(settings, body["model"], revision)
        except SpecInvalidError as exc:
            errors += exc.errors
    raise SpecInvalidError(errors)


@dataclass
class ClusterView:
    """What planning reads about the live cluster (the orchestrators' heartbeats).

    ``devices``/``nodes`` None: unknown, not checked; ``kind`` None: the device kind
    is not checked (the default view checks nothing).
    """

    devices: int | None = None
    nodes: list[NodeInventory] | None = None
    kind: str | None = None

    @classmethod
    def read(cls, session: Session, settings: Settings) -> ClusterView:
        repo = OrchestratorRepository(session)
        resource, stale = settings.orchestrator.device_resource, settings.orchestrator.stale_after_s
        return cls(
            devices=repo.cluster_devices(resource, stale),
            nodes=repo.cluster_nodes(resource, stale),
            kind=repo.device_kind(resource, stale),
        )


def _plan(
    session: Session,
    settings: Settings,
    spec: ExperimentSpec,
    catalog: EngineArgCatalog,
    model: ResolvedModel,
    resolver: Resolver | None,
) -> Plan:
    """:func:`plan_experiment` for ``spec`` on ``model``, checked against the live cluster
    (read in ``session``); see :func:`_plan_for`."""
    return _plan_for(ClusterView.read(session, settings), spec, catalog, model, resolver)


def _plan_for(
    cluster: ClusterView,
    spec: ExperimentSpec,
    catalog: EngineArgCatalog,
    model: ResolvedModel,
    resolver: Resolver | None,
) -> Plan:
    """:func:`plan_experiment` for ``spec`` on ``model``, checked against ``cluster``.

    A variant with ``layout.executor: "ray"`` is refused when the device kind in force
    is CPU (the CPU build of vLLM refuses the Ray executor). Uses no database.
    """
    if model.resolution.get("offline") and model.resolution.get("weights_cached") is False:
        variants, _ = expand(spec)
        missing = [v.name for v in variants if v.config.engine_args.get("load_format") != "dummy"]
        if missing:
            return Plan(
                variants=variants,
                errors=[
                    {
                        "loc": ["body", "model"],
                        "msg": f"{model.model_id} @ {model.revision}: the node's Hugging Face "
                        f"cache ({model.resolution.get('hf_cache')}) has its config and "
                        "tokenizer but no weights, and HF_HUB_OFFLINE=1 there, so vLLM cannot "
                        "load it; download the weights into that cache, or set "
                        "engine_args.load_format 'dummy' (random weights) for: "
                        f"{', '.join(missing)}",
                        "type": "model_weights_missing",
                    }
                ],
            )
    if cluster.kind == "CPU":
        # before vLLM's (slow) configuration check: nothing else matters for these
        variants, _ = expand(spec)
        refused = [
            {
                "loc": _executor_loc(spec, v),
                "msg": f"{v.name}: {RAY_EXECUTOR_ON_CPU}",
                "type": "executor_unsupported",
            }
            for v in variants
            if v.config.layout.executor == "ray"
        ]
        if refused:
            return Plan(variants=variants, errors=refused)
    return plan_experiment(
        spec,
        catalog,
        model_dir=str(model.path),
        model_digest=model.digest,
        generated_model=model.generated,
        cluster_devices=cluster.devices,
        resolver=resolver,
        model_max_len=model.max_position_embeddings,
        cluster_nodes=cluster.nodes,
    )


def _executor_loc(spec: ExperimentSpec, v: PlannedVariant) -> list[str | int]:
    """Where a variant's ``layout.executor`` comes from in the submitted document."""
    if v.source == "variant" and "layout.executor" in v.changes:
        index = next(i for i, x in enumerate(spec.variants) if x.name == v.name)
        return ["body", "variants", index, "changes", "layout.executor"]
    if v.source == "factor":
        return ["body", "factors", v.variable or ""]
    return ["body", "baseline", "layout", "executor"]


#: Why ``layout.executor: "ray"`` is refused on CPU (also the launch-time refusal).
RAY_EXECUTOR_ON_CPU = (
    "layout.executor 'ray' needs GPUs: the device kind of this cluster is CPU, and vLLM's "
    "CPU build refuses --distributed-executor-backend ray ('current platform cpu does not "
    "support ray'); use executor 'mp' (one vllm serve per node with --nnodes)"
)


def create_experiment(
    session: Session,
    settings: Settings,
    spec: ExperimentSpec,
    catalog: EngineArgCatalog,
    *,
    resolver: Resolver | None = None,
) -> Experiment:
    """Check ``spec`` and store the experiment with all its runs (``queued``).

    Raises :class:`SpecInvalidError` listing every problem; nothing is stored then.
    The check (vLLM's, through ``resolver``) runs inside the caller's transaction:
    the API uses :func:`submit_experiment` instead.
    """
    model = _model_for(settings, spec)
    checked = _check_experiment(ClusterView.read(session, settings), spec, catalog, model, resolver)
    return _store_experiment(session, checked, catalog)


def submit_experiment(
    session: Session,
    settings: Settings,
    spec: ExperimentSpec,
    catalog: EngineArgCatalog,
    *,
    resolver: Resolver | None = None,
) -> Experiment:
    """:func:`create_experiment` holding no database connection during the check.

    The cluster's state is read, then the caller's transaction is committed
    (:func:`orchestrator.core.db.release_connection`: its connection goes back to the pool);
    the model, vLLM's check and the request lists are computed with no connection
    held; the experiment is stored in a new transaction of ``session``, which the
    caller's unit of work commits. Errors as :func:`create_experiment`, plus 503
    ``submissions_busy`` from ``resolver``.
    """
    cluster = ClusterView.read(session, settings)
    release_connection(session)
    model = _model_for(settings, spec)
    checked = _check_experiment(cluster, spec, catalog, model, resolver)
    return _store_experiment(session, checked, catalog)


def precheck(settings: Settings, catalog: EngineArgCatalog, doc: Any) -> None:
    """Ask vLLM about the configurations of spec document ``doc`` using no database,
    inside :func:`remembered_checks`, so that checking it again there in a transaction
    (:func:`orchestrator.schedules.service.validate_template`) reuses the answers instead of
    holding a connection during vLLM's check. Reports nothing: problems are reported by
    that later check (which also knows the cluster)."""
    try:
        spec = parse_spec(doc, settings, catalog)
        model = _model_for(settings, spec)
    except SpecInvalidError:
        return
    _plan_for(ClusterView(), spec, catalog, model, engine_resolver(settings))


def _model_for(settings: Settings, spec: ExperimentSpec) -> ResolvedModel:
    pre_errors = expand(spec)[1]
    if pre_errors:
        raise SpecInvalidError(pre_errors)
    return resolve_model(settings, spec.model, spec.revision)


@dataclass
class _Checked:
    """A spec that passed every check, with what storing it needs."""

    spec: ExperimentSpec
    model: ResolvedModel
    plan: Plan
    hasher: _RequestListHasher


def _check_experiment(
    cluster: ClusterView,
    spec: ExperimentSpec,
    catalog: EngineArgCatalog,
    model: ResolvedModel,
    resolver: Resolver | None,
) -> _Checked:
    """Plan ``spec`` and build its request lists (no database). Raises
    :class:`SpecInvalidError` with every problem."""
    plan = _plan_for(cluster, spec, catalog, model, resolver)
    if plan.errors:
        raise SpecInvalidError(plan.errors)
    return _Checked(spec, model, plan, _hashed(model, plan))


def _hashed(model: ResolvedModel, plan: Plan) -> _RequestListHasher:
    """A hasher that already holds every workload's request list hash of ``plan``."""
    hasher = _RequestListHasher(model.path)
    for v in plan.variants:
        hasher(v.config.workload)
    return hasher


def _store_experiment(session: Session, c: _Checked, catalog: EngineArgCatalog) -> Experiment:
    spec, model, plan, hasher = c.spec, c.model, c.plan, c.hasher
    experiment = Experiment(
        name=spec.name,
        description=spec.description,
        spec=spec.model_dump(mode="json"),
        model_id=model.model_id,
        model_digest=model.digest,
        model_revision=model.revision,
        request_list_hash=hasher(plan.variants[0].config.workload),
        repeats=spec.repeats,
        variants=[_variant_doc(v) for v in plan.variants],
    )
    if plan.pinned:
        experiment.spec = {**experiment.spec, "pinned_engine_args": plan.pinned}
    if model.resolution:
        experiment.spec = {**experiment.spec, "model_resolution": model.resolution}
    ExperimentRepository(session).add(experiment)
    _store_runs(session, experiment, plan.runs, model, catalog, hasher, {})
    session.refresh(experiment)
    return experiment


class _RequestListHasher:
    """Hash of each distinct workload's request list, built with the model's tokenizer."""

    def __init__(self, model_path: Path) -> None:
        from jobs.modelgen import load_tokenizer

        self.tokenizer = load_tokenizer(model_path)
        self.hashes: dict[str, str] = {}

    def __call__(self, workload: WorkloadSpec) -> str:
        from jobs.workload import build_requests, request_list_hash

        key = workload.model_dump_json()
        if key not in self.hashes:
            self.hashes[key] = request_list_hash(build_requests(workload, self.tokenizer))
        return self.hashes[key]


def _variant_doc(v: PlannedVariant) -> dict[str, Any]:
    return {
        "name": v.name,
        "position": v.position,
        "reference": v.reference,
        "variable": v.variable,
        "variable_paths": v.variable_paths,
        "changes": v.changes,
        "source": v.source,
    }


def _store_runs(
    session: Session,
    experiment: Experiment,
    runs: list[PlannedRun],
    model: ResolvedModel,
    catalog: EngineArgCatalog,
    hasher: _RequestListHasher,
    run_ids: dict[tuple[str, int], str],
    sequence_offset: int = 0,
) -> list[Run]:
    """Insert ``runs`` (queued); ``run_ids`` maps (variant, repeat) to existing run ids."""
    stored = []
    for p in sorted(runs, key=lambda r: (r.variant.position, r.repeat_index)):
        v = p.variant
        explicit = p.explicit_engine_args
        run = Run(
            experiment_id=experiment.id,
            name=v.name,
            position=v.position,
            is_baseline=v.reference is None,
            reference_run_id=run_ids.get((v.reference, p.repeat_index)) if v.reference else None,
            reference_variant=v.reference,
            variable=v.variable,
            variable_paths=v.variable_paths,
            changes=v.changes,
            repeat_index=p.repeat_index,
            sequence=sequence_offset + p.sequence,
            server_key=p.server_key,
            resolved_config=p.resolved_config,
            status=RunStatus.QUEUED.value,
            progress={},
            engine_args=p.resolved_engine_args,
            explicit_engine_args=explicit,
            layout=v.config.layout.model_dump(mode="json"),
            workload=v.config.workload.model_dump(mode="json"),
            model_id=model.model_id,
            model_path=str(model.path),
            model_digest=model.digest,
            model_revision=model.revision,
            max_model_len=context_cap(p, model),
            seed=v.config.workload.seed,
            request_list_hash=hasher(v.config.workload),
            vllm_version=catalog.vllm_version,
            engine_info={},
            timings={},
        )
        session.add(run)
        session.flush()
        run_ids[(v.name, p.repeat_index)] = run.id
        stored.append(run)
    return stored


def context_cap(p: PlannedRun, model: ResolvedModel) -> int | None:
    """The run's context cap: vLLM's resolved value, else an integer in the spec, else the
    model's ``max_position_embeddings``."""
    resolved = (p.resolved_config or {}).get("model_config.max_model_len")
    if isinstance(resolved, int) and not isinstance(resolved, bool):
        return resolved
    return parse_human_int(p.explicit_engine_args.get("max_model_len")) or (
        model.max_position_embeddings
    )


_SPEC_FACTS = ("pinned_engine_args", "model_resolution")


def add_variant(
    session: Session,
    settings: Settings,
    catalog: EngineArgCatalog,
    run_id: str,
    variant: Variant,
    *,
    resolver: Resolver | None = None,
) -> list[Run]:
    """Clone run ``run_id``'s variant with one change: ``POST /runs/{id}/variants``.

    The new variant's reference is the cloned run's variant; it gets the
    experiment's repeat count, queued after the experiment's existing runs.
    Raises :class:`SpecInvalidError` under the same rules as a new experiment.
    The check runs inside the caller's transaction (the experiment row locked):
    the API uses :func:`submit_variant` instead.
    """
    run = get_run(session, run_id)
    experiment = session.get(Experiment, run.experiment_id, with_for_update=True)
    assert experiment is not None
    cluster = ClusterView.read(session, settings)
    c = _check_variant(cluster, settings, catalog, experiment.spec, run.name, variant, resolver)
    return _store_variant(session, experiment, c, catalog)


def submit_variant(
    session: Session,
    settings: Settings,
    catalog: EngineArgCatalog,
    run_id: str,
    variant: Variant,
    *,
    resolver: Resolver | None = None,
    attempts: int = 3,
) -> list[Run]:
    """:func:`add_variant` holding no database connection during the check.

    The experiment's spec and the cluster's state are read and the caller's
    transaction committed (:func:`orchestrator.core.db.release_connection`); the new
    variant is checked with no connection held; then, in a new transaction of
    ``session`` (committed by the caller), the experiment row is locked and the runs
    stored if its spec is still the one checked. If another variant was added
    meanwhile, the check is done again (vLLM's answers remembered), up to
    ``attempts`` times, then 409 ``experiment_busy``.
    """
    with remembered_checks():
        for _ in range(attempts):
            run = get_run(session, run_id)
            experiment = session.get(Experiment, run.experiment_id, populate_existing=True)
            assert experiment is not None
            seen = copy.deepcopy(experiment.spec)
            reference, cluster = run.name, ClusterView.read(session, settings)
            release_connection(session)
            c = _check_variant(cluster, settings, catalog, seen, reference, variant, resolver)
            experiment = session.get(
                Experiment, run.experiment_id, with_for_update=True, populate_existing=True
            )
            assert experiment is not None
            if experiment.spec == seen:
                session.expire(experiment, ["runs"])  # as they are now, under the lock
                return _store_variant(session, experiment, c, catalog)
    raise ConflictError(
        f"the experiment of run {run_id} kept changing while the variant was checked; "
        "submit it again",
        code_hint="experiment_busy",
    )


@dataclass
class _CheckedVariant:
    checked: _Checked
    variant: Variant
    #: facts the service added to the stored spec (not part of what a user submits)
    added: dict[str, Any]


def _check_variant(
    cluster: ClusterView,
    settings: Settings,
    catalog: EngineArgCatalog,
    stored_spec: dict[str, Any],
    reference: str,
    variant: Variant,
    resolver: Resolver | None = None,
) -> _CheckedVariant:
    """The experiment spec ``stored_spec`` with ``variant`` (referring to ``reference``)
    appended, planned and checked (no database). Raises :class:`SpecInvalidError`; the
    new variant's problems are located at ``body`` (the request's own body)."""
    added = {k: v for k, v in stored_spec.items() if k in _SPEC_FACTS}
    doc = {k: v for k, v in stored_spec.items() if k not in _SPEC_FACTS}
    variant = variant.model_copy(update={"reference": reference})
    doc["variants"] = [*doc.get("variants", []), variant.model_dump(mode="json")]
    try:
        spec = ExperimentSpec.model_validate(doc)
    except ValidationError as exc:
        raise SpecInvalidError.from_validation(exc) from exc
    model = resolve_model(settings, spec.model, spec.revision)
    plan = _plan_for(cluster, spec, catalog, model, resolver)
    if plan.errors:
        new_loc = ["body", "variants", len(spec.variants) - 1]
        raise SpecInvalidError(
            [
                {**e, "loc": ["body", *e["loc"][3:]]} if e["loc"][:3] == new_loc else e
                for e in plan.errors
            ]
        )
    return _CheckedVariant(_Checked(spec, model, plan, _hashed(model, plan)), variant, added)


def _store_variant(
    session: Session, experiment: Experiment, c: _CheckedVariant, catalog: EngineArgCatalog
) -> list[Run]:
    new_runs = [p for p in c.checked.plan.runs if p.variant.name == c.variant.name]
    existing = {(r.name, r.repeat_index): r.id for r in experiment.runs}
    offset = max((r.sequence for r in experiment.runs), default=-1) + 1
    first = min(p.sequence for p in new_runs)
    for p in new_runs:
        p.sequence -= first
    experiment.spec = {**c.checked.spec.model_dump(mode="json"), **c.added}
    experiment.variants = [*experiment.variants, _variant_doc(new_runs[0].variant)]
    model, hasher = c.checked.model, c.checked.hasher
    return _store_runs(
        session, experiment, new_runs, model, catalog, hasher, existing, sequence_offset=offset
    )


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
        raise ConflictError(
            f"run {run_id} already ended ({run.status}); nothing to cancel",
            code_hint="run_already_ended",
        )
    if run.status == RunStatus.QUEUED.value:
        repo.transition(run, RunStatus.CANCELLED, "cancelled before it started")
    else:
        run.cancel_requested = True
        session.flush()
    return run


def reserved_devices(layout: dict[str, Any]) -> int:
    """Devices a run reserves: ``layout.devices``, else TP x PP."""
    tp = int(layout.get("tensor_parallel_size", 1))
    pp = int(layout.get("pipeline_parallel_size", 1))
    return int(layout.get("devices") or tp * pp)


def cpu_thread_binding(layout: dict[str, Any], first_core: int = 0) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for a run on CPU cores: one core list per rank.

    The run's devices (cores ``first_core ..``) are split evenly over its
    TP x PP ranks: TP=2 on 2 cores -> ``"0|1"``; TP=1 on 2 cores -> ``"0-1"``.
    vLLM's CPU backend needs an explicit binding when TP or PP > 1
    (ENGINE_NOTES.md).
    """
    ranks = int(layout.get("tensor_parallel_size", 1)) * int(
        layout.get("pipeline_parallel_size", 1)
    )
    per = max(1, reserved_devices(layout) // ranks)
    parts = []
    for rank in range(ranks):
        a = first_core + rank * per
        parts.append(f"{a}-{a + per - 1}" if per > 1 else str(a))
    return "|".join(parts)


def _slos(run: Run) -> dict[str, float]:
    """The run's experiment's goodput SLOs as ``{"ttft"|"tpot"|"e2el": ms}`` ({} if none)."""
    doc = (run.experiment.spec or {}).get("slos") if run.experiment is not None else None
    return GoodputSLOs.model_validate(doc).as_loadgen() if doc else {}


def build_batch_job(settings: Settings, runs: list[Run], resource: str = "CPU") -> BatchJob:
    """The :class:`BatchJob` for ``runs`` (same server configuration), in order.

    The server is launched with the first run's configuration; each run is
    one segment with its own workload. ``resource`` is the device kind in force
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
            # cached prompt tokens per request (usage.prompt_tokens_details), unless the user
            # set the flag; it changes nothing the engine computes
            engine_args={"enable_prompt_tokens_details": True, **first.explicit_engine_args},
            env=env,
            startup_timeout_s=settings.engine.startup_timeout_s,
            log_path=str(log_path),
        ),
        segments=[
            RunSegment(
                run_id=r.id,
                workload=WorkloadSpec.model_validate(r.workload),
                goodput_slos_ms=_slos(r),
            )
            for r in runs
        ],
        request_timeout_s=settings.engine.request_timeout_s,
    )


def _kv_cache_check(run: Run, engine_info: dict[str, Any]) -> dict[str, Any]:
    """``{"kv_cache_check": ...}``: the KV cache estimate next to the engine's printed
    figures (:func:`orchestrator.analysis.kvcache.check_against_engine`), or ``{}`` when the
    model's config.json or the engine's figures are not available."""
    from orchestrator.analysis.kvcache import check_against_engine

    facts = engine_info.get("startup_facts") or {}
    try:
        config = json.loads((Path(run.model_path) / "config.json").read_text())
        check = check_against_engine(config, run.engine_args or {}, facts)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.info("run %s: no KV cache check (%s)", run.id, exc)
        return {}
    return {} if check is None else {"kv_cache_check": check}


def _prefix_analysis(run: Run, result: RunResult) -> dict[str, Any]:
    """``{"prefix_analysis": ...}`` for a succeeded run with prefix caching on: the
    prompt-prefix analyser over the run's own request list (rebuilt from its workload,
    as the runner built it), summarised by :func:`orchestrator.analysis.prefix.summarize`;
    ``{"prefix_analysis": {"error": ...}}`` when it cannot be computed, ``{}`` otherwise."""
    if result.status != "succeeded" or not (run.engine_args or {}).get("enable_prefix_caching"):
        return {}
    try:
        from jobs.modelgen import load_tokenizer
        from jobs.workload import build_requests
        from orchestrator.analysis.prefix import analyze_prefix, summarize

        spec = WorkloadSpec.model_validate(run.workload)
        requests = build_requests(spec, load_tokenizer(run.model_path))
        block_size = int((run.engine_args or {}).get("block_size") or 16)
        analysis = analyze_prefix(requests, run.model_path, block_size=block_size)
    except Exception as exc:  # the run's result must be stored whatever the analyser does
        log.warning("run %s: prefix analysis failed: %s", run.id, exc)
        return {"prefix_analysis": {"error": f"{type(exc).__name__}: {exc}"[:500]}}
    return {"prefix_analysis": summarize(analysis)}


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
    run.engine_info = {
        **result.engine_info,
        **_kv_cache_check(run, result.engine_info),
        **_prefix_analysis(run, result),
    }
    run.timings = result.timings
    # the final counters are what was measured, not the last heartbeat's (which may
    # predate the last requests or belong to the previous phase)
    measured = sum(1 for r in result.requests if not r.warmup)
    run.progress = {
        **(run.progress or {}),
        "phase": "done",
        "message": result.status,
        "requests_done": measured,
    }
    if result.status == "succeeded":
        run.progress["requests_total"] = measured
    else:  # never "400 of 0": the planned count, or at least what finished
        planned = int(run.progress.get("requests_total") or 0)
        run.progress["requests_total"] = max(planned, measured)
    run.error = result.error
    run.partial = result.partial
    if result.engine_info.get("vllm_version"):
        run.vllm_version = str(result.engine_info["vllm_version"])
    status = RunStatus(result.status)
    if status == RunStatus.SUCCEEDED and run.status == RunStatus.PREPARING.value:
        repo.transition(run, RunStatus.RUNNING)
    repo.transition(run, status, result.error if status != RunStatus.SUCCEEDED else None)
