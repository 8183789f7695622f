"""Time parse_stats + parse_events on a generated 5 MB vLLM log (16,000 stats records,
each followed by an access line), five times; prints the median and the minimum.

Usage: .venv/bin/python scripts/bench_enginelog.py REPO_ROOT
(REPO_ROOT: this checkout, or a `git worktree` of another commit, to compare in one run).
"""

import statistics
import sys
import time

sys.path.insert(0, sys.argv[1])
from jobs.signals.engineevents import parse_events  # noqa: E402
from jobs.signals.enginelog import parse_stats  # noqa: E402

hdr = "(APIServer pid=1) INFO 05-12 08:{m:02d}:{s:02d} [loggers.py:336] "
msg = (
    "Engine 000: Avg prompt throughput: 880.0 tokens/s, Avg generation throughput: 95.5 tokens/s, "
    "Running: 9 reqs, Waiting: 0 reqs, GPU KV cache usage: 12.5%, "
    "Prefix cache hit rate: 71.3%, Preemptions: {p}"
)
lines = []
for i in range(16000):
    lines.append(hdr.format(m=(i // 60) % 60, s=i % 60) + msg.format(p=i % 7))
    lines.append('INFO:     127.0.0.1:5 - "POST /v1/completions HTTP/1.1" 200 OK')
text = "\n".join(lines) + "\n"
ts = []
for _ in range(5):
    t = time.perf_counter()
    parse_stats(text)
    parse_events(text)
    ts.append(time.perf_counter() - t)
print(f"{len(text) / 1e6:.1f} MB  median {statistics.median(ts):.3f} s  min {min(ts):.3f} s")
