"""Save everything the API serves about one experiment as one JSON document.

Usage: python scripts/export_experiment.py http://127.0.0.1:8000 <experiment id> out.json

The document (``{"experiment": ..., "runs": {run_id: {"metrics", "requests",
"log", "parity"}}}``) is what the dashboard tests load as real run data
(``tests/web/data/``).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import httpx


def export(api: str, experiment_id: str) -> dict[str, Any]:
    with httpx.Client(base_url=api.rstrip("/") + "/api/v1", timeout=60) as c:
        exp = c.get(f"/experiments/{experiment_id}").raise_for_status().json()
        runs: dict[str, Any] = {}
        for run in exp["runs"]:
            rid = run["id"]
            requests: list[dict[str, Any]] = []
            while True:
                page = (
                    c.get(f"/runs/{rid}/requests", params={"limit": 500, "offset": len(requests)})
                    .raise_for_status()
                    .json()
                )
                requests += page["items"]
                if not page["items"] or len(requests) >= page["total"]:
                    break
            parity = c.get(f"/runs/{rid}/parity")
            runs[rid] = {
                "metrics": c.get(f"/runs/{rid}/metrics", params={"max_points": 100000})
                .raise_for_status()
                .json(),
                "requests": requests,
                "log": c.get(f"/runs/{rid}/log", params={"raw": True}).text,
                "parity": parity.json() if parity.status_code == 200 else None,
            }
        return {"experiment": exp, "runs": runs}


if __name__ == "__main__":
    api, experiment_id, out = sys.argv[1:4]
    with open(out, "w") as f:
        json.dump(export(api, experiment_id), f, separators=(",", ":"))
