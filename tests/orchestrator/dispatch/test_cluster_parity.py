"""Placement and node parity on a multi-node Ray cluster on one machine.

``ray.cluster_utils.Cluster`` starts a head and three worker nodes, each with
two fake GPUs (a Ray resource; nothing here touches a GPU). The node probe
runs for real on every node (``jobs/launcher/vllm_launcher.py fingerprint`` through a
Ray task pinned to the node); the orchestrator's own python stands in for the
engine's, so the versions it reports are those of this venv (the real engine
environment is probed in tests/jobs/test_nodeprobe.py).

- two matching nodes pass;
- a node whose environment differs (``NCCL_IB_DISABLE`` set on it only)
  blocks, with the report naming the field, every node's value and the odd
  node;
- a node whose copy of the model differs blocks on ``model_files``;
- a TP=2 x PP=2 launch over a mismatched pair is blocked before anything is
  started and its placement group is removed; shapes no node can hold are
  refused; busy shapes wait.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

from jobs.schemas import BatchJob, EngineLaunch, RunSegment, WorkloadSpec
from orchestrator.core.settings import EngineSettings, OrchestratorSettings, Settings
from orchestrator.dispatch.dispatcher import LaunchBlocked, LaunchRefused, NoCapacity
from orchestrator.dispatch.ray.backend import RayRunBackend

#: One xdist group: the Ray cluster is a module fixture, built once for the module's tests
#: (spread over the workers, each would build its own).
pytestmark = pytest.mark.xdist_group("cluster-parity")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    # a custom resource names this node, so a test can hold exactly it
    same_a = c.add_node(num_cpus=1, num_gpus=2, resources={"vlab_test_same_a": 1})
    same_b = c.add_node(num_cpus=1, num_gpus=2)
    odd = c.add_node(num_cpus=1, num_gpus=2, env_vars={"NCCL_IB_DISABLE": "1"})
    c.wait_for_nodes()
    ray.init(address=c.address)
    home = tmp_path_factory.mktemp("vlab-home")
    model = tmp_path_factory.mktemp("model")
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (model / "tokenizer.json").write_text('{"version": "1.0"}')
    settings = Settings(
        home=home,
        engine=EngineSettings(python=Path(sys.executable)),
        orchestrator=OrchestratorSettings(device_resource="GPU", placement_timeout_s=30),
    )
    try:
        yield {
            "backend": RayRunBackend(settings),
            "settings": settings,
            "model": model,
            "same": [same_a.node_id, same_b.node_id],
            "odd": odd.node_id,
        }
    finally:
        ray.shutdown()
        c.shutdown()


def _job(model: Path, tmp: Path) -> BatchJob:
    return BatchJob(
        launch=EngineLaunch(
            engine_python=sys.executable,
            model_dir=str(model),
            served_model_name="m",
            engine_args={"max_model_len": 1024},
            log_path=str(tmp / "engine.log"),
        ),
        segments=[RunSegment(run_id="r", workload=WorkloadSpec())],
    )


def _gpus_free(backend: RayRunBackend) -> int:
    deadline = time.monotonic() + 20
    while True:
        free = sum(n.available for n in backend.nodes())
        if free == 6 or time.monotonic() > deadline:
            return free
        time.sleep(0.5)


def test_inventory_sees_three_gpu_nodes(cluster: dict[str, Any]) -> None:
    nodes = cluster["backend"].nodes()
    assert sorted(n.total for n in nodes) == [2, 2, 2]  # the head has no GPU
    assert {n.node_id for n in nodes} == {*cluster["same"], cluster["odd"]}


def test_matching_nodes_pass(cluster: dict[str, Any]) -> None:
    report = cluster["backend"].check_nodes(
        cluster["same"], model_dir=str(cluster["model"]), engine_args={"max_model_len": 1024}
    )
    assert report["verdict"] == "ok", report["mismatches"]
    assert report["node_ids"] == cluster["same"]
    assert len(report["nodes"]) == 2


def test_environment_difference_blocks_with_a_per_node_report(cluster: dict[str, Any]) -> None:
    ids = [cluster["same"][0], cluster["odd"]]
    report = cluster["backend"].check_nodes(ids, model_dir=str(cluster["model"]), engine_args={})
    assert report["verdict"] == "blocked"
    (finding,) = [m for m in report["mismatches"] if m["field"] == "env.NCCL_IB_DISABLE"]
    assert finding["severity"] == "blocking"
    first, odd = report["nodes"]
    assert finding["values"][odd] == "1" and finding["values"][first] is None
    # a communication setting set on one node only: the odd node is the one lacking it
    assert finding["odd_nodes"] == [first] == finding["unset_on"]
    assert {v["rule"]: v["verdict"] for v in finding["rules"]}["nccl_same"] == "blocking"
    assert "NCCL" in finding["rule"]


def test_model_copy_that_differs_blocks(cluster: dict[str, Any]) -> None:
    """The odd node's digest cache holds another digest for a file of the same size and
    mtime: to the probe that node has a different copy of the model."""
    backend: RayRunBackend = cluster["backend"]
    model: Path = cluster["model"]
    ids = cluster["same"]
    report = backend.check_nodes(ids, model_dir=str(model), engine_args={})
    assert report["verdict"] == "ok"
    cache = backend.digest_cache_path(ids[1])
    doc = json.loads(Path(cache).read_text())
    poisoned = False
    for key, entry in doc.items() if isinstance(doc, dict) else []:
        if "tokenizer.json" in key and isinstance(entry, dict) and "sha256" in entry:
            entry["sha256"] = "0" * 64
            poisoned = True
    assert poisoned, doc
    Path(cache).write_text(json.dumps(doc))
    report = backend.check_nodes(ids, model_dir=str(model), engine_args={})
    assert report["verdict"] == "blocked"
    files = [m for m in report["mismatches"] if m["field"] == "model_files"]
    assert files and any("tokenizer.json" in json.dumps(m) for m in files)


def test_launch_over_mismatched_nodes_is_blocked_and_releases(
    cluster: dict[str, Any], tmp_path: Path
) -> None:
    backend: RayRunBackend = cluster["backend"]
    job = _job(cluster["model"], tmp_path)
    # TP=2 x PP=2 needs two nodes of 2 GPUs; take one matching node so only the odd
    # one and the other are left
    holder = ray.util.placement_group([{"GPU": 2, "vlab_test_same_a": 1}], strategy="STRICT_PACK")
    ray.get(holder.ready(), timeout=30)
    try:
        layout = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}
        with pytest.raises(LaunchBlocked) as info:
            backend.launch("blocked-run", job, layout)
        report, placement = info.value.report, info.value.placement
        assert report["verdict"] == "blocked"
        assert any(m["field"] == "env.NCCL_IB_DISABLE" for m in report["mismatches"])
        assert placement["nnodes"] == 2
        assert [n["rank"] for n in placement["nodes"]] == [0, 1]
        assert all(n["devices"] == 2 for n in placement["nodes"])
        assert cluster["odd"] in {n["node_id"] for n in placement["nodes"]}
        # nothing left reserved by the blocked launch: only the holder's 2 GPUs are used
        deadline = time.monotonic() + 20
        while sum(n.available for n in backend.nodes()) != 4 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert sum(n.available for n in backend.nodes()) == 4
        # busy: TP=2 x PP=3 fits the cluster (three 2-GPU nodes) but not what is free now
        with pytest.raises(NoCapacity):
            backend.launch(
                "busy-run", job, {"tensor_parallel_size": 2, "pipeline_parallel_size": 3}
            )
    finally:
        ray.util.remove_placement_group(holder)
    assert _gpus_free(backend) == 6


def test_shapes_no_node_can_hold_are_refused(cluster: dict[str, Any], tmp_path: Path) -> None:
    backend: RayRunBackend = cluster["backend"]
    job = _job(cluster["model"], tmp_path)
    with pytest.raises(LaunchRefused, match="tensor_parallel_size 4 needs 4 GPU devices"):
        backend.launch("too-wide", job, {"tensor_parallel_size": 4})
    with pytest.raises(LaunchRefused, match="8"):
        backend.launch("too-big", job, {"tensor_parallel_size": 2, "pipeline_parallel_size": 4})
