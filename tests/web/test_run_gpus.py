"""The run page's GPUs and energy: the GPU table, the telemetry facts, the energy and
power cards, the GPU charts, the model revision and the executor, for a run on GPUs;
the empty states for a CPU run and for a run stored before GPU assignments were."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from playwright.sync_api import Page, expect
from sqlalchemy import delete, insert
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.core.models import Experiment, Run, RunMetric, RunSample
from tests.web.conftest import screenshot
from tests.web.seed import (
    CPU_NOTE,
    GPU_MEMORY_MIB,
    GPU_NAME,
    GPUS,
    MODEL_REVISION,
    gpu_runs,
)

GPU_CHARTS = ("chart-gpu-power", "chart-gpu-util", "chart-gpu-mem")


@pytest.fixture(scope="module")
def gpu_data(web_db: sessionmaker[Session]) -> Iterator[dict[str, Any]]:
    with web_db.begin() as s:
        data = gpu_runs(s, name=f"gpu-{uuid.uuid4().hex[:8]}")
    yield data
    with web_db.begin() as s:
        s.execute(delete(Run).where(Run.experiment_id == data["experiment_id"]))
        s.execute(delete(Experiment).where(Experiment.id == data["experiment_id"]))


def _datasets(page: Page, canvas_id: str) -> list[dict[str, Any]]:
    """``[{label, points: [[x, y]]}]`` of a chart."""
    return list(
        page.evaluate(
            "id => Chart.getChart(document.getElementById(id)).data.datasets"
            ".map(d => ({label: d.label, points: d.data.map(p => [p.x, p.y])}))",
            canvas_id,
        )
    )


def _wait_gpu_chart(page: Page, canvas_id: str, datasets: int) -> None:
    page.wait_for_function(
        "([id, n]) => { const c = Chart.getChart(document.getElementById(id));"
        " return c && c.data.datasets.length === n && c.data.datasets[0].data.length > 0; }",
        arg=[canvas_id, datasets],
    )


def test_gpu_run_shows_gpus_energy_and_charts(
    page: Page, live_server: str, gpu_data: dict[str, Any]
) -> None:
    metrics = gpu_data["metrics"]["gpu"]
    samples = gpu_data["samples"]["gpu"]
    page.goto(f"{live_server}/runs/{gpu_data['gpu']}")

    # the GPU table: one row per GPU in rank order
    rows = page.locator("#gpu-table tbody tr")
    expect(rows).to_have_count(2)
    assert rows.evaluate_all("rs => rs.map(r => r.dataset.uuid)") == [g[3] for g in GPUS]
    heads = page.locator("#gpu-table thead th").all_inner_texts()
    assert heads == [
        "Series",
        "Node rank",
        "Node id",
        "CUDA_VISIBLE_DEVICES",
        "GPU index",
        "UUID",
        "Name",
        "Memory total (GiB)",
        "vLLM rank",
    ]
    for k, (rank, node_id, index, gpu_uuid) in enumerate(GPUS):
        cells = rows.nth(k).locator("td").all_inner_texts()
        assert cells == [
            f"gpu{k}",
            str(rank),
            node_id[:12] + "…",
            str(index),
            str(index),
            gpu_uuid,
            GPU_NAME,
            f"{GPU_MEMORY_MIB / 1024:.1f}",
            str(rank),
        ]
        expect(rows.nth(k).locator("td").nth(2)).to_have_attribute("title", node_id)
    telemetry = page.locator("#gpu-telemetry")
    expect(telemetry).to_contain_text("NVML (nvidia-ml-py)")
    expect(telemetry).to_contain_text("NVML energy counter")
    expect(telemetry).to_contain_text(f"{metrics['gpu_energy_j']:,.1f} J")
    expect(telemetry).to_contain_text(f"{metrics['gpu_mean_utilization_pct']:.1f} %")
    expect(page.locator("#gpus-empty")).to_have_count(0)

    # the cards, as stored
    energy = page.locator('#cards .card[data-metric="energy_per_output_token_j"]')
    expect(energy.locator(".v")).to_have_text(f"{metrics['energy_per_output_token_j']:.3f}")
    expect(energy.locator(".k")).to_have_text("Energy per output token (J/token)")
    power = page.locator('#cards .card[data-metric="gpu_mean_power_w"] .v')
    expect(power).to_have_text(f"{metrics['gpu_mean_power_w']:.1f}")
    # the GPU metrics have their own group, with units (utilisation is already %)
    util_row = page.locator("#metrics-gpu tr[data-metric=gpu_mean_utilization_pct]")
    expect(util_row.locator("td")).to_have_text(["gpu_mean_utilization_pct", "70.5", "%"])
    expect(page.locator("#metrics-gpu tr[data-metric=energy_per_output_token_j]")).to_contain_text(
        "J/token"
    )
    expect(page.locator("#metrics-client tr[data-metric=gpu_energy_j]")).to_have_count(0)

    # the charts: one line per GPU, every sample, the measured-phase band
    expect(page.locator("#gpu-charts")).to_be_visible()
    expect(page.locator("#gpu-charts-none")).to_be_hidden()
    for canvas in GPU_CHARTS:
        _wait_gpu_chart(page, canvas, 2)
        expect(page.locator(f'.chart-empty[data-for="{canvas}"]')).to_be_hidden()
    power_sets = _datasets(page, "chart-gpu-power")
    assert [d["label"] for d in power_sets] == [
        f"gpu{k} (node {rank}, index {index})" for k, (rank, _, index, _) in enumerate(GPUS)
    ]
    for k, d in enumerate(power_sets):
        assert d["points"] == [[p["t_s"], p["values"][f"gpu{k}_power_w"]] for p in samples]
    mem = _datasets(page, "chart-gpu-mem")
    first = samples[0]
    assert mem[1]["points"][0] == [first["t_s"], first["values"]["gpu1_memory_used_mib"] / 1024]
    util = _datasets(page, "chart-gpu-util")
    assert util[0]["points"][-1][1] == samples[-1]["values"]["gpu0_utilization_pct"]
    band = page.evaluate(
        "Chart.getChart(document.getElementById('chart-gpu-power')).options.plugins.phaseBand"
    )
    assert band == {"from": samples[0]["t_s"], "to": samples[-1]["t_s"]}
    assert (
        page.evaluate(
            "Chart.getChart(document.getElementById('chart-gpu-util')).options.scales.y.max"
        )
        == 100
    )

    # configuration: the pinned revision and where the model came from
    model = page.locator("#model-table")
    expect(model).to_contain_text(MODEL_REVISION)
    expect(model).to_contain_text("hf_cache · offline · weights cached · 2 files")
    expect(page.locator("#model-revision")).to_have_text(MODEL_REVISION[:12])
    # placement: executor and where the device kind came from
    expect(page.locator("#executor")).to_contain_text("executor mp")
    expect(page.locator("#device-kind")).to_have_text(
        "resource GPU (device kind detected from the cluster)"
    )
    # shown in their own sections, not again in the raw engine info
    expect(page.locator("#engine-info pre")).not_to_contain_text("gpu_assignment")
    screenshot(page, "run-gpus")


def test_cpu_run_says_gpu_figures_are_not_measured(
    page: Page, live_server: str, gpu_data: dict[str, Any]
) -> None:
    page.goto(f"{live_server}/runs/{gpu_data['cpu']}")
    empty = page.locator("#gpus-empty")
    expect(empty).to_contain_text(CPU_NOTE)
    expect(empty).to_contain_text(
        "GPU utilisation, memory, power and energy are not measured on CPU hosts"
    )
    expect(empty).to_contain_text("never shown as zeros")
    expect(page.locator("#gpu-table")).to_have_count(0)
    for metric in ("energy_per_output_token_j", "gpu_mean_power_w"):
        expect(page.locator(f'#cards .card[data-metric="{metric}"]')).to_have_count(0)
    expect(page.locator("#metrics-gpu")).to_have_count(0)
    # the other charts are drawn; the GPU ones stay hidden and are never made
    page.wait_for_function(
        "() => { const c = Chart.getChart(document.getElementById('chart-kv'));"
        " return c && c.data.datasets[0].data.length === 5; }"
    )
    expect(page.locator("#gpu-charts")).to_be_hidden()
    expect(page.locator("#gpu-charts-none")).to_be_visible()
    expect(page.locator("#gpu-charts-none")).to_contain_text("no GPU telemetry")
    for canvas in GPU_CHARTS:
        assert page.evaluate(f"Chart.getChart(document.getElementById('{canvas}')) === undefined")
    expect(page.locator("#executor")).to_contain_text("executor mp")
    expect(page.locator("#device-kind")).to_have_text(
        "resource CPU (device kind set in the orchestrator settings)"
    )
    expect(page.locator("#model-revision")).to_have_count(0)


def test_run_stored_before_gpu_assignments(
    page: Page, live_server: str, seeded: dict[str, Any]
) -> None:
    page.goto(f"{live_server}/runs/{seeded['real']['runs']['apc-on#0']}")
    expect(page.locator("#gpus-empty")).to_contain_text("No GPU assignment recorded")
    expect(page.locator("#gpus-empty")).to_contain_text("not measured on CPU hosts")
    expect(page.locator("#gpu-charts")).to_be_hidden()
    expect(page.locator("#gpu-charts-none")).to_be_visible()


def test_gpu_charts_appear_live(
    page: Page, live_server: str, gpu_data: dict[str, Any], web_db: sessionmaker[Session]
) -> None:
    """An active run with no GPU assignment stored yet: the GPU charts appear with the
    first samples carrying GPU keys, and are named after the GPUs once the run ends."""
    samples = gpu_data["samples"]["gpu"]
    started = datetime.now(UTC) - timedelta(seconds=20)
    with web_db.begin() as s:
        src = s.get(Run, gpu_data["gpu"])
        assert src is not None
        assignment = src.engine_info["gpu_assignment"]
        run = Run(
            id=str(uuid.uuid4()),
            experiment_id=gpu_data["experiment_id"],
            name="gpu-live",
            position=2,
            sequence=2,
            status="running",
            progress={"phase": "measuring", "requests_done": 1, "requests_total": 8},
            started_at=started,
            engine_args={},
            explicit_engine_args={},
            layout=src.layout,
            workload=src.workload,
            model_id=src.model_id,
            model_path=src.model_path,
            model_digest=src.model_digest,
            seed=0,
            request_list_hash=src.request_list_hash,
            engine_info={},
        )
        s.add(run)
        run_id = run.id
        s.execute(
            insert(RunSample),
            [
                {"run_id": run_id, "t_s": p["t_s"], "phase": p["phase"], "values": {
                    k: v for k, v in p["values"].items() if not k.startswith("gpu")
                }}
                for p in samples[:2]
            ],
        )  # fmt: skip
    try:
        page.goto(f"{live_server}/runs/{run_id}")
        expect(page.locator("#live")).to_be_visible()
        expect(page.locator("#gpus-empty")).to_contain_text("the run has not been placed yet")
        expect(page.locator("#gpu-charts")).to_be_hidden()

        with web_db.begin() as s:
            s.execute(
                insert(RunSample),
                [
                    {"run_id": run_id, "t_s": p["t_s"], "phase": p["phase"], "values": p["values"]}
                    for p in samples[2:]
                ],
            )
        expect(page.locator("#gpu-charts")).to_be_visible(timeout=10_000)
        expect(page.locator("#gpu-charts-none")).to_be_hidden()
        _wait_gpu_chart(page, "chart-gpu-power", 2)
        assert [d["label"] for d in _datasets(page, "chart-gpu-power")] == ["gpu0", "gpu1"]

        with web_db.begin() as s:
            s.execute(
                insert(RunMetric),
                [{"run_id": run_id, "name": "gpu_mean_power_w", "value": 201.5}],
            )
            r = s.get(Run, run_id)
            assert r is not None
            r.engine_info = {"gpu_assignment": assignment}
            r.status, r.finished_at = "succeeded", started + timedelta(seconds=15)
        expect(page.locator("#status")).to_have_text("succeeded", timeout=10_000)
        expect(page.locator("#gpu-table tbody tr")).to_have_count(2)
        expect(page.locator('#cards .card[data-metric="gpu_mean_power_w"] .v')).to_have_text(
            "201.5"
        )
        page.wait_for_function(
            "() => Chart.getChart(document.getElementById('chart-gpu-power'))"
            ".data.datasets[0].label.startsWith('gpu0 (node 0')"
        )
    finally:
        with web_db.begin() as s:
            r = s.get(Run, run_id)
            if r is not None and r.status == "running":
                r.status, r.finished_at = "cancelled", datetime.now(UTC)
