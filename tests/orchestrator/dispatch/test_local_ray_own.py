"""Without ``RAY_ADDRESS`` a service starts a Ray of its own, even while another Ray runs
on the host (another user's ``ray start``, a test's ``ray.cluster_utils.Cluster``): a
fresh-user trial saw ``vlab up`` join a test's simulated 4-GPU cluster, call the device
kind GPU from it, and die with it a minute later."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ray.cluster_utils import Cluster

from orchestrator.dispatch.ray.localray import KEEP_SESSIONS
from tests.conftest import REPO
from tests.orchestrator.dispatch.test_local_ray_sessions import make_sessions

#: Starts the service's local Ray as ``vlab up`` does, prints its cluster resources.
PROBE = """
import json, sys
import ray
from orchestrator.core.settings import Settings
from orchestrator.dispatch.ray.localray import start_local_ray
start_local_ray(Settings(home=sys.argv[1]))
print(json.dumps(ray.cluster_resources()))
ray.shutdown()
"""


def test_a_local_ray_is_the_services_own_beside_a_running_cluster(tmp_path: Path) -> None:
    """... and its start prunes the session folders ended Rays left under ``<home>/ray``."""
    ended = make_sessions(tmp_path / "home" / "ray", KEEP_SESSIONS + 2)
    foreign = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"foreign": 1}}
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", PROBE, str(tmp_path / "home")],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        foreign.shutdown()
    assert done.returncode == 0, done.stderr[-2000:]
    resources = json.loads(done.stdout.strip().splitlines()[-1])
    assert "foreign" not in resources, resources
    assert resources["CPU"] >= 1
    assert [p.is_dir() for p in ended] == [False, False] + [True] * KEEP_SESSIONS
