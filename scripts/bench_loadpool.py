"""Benchmark: the load generator's open-loop ceiling against workers, and its CPU per request next
to ``vllm bench serve``'s on the same stub, in one run.

Usage (from the repo root; the vLLM part needs `make engine`):

    .venv/bin/python scripts/bench_loadpool.py [--workers 1,2,4] [--rounds 3]
        [--rate 100] [--requests 600] [--no-vllm] [--json out.json]

Workload, as ``scripts/bench_loadgen.py``: chat API, random prompts of 128 tokens of a
generated tiny tokenizer (decoded, as vLLM's random dataset), 64 output tokens with
``ignore_eos``, streamed.

(a) Ceiling against workers: :func:`jobs.load.loadceiling.measure_ceiling` with 1 (this
    process, in-process ``run_load``), 2 and 4 worker processes (not pinned), against
    its own stub (TTFT 1 ms, 1 ms between tokens) in a subprocess; ``--rounds`` rounds,
    the worker counts interleaved within each round; the ratio to one process is taken
    within each round.
(b) Client CPU per request at a constant open-loop rate (``--rate`` req/s,
    ``--requests`` requests) against one stub (TTFT 50 ms, 10 ms between tokens, a
    subprocess): our client in a subprocess (1 process, and ``--pool-workers`` worker
    processes) and ``vllm bench serve`` (``--request-rate R --burstiness inf``), one
    after the other, ``--rounds`` times interleaved. The CPU is read from ``/proc``
    (user + system, the client's process and its children) at the moments the stub has
    received 10 % and 90 % of the requests: CPU per request = CPU between those moments /
    requests received between them. Start-up, dataset building and the tail are outside
    the window, for both clients alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_loadgen import _VLLM_CLI, LAUNCHER, MODEL_NAME, _prompts  # noqa: E402

from jobs.load.loadceiling import measure_ceiling  # noqa: E402
from jobs.modelgen.generator import generate_model  # noqa: E402
from jobs.schemas import ChatRequest  # noqa: E402
from jobs.stub.stubserver import StubServer  # noqa: E402

_CLK_TCK = os.sysconf("SC_CLK_TCK")

#: our client in a subprocess: requests from a JSON file, an open loop at RATE
_OUR_CLIENT = """
import asyncio, json, sys
from jobs.load.loadpool import run_load_workers
from jobs.schemas import ChatRequest
url, path, rate = sys.argv[1], sys.argv[2], float(sys.argv[3])
workers, tokens = int(sys.argv[4]), int(sys.argv[5])
prompts = json.load(open(path))
reqs = [
    ChatRequest(
        index=i, messages=[{"role": "user", "content": p}], max_tokens=tokens, arrival_s=i / rate
    )
    for i, p in enumerate(prompts)
]
got = asyncio.run(run_load_workers(url, "tiny", reqs, concurrency=len(reqs), workers=workers))
print(json.dumps({"failed": sum(not r.success for r in got.records), "cpu_s": got.client_cpu_s}))
"""


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of ``pid`` and its live descendants, from ``/proc``."""
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        p = int(entry)
        children.setdefault(int(fields[1]), []).append(p)
        cpu[p] = (int(fields[11]) + int(fields[12])) / _CLK_TCK
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += cpu.get(p, 0.0)
        todo.extend(children.get(p, []))
    return total


def _received(stub: StubServer) -> int:
    with urllib.request.urlopen(stub.base_url + "/stub/stats", timeout=5) as resp:
        return int(json.loads(resp.read())["requests"])


@dataclass
class CpuRun:
    client: str
    round: int
    rate: float
    requests: int
    window_requests: int
    window_cpu_s: float
    window_s: float
    failed: int | None

    @property
    def cpu_ms_per_request(self) -> float:
        return self.window_cpu_s * 1000 / self.window_requests if self.window_requests else 0.0


