"""The GPU check: the demo on a real NVIDIA GPU, and the figures a reviewer needs.

Run by ``scripts/gpu_check.sh`` (not part of CI). Starts the service like ``vlab
demo`` (embedded Postgres unless ``DATABASE_URL``, a local Ray that sees the GPUs),
submits ``examples/gpu-check.json`` (prefix caching off vs on, TP=1), waits, then
prints: the device kind and how it was chosen, every run's GPUs (node, index, UUID,
vLLM rank, ``CUDA_VISIBLE_DEVICES``), the GPU telemetry source, the TTFT and E2EL
ratios APC on / off with their 95 % intervals, energy per output token and mean
power per GPU. Exit code 1 when a run failed or a figure a GPU run must have is
missing.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

import httpx

from orchestrator.cli.main import load_spec_file, submit_spec
from orchestrator.cli.report import watch
from orchestrator.cli.runtime import Runtime
from orchestrator.core.settings import get_settings

SPEC = Path(__file__).resolve().parent.parent / "examples" / "gpu-check.json"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fmt(value: Any, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}g}"


def main() -> int:
    settings = get_settings()
    rt = Runtime(settings)
    rt.start_database()
    rt.start_orchestrator()
    port = _port()
    rt.start_api_thread("127.0.0.1", port)
    api = f"http://127.0.0.1:{port}"
    ok = True
    try:
        kind, source = rt.device_kind or ("?", "?")
        print(f"device kind: {kind} ({source})")
        if kind != "GPU":
            print("FAIL: the Ray cluster shows no GPU; is this an NVIDIA GPU machine?")
            return 1
        created = submit_spec(api, load_spec_file(SPEC))
        if created is None:
            return 1
        exp = watch(api, created["id"])
        for run in exp["runs"]:
            info = run.get("engine_info") or {}
            metrics = run.get("metrics") or {}
            print(f"\nrun {run['name']} #{run['repeat_index']}: {run['status']} {run['url']}")
            if run["status"] != "succeeded":
                ok = False
                print(f"  error: {run.get('error')}")
            for node in info.get("gpu_assignment") or []:
                print(
                    f"  node rank {node.get('node_rank')} CUDA_VISIBLE_DEVICES="
                    f"{node.get('cuda_visible_devices')} telemetry={node.get('telemetry')}"
                )
                for gpu in node.get("gpus") or []:
                    print(
                        f"    GPU {gpu.get('index')} {gpu.get('uuid')} {gpu.get('name')} "
                        f"vLLM rank {gpu.get('rank')}"
                    )
            telemetry = info.get("gpu_telemetry") or {}
            print(f"  telemetry: {telemetry}")
            for key, unit in (
                ("energy_per_output_token_j", "J/token"),
                ("gpu_mean_power_w", "W per GPU"),
                ("gpu_energy_j", "J"),
                ("gpu_peak_memory_used_mib", "MiB"),
                ("median_ttft_ms", "ms"),
            ):
                print(f"  {key}: {_fmt(metrics.get(key))} {unit}")
            if run["status"] == "succeeded" and "energy_per_output_token_j" not in metrics:
                ok = False
                print("  FAIL: no energy per output token on a GPU run")
        comparison = httpx.get(f"{api}/api/v1/experiments/{created['id']}/comparison", timeout=60)
        for variant in comparison.json().get("variants", []):
            for m in variant.get("metrics", []):
                if m.get("metric") in (
                    "median_ttft_ms",
                    "median_e2el_ms",
                    "energy_per_output_token_j",
                ):
                    of = m.get("ci_of") or "ratio"  # the interval is of the ratio or the
                    print(  # difference (when the reference is 0)
                        f"{variant.get('variant')}: {m['metric']} ratio {_fmt(m.get('ratio'))}, "
                        f"95 % CI of the {of} {_fmt(m.get('ci_low'))}..{_fmt(m.get('ci_high'))}"
                        f" ({m.get('verdict')})"
                    )
        return 0 if ok else 1
    finally:
        rt.stop()


if __name__ == "__main__":
    sys.exit(main())
