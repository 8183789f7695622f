"""Pure data contracts between the orchestrator and what runs on a node.

Everything a run job needs comes in as a :class:`RunJob`; everything it
produces goes back as a :class:`RunResult`. Both are plain pydantic models so
they cross a Ray boundary (pickled) and the orchestrator can persist them
without this package ever touching the database.

Metric names in :attr:`RunResult.metrics` follow the keys of the JSON result
written by ``vllm bench serve`` (``mean_ttft_ms``, ``median_ttft_ms``,
``p99_ttft_ms``, ``request_throughput``, ``output_throughput``,
``total_token_throughput`` ...) so numbers compare with what the field
publishes; server-side names are documented in :mod:`jobs.metrics`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class WorkloadSpec(BaseModel):
    """The request list of a run and how it is driven (first version).

    ``shared_prefix``: every request is a chat with the same fixed prefix
    (system instructions, a tool schema, a versioned document header, about
    ``prefix_tokens`` tokens) followed by a varying user question of about
    ``question_tokens`` tokens. The list is fully determined by ``seed`` and
    the other fields, and is sent in the same order in every run.

    Request classes: ``round(num_requests * long_fraction)`` measured requests
    (seeded positions) are class ``long``: the same shared prefix, then a
    unique document of about ``long_input_tokens`` tokens before the
    question; the rest are class ``short``. Short requests are identical
    whatever the fraction, so a mixed run's short requests compare with a
    short-only run's.
    """

    kind: Literal["shared_prefix"] = "shared_prefix"
    num_requests: int = Field(16, ge=1, le=20_000, description="measured requests")
    concurrency: int = Field(1, ge=1, le=4096, description="closed-loop in-flight limit")
    seed: int = Field(0, ge=0)
    prefix_tokens: int = Field(1024, ge=0, le=131_072, description="target shared-prefix length")
    question_tokens: int = Field(32, ge=1, le=131_072, description="target varying-part length")
    output_tokens: int = Field(16, ge=1, le=131_072, description="max_tokens, with ignore_eos")
    warmup_requests: int = Field(1, ge=0, le=1000, description="excluded from the metrics")
    long_fraction: float = Field(
        0.0, ge=0.0, le=1.0, description="share of measured requests of class 'long'"
    )
    long_input_tokens: int = Field(
        1536, ge=1, le=131_072, description="target length of a long request's document"
    )

    # strict: 4 is a count, "4" and true are not (JSON numbers still fill float fields)
    model_config = {"extra": "forbid", "strict": True}


class ChatRequest(BaseModel):
    """One request of the list: an OpenAI chat-completions body without model/stream."""

    index: int
    messages: list[dict[str, str]]
    max_tokens: int
    warmup: bool = False
    request_class: str = "short"


class EngineLaunch(BaseModel):
    """How to start one single-node vLLM OpenAI-compatible server.

    ``engine_args`` use vLLM's own argument names in snake_case
    (``enable_prefix_caching``, ``max_model_len``...). They are rendered as
    ``--kebab-case`` flags; booleans as ``--flag`` / ``--no-flag``.
    """

    engine_python: str = Field(description="python executable of the engine venv")
    model_dir: str
    served_model_name: str
    engine_args: dict[str, Any] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 0
    startup_timeout_s: float = 600.0
    log_path: str = Field(description="file the server's stdout+stderr go to")


class RunJob(BaseModel):
    """Everything one run needs on its node."""

    run_id: str
    launch: EngineLaunch
    workload: WorkloadSpec
    scrape_interval_s: float = 1.0
    request_timeout_s: float = 600.0


class RunSegment(BaseModel):
    """One run inside a :class:`BatchJob`: its id and its (client-side) workload."""

    run_id: str
    workload: WorkloadSpec


class BatchJob(BaseModel):
    """Runs that share one vLLM server (they differ only in client-side settings).

    The server is started once for ``launch``; the segments run in order, each
    with its own warm-up and measurement, and the prefix cache is reset
    (``POST /reset_prefix_cache``) before each segment's measured requests.
    """

    launch: EngineLaunch
    segments: list[RunSegment] = Field(min_length=1)
    scrape_interval_s: float = 1.0
    request_timeout_s: float = 600.0


class RequestRecord(BaseModel):
    """Client-side timing of one request (seconds; offsets from the run start).

    Definitions follow ``vllm bench serve``: TTFT is the time to the first
    streamed content token; ITL the gaps between successive streamed chunks;
    TPOT = (E2EL - TTFT) / (output_tokens - 1); E2EL the whole request.
    """

    index: int
    warmup: bool = False
    request_class: str | None = None
    success: bool
    error: str | None = None
    start_s: float
    ttft_s: float | None = None
    itl_s: list[float] = Field(default_factory=list)
    tpot_s: float | None = None
    e2el_s: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None


class MetricSample(BaseModel):
    """One scrape of the server's ``/metrics``; ``t_s`` seconds since run start.

    ``values`` keys: see :data:`jobs.metrics.SAMPLE_KEYS`.
    """

    t_s: float
    phase: Literal["before", "during", "after"]
    values: dict[str, float]


class RunResult(BaseModel):
    """Outcome of one run. ``status`` is ``succeeded`` or ``failed``/``cancelled``."""

    run_id: str
    status: Literal["succeeded", "failed", "cancelled"]
    error: str | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    requests: list[RequestRecord] = Field(default_factory=list)
    samples: list[MetricSample] = Field(default_factory=list)
    engine_log: str = ""
    engine_info: dict[str, Any] = Field(default_factory=dict)
    timings: dict[str, float] = Field(default_factory=dict)


class Progress(BaseModel):
    """What a running job reports while it works.

    ``run_id``: the run (batch segment) the report is about; ``None`` only
    from producers that do not set it.
    """

    phase: Literal["starting", "waiting_health", "warmup", "measuring", "stopping", "done"]
    requests_done: int = 0
    requests_total: int = 0
    message: str = ""
    run_id: str | None = None
