"""Model resolution on a cluster node: where a model named by Hugging Face id lives.

A submission names a model the vLLM way (``Qwen/Qwen2.5-7B-Instruct`` with a
revision); the weights live in the Hugging Face cache of the GPU nodes
(``HF_HOME``, often shared storage), not on the API host. :func:`locate_on_cluster`
runs :func:`jobs.engine.queries.resolve_model` as a Ray task on a live node that has the
run's device kind, in the engine's own interpreter there (that node's python from
``VLAB_ENGINE__PYTHON_BY_NODE``, in the engine's image with ``VLAB_ENGINE__IMAGE_URI``),
and returns that node's answer (snapshot commit, file digests, config and tokenizer files).
"""

from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError, RayTaskError

from jobs.engine.queries import resolve_model
from jobs.engine.server import EngineError
from orchestrator.core.settings import EngineSettings, Settings, detect_device_resource


def _resolve_task(
    engine_python: str,
    model: str,
    revision: str | None,
    roots: list[str],
    timeout_s: float,
    engine: EngineSettings | None = None,
) -> dict[str, Any]:
    """Body of the Ray task (module level: pickled by reference). With ``engine``, the
    python is this node's (:meth:`EngineSettings.python_for_node`, ``engine_python`` the
    default)."""
    context = ray.get_runtime_context()
    ip = ray.util.get_node_ip_address()
    if engine is not None:
        engine_python, _ = engine.python_for_node(ip, context.get_node_labels(), engine_python)
    doc = resolve_model(engine_python, model, revision, model_roots=roots, timeout_s=timeout_s)
    doc["node"] = {"node_id": context.get_node_id(), "ip": ip, "engine_python": engine_python}
    return doc


def locate_on_cluster(settings: Settings, model: str, revision: str | None) -> dict[str, Any]:
    """Resolve ``model`` at ``revision`` on one live node with devices of the run's kind.

    The task asks for 0.001 of a device, so it lands on a node that can
    run the model (a GPU node on GPU clusters). Raises :class:`jobs.engine.server.EngineError`
    with the node's answer (not in its cache, offline...) or with the reason no node
    answered in ``engine.model_resolve_timeout_s`` seconds.
    """
    resource, _ = detect_device_resource(
        settings.orchestrator.device_resource,
        {k: float(v) for k, v in ray.cluster_resources().items()},
    )
    timeout_s = settings.engine.model_resolve_timeout_s
    task = ray.remote(num_cpus=0, max_retries=0)(_resolve_task)
    amount: dict[str, Any] = {"num_gpus": 0.001} if resource == "GPU" else {"num_cpus": 0.001}
    if settings.engine.image_uri:  # resolved in the engine's image, as the engine runs
        amount["runtime_env"] = {"image_uri": settings.engine.image_uri}
    ref = task.options(name="vlab-resolve-model", **amount).remote(
        str(settings.engine.python),
        model,
        revision,
        [str(r) for r in settings.model_roots],
        timeout_s,
        settings.engine if settings.engine.python_by_node else None,
    )
    try:
        doc: dict[str, Any] = ray.get(ref, timeout=timeout_s + 30)
        return doc
    except GetTimeoutError as exc:
        ray.cancel(ref, force=True)
        raise EngineError(
            f"no {resource} node answered within {timeout_s + 30:g} s (cluster busy or gone?)"
        ) from exc
    except RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, EngineError):
            raise EngineError(f"on a {resource} node: {cause.message}", cause.log_lines) from exc
        raise EngineError(f"on a {resource} node: {type(cause).__name__}: {cause}") from exc
    except RayError as exc:
        raise EngineError(f"Ray could not run the model resolution: {exc}") from exc
