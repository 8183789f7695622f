"""SIMULATED GPU cluster, end to end through REST: exact GPU assignment, telemetry, models by id.

Nothing here has a GPU. The cluster is real Ray (``ray.cluster_utils.Cluster``)
whose nodes advertise fake GPUs (``num_gpus``); the engine is the simulated
vLLM of :mod:`tests.simgpu.engine` (the project's stub server behind vLLM's GPU
behaviour: it reports the ``CUDA_VISIBLE_DEVICES`` it was given and fails with
CUDA out of memory when a GPU it wants is held by another engine), and
``nvidia-smi`` is the simulated one of ``tests/simgpu/bin``. The orchestrator,
placement, supervisor, parity probe, telemetry and persistence are the real ones.

- one 4-GPU node: two TP=2 runs at once get disjoint GPUs and both succeed; the
  device kind is detected (GPU); each run records its GPUs (index, UUID, rank) and
  its GPU telemetry (power, energy, J/token);
- a model named by Hugging Face id resolves in the node's HF cache (offline);
  an id the cache lacks is a 422 with the node's answer;
- two 2-GPU nodes: a TP=2 x PP=2 run spans both (``--nnodes 2``), with parity, and
  records its GPUs per node and rank;
- ``layout.executor: "ray"``: vLLM's Ray executor (simulated) takes the run's own
  placement group, one GPU per worker, without creating a second group;
- a tuning campaign side by side (2 runs at once, 4 GPUs): each configuration's pairs on one
  server, the two configurations at the same time on disjoint GPUs, J/token the objective.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from ray.cluster_utils import Cluster

from jobs.modelgen.generator import generate_model
from orchestrator.cli.runtime import Runtime
from orchestrator.core.settings import EngineSettings, OrchestratorSettings, Settings
from orchestrator.experiments import model_resolution as service
from tests.conftest import fresh_database
from tests.ports import free_port as _free_port
from tests.simgpu import NODE_ENV, NVIDIA_SMI_DIR, STATE_ENV, write_inventory
from tests.simgpu.engine import write_engine_python

#: One worker runs the module under ``pytest -n`` (``make test``), and each class has its
#: own cluster, torn down before the next class builds one: a whole simulated cluster per
#: fixture, and two alive at once (module fixtures of one module, or two workers) left a
#: GPU without its UUID in fresh-clone CIs (the second stack's ``ray.shutdown()`` pulls
#: Ray from under the first one's dispatcher, and the spare Ray nodes load the machine).
pytestmark = pytest.mark.xdist_group("simgpu")

SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"


def _hf_cache(root: Path, repo: str, model_dir: Path) -> Path:
    """A Hugging Face cache (hub layout) holding ``repo`` at commit :data:`SNAPSHOT`."""
    hub = root / "hub" / ("models--" + repo.replace("/", "--"))
    snap = hub / "snapshots" / SNAPSHOT
    (hub / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (hub / "refs").mkdir()
    (hub / "refs" / "main").write_text(SNAPSHOT)
    for f in sorted(model_dir.iterdir()):
        blob = hub / "blobs" / f"blob-{f.name}"
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    return root


def _stack(
    tmp: Path, server_url: str, gpus_per_node: list[int], hf_home: Path | None = None
) -> Iterator[dict[str, Any]]:
    if ray.is_initialized():
        ray.shutdown()
    state = tmp / "sim-gpus"
    # the stand-in nvidia-smi runs under the first python3 on PATH: this interpreter's
    # (a version manager's shim, a shell script spawning several processes, can pass the
    # readers' 5 s timeout on a loaded machine)
    bins = [str(NVIDIA_SMI_DIR), str(Path(sys.executable).parent)]
    path = os.pathsep.join([*bins, os.environ.get("PATH", "")])
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    nodes = []
    for i, count in enumerate(gpus_per_node):
        name = f"sim{i}"
        write_inventory(state, name, count)
        env = {STATE_ENV: str(state), NODE_ENV: name, "PATH": path, "HF_HUB_OFFLINE": "1"}
        if hf_home is not None:
            env["HF_HOME"] = str(hf_home)
        nodes.append(cluster.add_node(num_cpus=2, num_gpus=count, env_vars=env))
    cluster.wait_for_nodes()
    home = tmp / "home"
    home.mkdir()
    engine_python = write_engine_python(tmp / "engine-python")
    with fresh_database(server_url) as database_url:
        settings = Settings(
            home=home,
            database_url=database_url,
            ray_address=cluster.address,
            engine=EngineSettings(
                python=engine_python, startup_timeout_s=60, resolve_configs=False
            ),
            orchestrator=OrchestratorSettings(
                poll_interval_s=0.3, max_concurrent_runs=2, placement_timeout_s=30
            ),
        )
        rt = Runtime(settings)
        rt.start_database()
        rt.start_orchestrator()
        port = _free_port()
        rt.start_api_thread("127.0.0.1", port)
        try:
            yield {
                "api": f"http://127.0.0.1:{port}",
                "rt": rt,
                "nodes": nodes,
                "state": state,
                "cluster": cluster,
            }
        finally:
            rt.stop()
            service.set_model_locator(None)
            cluster.shutdown()


def _spec(
    name: str, layout: dict[str, Any], model: str = "tiny", num_requests: int = 12
) -> dict[str, Any]:
    return {
        "name": name,
        "model": model,
        "baseline": {
            "engine_args": {"max_model_len": 1024},
            "layout": layout,
            "workload": {
                "num_requests": num_requests,
                "concurrency": 2,
                "prefix_tokens": 64,
                "question_tokens": 8,
                "output_tokens": 24,
                "warmup_requests": 1,
            },
        },
        "repeats": 1,
    }


def _submit(api: str, spec: dict[str, Any]) -> str:
    resp = httpx.post(f"{api}/api/v1/experiments", json=spec, timeout=120)
    assert resp.status_code == 201, resp.text
    (run,) = resp.json()["runs"]
    return str(run["id"])


def _ended(api: str, run_id: str, timeout_s: float = 180) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run: dict[str, Any] = httpx.get(f"{api}/api/v1/runs/{run_id}", timeout=30).json()
        if run["status"] in ("succeeded", "failed", "cancelled", "blocked"):
            return run
        time.sleep(0.5)
    raise AssertionError(f"run {run_id} did not end")


@pytest.fixture(scope="class")
def one_node(tmp_path_factory: pytest.TempPathFactory, server_url: str) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("sim-one-node")
    hf_home = _hf_cache(
        tmp / "hf", "acme/tiny-chat", generate_model(tmp / "tiny-src", "tiny", seed=3)
    )
    yield from _stack(tmp, server_url, [4], hf_home=hf_home)


@pytest.fixture(scope="class")
def two_nodes(
    tmp_path_factory: pytest.TempPathFactory, server_url: str
) -> Iterator[dict[str, Any]]:
    yield from _stack(tmp_path_factory.mktemp("sim-two-nodes"), server_url, [2, 2])


def _at(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


class TestOneNode:
    """One 4-GPU node (the class's cluster ends before the two-node one starts)."""

    def test_sim_two_concurrent_tp2_runs_get_disjoint_gpus(self, one_node: dict[str, Any]) -> None:
        api = one_node["api"]
        assert one_node["rt"].device_kind == ("GPU", "detected")
        tp2 = {"tensor_parallel_size": 2}
        ids = [_submit(api, _spec(f"tp2-{i}", tp2, num_requests=60)) for i in range(2)]
        runs = [_ended(api, i) for i in ids]
        for run in runs:
            assert run["status"] == "succeeded", run["error"]
            assert run["placement"]["resource"] == "GPU"
            assert run["placement"]["device_kind_source"] == "detected"
            assert run["placement"]["bundle_shape"] == "per_node"
        # both held their GPUs at once: each reserved them when claimed, to its end (on a
        # loaded machine one may measure after the other)
        claimed = [_at(run["claimed_at"]) for run in runs]
        ended = [_at(run["finished_at"]) for run in runs]
        assert max(claimed) < min(ended), ("the two runs did not overlap", claimed, ended)
        held = []
        for run in runs:
            (node,) = run["engine_info"]["gpu_assignment"]
            assert [g["rank"] for g in node["gpus"]] == [0, 1]
            assert node["cuda_visible_devices"] == ",".join(str(g["index"]) for g in node["gpus"])
            assert all((g["uuid"] or "").startswith("GPU-") for g in node["gpus"]), node
            held.append({g["uuid"] for g in node["gpus"]})
        assert not held[0] & held[1]
        assert len(held[0] | held[1]) == 4

        # telemetry: every second, per GPU and in total; energy per output token
        run = runs[0]
        metrics = run["metrics"]
        assert run["engine_info"]["gpu_telemetry"]["source"] == "nvidia-smi"
        assert run["engine_info"]["gpu_telemetry"]["energy_source"] == "power_integral"
        assert metrics["gpu_mean_power_w"] == pytest.approx(400.0, rel=0.05)  # busy simulated GPU
        expected = metrics["gpu_energy_j"] / metrics["total_output_tokens"]
        assert metrics["energy_per_output_token_j"] == pytest.approx(expected)
        assert metrics["gpu_peak_memory_used_mib"] == 60000
        series = httpx.get(f"{api}/api/v1/runs/{run['id']}/metrics", timeout=30).json()
        during = [p for p in series["samples"] if p["phase"] == "during"]
        assert during and all("gpu0_power_w" in p["values"] for p in during)
        assert all("gpu_power_w" in p["values"] for p in during)

    def test_sim_hf_model_id_resolves_on_the_node(self, one_node: dict[str, Any]) -> None:
        api = one_node["api"]
        spec = _spec("by-id", {"tensor_parallel_size": 1}, model="acme/tiny-chat")
        # the cache holds config and tokenizer only, and the node is offline: refused ...
        refused = httpx.post(f"{api}/api/v1/experiments", json=spec, timeout=120)
        assert refused.status_code == 422, refused.text
        assert [e["type"] for e in refused.json()["errors"]] == ["model_weights_missing"]
        # ... unless the run uses random weights (vLLM's load_format dummy)
        spec["baseline"]["engine_args"]["load_format"] = "dummy"
        run_id = _submit(api, spec)
        run = _ended(api, run_id)
        assert run["status"] == "succeeded", run["error"]
        assert run["model_id"] == "acme/tiny-chat"
        assert run["model_revision"] == SNAPSHOT
        resolution = run["engine_info"]["model_resolution"]
        assert resolution["source"] == "hf_cache" and resolution["revision"] == SNAPSHOT
        assert "snapshots/" + SNAPSHOT in resolution["path"]
        assert {f["path"] for f in resolution["files"]} >= {"config.json", "tokenizer.json"}

        bad = httpx.post(
            f"{api}/api/v1/experiments",
            json=_spec("missing", {"tensor_parallel_size": 1}, model="acme/not-cached"),
            timeout=120,
        )
        assert bad.status_code == 422, bad.text
        (err,) = [e for e in bad.json()["errors"] if e["loc"][-1] == "model"]
        assert "HF_HUB_OFFLINE" in err["msg"] and "acme/not-cached" in err["msg"]

    def test_sim_a_campaign_measures_its_configurations_side_by_side(
        self, one_node: dict[str, Any]
    ) -> None:
        """A campaign on the 4-GPU node whose dispatcher runs 2 runs at once: its 2
        configurations (prefix caching off/on) get a slot each, so the cycle is 2 pairs at
        once, each configuration's 2 runs on one server (the second reuses it) and the two
        servers at the same time on disjoint GPUs; the objective is the GPUs' J/token, which
        the simulated telemetry gives every run."""
        api = one_node["api"]
        doc = {
            "name": "sim side by side",
            "model": "tiny",
            "baseline": _spec("x", {"tensor_parallel_size": 1}, num_requests=24)["baseline"],
            "objective": {"metric": "energy_per_output_token_j"},
            "space": [
                {
                    "name": "engine_args.enable_prefix_caching",
                    "levels": [False, True],
                    "start": False,
                }
            ],
            "budget": {"max_runs": 12},  # room to measure a run again
            "rule": {"min_repeats": 2, "max_repeats": 2},
        }
        resp = httpx.post(f"{api}/api/v1/campaigns", json=doc, timeout=120)
        assert resp.status_code == 201, resp.text
        cid = resp.json()["id"]
        deadline = time.monotonic() + 240
        while True:
            body = httpx.get(f"{api}/api/v1/campaigns/{cid}", timeout=30).json()
            if body["status"] not in ("queued", "running"):
                break
            assert time.monotonic() < deadline, body
            time.sleep(1)
        assert body["status"] == "succeeded", body["status_reason"]
        runs = {r["label"]: httpx.get(r["url"], timeout=30).json() for r in body["runs"]}
        first = ["r1.c1.incumbent", "r1.c2.incumbent"]
        second = ["r1.c1.engine_args.enable_prefix_caching=true"]
        second.append("r1.c2.engine_args.enable_prefix_caching=true")
        assert set(first + second) <= set(runs)
        for pair in (first, second):  # one server per configuration: the second run reuses it
            a, b = (runs[label] for label in pair)
            assert a["status"] == b["status"] == "succeeded", (a["error"], b["error"])
            assert a["engine_info"]["server_reused"] is False
            assert b["engine_info"]["server_reused"] is True
        inc, cand = (runs[pair[0]] for pair in (first, second))
        claimed = [_at(r["claimed_at"]) for r in (inc, cand)]
        assert max(claimed) < min(_at(r["finished_at"]) for r in (inc, cand)), "not side by side"
        gpus = [
            {g["uuid"] for node in r["engine_info"]["gpu_assignment"] for g in node["gpus"]}
            for r in (inc, cand)
        ]
        assert len(gpus[0]) == len(gpus[1]) == 1 and not gpus[0] & gpus[1]
        candidate = next(c for c in body["candidates"] if c["round"] == 1)
        assert candidate["pairs"] == 2, (candidate["reason"], candidate["outcome"], body["runs"])
        assert body["wall_time"]["servers_reused"] >= 2
        # "auto" knows the GPUs' memory from what the GPU runs recorded: only the generated
        # model's weights (none: dummy weights) keep it from weighing TP
        doc.update(name="sim auto", space="auto")
        doc["baseline"] = {**doc["baseline"], "layout": {"devices": 2}}
        resp = httpx.post(f"{api}/api/v1/campaigns", json=doc, timeout=120)
        assert resp.status_code == 201, resp.text
        auto = resp.json()
        httpx.post(f"{api}/api/v1/campaigns/{auto['id']}/cancel", timeout=30)
        (tp,) = [n for n in auto["space_proposal"] if n["name"] == "layout.tensor_parallel_size"]
        assert "(its weights' size unknown)" in tp["why"], tp


class TestTwoNodes:
    """Two 2-GPU nodes."""

    def test_sim_tp2_pp2_over_two_nodes_records_gpus_per_rank(
        self, two_nodes: dict[str, Any]
    ) -> None:
        api = two_nodes["api"]
        layout = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}
        run = _ended(api, _submit(api, _spec("tp2pp2", layout)))
        assert run["status"] == "succeeded", run["error"]
        assert run["placement"]["nnodes"] == 2
        assignment = run["engine_info"]["gpu_assignment"]
        assert [a["node_rank"] for a in assignment] == [0, 1]
        assert [[g["rank"] for g in a["gpus"]] for a in assignment] == [[0, 1], [2, 3]]
        assert len({a["node_id"] for a in assignment}) == 2
        assert len({g["uuid"] for a in assignment for g in a["gpus"]}) == 4, assignment
        part = run["engine_info"]["node_parts"][0]
        assert "--headless" in part["command"] and "--nnodes" in part["command"]
        parity = httpx.get(f"{api}/api/v1/runs/{run['id']}/parity", timeout=30).json()
        assert parity["report"]["verdict"] == "ok", parity["report"]["mismatches"]
        # telemetry covers the GPUs of both nodes
        assert run["metrics"]["gpu_mean_power_w"] == pytest.approx(400.0, rel=0.05)
        series = httpx.get(f"{api}/api/v1/runs/{run['id']}/metrics", timeout=30).json()
        during = [p for p in series["samples"] if p["phase"] == "during"]
        assert all("gpu3_power_w" in p["values"] for p in during)

    def test_sim_ray_executor_uses_the_runs_placement_group(
        self, two_nodes: dict[str, Any]
    ) -> None:
        api = two_nodes["api"]
        layout = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "executor": "ray"}
        run = _ended(api, _submit(api, _spec("ray-executor", layout)))
        assert run["status"] == "succeeded", run["error"]
        assert run["placement"]["executor"] == "ray"
        assert run["placement"]["bundle_shape"] == "per_device"
        command = run["engine_info"]["command"]
        assert command[command.index("--distributed-executor-backend") + 1] == "ray"
        assert "--nnodes" not in command
        log = httpx.get(f"{api}/api/v1/runs/{run['id']}/log", params={"raw": 1}, timeout=30).text
        assert "Using the existing placement group" in log
        assert "Creating a new one" not in log
