"""Tests of jobs.signals.gpus: GPU telemetry readers, sample keys and the run summary.

Tests named ``test_sim_*`` use the SIMULATED ``nvidia-smi`` of :mod:`tests.simgpu`
(no real GPU is touched); the NVML tests use a fake ``nvml`` module object.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from jobs.engine.command import LAUNCHER_PATH
from jobs.schemas import MetricSample
from jobs.signals.enginemetrics import SAMPLE_KEYS
from jobs.signals.gpus import (
    GpuReader,
    GpuReading,
    gpu_sample_values,
    is_gpu_counter,
    parse_nvidia_smi,
    resolve_visible,
    summarize_gpu_samples,
    visible_devices,
)
from orchestrator.runs.timeseries import is_counter
from tests.simgpu import (
    NODE_ENV,
    NVIDIA_SMI_DIR,
    STATE_ENV,
    held,
    lock_path,
    simulated_uuid,
    write_inventory,
)

REPO = Path(__file__).resolve().parents[2]
SIM_SMI = str(NVIDIA_SMI_DIR / "nvidia-smi")


# ------------------------------------------------------------------ fake NVML


class FakeNvmlError(Exception):
    pass


class FakeNvml:
    """A stand-in for the ``pynvml`` module: GPUs as dicts, handles are the dicts."""

    def __init__(self, gpus: list[dict[str, Any]], init_error: Exception | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.initialised = 0
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self.gpus):
            raise FakeNvmlError("Invalid Argument")
        return self.gpus[index]

    def nvmlDeviceGetUUID(self, h: dict[str, Any]) -> str:
        return str(h["uuid"])

    def nvmlDeviceGetName(self, h: dict[str, Any]) -> bytes:
        return str(h["name"]).encode()  # old pynvml returned bytes

    def nvmlDeviceGetUtilizationRates(self, h: dict[str, Any]) -> SimpleNamespace:
        return SimpleNamespace(gpu=h["util"], memory=0)

    def nvmlDeviceGetMemoryInfo(self, h: dict[str, Any]) -> SimpleNamespace:
        return SimpleNamespace(used=h["used_b"], total=h["total_b"], free=0)

    def nvmlDeviceGetPowerUsage(self, h: dict[str, Any]) -> int:
        return int(h["power_mw"])

    def nvmlDeviceGetTotalEnergyConsumption(self, h: dict[str, Any]) -> int:
        if h.get("energy_mj") is None:
            raise FakeNvmlError("Not Supported")
        return int(h["energy_mj"])


MIB = 1024 * 1024


def _fake_gpus() -> list[dict[str, Any]]:
    return [
        {
            "uuid": "GPU-aaaa0000-0000-0000-0000-000000000000",
            "name": "NVIDIA H100 80GB HBM3",
            "util": 10,
            "used_b": 1000 * MIB,
            "total_b": 81559 * MIB,
            "power_mw": 120_500,
            "energy_mj": 5_000_000,
        },
        {
            "uuid": "GPU-bbbb0000-0000-0000-0000-000000000000",
            "name": "NVIDIA H100 80GB HBM3",
            "util": 95,
            "used_b": 70000 * MIB,
            "total_b": 81559 * MIB,
            "power_mw": 650_000,
            "energy_mj": 9_250_500,
        },
        {
            "uuid": "GPU-bbcc0000-0000-0000-0000-000000000000",
            "name": "NVIDIA H100 80GB HBM3",
            "util": 0,
            "used_b": 0,
            "total_b": 81559 * MIB,
            "power_mw": 70_000,
            "energy_mj": None,
        },
    ]


def test_nvml_devices_convert_units_and_map_index_uuid() -> None:
    nvml = FakeNvml(_fake_gpus())
    reader = GpuReader(nvml=nvml, nvidia_smi=None)
    assert reader.source == "nvml"
    assert reader.note == ""
    assert nvml.initialised == 1

    devs = reader.devices()
    assert [d.index for d in devs] == [0, 1, 2]
    assert [d.uuid for d in devs] == [g["uuid"] for g in _fake_gpus()]
    first = devs[0]
    assert first.name == "NVIDIA H100 80GB HBM3"  # bytes decoded
    assert first.utilization_pct == 10.0
    assert first.memory_used_mib == 1000.0
    assert first.memory_total_mib == 81559.0
    assert first.power_w == pytest.approx(120.5)
    assert first.energy_j == pytest.approx(5000.0)  # mJ -> J
    assert devs[1].energy_j == pytest.approx(9250.5)
    assert devs[2].energy_j is None  # counter not supported -> None, not an error

    reader.close()
    assert nvml.shutdowns == 1
    reader.close()
    assert nvml.shutdowns == 1


def test_nvml_read_keeps_the_given_order_and_skips_unknown_indices() -> None:
    reader = GpuReader(nvml=FakeNvml(_fake_gpus()), nvidia_smi=None)
    got = reader.read([2, 0, 7, -1])
    assert [r.index for r in got] == [2, 0]
    assert got[0].uuid.startswith("GPU-bbcc")
    assert reader.read([]) == []


def test_nvml_init_failure_falls_back_to_nvidia_smi_note() -> None:
    reader = GpuReader(
        nvml=FakeNvml([], init_error=FakeNvmlError("Driver Not Loaded")), nvidia_smi=SIM_SMI
    )
    assert reader.source == "nvidia-smi"
    assert "Driver Not Loaded" in reader.note


def test_no_backend_gives_empty_lists_and_a_note() -> None:
    reader = GpuReader(
        nvml=FakeNvml([], init_error=FakeNvmlError("NVML Shared Library Not Found")),
        nvidia_smi=None,
    )
    assert reader.source is None
    assert reader.devices() == []
    assert reader.read([0, 1]) == []
    assert reader.note.startswith("no NVIDIA GPU telemetry on this node")
    assert "NVML Shared Library Not Found" in reader.note
    assert "nvidia-smi is not on PATH" in reader.note
    reader.close()


def test_default_reader_on_this_machine_never_raises() -> None:
    reader = GpuReader(nvidia_smi=None)  # real pynvml import; no GPU here
    if reader.source is None:
        assert reader.devices() == []
        assert "NVML did not load" in reader.note
    reader.close()


def test_parse_nvidia_smi_na_values_and_commas_in_names() -> None:
    text = (
        "0, GPU-1, Tesla, Weird, Name, [N/A], 10, 100, [Not Supported]\n"
        "garbage line\n"
        "1, GPU-2, NVIDIA A10, 3, 20, 23028, 60.25\n"
    )
    got = parse_nvidia_smi(text)
    assert [r.index for r in got] == [0, 1]
    assert got[0].name == "Tesla, Weird, Name"
    assert got[0].utilization_pct is None
    assert got[0].power_w is None
    assert got[0].memory_used_mib == 10.0
    assert got[1] == GpuReading(1, "GPU-2", "NVIDIA A10", 3.0, 20.0, 23028.0, 60.25, None)


# ------------------------------------------------------ simulated nvidia-smi


@pytest.fixture()
def sim_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A simulated node ``node-a`` with 4 GPUs; env and PATH point at the stand-in."""
    write_inventory(tmp_path, "node-a", 4)
    monkeypatch.setenv(STATE_ENV, str(tmp_path))
    monkeypatch.setenv(NODE_ENV, "node-a")
    monkeypatch.setenv("PATH", f"{NVIDIA_SMI_DIR}{os.pathsep}{os.environ.get('PATH', '')}")
    yield tmp_path


