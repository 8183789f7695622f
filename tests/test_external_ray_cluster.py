"""An existing Ray cluster whose nodes do not have vlab: `vlab up` joins it for real.

The cluster (:mod:`tests.external_ray`) is two ``ray start`` nodes, a head and a
worker, each a separate process tree running ``.ray-only-venv`` (Ray 2.60 with
``ray[default]``, nothing of ours: no ``jobs``, ``numpy``, ``tokenizers``, ``httpx``),
each advertising one SIMULATED GPU (``--num-gpus 1``; :mod:`tests.simgpu`: the
engine is the simulated vLLM of :mod:`tests.simgpu.engine`, no vLLM anywhere). The
service is the real ``vlab up`` command, started from an empty working directory
(Ray puts a driver's working directory on its workers' ``sys.path``:
``ray/_private/worker.py``, ``_py_driver_sys_path``), with ``RAY_ADDRESS`` pointing
at the head. Everything goes through REST.

- it ships ``jobs`` and ``orchestrator`` (``py_modules``) and the pinned requirements
  of ``jobs`` (``pip``) with Ray's ``runtime_env``; then a run, an on-demand parity
  check over both nodes and a PP=2 run spanning both nodes succeed;
- with ``VLAB_ORCHESTRATOR__SHIP_TO_NODES=never`` it refuses to start, in one line
  naming each node and what it lacks;
- a Ray Client address (``ray://``) is refused at start-up with the reason;
- a cluster with token authentication (``RAY_AUTH_MODE=token`` on every node, as
  KubeRay's ``authOptions`` sets it) is refused in one line saying what to set,
  instead of Ray's ``ConnectionError`` traceback; with what it says set, the join
  gets past authentication.
"""

from __future__ import annotations

import importlib.metadata
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from orchestrator.dispatch.ray.join import WORKER_REQUIREMENTS
from tests.conftest import fresh_database
from tests.external_ray import RayOnlyCluster, free_port, ray_only_python
from tests.simgpu import NODE_ENV, NVIDIA_SMI_DIR, STATE_ENV, write_inventory
from tests.simgpu.engine import write_engine_python

#: One xdist group: the cluster and the service are module fixtures (a ``ray start`` head and
#: worker, the service shipping its code and requirements to them): spread over the
#: workers, each worker that got one of these tests built its own (three set-ups of 50-90 s
#: in a fresh-clone CI).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("external-ray")]

VLAB = Path(sys.executable).with_name("vlab")


@pytest.fixture(scope="module")
def ray_python() -> Path:
    return ray_only_python()


@pytest.fixture(scope="module")
def database(server_url: str) -> Iterator[str]:
    with fresh_database(server_url) as url:
        yield url


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, ray_python: Path) -> Iterator[RayOnlyCluster]:
    state = tmp_path_factory.mktemp("sim-gpus")
    c = RayOnlyCluster(ray_python)
    try:
        for i in range(2):
            name = f"ext{i}"
            write_inventory(state, name, 1)
            env = {
                STATE_ENV: str(state),
                NODE_ENV: name,
                "PATH": str(NVIDIA_SMI_DIR),
                "HF_HUB_OFFLINE": "1",
            }
            if i == 0:
                c.start_head(num_cpus=2, num_gpus=1, env=env)
            else:
                c.add_node(num_cpus=2, num_gpus=1, env=env)
        c.wait_for_nodes(2)
        yield c
    finally:
        c.stop()


