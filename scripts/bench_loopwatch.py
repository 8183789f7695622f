"""CPU the load generator's stall watch costs (jobs.load.stalls.LoopWatch): its task alone on
an event loop for ``--seconds`` (default 10), as CPU time of the loop's thread over wall time.

    .venv/bin/python scripts/bench_loopwatch.py --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import time

from jobs.load.stalls import TICK_S, LoopWatch


async def _measure(seconds: float) -> tuple[float, float, int]:
    watch = LoopWatch(time.perf_counter())
    cpu, wall = time.thread_time(), time.perf_counter()
    task = asyncio.create_task(watch.run())
    await asyncio.sleep(seconds)
    task.cancel()
    return time.thread_time() - cpu, time.perf_counter() - wall, len(watch.stalls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    cpu, wall, stalls = asyncio.run(_measure(args.seconds))
    wakeups = wall / TICK_S
    print(
        f"{wall:.2f} s wall, {cpu * 1000:.1f} ms CPU ({100 * cpu / wall:.2f} % of a core; "
        f"{cpu / wakeups * 1e6:.0f} us a wake-up, {wakeups:.0f} wake-ups); {stalls} stalls"
    )


if __name__ == "__main__":
    main()