def test_sim_inventory_uuids_are_deterministic_and_distinct(tmp_path: Path) -> None:
    a = write_inventory(tmp_path, "node-a", 2)
    b = write_inventory(tmp_path, "node-b", 2)
    assert a == write_inventory(tmp_path, "node-a", 2)
    uuids = [g["uuid"] for g in a + b]
    assert len(set(uuids)) == 4
    for u in uuids:
        parts = u.removeprefix("GPU-").split("-")
        assert u.startswith("GPU-5113") and [len(p) for p in parts] == [8, 4, 4, 4, 12]
    stored = json.loads((tmp_path / "node-a" / "gpus.json").read_text())
    assert stored[1] == {
        "index": 1,
        "uuid": simulated_uuid("node-a", 1),
        "name": "NVIDIA H200 (simulated)",
        "memory_total_mib": 143771,
    }


def test_sim_nvidia_smi_reader_and_a_held_lock_flips_a_gpu_to_busy(sim_node: Path) -> None:
    reader = GpuReader(nvml=None)  # nvidia-smi found on PATH: the stand-in
    assert reader.source == "nvidia-smi"
    assert "NVML disabled" in reader.note

    idle = reader.devices()
    assert [r.index for r in idle] == [0, 1, 2, 3]
    assert idle[2].uuid == simulated_uuid("node-a", 2)
    assert idle[2] == GpuReading(
        2, simulated_uuid("node-a", 2), "NVIDIA H200 (simulated)", 0.0, 0.0, 143771.0, 75.0, None
    )

    path = lock_path(sim_node, "node-a", 2)
    path.touch()
    assert not held(sim_node, "node-a", 2)
    with path.open("r") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert held(sim_node, "node-a", 2)
        busy = reader.read([3, 2])
        assert [r.index for r in busy] == [3, 2]
        assert busy[1].utilization_pct == 90.0
        assert busy[1].memory_used_mib == 60000.0
        assert busy[1].power_w == 400.0
        assert busy[1].energy_j is None  # nvidia-smi has no energy counter
        assert busy[0].utilization_pct == 0.0 and busy[0].power_w == 75.0
    assert not held(sim_node, "node-a", 2)
    assert reader.read([2])[0].utilization_pct == 0.0


