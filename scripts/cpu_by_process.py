"""Where a command's CPU goes, by kind of process: runs the command and reads every
process's CPU time from ``/proc`` once a second until it ends, then prints CPU-seconds per
kind (vLLM, pytest's workers, Ray's infrastructure and workers, chromium, ``vlab``
services, Postgres, ...), largest first.

``time`` and ``getrusage`` miss what a test suite starts and does not wait for (Ray's and
vLLM's processes leave pytest's tree), so this reads all processes; those that ran before
the command started are left out. A process shorter than a sampling interval is missed,
and one's last second before it exits is lost: the total is a floor (compare it with the
cgroup's ``cpuacct.usage``). Used for docs/BENCHMARKS.md ("Where pass 1's CPU goes, by
process"):

    python3 scripts/cpu_by_process.py [--json OUT] -- .venv/bin/pytest -n 4 ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter

TICKS = os.sysconf("SC_CLK_TCK")

#: (kind, texts to find in the process's name and command line), first match wins.
KINDS: list[tuple[str, str]] = [
    ("vLLM (API server, engine core, workers, resolutions)", "engine-venv|VLLM|vllm"),
    ("pytest-xdist workers", "exec(eval(sys.stdin"),
    ("Ray infrastructure", "gcs_server|raylet|dashboard|runtime_env|log_monitor|monitor.py"),
    ("Ray workers", "ray::|default_worker.py"),
    ("pytest (controller, nested runs)", "pytest"),
    ("vlab services and commands", "bin/vlab"),
    ("chromium and playwright", "chrom|playwright"),
    ("Postgres", "postgres"),
    ("stub servers and load workers", "jobs.stub|jobs.load"),
]


def kind_of(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
    except OSError:
        return None
    text = f"{comm} {cmd}"
    for kind, needles in KINDS:
        if any(n in text for n in needles.split("|")):
            return kind
    return "other: " + comm


def cpu_of(pid: int) -> tuple[int, float] | None:
    """(start time in ticks, user + system CPU-seconds) of ``pid``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19]), (int(fields[11]) + int(fields[12])) / TICKS


def pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the totals to this file")
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command")
    before = {(p, s[0]) for p in pids() if (s := cpu_of(p)) is not None}
    seen: dict[tuple[int, int], list] = {}
    totals: Counter[str] = Counter()
    t0 = time.monotonic()
    proc = subprocess.Popen(command)
    while True:
        done = proc.poll() is not None
        for pid in pids():
            stat = cpu_of(pid)
            if stat is None or (pid, stat[0]) in before:
                continue
            entry = seen.get((pid, stat[0]))
            if entry is None:
                kind = kind_of(pid)
                if kind is None:
                    continue
                entry = seen[(pid, stat[0])] = [kind, 0.0]
            totals[entry[0]] += stat[1] - entry[1]
            entry[1] = stat[1]
        if done:
            break
        time.sleep(args.interval)
    wall = time.monotonic() - t0
    print(f"\n{sum(totals.values()):.0f} CPU-seconds seen over {wall:.0f} s; by kind:")
    for kind, cpu in totals.most_common(15):
        print(f"{cpu:9.1f}  {kind}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"wall_s": wall, "cpu_s": dict(totals.most_common())}, f, indent=1)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
