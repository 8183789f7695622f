"""The engine environment on this node: is the engine's python there, and can it run?

Runs on a node (in a Ray task, :mod:`orchestrator.dispatch.ray.probe`), before anything
of a run is placed there: a stat of the configured python, nothing executed, so it is
cheap (no interpreter start, no ``import torch``) and works for any engine python (the
tests' stand-ins included). The versions the python imports come with the full node
probe (``jobs/launcher/vllm_launcher.py fingerprint``: ``vllm``, ``torch``, and the digest of
its installed distributions under ``engine_env``).

Use::

    facts = engine_env_facts("/opt/vllm/bin/python", kind="path", source="VLAB_ENGINE__PYTHON")
    # {"kind": "path", "python": ..., "exists": False, "executable": False, ...}

What a missing environment means for a run is decided by the parity rule ``engine_env``
(:func:`orchestrator.cluster.parity_engineenv.engine_env_problem`).

Standard library only: no Ray, nothing of ours.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["engine_env_facts"]


def engine_env_facts(
    python: str,
    *,
    kind: str = "path",
    source: str | None = None,
    image_uri: str | None = None,
) -> dict[str, Any]:
    """What this node has of the engine environment at ``python``, without running it.

    Args:
        python: the engine's python on this node (inside the container for ``kind``
            ``"image"``: the Ray task that calls this runs in the image).
        kind: ``"path"`` (a python on the node) or ``"image"`` (a container image,
            Ray's ``image_uri``).
        source: the setting that chose ``python`` (reported, e.g.
            ``"VLAB_ENGINE__PYTHON_BY_NODE[10.0.0.2]"``).
        image_uri: the image, for ``kind`` ``"image"``.

    Returns:
        ``{"kind", "python", "source", "exists", "is_file", "executable"}``
        plus ``"image_uri"`` for an image. ``exists`` follows symlinks (a venv python
        whose base interpreter is gone does not exist); ``is_file`` is None when it does
        not exist; ``executable`` is ``os.access(X_OK)`` on a regular file.
    """
    exists = os.path.exists(python)
    is_file = os.path.isfile(python)
    facts: dict[str, Any] = {
        "kind": kind,
        "python": python,
        "source": source,
        "exists": exists,
        "is_file": is_file if exists else None,
        "executable": (is_file and os.access(python, os.X_OK)) if exists else False,
    }
    if kind == "image":
        facts["image_uri"] = image_uri
    return facts