def test_sim_nvidia_smi_driver_failure_is_a_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(STATE_ENV, str(tmp_path))
    monkeypatch.setenv(NODE_ENV, "no-such-node")
    reader = GpuReader(nvml=None, nvidia_smi=SIM_SMI)
    assert reader.source == "nvidia-smi"
    assert reader.devices() == []
    assert "exited with 9" in reader.note
    assert "couldn't communicate with the NVIDIA driver" in reader.note


def test_sim_nvidia_smi_list_and_topology(sim_node: Path) -> None:
    listed = subprocess.run([SIM_SMI, "-L"], capture_output=True, text=True, check=True).stdout
    assert listed.splitlines()[1] == (
        f"GPU 1: NVIDIA H200 (simulated) (UUID: {simulated_uuid('node-a', 1)})"
    )
    topo = subprocess.run([SIM_SMI, "topo", "-m"], capture_output=True, text=True, check=True)
    assert "GPU3" in topo.stdout and "NV18" in topo.stdout
    bad = subprocess.run(
        [SIM_SMI, "--query-gpu=bogus", "--format=csv"], capture_output=True, text=True, check=False
    )
    assert bad.returncode == 2


def test_sim_vllm_launcher_gpu_facts_against_the_stand_in(sim_node: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(LAUNCHER_PATH), "fingerprint"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        timeout=60,
    )
    doc = json.loads(proc.stdout)
    assert doc["gpu_count"] == 4
    assert doc["gpu_model"] == "NVIDIA H200 (simulated)"
    assert doc["gpu_memory_mib"] == 143771
    assert doc["nvidia_driver"] == "570.00-sim"
    assert "GPU0" in doc["gpu_topology"]


# ------------------------------------------------------------ visible devices


def _readings() -> list[GpuReading]:
    return [
        GpuReading(i, u, "G", None, None, None, None, None)
        for i, u in enumerate(
            [
                "GPU-aaaa1111-0000-0000-0000-000000000000",
                "GPU-bbbb1111-0000-0000-0000-000000000000",
                "GPU-bbbb2222-0000-0000-0000-000000000000",
                "GPU-cccc1111-0000-0000-0000-000000000000",
            ]
        )
    ]


