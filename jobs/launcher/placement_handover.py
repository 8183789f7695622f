"""The run's placement group handed to vLLM's Ray executor (``layout.executor: "ray"``).

The one module of ``jobs`` that imports Ray (a row of the layer table in
docs/ARCHITECTURE.md): vLLM's own Ray executor runs inside the engine process, and
:func:`adopt_run_placement_group` points it at the run's placement group. Ray is
imported inside the function (``# deferred:``), only where the variable is set.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

#: The run's placement group (hex id) for vLLM's Ray executor; set by the orchestrator.
RAY_PG_ENV = "VLAB_RAY_PLACEMENT_GROUP_ID"


def adopt_run_placement_group() -> bool:
    """Make vLLM's Ray executor use the run's own placement group; True when installed.

    vLLM (``vllm/v1/executor/ray_utils.py``, ``initialize_ray_cluster``) takes
    ``parallel_config.placement_group``, else ``ray.util.get_current_placement_group()``,
    and creates a new group only when both are empty. ``vllm serve`` is a plain
    process (a new Ray driver), where that call returns None: a second group would
    then wait forever for the GPUs the run's group already holds. With
    ``VLAB_RAY_PLACEMENT_GROUP_ID`` set, the call answers the run's group instead
    (when the caller is not already inside one). Installed when the launcher is loaded, so
    every vLLM process (each loads it) sees it; without Ray or the variable
    nothing changes.
    """
    pg_hex = os.environ.get(RAY_PG_ENV)
    if not pg_hex:
        return False
    try:
        # deferred: Ray only where vLLM's Ray executor runs (and the variable is set)
        import ray.util
        from ray._raylet import PlacementGroupID

        # the module (``ray.util.placement_group`` the attribute is a function)
        pg_module = importlib.import_module("ray.util.placement_group")
    except ImportError:
        return False
    original = pg_module.get_current_placement_group

    def current_placement_group() -> Any:
        found = original()
        if found is not None:
            return found
        return pg_module.PlacementGroup(PlacementGroupID.from_hex(pg_hex))

    ray.util.get_current_placement_group = current_placement_group
    pg_module.get_current_placement_group = current_placement_group  # type: ignore[attr-defined]
    return True
