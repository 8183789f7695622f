"""Model resolution: the model a spec names, found (or generated) the way vLLM names models.

:func:`resolve_model` turns ``model`` (+ ``revision``) into a :class:`ResolvedModel`:
a generated model (``tiny``/``small``), a directory on this host, or a Hugging Face id
resolved on a node that will run it (:func:`locate_model`, through the installed
:data:`ModelLocator`); a node's answer leaves the model's config and tokenizer files
under ``<home>/model_meta`` (:func:`_store_meta`).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jobs.engine.queries import resolve_model as resolve_on_this_host
from jobs.engine.server import EngineError
from jobs.modelgen.generator import generate_model, model_digest
from orchestrator.core.errors import SpecInvalidError
from orchestrator.core.settings import Settings
from orchestrator.experiments.config_check import gate_for, remembered
from orchestrator.experiments.pathpolicy import model_name_problem, policy_from_settings

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
#: document of ``jobs/launcher/vllm_launcher.py resolve-model``; raises ``EngineError`` with the
#: node's answer. The orchestrator's Ray layer installs one that runs on a cluster node
#: (:func:`orchestrator.dispatch.ray.model_locator.locate_on_cluster`); without it the model is
#: resolved on this host with the engine environment.
ModelLocator = Callable[[Settings, str, str | None], dict[str, Any]]
_locator: ModelLocator | None = None
_located: dict[tuple[str, str | None], tuple[float, dict[str, Any]]] = {}
_located_lock = threading.Lock()
#: Seconds a node's answer for a model id is reused (a submission asks twice).
LOCATE_CACHE_S = 60.0
_generate_lock = threading.Lock()
_HF_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def set_model_locator(locator: ModelLocator | None) -> None:
    """Install (or remove) the process-wide model locator."""
    global _locator
    _locator = locator
    with _located_lock:
        _located.clear()


def _locate_here(settings: Settings, model: str, revision: str | None) -> dict[str, Any]:
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

    Within :func:`orchestrator.experiments.config_check.remembered_checks`, a model
    already resolved there is reused.

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
    memo = remembered()
    if memo is not None and (model, revision) in memo.models:
        return memo.models[(model, revision)]
    found = _resolve_model(settings, model, revision)
    if memo is not None:
        memo.models[(model, revision)] = found
    return found


def _resolve_model(settings: Settings, model: str, revision: str | None) -> ResolvedModel:
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
        digest = model_digest(path)
        return ResolvedModel(model, path.resolve(), digest, generated=True)
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