def _cpu_window(
    stub: StubServer, cmd: list[str], n: int, cwd: Path
) -> tuple[int, float, float, str]:
    """Run ``cmd``; CPU of its process tree between the stub's 10 % and 90 % receipts."""
    base = _received(stub)
    lo, hi = base + n // 10, base + n - n // 10
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd
    )
    marks: list[tuple[int, float, float]] = []  # (received, cpu, time) at the window's ends
    while proc.poll() is None:
        got = _received(stub)
        if (not marks and got >= lo) or (len(marks) == 1 and got >= hi):
            marks.append((got, _tree_cpu_s(proc.pid), time.perf_counter()))
        time.sleep(0.02)
    out = proc.stdout.read() if proc.stdout else ""
    if proc.returncode != 0 or len(marks) < 2:
        raise RuntimeError(f"{cmd[:3]} failed ({proc.returncode}, marks {marks}):\n{out[-3000:]}")
    (r0, c0, t0), (r1, c1, t1) = marks
    return r1 - r0, c1 - c0, t1 - t0, out


def run_ours(
    stub: StubServer, prompts: Path, n: int, rate: float, workers: int, tokens: int, rnd: int
) -> CpuRun:
    cmd = [sys.executable, "-c", _OUR_CLIENT, stub.base_url, str(prompts), str(rate)]
    cmd += [str(workers), str(tokens)]
    k, cpu, wall, out = _cpu_window(stub, cmd, n, ROOT)
    failed = json.loads(out.strip().splitlines()[-1])["failed"]
    name = "ours, 1 process" if workers == 1 else f"ours, {workers} worker processes"
    return CpuRun(name, rnd, rate, n, k, cpu, wall, failed)


def run_vllm(
    stub: StubServer,
    engine_python: str,
    model_dir: Path,
    work: Path,
    n: int,
    rate: float,
    tokens: int,
    rnd: int,
) -> CpuRun:
    cmd = [engine_python, "-c", _VLLM_CLI, str(LAUNCHER), "bench", "serve"]
    cmd += ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions"]
    cmd += ["--base-url", stub.base_url, "--model", MODEL_NAME, "--tokenizer", str(model_dir)]
    cmd += ["--dataset-name", "random", "--random-input-len", "128"]
    cmd += ["--random-output-len", str(tokens), "--ignore-eos"]
    cmd += ["--num-prompts", str(n), "--num-warmups", "0", "--seed", "0"]
    cmd += ["--request-rate", f"{rate:g}", "--burstiness", "inf", "--max-concurrency", str(n)]
    cmd += ["--save-result", "--result-dir", str(work), "--result-filename", f"v{rnd}.json"]
    cmd += ["--disable-tqdm"]
    k, cpu, wall, _ = _cpu_window(stub, cmd, n, work)
    d = json.loads((work / f"v{rnd}.json").read_text())
    return CpuRun("vllm bench serve", rnd, rate, n, k, cpu, wall, int(d["failed"]))


