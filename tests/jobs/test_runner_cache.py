"""The warm-cache check end to end through :func:`jobs.run.runner.execute_batch`.

Without vLLM, the engine python is a test double serving the project's stub server
(:mod:`jobs.stub.stubserver`) with its simulated prefix cache (:mod:`jobs.stub.stubengine`): cached
tokens in ``usage.prompt_tokens_details`` and the ``vllm:prefix_cache_*_total``
counters come from it. With ``reset_keeps_cache`` its ``POST /reset_prefix_cache``
answers 200 and keeps the blocks: what vLLM's block pool does when blocks are still held
("Failed to reset prefix cache because some blocks (%d) are not freed yet",
vllm/v1/core/block_pool.py ``reset_prefix_cache``) behind an older API server that
answered 200 without checking ("Note that we currently do not check if the prefix cache
is successfully reset in the API server", vllm/entrypoints/openai/api_server.py). Two
runs with the same workload on one server then share their prompt prefix, and the
second run's first request finds the first run's blocks: a warm cache of the kind that
inflated TTFT 49x and throughput 2.32x in vllm-project/vllm#54227.

The warm-ups never share the measured prefix (:mod:`jobs.load.workload`), so a run's own
warm-up cannot contaminate it; an earlier run on the same server can.

With vLLM: three runs on one real server, the third after a reset that answers success
and does nothing; vLLM's own ``cached_tokens`` flag it (tests/jobs/test_runner_real_vllm.py).
"""

from __future__ import annotations

import stat
import sys
from pathlib import Path
from typing import Any

from jobs.run.runner import execute_batch
from jobs.schemas import BatchJob, EngineLaunch, RunResult, RunSegment, WorkloadSpec
from tests.jobs.test_runner_batch import _assert_no_engine_left

REPO = Path(__file__).resolve().parents[2]

STUB_ENGINE = """\
#!{python}
# Test double for the engine venv's python: the project's stub server, prefix cache on.
import sys
sys.path.insert(0, {repo!r})
argv = sys.argv

def opt(name, default):
    return argv[argv.index(name) + 1] if name in argv else default

print("INFO stub engine starting", flush=True)
from jobs.stub.stubserver import main
flags = [f for f in ("--prefix-cache", "--reset-keeps-cache", "--no-cached-tokens")
         if "--stub" + f[1:] in argv]
main([
    "--host", opt("--host", "127.0.0.1"), "--port", opt("--port", "0"),
    "--model", opt("--served-model-name", "stub"),
    "--ttft-ms", opt("--stub-ttft-ms", "20"), "--itl-ms", "5",
    "--block-size", "8", *flags,
])
"""


def _stub_engine(tmp_path: Path) -> str:
    path = tmp_path / "stub_engine"
    path.write_text(STUB_ENGINE.format(python=sys.executable, repo=str(REPO)))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _workload(**kw: object) -> WorkloadSpec:
    doc: dict[str, object] = {
        "num_requests": 6,
        "prefix_tokens": 64,
        "question_tokens": 8,
        "output_tokens": 4,
        "warmup_requests": 1,
        "seed": 3,
    }
    doc.update(kw)
    return WorkloadSpec.model_validate(doc)


def _batch(
    tmp_path: Path, model_dir: Path, stub: dict[str, Any], num_requests: int = 6, **second: object
) -> BatchJob:
    """Two runs with the same request list on one stub server (``second``: the second
    run's workload fields)."""
    return BatchJob(
        launch=EngineLaunch(
            engine_python=_stub_engine(tmp_path),
            model_dir=str(model_dir),
            served_model_name="tiny",
            engine_args={"enable_prefix_caching": True, **stub},
            startup_timeout_s=120,
            log_path=str(tmp_path / "server.log"),
        ),
        segments=[
            RunSegment(run_id="first", workload=_workload(num_requests=num_requests)),
            RunSegment(run_id="second", workload=_workload(num_requests=num_requests, **second)),
        ],
        scrape_interval_s=0.2,
        request_timeout_s=60,
    )


def _measured(run: RunResult) -> list[Any]:
    return [r for r in run.requests if not r.warmup]