def test_visible_devices_parsing() -> None:
    assert visible_devices({}) is None
    assert visible_devices({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_devices({"CUDA_VISIBLE_DEVICES": " 2, 0 ,GPU-ab "}) == ["2", "0", "GPU-ab"]


def test_resolve_visible_by_index_uuid_and_prefix() -> None:
    rs = _readings()
    assert [r.index for r in resolve_visible(rs, ["3", "1"])] == [3, 1]
    full = "GPU-bbbb2222-0000-0000-0000-000000000000"
    assert [r.index for r in resolve_visible(rs, [full, "0"])] == [2, 0]
    assert [r.index for r in resolve_visible(rs, ["GPU-cccc", "GPU-AAAA1"])] == [3, 0]
    # an ambiguous prefix or an unknown entry ends the list, as in CUDA
    assert [r.index for r in resolve_visible(rs, ["1", "GPU-bbbb", "0"])] == [1]
    assert [r.index for r in resolve_visible(rs, ["0", "2", "-1", "1"])] == [0, 2]
    assert [r.index for r in resolve_visible(rs, ["0", "9", "1"])] == [0]
    assert resolve_visible(rs, []) == []


# ---------------------------------------------------------------- sample keys


def test_gpu_sample_values_per_gpu_and_aggregates() -> None:
    a = GpuReading(5, "GPU-a", "G", 80.0, 1000.0, 80000.0, 300.0, 1000.0)
    b = GpuReading(1, "GPU-b", "G", 40.0, 3000.0, 80000.0, 100.0, 2500.0)
    got = gpu_sample_values([a, b])
    assert got == {
        "gpu0_utilization_pct": 80.0,
        "gpu0_memory_used_mib": 1000.0,
        "gpu0_power_w": 300.0,
        "gpu0_energy_j": 1000.0,
        "gpu1_utilization_pct": 40.0,
        "gpu1_memory_used_mib": 3000.0,
        "gpu1_power_w": 100.0,
        "gpu1_energy_j": 2500.0,
        "gpu_utilization_pct": 60.0,
        "gpu_memory_used_mib": 4000.0,
        "gpu_power_w": 400.0,
        "gpu_energy_j": 3500.0,
    }
    # no counter on one GPU: no energy aggregate, the other GPU's own key stays
    c = GpuReading(2, "GPU-c", "G", 0.0, 0.0, 80000.0, 75.0, None)
    got = gpu_sample_values([a, c])
    assert "gpu_energy_j" not in got and "gpu1_energy_j" not in got
    assert got["gpu0_energy_j"] == 1000.0 and got["gpu_power_w"] == 375.0
    assert gpu_sample_values([]) == {}
    aggregates = {k for k in gpu_sample_values([a, b]) if not k[3].isdigit()}
    assert aggregates <= set(SAMPLE_KEYS)


def test_energy_keys_are_counters() -> None:
    for key in ("gpu_energy_j", "gpu0_energy_j", "gpu12_energy_j"):
        assert is_gpu_counter(key) and is_counter(key)
    for key in (
        "gpu_power_w",
        "gpu0_power_w",
        "gpu_prefix_cache_hit_rate_v0_fraction",
        "gpux_energy_j",
    ):
        assert not is_gpu_counter(key) and not is_counter(key)
    assert SAMPLE_KEYS["gpu_energy_j"].startswith("counter")
    assert SAMPLE_KEYS["gpu_power_w"].startswith("gauge")


# -------------------------------------------------------------------- summary


def _s(t: float, phase: Any, **values: float) -> MetricSample:
    return MetricSample(t_s=t, phase=phase, values={"num_requests_running": 1.0, **values})


def test_summary_uses_the_energy_counter_delta() -> None:
    samples = [
        _s(
            0.0,
            "before",
            gpu_energy_j=1000.0,
            gpu_power_w=100.0,
            gpu_utilization_pct=0.0,
            gpu0_memory_used_mib=100.0,
            gpu1_memory_used_mib=50.0,
        ),
        _s(
            1.0,
            "during",
            gpu_energy_j=1500.0,
            gpu_power_w=999.0,
            gpu_utilization_pct=80.0,
            gpu0_memory_used_mib=7000.0,
            gpu1_memory_used_mib=6500.0,
        ),
        _s(2.0, "during", gpu_energy_j=2000.0, gpu_power_w=999.0, gpu_utilization_pct=60.0),
        _s(4.0, "after", gpu_energy_j=3000.0, gpu_power_w=100.0, gpu_utilization_pct=5.0),
    ]
    metrics, info = summarize_gpu_samples(samples, output_tokens=400, gpus=2)
    assert metrics == {
        "gpu_energy_j": 2000.0,
        "energy_per_output_token_j": 5.0,
        "gpu_mean_power_w": 250.0,  # 2000 J / 4 s / 2 GPUs
        "gpu_peak_memory_used_mib": 7000.0,
        "gpu_mean_utilization_pct": 70.0,
    }
    assert info["available"] is True
    assert info["energy_source"] == "nvml_energy_counter"
    assert info["source"] == "nvml"
    assert info["notes"] == []


def test_summary_power_integral_fallback_exact_numbers() -> None:
    samples = [
        _s(0.0, "before", gpu_power_w=100.0, gpu0_power_w=100.0),
        _s(1.0, "during", gpu_power_w=300.0, gpu_utilization_pct=90.0),
        _s(3.0, "during", gpu_power_w=500.0, gpu_utilization_pct=50.0),
        _s(4.0, "after", gpu_power_w=100.0),
    ]
    metrics, info = summarize_gpu_samples(samples, output_tokens=100, gpus=1, source="nvidia-smi")
    # trapezoids: 1*(100+300)/2 + 2*(300+500)/2 + 1*(500+100)/2 = 200 + 800 + 300
    assert metrics["gpu_energy_j"] == pytest.approx(1300.0)
    assert metrics["energy_per_output_token_j"] == pytest.approx(13.0)
    assert metrics["gpu_mean_power_w"] == pytest.approx(325.0)
    assert metrics["gpu_mean_utilization_pct"] == pytest.approx(70.0)
    assert "gpu_peak_memory_used_mib" not in metrics
    assert info["energy_source"] == "power_integral"
    assert info["source"] == "nvidia-smi"
    assert any("sampled power" in n for n in info["notes"])


def test_summary_without_gpu_keys_is_empty_with_a_note() -> None:
    samples = [_s(0.0, "before", gpu_prefix_cache_hit_rate_v0_fraction=0.5), _s(1.0, "after")]
    metrics, info = summarize_gpu_samples(samples, output_tokens=10, gpus=1)
    assert metrics == {}
    assert info["available"] is False and info["note"]
    assert summarize_gpu_samples([], output_tokens=10, gpus=1)[0] == {}


def test_summary_zero_output_tokens_gives_no_joules_per_token() -> None:
    samples = [_s(0.0, "before", gpu_energy_j=0.0), _s(2.0, "after", gpu_energy_j=100.0)]
    metrics, info = summarize_gpu_samples(samples, output_tokens=0, gpus=1)
    assert metrics["gpu_energy_j"] == 100.0
    assert metrics["gpu_mean_power_w"] == 50.0
    assert "energy_per_output_token_j" not in metrics
    assert any("output tokens" in n for n in info["notes"])


def test_summary_one_point_leaves_energy_out_with_a_note() -> None:
    samples = [_s(0.0, "before"), _s(1.0, "during", gpu_power_w=300.0, gpu_utilization_pct=40.0)]
    metrics, info = summarize_gpu_samples(samples, output_tokens=10, gpus=1)
    assert metrics == {"gpu_mean_utilization_pct": 40.0}
    assert "energy_source" not in info
    assert any("fewer than 2" in n for n in info["notes"])


def test_summary_counter_going_down_falls_back_to_power() -> None:
    samples = [
        _s(0.0, "before", gpu_energy_j=5000.0, gpu_power_w=200.0),
        _s(2.0, "after", gpu_energy_j=10.0, gpu_power_w=200.0),
    ]
    metrics, info = summarize_gpu_samples(samples, output_tokens=4, gpus=1)
    assert metrics["gpu_energy_j"] == pytest.approx(400.0)
    assert info["energy_source"] == "power_integral"
    assert any("went down" in n for n in info["notes"])
