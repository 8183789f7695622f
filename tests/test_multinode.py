"""A real two-node PP=2 run of the vLLM CPU build, through the normal REST path.

Two Ray worker nodes on this machine (``ray.cluster_utils.Cluster``, one CPU
each; the head has none, so runs must go to the workers). A TP=1 x PP=2 run
does not fit one node: it is placed on both, every node's environment is
probed and compared, and one ``vllm serve`` process runs per node
(``--nnodes 2 --node-rank 0|1``, the follower ``--headless``), each bound
to its own core. Then a second run loses its follower node mid-run: it fails
with the reason, and its devices are freed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from ray.cluster_utils import Cluster

from orchestrator.cli.runtime import Runtime
from orchestrator.core.settings import EngineSettings, OrchestratorSettings, Settings
from tests.conftest import ENGINE_PYTHON, fresh_database, needs_engine
from tests.ports import free_port as _free_port

#: needs_engine skips without the engine environment, except under CI (it fails there).
pytestmark = [pytest.mark.engine, needs_engine]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, server_url: str) -> Iterator[dict[str, Any]]:
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    home = tmp_path_factory.mktemp("vlab-home")
    with fresh_database(server_url) as database_url:
        settings = Settings(
            home=home,
            database_url=database_url,
            ray_address=cluster.address,
            engine=EngineSettings(python=Path(str(ENGINE_PYTHON)), startup_timeout_s=420),
            orchestrator=OrchestratorSettings(poll_interval_s=0.5, stale_after_s=60),
        )
        rt = Runtime(settings)
        rt.start_database()
        rt.start_orchestrator()
        port = _free_port()
        rt.start_api_thread("127.0.0.1", port)
        try:
            yield {"api": f"http://127.0.0.1:{port}", "cluster": cluster, "nodes": nodes}
        finally:
            rt.stop()
            cluster.shutdown()


def _spec(name: str, num_requests: int) -> dict[str, Any]:
    return {
        "name": name,
        "model": "tiny",
        "baseline": {
            # not enforce_eager: vLLM 0.32's CPU build with PP=2 and enforce_eager dies at
            # the first request (EngineCore: KeyError in the scheduler's update_from_output)
            "engine_args": {"max_model_len": 1024},
            "layout": {"tensor_parallel_size": 1, "pipeline_parallel_size": 2},
            "workload": {
                "num_requests": num_requests,
                "prefix_tokens": 128,
                "question_tokens": 16,
                "output_tokens": 8,
                "warmup_requests": 1,
            },
        },
        "repeats": 1,
    }


def _wait(api: str, run_id: str, until: Any, timeout_s: float = 600) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    run: dict[str, Any] = {}
    while time.monotonic() < deadline:
        run = httpx.get(f"{api}/api/v1/runs/{run_id}", timeout=30).json()
        if until(run):
            return run
        time.sleep(1)
    raise AssertionError(f"run {run_id} never got there: {run}")


def _ended(run: dict[str, Any]) -> bool:
    return run["status"] in ("succeeded", "failed", "cancelled", "blocked")


def test_pp2_over_two_nodes_then_losing_a_node(stack: dict[str, Any]) -> None:
    api = stack["api"]
    resp = httpx.post(f"{api}/api/v1/experiments", json=_spec("pp2", 4), timeout=300)
    assert resp.status_code == 201, resp.text
    (run_brief,) = resp.json()["runs"]
    run = _wait(api, run_brief["id"], _ended)
    assert run["status"] == "succeeded", run["error"]
    placement = run["placement"]
    assert placement["nnodes"] == 2
    assert [n["rank"] for n in placement["nodes"]] == [0, 1]
    assert {n["node_id"] for n in placement["nodes"]} == {n.node_id for n in stack["nodes"]}
    assert [n["cpu_binding"] for n in placement["nodes"]] == ["0", "1"]  # a core each
    assert [n["stages"] for n in placement["nodes"]] == [[0], [1]]
    assert run["metrics"]["completed"] == 4
    parts = run["engine_info"]["node_parts"]
    assert len(parts) == 1 and "--headless" in parts[0]["command"]
    assert "--node-rank" in parts[0]["command"]
    parity = httpx.get(f"{api}/api/v1/runs/{run['id']}/parity", timeout=30).json()
    assert parity["report"]["verdict"] == "ok", parity["report"]["mismatches"]
    assert len(parity["report"]["nodes"]) == 2

    # On demand: the orchestrator answers POST /cluster/parity with the same probe.
    ids = [n.node_id for n in stack["nodes"]]
    check = httpx.post(
        f"{api}/api/v1/cluster/parity", json={"node_ids": ids, "model": "tiny"}, timeout=60
    )
    assert check.status_code == 202, check.text
    deadline = time.monotonic() + 120
    doc = check.json()
    while doc["status"] in ("pending", "running") and time.monotonic() < deadline:
        time.sleep(1)
        doc = httpx.get(doc["url"], timeout=30).json()
    assert doc["status"] == "done", doc
    assert doc["report"]["verdict"] == "ok" and doc["report"]["node_ids"] == ids

    # Losing the follower's node mid-run fails the run with the reason and frees its devices.
    resp = httpx.post(f"{api}/api/v1/experiments", json=_spec("pp2-lost", 400), timeout=300)
    assert resp.status_code == 201, resp.text
    (lost_brief,) = resp.json()["runs"]
    running = _wait(api, lost_brief["id"], lambda r: r["status"] == "running" or _ended(r))
    assert running["status"] == "running", running
    follower = next(n for n in running["placement"]["nodes"] if n["rank"] == 1)
    victim = next(n for n in stack["nodes"] if n.node_id == follower["node_id"])
    stack["cluster"].remove_node(victim)
    lost = _wait(api, lost_brief["id"], _ended, timeout_s=300)
    assert lost["status"] == "failed"
    assert "node rank 1" in (lost["error"] or ""), lost["error"]
    deadline = time.monotonic() + 60
    while ray.available_resources().get("CPU", 0) < 1 and time.monotonic() < deadline:
        time.sleep(1)
    assert ray.available_resources().get("CPU", 0) >= 1  # the surviving node's core is free