def _service_env(tmp: Path, database_url: str, ray_address: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLAB_", "RAY_"))}
    env.update(
        {
            "DATABASE_URL": database_url,
            "RAY_ADDRESS": ray_address,
            "VLAB_HOME": str(tmp / "home"),
            "VLAB_API__HOST": "127.0.0.1",
            "VLAB_API__PORT": str(free_port()),
            "VLAB_ENGINE__PYTHON": str(write_engine_python(tmp / "engine-python")),
            "VLAB_ENGINE__STARTUP_TIMEOUT_S": "60",
            "VLAB_ENGINE__RESOLVE_CONFIGS": "false",
            "VLAB_ORCHESTRATOR__POLL_INTERVAL_S": "0.3",
            "VLAB_ORCHESTRATOR__PLACEMENT_TIMEOUT_S": "30",
            "VLAB_ORCHESTRATOR__NODE_SETUP_TIMEOUT_S": "300",
            "HOME": str(tmp),  # no ~/.ray/auth_token of the machine's user
        }
    )
    env.update(extra)
    return env


def _refused(tmp: Path, env: dict[str, str]) -> str:
    """Run `vlab up` that must refuse to start: exit 2 and one `error:` line; returns it."""
    proc = subprocess.run(
        [str(VLAB), "up"], env=env, cwd=tmp, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    return lines[0]


@pytest.fixture(scope="module")
def service(
    tmp_path_factory: pytest.TempPathFactory, cluster: RayOnlyCluster, database: str
) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("ext-service")
    env = _service_env(tmp, database, cluster.address)
    log_path = tmp / "vlab-up.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [str(VLAB), "up"], env=env, cwd=tmp, stdout=log, stderr=subprocess.STDOUT
        )
    api = f"http://127.0.0.1:{env['VLAB_API__PORT']}"
    try:
        deadline = time.monotonic() + 400
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"vlab up exited {proc.returncode}:\n{log_path.read_text()}")
            try:
                if httpx.get(f"{api}/healthz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()[-4000:]
            time.sleep(0.5)
        yield {"api": api, "log": log_path, "proc": proc}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def _spec(name: str, layout: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "model": "tiny",
        "baseline": {
            "engine_args": {"max_model_len": 1024},
            "layout": layout,
            "workload": {
                "num_requests": 8,
                "concurrency": 2,
                "prefix_tokens": 64,
                "question_tokens": 8,
                "output_tokens": 16,
                "warmup_requests": 1,
            },
        },
        "repeats": 1,
    }


def _run(api: str, spec: dict[str, Any], timeout_s: float = 240) -> dict[str, Any]:
    resp = httpx.post(f"{api}/api/v1/experiments", json=spec, timeout=120)
    assert resp.status_code == 201, resp.text
    (brief,) = resp.json()["runs"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run: dict[str, Any] = httpx.get(f"{api}/api/v1/runs/{brief['id']}", timeout=30).json()
        if run["status"] in ("succeeded", "failed", "cancelled", "blocked"):
            return run
        time.sleep(0.5)
    raise AssertionError(f"run {brief['id']} did not end")


def test_the_nodes_python_has_ray_only(ray_python: Path) -> None:
    """The premise: the nodes' Python has Ray and none of what vlab's tasks import."""
    probe = (
        "import importlib.util, ray; print(ray.__version__); print(' '.join(m for m in "
        "('jobs', 'orchestrator', 'numpy', 'tokenizers', 'httpx') "
        "if importlib.util.find_spec(m) is not None))"
    )
    out = subprocess.run(
        [str(ray_python), "-I", "-c", probe], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out == [importlib.metadata.version("ray"), ""]


def test_refuses_nodes_that_lack_vlab_when_shipping_is_off(
    tmp_path: Path, cluster: RayOnlyCluster, database: str
) -> None:
    env = _service_env(
        tmp_path, database, cluster.address, VLAB_ORCHESTRATOR__SHIP_TO_NODES="never"
    )
    line = _refused(tmp_path, env)
    assert "2 of 2 node(s) cannot run vlab's tasks" in line
    assert line.count("Ray node ") == 2 and line.count(str(cluster.python)) == 2
    assert "lacks vlab's code (jobs, orchestrator: not importable)" in line
    for dist in ("numpy", "tokenizers", "httpx"):
        assert f"{dist}=={importlib.metadata.version(dist)} (absent)" in line
    assert "VLAB_ORCHESTRATOR__SHIP_TO_NODES=auto" in line


def test_ray_client_address_is_refused_with_the_reason(
    tmp_path: Path, cluster: RayOnlyCluster, database: str
) -> None:
    address = f"ray://127.0.0.1:{cluster.client_port}"
    line = _refused(tmp_path, _service_env(tmp_path, database, address))
    assert f"RAY_ADDRESS={address} is a Ray Client address" in line
    assert "RAY_ADDRESS=127.0.0.1:6379" in line


def test_ships_code_and_requirements_to_ray_only_nodes(
    service: dict[str, Any], ray_python: Path
) -> None:
    log = service["log"].read_text()
    (line,) = [ln for ln in log.splitlines() if "with Ray's runtime_env; 2 node(s) ready" in ln]
    assert "shipped py_modules jobs, orchestrator and pip " in line
    # pinned to the service's version: exactly the requirements the nodes lack or have
    # at another version (ray[default] brings pydantic, for instance)
    script = (
        "import importlib.metadata as m, sys\n"
        "for d in sys.argv[1:]:\n"
        "    try: print(d, m.version(d))\n"
        "    except m.PackageNotFoundError: print(d, None)\n"
    )
    out = subprocess.run(
        [str(ray_python), "-I", "-c", script, *WORKER_REQUIREMENTS],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    on_nodes = dict(ln.split(" ", 1) for ln in out.splitlines())
    assert on_nodes["numpy"] == "None" and on_nodes["tokenizers"] == "None"
    for dist in WORKER_REQUIREMENTS:
        here = importlib.metadata.version(dist)
        assert (f"{dist}=={here}" in line) == (on_nodes[dist] != here), (dist, line)


def test_a_run_succeeds_on_the_ray_only_cluster(service: dict[str, Any]) -> None:
    run = _run(service["api"], _spec("ext-tp1", {"tensor_parallel_size": 1}))
    assert run["status"] == "succeeded", run["error"]
    assert run["metrics"]["completed"] == 8
    (node,) = run["engine_info"]["gpu_assignment"]
    assert [g["rank"] for g in node["gpus"]] == [0]


def test_a_parity_check_over_both_nodes(service: dict[str, Any]) -> None:
    api = service["api"]
    check = httpx.post(f"{api}/api/v1/cluster/parity", json={"model": "tiny"}, timeout=60)
    assert check.status_code == 202, check.text
    doc = check.json()
    deadline = time.monotonic() + 120
    while doc["status"] in ("pending", "running") and time.monotonic() < deadline:
        time.sleep(0.5)
        doc = httpx.get(doc["url"], timeout=30).json()
    assert doc["status"] == "done", doc
    assert doc["report"]["verdict"] == "ok", doc["report"]["mismatches"]
    assert len(doc["report"]["node_ids"]) == 2


def test_a_pp2_run_spans_both_nodes(service: dict[str, Any]) -> None:
    api = service["api"]
    run = _run(api, _spec("ext-pp2", {"pipeline_parallel_size": 2}))
    assert run["status"] == "succeeded", run["error"]
    assert run["placement"]["nnodes"] == 2
    assert [n["stages"] for n in run["placement"]["nodes"]] == [[0], [1]]
    (part,) = run["engine_info"]["node_parts"]
    assert "--headless" in part["command"] and "--nnodes" in part["command"]
    parity = httpx.get(f"{api}/api/v1/runs/{run['id']}/parity", timeout=30).json()
    assert parity["report"]["verdict"] == "ok", parity["report"]["mismatches"]


def test_token_authentication_is_one_line_saying_what_to_set(
    tmp_path: Path, ray_python: Path, database: str
) -> None:
    """Ray 2.60 (``ray/_private/worker.py``, ``init``; ``ray/_private/node.py``,
    ``_init_gcs_client``): joining a token-auth cluster without the token raises
    ``ConnectionError("Failed to connect to Ray cluster at ...")`` from a
    ``RuntimeError`` whose text holds ``AuthenticationError: RPC error: InvalidAuthToken``
    (seen here); an explicit address sends a token only with ``RAY_AUTH_MODE=token`` in
    the driver. (A token without the mode, a wrong token, the other shapes:
    ``tests/orchestrator/dispatch/test_join.py``.)"""
    token = "vlab-test-" + os.urandom(8).hex()
    auth = RayOnlyCluster(ray_python, auth_token=token)
    try:
        auth.start_head(num_cpus=1, num_gpus=0)
        # Ray retries its GCS connection for about 20 s before it gives up (the retries
        # are Ray's RAY_gcs_server_port_wait_time_s): 2 here, to keep the test short
        env = _service_env(tmp_path, database, auth.address, RAY_gcs_server_port_wait_time_s="2")
        line = _refused(tmp_path, env)
        assert f"the Ray cluster at {auth.address} requires token authentication" in line
        assert "set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN=" in line
        assert "RAY_AUTH_TOKEN_PATH" in line and "ray get-auth-token" in line

        # with what the line says set, the join gets past authentication (and, shipping
        # nothing, stops at the node check: the node has Ray only)
        good = {
            **env,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": token,
            "VLAB_ORCHESTRATOR__SHIP_TO_NODES": "never",
        }
        line = _refused(tmp_path, good)
        assert "1 of 1 node(s) cannot run vlab's tasks" in line
    finally:
        auth.stop()
