"""The engine environment per node on a real Ray cluster: a node without it blocks the run.

``ray.cluster_utils.Cluster`` starts a head and two worker nodes with two fake GPUs
each (a Ray resource), labelled the Ray way (``ray start --labels``; here
``Cluster.add_node(labels=...)``, which ``ray.nodes()`` reports under ``Labels`` next
to Ray's own ``ray.io/node-id``). ``VLAB_ENGINE__PYTHON_BY_NODE`` points the node
labelled ``vlab-engine=broken`` at a python that does not exist; the others use
``VLAB_ENGINE__PYTHON`` (this venv's python standing in for the engine's, as in
``test_cluster_parity.py``). Both nodes share this machine's IP, which is why the
override selects by label, not by IP.

- the on-demand parity check names the node and the path, and compares the engine
  environments only (the full probe did not run where the engine is missing);
- a TP=2 x PP=2 launch over both nodes is blocked before its placement group exists;
  a one-node run that lands on the broken node too;
- through the dispatcher the run ends ``blocked`` with that report stored, its error
  naming the node and the path;
- on the node that has it, the full probe reports ``engine_env`` (where the python is,
  the setting that chose it, the digest of its packages);
- with ``VLAB_ENGINE__IMAGE_URI`` the checks run in Ray's ``image_uri`` runtime_env:
  this machine has no container runtime, so Ray's image plugin fails to start podman
  (``ray/_private/runtime_env/image_uri.py``, ``_create_impl``: ``podman run ...``)
  and the run is blocked with Ray's words, which shows the image reached the tasks'
  runtime_env; nothing ran in a container here.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group_table
from sqlalchemy import create_engine
from sqlalchemy.orm import Session, sessionmaker

from jobs.schemas import BatchJob, EngineLaunch, RunSegment, WorkloadSpec
from orchestrator.core.db import normalize_url, upgrade_to_head
from orchestrator.core.models import Run
from orchestrator.core.settings import EngineSettings, OrchestratorSettings, Settings
from orchestrator.dispatch.dispatcher import Dispatcher, LaunchBlocked
from orchestrator.dispatch.ray.backend import RayRunBackend
from tests.conftest import fresh_database
from tests.factories import make_experiment

MISSING = "/nonexistent/vlab-engine/bin/python"
SOURCE = "VLAB_ENGINE__PYTHON_BY_NODE[vlab-engine=broken]"


#: One xdist group: the Ray cluster is a module fixture, built once for the module's tests
#: (spread over the workers, each would build its own).
pytestmark = pytest.mark.xdist_group("engine-env-cluster")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    good = c.add_node(
        num_cpus=1, num_gpus=2, resources={"vlab_test_good": 1}, labels={"vlab-engine": "good"}
    )
    broken = c.add_node(num_cpus=1, num_gpus=2, labels={"vlab-engine": "broken"})
    c.wait_for_nodes()
    ray.init(address=c.address)
    home = tmp_path_factory.mktemp("vlab-home")
    settings = Settings(
        home=home,
        engine=EngineSettings(
            python=Path(sys.executable),
            python_by_node={"vlab-engine=broken": MISSING, "vlab-engine=good": sys.executable},
        ),
        orchestrator=OrchestratorSettings(device_resource="GPU", placement_timeout_s=30),
    )
    try:
        yield {
            "backend": RayRunBackend(settings),
            "settings": settings,
            "home": home,
            "good": good.node_id,
            "broken": broken.node_id,
        }
    finally:
        ray.shutdown()
        c.shutdown()


def _job(tmp: Path) -> BatchJob:
    return BatchJob(
        launch=EngineLaunch(
            engine_python=sys.executable,
            model_dir=str(tmp / "model"),
            served_model_name="m",
            log_path=str(tmp / "engine.log"),
        ),
        segments=[RunSegment(run_id="r", workload=WorkloadSpec())],
    )


def _no_groups_left() -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        live = [g for g in placement_group_table().values() if g.get("state") != "REMOVED"]
        if not live:
            return True
        time.sleep(0.2)
    return False


def _assert_names_broken(report: dict[str, Any], rank: int) -> None:
    assert report["verdict"] == "blocked"
    assert report["stage"] == "engine_env"
    first = report["mismatches"][0]
    assert first["field"] == "engine_env" and first["rule_name"] == "engine_env"
    (odd,) = first["odd_nodes"]
    assert odd.startswith(f"rank{rank}:")
    assert report["node_ids"][rank] == report["node_ids"][report["nodes"].index(odd)]
    problem = first["problems"][odd]
    what, _, copy = problem.partition("; ")
    assert f"engine python {MISSING} does not exist on this node ({SOURCE})" == what
    if len(report["nodes"]) > 1:  # whether another node's engine python would work here:
        # the probe checked only this node's own path, so it cannot tell
        assert "would work here is unknown" in copy and "was not captured" in copy
    else:  # one node: no other value to copy
        assert copy == ""
    assert first["values"][odd]["python"] == MISSING
    assert first["values"][odd]["exists"] is False
    # only the engine environments were compared: nothing else is blamed on that node
    assert {m["field"] for m in report["mismatches"]} == {"engine_env"}


def test_parity_check_names_the_node_and_the_path(cluster: dict[str, Any]) -> None:
    backend: RayRunBackend = cluster["backend"]
    report = backend.check_nodes(
        [cluster["good"], cluster["broken"]], model_dir=None, engine_args={}
    )
    _assert_names_broken(report, rank=1)
    assert report["node_ids"] == [cluster["good"], cluster["broken"]]
    good = report["mismatches"][0]["values"][report["nodes"][0]]
    assert good["python"] == sys.executable and good["exists"] and good["executable"]
    assert good["source"] == "VLAB_ENGINE__PYTHON_BY_NODE[vlab-engine=good]"


def test_full_probe_reports_the_engine_environment(cluster: dict[str, Any]) -> None:
    backend: RayRunBackend = cluster["backend"]
    report = backend.check_nodes([cluster["good"]], model_dir=None, engine_args={})
    assert report["verdict"] == "ok", report["mismatches"]
    assert "stage" not in report
    verdicts = {e["field"]: e["verdict"] for e in report["evaluations"]}
    assert verdicts["engine_env"] == "ok"
    assert verdicts["engine_env.digest"] == "ok"  # the launcher's digest of its packages
    assert not [f for f in report["unchecked_fields"] if f.startswith("engine_env")]
    assert {e["field"] for e in report["evaluations"]} >= {"engine_env.kind", "engine_env.python"}


def test_launch_over_a_node_without_the_engine_is_blocked_before_placing(
    cluster: dict[str, Any], tmp_path: Path
) -> None:
    backend: RayRunBackend = cluster["backend"]
    layout = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}
    with pytest.raises(LaunchBlocked) as info:
        backend.launch("engine-missing", _job(tmp_path), layout)
    report, placement = info.value.report, info.value.placement
    broken_rank = [n["node_id"] for n in placement["nodes"]].index(cluster["broken"])
    _assert_names_broken(report, rank=broken_rank)
    assert placement["planned"] is True and placement["nnodes"] == 2
    entry = placement["nodes"][broken_rank]
    assert entry["engine_python"] == MISSING and entry["engine_python_source"] == SOURCE
    assert MISSING in str(info.value) and "engine_env" in str(info.value)
    assert _no_groups_left()  # nothing was reserved


def test_one_node_run_on_the_broken_node_is_blocked(
    cluster: dict[str, Any], tmp_path: Path
) -> None:
    backend: RayRunBackend = cluster["backend"]
    holder = ray.util.placement_group([{"GPU": 2, "vlab_test_good": 1}], strategy="STRICT_PACK")
    ray.get(holder.ready(), timeout=30)
    try:
        with pytest.raises(LaunchBlocked) as info:
            backend.launch("one-node", _job(tmp_path), {"tensor_parallel_size": 2})
        _assert_names_broken(info.value.report, rank=0)
        assert info.value.report["node_ids"] == [cluster["broken"]]
    finally:
        ray.util.remove_placement_group(holder)
    assert _no_groups_left()


def test_dispatcher_records_the_run_blocked(cluster: dict[str, Any], server_url: str) -> None:
    with fresh_database(server_url) as url:
        upgrade_to_head(url)
        engine = create_engine(normalize_url(url))
        try:
            factory = sessionmaker(bind=engine, expire_on_commit=False)
            with factory() as s:
                exp = make_experiment(s, n_runs=1)
                run = exp.runs[0]
                run.layout = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}
                run_id = run.id
                s.commit()
            dispatcher = Dispatcher(cluster["settings"], factory, cluster["backend"])
            dispatcher.startup()
            try:
                dispatcher.tick()
            finally:
                dispatcher.shutdown()
            session: Session
            with factory() as session:
                stored = session.get(Run, run_id)
                assert stored is not None
                assert stored.status == "blocked"
                assert stored.parity and stored.parity["stage"] == "engine_env"
                assert stored.parity["mismatches"][0]["field"] == "engine_env"
                assert stored.placement and stored.placement["planned"] is True
                assert stored.error and MISSING in stored.error and SOURCE in stored.error
                assert f"/api/v1/runs/{run_id}/parity" in stored.error
        finally:
            engine.dispose()


def test_an_image_ray_cannot_start_blocks_with_rays_words(
    cluster: dict[str, Any], tmp_path: Path
) -> None:
    image = "registry.example.com/vlab/engine:0.32"
    settings = Settings(
        home=cluster["home"],
        engine=EngineSettings(python=Path("/opt/vllm/bin/python"), image_uri=image),
        orchestrator=OrchestratorSettings(device_resource="GPU", placement_timeout_s=30),
    )
    backend = RayRunBackend(settings)
    with pytest.raises(LaunchBlocked) as info:
        backend.launch("in-image", _job(tmp_path), {"tensor_parallel_size": 2})
    report = info.value.report
    first = report["mismatches"][0]
    assert first["field"] == "engine_env" and report["stage"] == "engine_env"
    (node,) = first["odd_nodes"]
    assert first["values"][node]["kind"] == "image"
    assert first["values"][node]["image_uri"] == image
    problem = first["problems"][node]
    assert problem.startswith(f"engine environment in the image {image} not usable on this node")
    assert "podman" in problem  # Ray's image plugin ran: the image was in the runtime_env
    assert info.value.placement["engine_env"] == {"kind": "image", "image_uri": image}
    # the on-demand check of both nodes says the same of each
    both = backend.check_nodes([cluster["good"], cluster["broken"]], model_dir=None, engine_args={})
    assert both["verdict"] == "blocked" and both["stage"] == "engine_env"
    assert both["mismatches"][0]["odd_nodes"] == both["nodes"]
    assert _no_groups_left()
