"""The engine environment of a node in the parity check: present, and the same everywhere.

Pure (no Ray, no database). A fingerprint's ``engine_env`` says where the engine's python
is on that node and what it has::

    "engine_env": {
      "kind": "path" | "image",        # a python on the node, or in a container image
      "python": "/opt/vllm/bin/python", # the configured python (inside the image for one)
      "source": "VLAB_ENGINE__PYTHON_BY_NODE[10.0.0.2]",   # the setting that chose it
      "image_uri": "registry/x/engine:0.32@sha256:...",    # kind "image" only
      "exists": true, "is_file": true, "executable": true, # a stat on the node
      "error": "...",                   # the check could not run there (image not started)
      "digest": "sha256:...", "distributions": 149   # its packages (the full probe only)
    }

:func:`engine_env_problem` and :func:`image_pin_problem` are the per-node checks of the
rules ``engine_env`` and ``engine_image_pinned``
(:mod:`orchestrator.cluster.parity_rules`); :func:`engine_only` reduces fingerprints to
what the engine-environment check knows, for the report of a launch blocked before the
full probe ran.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = [
    "ENGINE_ONLY_KEYS",
    "engine_env_problem",
    "engine_only",
    "image_pin_problem",
    "is_pinned",
]

#: Fingerprint keys a node reports before the full probe (identity and ``engine_env``).
ENGINE_ONLY_KEYS = ("node", "node_id", "ip", "hostname", "ray", "engine_env")

_DIGEST = re.compile(r"@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}$")


def engine_env_problem(value: Any) -> str | None:
    """Why a node's ``engine_env`` cannot run the engine (None: nothing known against it).

    In order: the ``error`` the node reported (the check could not run there: an image
    Ray could not start), the python absent, not a regular file, not executable. Keys
    the node did not report say nothing (a fingerprint without them is judged on the
    others); a value that is not a mapping is a problem of its own.
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        return f"engine_env is not an object: {value!r}"
    python = value.get("python") or "?"
    where = f" in the image {value['image_uri']}" if value.get("image_uri") else ""
    via = f" ({value['source']})" if value.get("source") else ""
    if value.get("error"):
        return f"engine environment{where} not usable on this node: {value['error']}{via}"
    if value.get("exists") is False:
        return f"engine python {python}{where} does not exist on this node{via}"
    if value.get("is_file") is False:
        return f"engine python {python}{where} is not a file on this node{via}"
    if value.get("executable") is False:
        return f"engine python {python}{where} is not executable on this node{via}"
    return None


def is_pinned(image_uri: str) -> bool:
    """Whether an image reference names its content by digest (``...@sha256:<hex>``)."""
    return bool(_DIGEST.search(image_uri))


def image_pin_problem(value: Any) -> str | None:
    """A warning for an image named by tag only: nodes may have pulled different images."""
    if not isinstance(value, str) or is_pinned(value):
        return None
    return (
        f"image {value} is named by tag only: each node pulls what the tag names when it "
        "pulls, so nodes may run different images under one name; pin it by digest "
        "(...@sha256:<digest>)"
    )


def engine_only(fingerprint: Mapping[str, Any]) -> dict[str, Any]:
    """The fingerprint's identity and ``engine_env`` (:data:`ENGINE_ONLY_KEYS`), nothing else.

    For the report of a launch blocked on a missing engine environment: the versions
    the full probe would add are absent on the nodes without one, and comparing an
    absent version with a present one would name the wrong node.
    """
    return {k: fingerprint[k] for k in ENGINE_ONLY_KEYS if k in fingerprint}
