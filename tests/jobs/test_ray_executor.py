"""vLLM's Ray executor inside the run's own placement group: command line and hand-over.

The CPU build refuses ``--distributed-executor-backend ray``, so this checks
everything up to the launch: the command, and that a new Ray driver (as ``vllm
serve`` is) started with the launcher's environment finds the run's group where
vLLM looks for it (``ray.util.get_current_placement_group()``), not None (which
would make vLLM create a second group that waits forever for the same GPUs).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from jobs.engine.command import LAUNCHER_PATH, build_serve_command
from jobs.schemas import EngineLaunch


def _launch(**kw: object) -> EngineLaunch:
    base: dict[str, object] = {
        "engine_python": "/engine/bin/python",
        "model_dir": "/models/tiny",
        "served_model_name": "tiny",
        "log_path": "/tmp/x.log",
        "engine_args": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
    }
    base.update(kw)
    return EngineLaunch.model_validate(base)


def test_ray_executor_command_has_the_backend_and_no_nnodes() -> None:
    cmd = build_serve_command(_launch(executor="ray"), port=8000)
    assert cmd[cmd.index("--distributed-executor-backend") + 1] == "ray"
    assert "--nnodes" not in cmd and "--headless" not in cmd
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    with pytest.raises(ValueError, match="one vllm serve"):
        build_serve_command(
            _launch(executor="ray", nnodes=2, master_addr="10.0.0.1", master_port=1), port=1
        )


def test_model_by_id_is_served_with_its_commit_unless_resolved_to_a_directory() -> None:
    sha = "0123456789abcdef0123456789abcdef01234567"
    cmd = build_serve_command(_launch(model_dir="acme/chat", model_revision=sha), port=1)
    assert cmd[3] == "acme/chat" and cmd[cmd.index("--revision") + 1] == sha
    # still to be resolved on the node: no --revision yet (the node serves its snapshot)
    pending = _launch(model_dir="acme/chat", model_revision=sha, resolve_model_on_node=True)
    assert "--revision" not in build_serve_command(pending, port=1)


HANDOVER = textwrap.dedent(
    """
    import importlib.util, json, os, sys
    import ray
    from ray.util.placement_group import placement_group
    ray.init(address="local", num_cpus=1, num_gpus=4, include_dashboard=False, log_to_driver=False)
    pg = placement_group([{"GPU": 1.0}] * 4, strategy="PACK")
    ray.get(pg.ready())
    before = ray.util.get_current_placement_group()
    os.environ["VLAB_RAY_PLACEMENT_GROUP_ID"] = pg.id.hex()
    spec = importlib.util.spec_from_file_location("launcher", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found = ray.util.get_current_placement_group()
    print(json.dumps({
        "before": None if before is None else before.id.hex(),
        "found": None if found is None else found.id.hex(),
        "wanted": pg.id.hex(),
        "bundles": found.bundle_specs if found is not None else None,
    }))
    ray.shutdown()
    """
)


def test_a_new_ray_driver_finds_the_runs_placement_group() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", HANDOVER, str(LAUNCHER_PATH)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["before"] is None  # what vLLM would see without the hand-over
    assert doc["found"] == doc["wanted"]
    assert doc["bundles"] == [{"GPU": 1.0}] * 4  # one GPU per bundle, as vLLM requires
