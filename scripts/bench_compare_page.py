"""Time the compare page (``GET /compare?run=...``) for growing selections.

Usage: .venv/bin/python scripts/bench_compare_page.py [--sizes 2,20,100,200] [--repeat 5]

Creates a scratch database on the server of ``DATABASE_URL`` (default: the
machine's Postgres at 127.0.0.1:5432; an embedded Postgres if that is not
reachable), loads the real demo experiment (``tests/web/data``: APC off/on, 2
repeats, 16 measured requests per run with per-token ITL, ``/metrics`` samples)
as many times as needed for the largest selection, then times the page through
the real app (in-process ASGI client, no network), best of ``--repeat``
requests per size (and the median CPU time of the process):

- **cold**: the comparison cache cleared before each request (every bootstrap
  recomputed), with the page's own draws per comparison (``n_boot_for``);
- **warm**: the same URL again (comparisons from the cache; database reads,
  settings diff and HTML rendering remain);
- **cold, 2000 draws**: what the page would cost without reducing the draws.

Prints a Markdown table; ``ratio`` is cold time / cold time of the smallest size.
Times are wall-clock unless marked CPU; on a busy machine compare the CPU column.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlencode

from fastapi.testclient import TestClient
from sqlalchemy import create_engine, select, text
from sqlalchemy.orm import sessionmaker

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import web.pages.compare as compare_page  # noqa: E402
from api.app import create_app  # noqa: E402
from orchestrator.core.db import (  # noqa: E402
    normalize_url,
    scratch_database,
    start_embedded_postgres,
    stop_embedded_postgres,
    upgrade_to_head,
)
from orchestrator.core.models import Experiment, Run  # noqa: E402
from orchestrator.core.settings import EngineSettings, Settings  # noqa: E402
from tests.web.seed import DATA, load_export  # noqa: E402

EXPORT = DATA / "demo_experiment.json"


@contextmanager
def _server() -> Iterator[str]:
    """``DATABASE_URL``, the local Postgres, or an embedded one in a temporary folder."""
    url = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    try:
        eng = create_engine(normalize_url(url), connect_args={"connect_timeout": 3})
        with eng.connect():
            pass
        eng.dispose()
        yield url
        return
    except Exception as exc:  # noqa: BLE001 - any connection failure: fall back
        print(f"  {url} not reachable ({type(exc).__name__}); embedded Postgres", file=sys.stderr)
    pgdata = Path(tempfile.mkdtemp()) / "pgdata"
    try:
        yield start_embedded_postgres(pgdata)
    finally:
        stop_embedded_postgres(pgdata)


def _seed(url: str, runs: int) -> list[str]:
    """Load the demo experiment ceil(runs / 4) times; return run ids (experiment, sequence)."""
    upgrade_to_head(url)
    engine = create_engine(url)
    factory = sessionmaker(bind=engine)
    t0 = time.perf_counter()
    copies = -(-runs // 4)
    with factory.begin() as s:
        for k in range(copies):
            load_export(s, EXPORT, name=f"demo-{k:04d}", shift=timedelta(minutes=k))
    with engine.connect() as c:
        c.execute(text("ANALYZE"))
        c.commit()
    with factory() as s:
        ids = list(
            s.scalars(
                select(Run.id)
                .join(Experiment, Run.experiment_id == Experiment.id)
                .order_by(Experiment.name, Run.sequence)
            )
        )
    engine.dispose()
    print(f"  seeded {len(ids)} runs in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return ids


def _time_ms(fn: Callable[[], None], repeat: int) -> tuple[float, float]:
    """(best wall-clock time, median process CPU time) of ``repeat`` calls, in ms.

    Best-of and CPU time (all threads of this process: the app runs in the test
    client's thread) are the figures least disturbed by other load on the machine.
    """
    walls, cpus = [], []
    for _ in range(repeat):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        walls.append((time.perf_counter() - t0) * 1000)
        cpus.append((time.process_time() - c0) * 1000)
    return min(walls), statistics.median(cpus)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="2,20,100,200", help="selection sizes, comma-separated")
    ap.add_argument("--repeat", type=int, default=5, help="requests per measurement (median)")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    rows = []
    with _server() as server, scratch_database(server, "vlab_bench") as url:
        ids = _seed(url, max(sizes))
        home = Path(tempfile.mkdtemp())
        settings = Settings(home=home, engine=EngineSettings(python=home / "none"))
        engine = create_engine(url)
        with TestClient(create_app(settings, sessionmaker(bind=engine))) as client:

            def get(path: str) -> Callable[[], None]:
                def run() -> None:
                    r = client.get(path)
                    assert r.status_code == 200, (path[:80], r.status_code)

                return run

            def cold(path: str) -> Callable[[], None]:
                def run() -> None:
                    compare_page.clear_cache()
                    get(path)()

                return run

            for n in sizes:
                path = "/compare?" + urlencode([("run", i) for i in ids[:n]])
                get(path)()  # warm up imports, connections and the template
                html = client.get(path).text
                comparisons = n - 1
                n_boot = compare_page.n_boot_for(comparisons)
                t_cold, cpu_cold = _time_ms(cold(path), args.repeat)
                get(path)()
                t_warm, _ = _time_ms(get(path), args.repeat)
                steps = compare_page.N_BOOT_STEPS
                compare_page.N_BOOT_STEPS = ((compare_page.MAX_RUNS, compare_page.FULL_N_BOOT),)
                try:
                    t_full, _ = _time_ms(cold(path), max(1, args.repeat // 2))
                finally:
                    compare_page.N_BOOT_STEPS = steps
                rows.append((n, n_boot, t_cold, cpu_cold, t_warm, t_full, len(html), len(path)))
                print(f"  {n} runs: cold {t_cold:.0f} ms", file=sys.stderr)
        engine.dispose()
    base = rows[0][2]
    print(
        "| runs | draws per comparison | cold (ms) | ratio | cold CPU (ms) | per run (ms) "
        "| warm, cached (ms) | cold, 2000 draws (ms) | HTML (KB) | URL (KB) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, n_boot, t_cold, cpu_cold, t_warm, t_full, size, url_len in rows:
        print(
            f"| {n} | {n_boot} | {t_cold:.0f} | {t_cold / base:.1f}x | {cpu_cold:.0f} "
            f"| {t_cold / n:.1f} | {t_warm:.0f} | {t_full:.0f} | {size / 1024:.0f} "
            f"| {url_len / 1024:.1f} |"
        )


if __name__ == "__main__":
    main()
