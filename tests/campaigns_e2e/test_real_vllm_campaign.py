"""A tuning campaign on real vLLM (CPU build): issue 25's "Real vLLM (CPU)" proof.

The service in one process as ``vlab up`` runs it (API, dispatcher with its campaigns loop,
local Ray, a database of its own), the real engine environment (``.engine-venv``) and the
generated tiny model. A campaign is submitted through ``POST /api/v1/campaigns`` over a
shared-prefix workload (every request: the same long prefix, then a short question), with
prefix caching (off/on, start off) and ``max_num_seqs`` (1/4, start 4) in its space and
median TTFT as its objective. Then:

- the campaign ends ``succeeded`` and adopts prefix caching, with its interval: the step's
  lower bound is above the rule's smallest gain (a lower TTFT, so a positive gain);
- ``max_num_seqs`` is decided from evidence: in the last round it is measured in (after
  prefix caching was adopted) it ends with its interval and a verdict (adopted, worse,
  inert, marginal or outpaid; never ``unknown``, ``undecided`` nor ``failed``);
- the confirmation (the final configuration against the start, interleaved) agrees with
  the path: the interval of the interaction (measured total minus the sum of the step
  gains) holds 0, and the sum it compares with is the path's;
- runs stored = runs planned: every stored run has a unique label the pure core planned
  (replaying them through :func:`orchestrator.tuning.service.rebuild` uses each once and
  gives the stored path), all succeeded, and their number is the campaign's ``runs_used``;
- each run's vLLM started once (no reused server: both knobs are engine arguments) with
  its label's configuration, read back from vLLM's own log (``non-default args``).

Figures (runs, server starts, wall time, the path) are printed (``pytest -s``) and
recorded in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from orchestrator.cli.runtime import Runtime
from orchestrator.core.models import Campaign, Run
from orchestrator.core.repositories import CampaignRepository, RunRepository
from orchestrator.core.settings import EngineSettings, OrchestratorSettings, Settings
from orchestrator.tuning.campaign_request import CampaignRequest
from orchestrator.tuning.evidence import Evidence
from orchestrator.tuning.evidence_inputs import RoundOrders
from orchestrator.tuning.service import rebuild
from tests.conftest import ENGINE_PYTHON, fresh_database, needs_engine
from tests.ports import free_port

#: Real vLLM (``engine``), 20-28 server starts (``slow``: left out of ``make check``). Its
#: verdicts are latency ratios measured on the 2-core machine: beside the parallel pass's
#: workers (load 10-28) a trial took 2.5 min a run and measured the same configuration at
#: 41 and 82 ms, so it runs in ``make test``'s second pass, alone (``timing``).
#: Opt-in (``VLAB_REAL_CAMPAIGN=1``): it takes 12-13 min alone, and its confirmation check
#: is a 97.5 % interval, so about 1 run in 40 fails with every step measured right, a rate
#: the CI suite cannot carry; its two recorded runs are in docs/BENCHMARKS.md.
pytestmark = [
    pytest.mark.engine,
    needs_engine,
    pytest.mark.slow,
    pytest.mark.timing,
    pytest.mark.skipif(
        os.environ.get("VLAB_REAL_CAMPAIGN", "").strip() != "1",
        reason="the real-vLLM campaign is opt-in (VLAB_REAL_CAMPAIGN=1; 12-13 min)",
    ),
]

ENGINE = ENGINE_PYTHON or "<no engine environment: run `make engine`>"
METRIC = "median_ttft_ms"
APC = "engine_args.enable_prefix_caching"
SEQS = "engine_args.max_num_seqs"
ENDED = ("succeeded", "failed", "cancelled")
#: Outcomes a candidate reaches from its interval (a test at the rule's confidence).
DECIDED = ("adopted", "worse", "inert", "marginal", "outpaid")
#: Each bound one-sided at 97.5 % (a 95 % two-sided interval): the confirmation's check of
#: the path is a test at 5 %, so a campaign whose steps were measured right disagrees about
#: 1 time in 20 (at 0.95, 1 in 10).
RULE = {"confidence": 0.975, "min_gain": 0.05, "equivalence_margin": 0.02}
#: Three pairs before a verdict: at two, a step that pays must read high to clear t(1 df)
#: (a trial at 0.95 with 2-3 pairs: prefix caching paid +265 % [+35 %, +886 %] on 2 pairs,
#: the confirmation measured +107 % and disagreed).
MIN_REPEATS, MAX_REPEATS = 3, 4

WORKLOAD = {
    "num_requests": 32,
    "concurrency": 4,
    "seed": 5,
    "prefix_tokens": 1536,
    "question_tokens": 16,
    "output_tokens": 8,
    "warmup_requests": 1,
}


def campaign_doc() -> dict[str, Any]:
    return {
        "name": "real vllm apc and max_num_seqs",
        "model": "tiny",
        "baseline": {"engine_args": {"max_model_len": 2048}, "workload": WORKLOAD},
        "objective": {"metric": METRIC},
        "space": [
            {"name": APC, "levels": [False, True], "start": False},
            {"name": SEQS, "levels": [1, 4], "start": 4},
        ],
        "budget": {"max_runs": 32},
        "rule": {**RULE, "min_repeats": MIN_REPEATS, "max_repeats": MAX_REPEATS},
    }


@pytest.fixture
def stack(tmp_path: Path, server_url: str) -> Iterator[dict[str, Any]]:
    """API + orchestrator (campaigns loop every second) + local Ray, on a database of its
    own (no other test's rows)."""
    with fresh_database(server_url) as database_url:
        settings = Settings(
            home=tmp_path / "home",
            database_url=database_url,
            engine=EngineSettings(python=Path(str(ENGINE)), startup_timeout_s=420),
            orchestrator=OrchestratorSettings(
                poll_interval_s=0.5, stale_after_s=60, campaigns_interval_s=1.0
            ),
        )
        rt = Runtime(settings)
        rt.start_database()
        rt.start_orchestrator()
        port = free_port()
        rt.start_api_thread("127.0.0.1", port)
        try:
            yield {"api": f"http://127.0.0.1:{port}", "rt": rt, "settings": settings}
        finally:
            rt.stop()


def wait_ended(api: str, campaign_id: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        body = httpx.get(f"{api}/api/v1/campaigns/{campaign_id}", timeout=30).json()
        if body["status"] in ENDED:
            return body
        time.sleep(3)
    raise AssertionError(f"campaign {campaign_id} did not end: {json.dumps(body)[:3000]}")


def label_config(label: str, start: dict[str, Any], path: list[dict[str, Any]]) -> dict[str, Any]:
    """The configuration run ``label`` measures: a round's incumbent is the start with the
    steps of the earlier rounds applied; a candidate changes one variable of it; the
    confirmation's ``start`` and ``final`` are the two ends of the path."""
    parts = label.split(".", 2)
    config = dict(start)
    if parts[0] == "confirm":
        if parts[2] == "final":
            for step in path:
                config[step["variable"]] = step["to_level"]
        return config
    rnd = int(parts[0][1:])
    for step in path:
        if step["round"] < rnd:
            config[step["variable"]] = step["to_level"]
    if parts[2] != "incumbent":
        variable, level = parts[2].rsplit("=", 1)
        flags = {"true": True, "false": False}
        config[variable] = flags[level.lower()] if level.lower() in flags else int(level)
    return config


def engine_non_default_args(log: str) -> list[dict[str, Any]]:
    """vLLM's ``non-default args: {...}`` lines of an engine log (one per server start)."""
    return [ast.literal_eval(m) for m in re.findall(r"non-default args: (\{.*\})", log)]


def _stored(rt: Runtime, campaign_id: str) -> tuple[Campaign, list[Run], dict[str, Any]]:
    factory = rt.session_factory
    assert factory is not None
    with factory() as s:
        row = CampaignRepository(s).get(campaign_id)
        assert row is not None
        runs = CampaignRepository(s).runs(campaign_id)
        metrics = RunRepository(s).metrics_for([r.id for r in runs], [METRIC])
        s.expunge_all()
    return row, runs, metrics


@pytest.mark.timeout(3600)
def test_campaign_adopts_prefix_caching_and_decides_max_num_seqs(stack: dict[str, Any]) -> None:
    t0 = time.monotonic()
    api, rt = stack["api"], stack["rt"]
    created = httpx.post(f"{api}/api/v1/campaigns", json=campaign_doc(), timeout=600)
    assert created.status_code == 201, created.text
    cid = created.json()["id"]
    body = wait_ended(api, cid, timeout_s=3300)
    wall_s = time.monotonic() - t0
    row, runs, metrics = _stored(rt, cid)
    runs_api = {r["label"]: httpx.get(r["url"], timeout=30).json() for r in body["runs"]}

    assert body["status"] == "succeeded", (body["status"], body["status_reason"])
    apc = _check_prefix_caching(body, runs_api, CampaignRequest.model_validate(row.request))
    _check_batching_knob(body["candidates"], apc)
    _check_confirmation(body)
    _check_runs_planned(row, runs, metrics, body)
    starts = _check_engine_starts(body, runs_api)
    _print_figures(body, runs, metrics, starts, wall_s)


def _check_prefix_caching(
    body: dict[str, Any], runs_api: dict[str, dict[str, Any]], request: CampaignRequest
) -> dict[str, Any]:
    """Prefix caching is a step of the path, with its interval above the smallest gain,
    and the runs with it on hit the shared prefix; returns the step."""
    path = body["path"]
    apc_steps = [s for s in path if s["variable"] == APC]
    assert len(apc_steps) == 1, path
    apc = apc_steps[0]
    assert (apc["from_level"], apc["to_level"], apc["verdict"]) == (False, True, "pays")
    assert apc["gain"]["relative_low"] > request.rule.min_gain > 0, apc
    assert apc["gain"]["n"] >= MIN_REPEATS
    assert body["incumbent"][APC] is True
    # ... through the prefix cache: the runs with it on hit the shared prefix, those with
    # it off query no cache at all
    for label, run in runs_api.items():
        hits = run["metrics"].get("prefix_cache_hit_rate")
        if label_config(label, body["start"], path)[APC]:
            assert hits is not None and hits > 0.3, (label, hits)
        else:
            assert run["metrics"].get("prefix_cache_hits_delta", 0) == 0, label
    return apc


def _check_batching_knob(candidates: list[dict[str, Any]], apc: dict[str, Any]) -> None:
    """``max_num_seqs`` is decided from its interval in the last round it was measured in,
    a round after prefix caching was adopted (or it was adopted itself). In a round where
    prefix caching was measured beside it, it may end ``undecided`` or ``outpaid``: at
    prefix caching off its effect on median TTFT is small and turns with the load (two
    requests batched in one step against one after the other), and that round is not its
    last. No candidate ends ``unknown`` (the budget holds the campaign) or ``failed``."""
    seqs = [c for c in candidates if c["variable"] == SEQS and c["outcome"] != "skipped"]
    assert seqs, candidates
    for c in seqs:
        assert c["gain"] is not None and c["pairs"] >= MIN_REPEATS, c
        assert c["outcome"] in (*DECIDED, "undecided"), c
    last = max(seqs, key=lambda c: c["round"])
    assert last["outcome"] in DECIDED, seqs
    assert last["verdict"] in ("pays", "worse", "inert", "marginal"), last
    assert last["round"] > apc["round"] or last["outcome"] == "adopted", seqs
    assert all(c["outcome"] not in ("unknown", "failed") for c in candidates), candidates


def _check_confirmation(body: dict[str, Any]) -> None:
    """The final configuration against the start agrees with the path: the interaction's
    interval (measured total minus the sum of the step gains) holds 0."""
    conf = body["confirmation"]
    assert conf is not None, body
    step_sum = math.fsum(s["gain"]["estimate"] for s in body["path"])
    assert conf["steps"]["estimate"] == pytest.approx(step_sum)
    assert conf["interaction"]["estimate"] == pytest.approx(
        conf["total"]["estimate"] - conf["steps"]["estimate"]
    )
    assert conf["agrees"] is True, conf
    assert conf["interaction"]["low"] <= 0 <= conf["interaction"]["high"], conf
    assert conf["total"]["n"] == MAX_REPEATS and conf["total"]["low"] > 0, conf


def _check_runs_planned(
    row: Campaign, runs: list[Run], metrics: dict[str, Any], body: dict[str, Any]
) -> None:
    """Runs stored = runs planned: each label once, all succeeded, and replaying them
    through the pure core uses each exactly once and gives the stored path."""
    labels = [r.campaign_label for r in runs]
    assert None not in labels and len(labels) == len(set(labels)), labels
    assert [r.status for r in runs] == ["succeeded"] * len(runs), [
        (r.campaign_label, r.status, r.status_reason) for r in runs
    ]
    assert len(runs) == body["runs_used"] == len(body["runs"])
    request = CampaignRequest.model_validate(row.request)
    result = row.result or {}
    hook = RoundOrders(result.get("order")).hook(lambda: Evidence(baseline=request.baseline))
    core, _ = rebuild(request, runs, metrics, hook)
    assert core.phase.value == "done" and core.runs_used == len(runs)
    assert [s.model_dump(mode="json") for s in core.path()] == [
        {k: v for k, v in s.items() if k != "effect"} for s in result["path"]
    ]


def _check_engine_starts(body: dict[str, Any], runs_api: dict[str, dict[str, Any]]) -> int:
    """Each run's vLLM started once (no reused server: both knobs are engine arguments),
    with its label's configuration as vLLM's own log shows it; returns the starts."""
    starts = 0
    for label, run in runs_api.items():
        want = label_config(label, body["start"], body["path"])
        assert run["engine_args"]["enable_prefix_caching"] is want[APC], label
        assert run["engine_args"]["max_num_seqs"] == want[SEQS], label
        assert run["engine_info"].get("server_reused") is not True, label
        log = httpx.get(f"{run['url']}/log", timeout=30).text
        logged = engine_non_default_args(log)
        assert len(logged) == 1, (label, len(logged))
        starts += len(logged)
        assert logged[0].get("enable_prefix_caching", False) is want[APC], (label, logged)
        assert logged[0].get("max_num_seqs") == want[SEQS], (label, logged)
        assert run["metrics"]["completed"] == WORKLOAD["num_requests"], label
    return starts


def _print_figures(
    body: dict[str, Any], runs: list[Run], metrics: dict[str, Any], starts: int, wall_s: float
) -> None:
    conf = body["confirmation"]
    figures = {
        "runs": len(runs),
        "server_starts": starts,
        "wall_s": round(wall_s, 1),
        "path": [
            f"r{s['round']} {s['variable']}: {s['from_level']} -> {s['to_level']} {s['effect']}"
            for s in body["path"]
        ],
        "candidates": [
            f"r{c['round']} {c['label']}: {c['outcome']} {c['effect']} ({c['pairs']} pairs)"
            for c in body["candidates"]
        ],
        "confirmation": {
            k: f"{conf[k]['relative']:+.1%} "
            f"[{conf[k]['relative_low']:+.1%}, {conf[k]['relative_high']:+.1%}]"
            for k in ("total", "steps", "interaction")
        },
        "objective": {r.campaign_label: round(metrics[r.id][METRIC], 1) for r in runs},
        "status_reason": body["status_reason"],
    }
    print("\nreal-vLLM campaign figures: " + json.dumps(figures), flush=True)