def test_reset_that_keeps_the_cache_flags_the_next_run(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    stub = {"stub_prefix_cache": True, "stub_reset_keeps_cache": True}
    first, second = execute_batch(_batch(tmp_path, tiny_model_dir, stub))
    assert first.status == second.status == "succeeded", (first.error, second.error)
    # flagged, not failed: the reset said it worked
    assert second.engine_info["prefix_cache_reset_ok"] is True
    assert second.engine_info["server_reused"] is True

    # the first run on a fresh server: its warm-up shares nothing with its requests
    check = first.engine_info["cache_contamination"]
    assert check["status"] == "clean", check
    assert _measured(first)[0].cached_tokens == 0
    assert any((r.cached_tokens or 0) > 0 for r in _measured(first)[1:])  # its own prefix

    # the second: its first request found the first run's prefix blocks
    check = second.engine_info["cache_contamination"]
    assert check["status"] == "contaminated", check
    found = _measured(second)[0].cached_tokens
    assert found is not None and found > 0
    assert check["cached_tokens_first_request"] == found
    assert check["cached_tokens"]["signal"] == "contaminated"
    assert check["cached_tokens"]["first_wave"] == 1  # concurrency 1
    assert check["note"].startswith("warm cache: the first measured request found")
    assert "restart the vLLM server for each run" in check["note"]
    # the counters grew from the first request on: by the after scrape the run's hits
    # are more than its 6 requests could have found among themselves
    assert check["counters"]["unit"] == "tokens"
    assert second.metrics["prefix_cache_hits_delta"] > first.metrics["prefix_cache_hits_delta"]
    _assert_no_engine_left([first, second])


def test_requests_sent_at_once_on_a_warm_cache(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Concurrency 4: the first wave is 4 requests; each found the old prefix, so the one
    the server looked up first did too."""
    stub = {"stub_prefix_cache": True, "stub_reset_keeps_cache": True}
    _, second = execute_batch(_batch(tmp_path, tiny_model_dir, stub, concurrency=4))
    assert second.status == "succeeded", second.error
    check = second.engine_info["cache_contamination"]
    assert check["status"] == "contaminated", check
    wave = check["cached_tokens"]["first_wave_cached_tokens"]
    assert len(wave) == 4 and all(v > 0 for v in wave)


def test_working_reset_is_clean(tmp_path: Path, tiny_model_dir: Path) -> None:
    first, second = execute_batch(_batch(tmp_path, tiny_model_dir, {"stub_prefix_cache": True}))
    assert first.status == second.status == "succeeded", (first.error, second.error)
    for run in (first, second):
        check = run.engine_info["cache_contamination"]
        assert check["status"] == "clean", check
        assert check["cached_tokens_first_request"] == 0
        assert check["prefix_cache_reset_ok"] is True
        assert check["note"].startswith("clean: the first measured request found no prompt")
    # the runs hit their own prefix (requests 2..6) and nothing else
    assert second.metrics["prefix_cache_hits_delta"] == first.metrics["prefix_cache_hits_delta"]


def test_sent_at_once_on_a_clean_cache_is_never_called_contaminated(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Concurrency 4 on an emptied cache: the first request looked up fills the prefix and
    the three sent with it hit it; from the client that is not told apart from a warm
    cache the first one missed, so the check says clean or unknown, never contaminated."""
    job = _batch(tmp_path, tiny_model_dir, {"stub_prefix_cache": True}, concurrency=4)
    _, second = execute_batch(job)
    assert second.status == "succeeded", second.error
    check = second.engine_info["cache_contamination"]
    assert check["status"] in ("clean", "unknown"), check
    if check["cached_tokens"]["signal"] != "clean":
        assert check["cached_tokens"]["signal"] == "inconclusive"


def test_no_signal_is_unknown(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A server that reports no cached tokens (vLLM without --enable-prompt-tokens-details)
    and has no prefix cache counters: unknown, not clean."""
    first, second = execute_batch(_batch(tmp_path, tiny_model_dir, {"stub_no_cached_tokens": True}))
    assert first.status == second.status == "succeeded", (first.error, second.error)
    assert all(r.cached_tokens is None for r in second.requests)
    check = second.engine_info["cache_contamination"]
    assert check["status"] == "unknown", check
    assert check["cached_tokens"]["signal"] == "unavailable"
    assert check["counters"]["signal"] == "unavailable"
    assert "--enable-prompt-tokens-details" in check["note"]


def test_counters_alone_catch_the_warm_cache(tmp_path: Path, tiny_model_dir: Path) -> None:
    """No per-request cached tokens, but the prefix cache counters: each request lasts
    0.6 s, so the scrapes every 0.2 s see the first request's lookup before the second is
    sent (concurrency 1); the hit counter grew by then, and one request cannot hit itself."""
    stub = {
        "stub_prefix_cache": True,
        "stub_reset_keeps_cache": True,
        "stub_no_cached_tokens": True,
        "stub_ttft_ms": 600,
    }
    first, second = execute_batch(_batch(tmp_path, tiny_model_dir, stub, num_requests=3))
    assert first.status == second.status == "succeeded", (first.error, second.error)
    clean = first.engine_info["cache_contamination"]
    assert clean["status"] == "clean", clean
    assert clean["counters"]["signal"] == "clean" and clean["counters"]["requests_sent"] == 1
    check = second.engine_info["cache_contamination"]
    assert check["status"] == "contaminated", check
    assert check["cached_tokens"]["signal"] == "unavailable"
    counters = check["counters"]
    assert counters["signal"] == "contaminated"
    assert counters["requests_sent"] == 1 and counters["self_hit_bound"] == 0.0
    assert check["counter_hits"] == counters["hits"] > 0
    assert "the prefix cache hit counter grew by" in check["note"]