def ceilings(
    prompts: list[str], workers: list[int], rounds: int, tokens: int, budget: float
) -> list[dict[str, Any]]:
    reqs = [
        ChatRequest(index=i, messages=[{"role": "user", "content": p}], max_tokens=tokens)
        for i, p in enumerate(prompts)
    ]
    out = []
    for rnd in range(rounds):
        for w in workers:
            c = asyncio.run(measure_ceiling(reqs, workers=w, budget_s=budget))
            top = c.at_ceiling()
            row = {
                "round": rnd,
                "workers": w,
                "ceiling_rps": c.ceiling_rps,
                "at_least": c.at_least,
                "limit": c.limit,
                "stub_limited": c.stub_limited,
                "cpu_ms_per_request": top.cpu_per_request_ms if top else None,
                "steps": len(c.steps),
                "elapsed_s": c.elapsed_s,
            }
            out.append(row)
            print(
                f"  round {rnd} workers {w}: ceiling {c.ceiling_rps} req/s "
                f"({'at least' if c.at_least else 'limit: ' + str(c.limit)})",
                flush=True,
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine-python", default=str(ROOT / ".engine-venv" / "bin" / "python"))
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--pool-workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--budget", type=float, default=8.0, help="seconds of ramp per ceiling")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--no-ceiling", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vlab-bench-loadpool-"))
    model_dir = generate_model(work / MODEL_NAME, MODEL_NAME)
    prompts = _prompts(model_dir, args.requests, 128, seed=0)
    prompts_file = work / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()}", flush=True)
    result: dict[str, Any] = {"ceilings": [], "cpu": []}
    if not args.no_ceiling:
        print("(a) ceiling against workers", flush=True)
        ws = [int(w) for w in args.workers.split(",")]
        result["ceilings"] = ceilings(prompts, ws, args.rounds, args.output_tokens, args.budget)
    print("(b) client CPU per request", flush=True)
    runs: list[CpuRun] = []
    with StubServer(0.05, 0.01, model=MODEL_NAME, process=True) as stub:
        for rnd in range(args.rounds):
            for client in ("ours1", "oursN", "vllm"):
                if client == "vllm" and args.no_vllm:
                    continue
                if client == "vllm":
                    r = run_vllm(
                        stub,
                        args.engine_python,
                        model_dir,
                        work,
                        args.requests,
                        args.rate,
                        args.output_tokens,
                        rnd,
                    )
                else:
                    w = 1 if client == "ours1" else args.pool_workers
                    r = run_ours(
                        stub, prompts_file, args.requests, args.rate, w, args.output_tokens, rnd
                    )
                runs.append(r)
                print(
                    f"  round {rnd} {r.client}: {r.cpu_ms_per_request:.3f} ms CPU/request "
                    f"({r.window_requests} requests in {r.window_s:.1f} s, failed {r.failed})",
                    flush=True,
                )
    result["cpu"] = [asdict(r) | {"cpu_ms_per_request": r.cpu_ms_per_request} for r in runs]
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(report(result))


def _ceiling_rows(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| workers | ceiling req/s, per round | median | ratio to 1 process, per round "
        "| CPU ms/request at the ceiling (median) |",
        "|---|---|---|---|---|",
    ]
    one = {r["round"]: r["ceiling_rps"] for r in rows if r["workers"] == 1}
    for w in sorted({r["workers"] for r in rows}):
        mine = [r for r in rows if r["workers"] == w]
        shown = ", ".join(
            f"{r['ceiling_rps']:.0f}{'+' if r['at_least'] else ''}" if r["ceiling_rps"] else "-"
            for r in mine
        )
        ratios = ", ".join(
            f"{r['ceiling_rps'] / one[r['round']]:.2f}"
            if r["ceiling_rps"] and one.get(r["round"])
            else "-"
            for r in mine
        )
        vals = [r["ceiling_rps"] for r in mine if r["ceiling_rps"]]
        cpus = [r["cpu_ms_per_request"] for r in mine if r["cpu_ms_per_request"]]
        med = f"{statistics.median(vals):.0f}" if vals else "-"
        cpu = f"{statistics.median(cpus):.2f}" if cpus else "-"
        lines.append(f"| {w} | {shown} | {med} | {ratios} | {cpu} |")
    return lines


def _cpu_rows(runs: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| client | CPU ms/request, per round | median | ratio to vllm bench serve, per round |",
        "|---|---|---|---|",
    ]
    vllm = {r["round"]: r["cpu_ms_per_request"] for r in runs if r["client"] == "vllm bench serve"}
    for client in dict.fromkeys(r["client"] for r in runs):
        mine = [r for r in runs if r["client"] == client]
        vals = [r["cpu_ms_per_request"] for r in mine]
        ratios = ", ".join(
            f"{r['cpu_ms_per_request'] / vllm[r['round']]:.2f}" if vllm.get(r["round"]) else "-"
            for r in mine
        )
        shown = ", ".join(f"{v:.3f}" for v in vals)
        lines.append(f"| {client} | {shown} | {statistics.median(vals):.3f} | {ratios} |")
    return lines


def report(result: dict[str, Any]) -> str:
    """Markdown tables of the run (ratios within each round)."""
    lines: list[str] = []
    if result["ceilings"]:
        lines += ["", *_ceiling_rows(result["ceilings"])]
    if result["cpu"]:
        lines += ["", *_cpu_rows(result["cpu"])]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
