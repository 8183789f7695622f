"""Pure data contracts between the orchestrator and what runs on a node.

Everything a run job needs comes in as a :class:`RunJob`; everything it
produces goes back as a :class:`RunResult`. Both are plain pydantic models so
they cross a Ray boundary (pickled) and the orchestrator can persist them
without this package ever touching the database.

Metric names in :attr:`RunResult.metrics` follow the keys of the JSON result
written by ``vllm bench serve`` (``mean_ttft_ms``, ``median_ttft_ms``,
``p99_ttft_ms``, ``request_throughput``, ``output_throughput``,
``total_token_throughput`` ...) so numbers compare with what the field
publishes; server-side names are documented in :mod:`jobs.signals.enginemetrics`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jobs.capacity.search import CapacityResult, CapacitySpec

_STRICT = ConfigDict(extra="forbid", strict=True)
#: Largest value of a 32-bit signed column (Postgres ``integer``): ``runs.seed`` stores
#: the workload's seed.
INT32_MAX = 2**31 - 1


class LengthDist(BaseModel):
    """A token length drawn per request, as ``vllm bench serve``'s random dataset does.

    Uniform integer in ``[floor(tokens * (1 - range_ratio)), ceil(tokens * (1 + range_ratio))]``
    (``--random-input-len`` / ``--random-range-ratio``); ``range_ratio`` 0 gives ``tokens``.
    """

    tokens: int = Field(ge=0, le=131_072)
    range_ratio: float = Field(0.0, ge=0.0, lt=1.0)

    model_config = _STRICT


SegmentSource = Literal[
    "instructions",
    "tools",
    "document_header",
    "document",
    "question",
    "passages",
    "conversation_state",
    "text",
]


class TemplateSegment(BaseModel):
    """One ordered part of a prompt template.

    ``fixed`` segments are identical in every request of the run (system
    instructions, tool schemas and output format, a versioned document
    header); variable ones are drawn per request (user question, retrieved
    passages, conversation state). ``source`` says what text fills it (see
    :mod:`jobs.load.workload`); ``text`` gives literal text instead (fixed only).
    ``tokens`` is the target length in the served model's tokens.
    """

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    role: Literal["system", "user"] = "user"
    fixed: bool = False
    source: SegmentSource = "question"
    text: str | None = Field(None, max_length=1_000_000)
    tokens: LengthDist = Field(default_factory=lambda: LengthDist(tokens=64))

    model_config = _STRICT


class RequestClassSpec(BaseModel):
    """A request class of a ``template`` workload: its share and length distributions.

    ``segment_tokens`` overrides the ``tokens`` of variable segments by name
    (0 tokens drops the segment for this class); ``output_tokens`` overrides
    the workload's output length.
    """

    name: str = Field(min_length=1, max_length=50, pattern=r"^[A-Za-z0-9_.-]+$")
    weight: float = Field(gt=0.0, le=1e6)
    segment_tokens: dict[str, LengthDist] = Field(default_factory=dict)
    output_tokens: LengthDist | None = None

    model_config = _STRICT


class MultiTurnSpec(BaseModel):
    """Multi-turn conversations: each request is the next turn of a conversation.

    A conversation's turn ``k`` carries its whole history (every earlier user
    turn and a seeded assistant answer of ``answer_tokens`` tokens for each),
    so its prefix grows turn by turn; turn ``k`` is sent only after turn
    ``k - 1`` of the same conversation finished.
    """

    turns: int = Field(2, ge=2, le=64)
    answer_tokens: int = Field(64, ge=1, le=32_768)

    model_config = _STRICT


class WorkloadSpec(BaseModel):
    """The request list of a run and how it is driven.

    Kinds (:mod:`jobs.load.workload` builds the list, deterministic in ``seed``):

    - ``shared_prefix``: every request is a chat with the same fixed prefix
      (system instructions, a tool schema, a versioned document header, about
      ``prefix_tokens`` tokens) followed by a varying user question of about
      ``question_tokens`` tokens. ``round(num_requests * long_fraction)``
      measured requests (seeded positions) are class ``long``: the same
      shared prefix, then a unique document of about ``long_input_tokens``
      tokens before the question; the rest are class ``short``. Short
      requests are identical whatever the fraction, so a mixed run's short
      requests compare with a short-only run's.
    - ``template``: requests built from ordered ``segments`` (fixed or
      variable), in ``classes`` with their own length distributions, optionally
      ``multi_turn``.
    - ``replay``: the user's own requests, ``replay`` (OpenAI chat or
      completions bodies, optional ``timestamp`` in seconds), in file order.

    Arrival (measured requests; warm-ups always go one at a time):

    - ``closed``: at most ``concurrency`` requests in flight, the next sent as
      soon as one finishes (``vllm bench serve --request-rate inf
      --max-concurrency N``);
    - ``constant``: one request every ``1 / request_rate`` s;
    - ``poisson``: gamma-distributed gaps with shape ``burstiness`` and mean
      ``1 / request_rate`` (``burstiness`` 1 is a Poisson process, lower is
      burstier), as ``vllm bench serve --request-rate --burstiness``;
    - ``trace``: the replay's own ``timestamp`` offsets.

    In the open-loop modes ``concurrency`` still caps the requests in flight
    (``--max-concurrency``). ``duration_s``, when set, stops sending measured
    requests that many seconds after the first was sent (those in flight finish):
    ``num_requests`` is then the most it sends, and the run is judged on the requests
    it sent in that window (a run that sent fewer than ``num_requests`` succeeds).
    """

    kind: Literal["shared_prefix", "template", "replay"] = "shared_prefix"
    num_requests: int = Field(16, ge=1, le=20_000, description="measured requests")
    concurrency: int = Field(1, ge=1, le=4096, description="in-flight limit")
    seed: int = Field(0, ge=0, le=INT32_MAX, description="request-list seed (stored 32-bit)")
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
    segments: list[TemplateSegment] | None = Field(
        None, max_length=32, description="template: ordered prompt segments"
    )
    classes: list[RequestClassSpec] | None = Field(
        None, max_length=16, description="template: request classes and their mix"
    )
    multi_turn: MultiTurnSpec | None = None
    replay: list[dict[str, Any]] | None = Field(
        None, max_length=20_000, description="replay: OpenAI request bodies in send order"
    )
    arrival: Literal["closed", "constant", "poisson", "trace"] = "closed"
    request_rate: float | None = Field(None, gt=0.0, le=100_000.0, description="requests/s")
    burstiness: float = Field(1.0, gt=0.0, le=1000.0)
    duration_s: float | None = Field(None, gt=0.0, le=86_400.0)

    # strict: 4 is a count, "4" and true are not (JSON numbers still fill float fields)
    model_config = _STRICT

    @model_validator(mode="after")
    def _fields_fit_kind(self) -> WorkloadSpec:
        problems = []
        if self.kind != "template":
            problems += [
                f"'{name}' applies to kind 'template' only"
                for name in ("segments", "classes", "multi_turn")
                if getattr(self, name) is not None
            ]
        if self.kind == "replay" and not self.replay:
            problems.append("kind 'replay' needs 'replay': a non-empty list of request bodies")
        if self.kind != "replay" and self.replay is not None:
            problems.append("'replay' applies to kind 'replay' only")
        if self.arrival in ("constant", "poisson") and self.request_rate is None:
            problems.append(f"arrival '{self.arrival}' needs 'request_rate' (requests/s)")
        if self.arrival in ("closed", "trace") and self.request_rate is not None:
            problems.append(f"'request_rate' does not apply to arrival '{self.arrival}'")
        if self.arrival != "poisson" and self.burstiness != 1.0:
            problems.append(f"'burstiness' applies to arrival 'poisson' only, not '{self.arrival}'")
        if self.arrival == "trace" and self.kind != "replay":
            problems.append("arrival 'trace' replays timestamps: it needs kind 'replay'")
        if problems:
            raise ValueError("; ".join(problems))
        return self


class ChatRequest(BaseModel):
    """One request of the list.

    ``messages`` is an OpenAI chat-completions ``messages`` list; when
    ``prompt`` is set the request goes to the completions API instead.
    ``extra_body`` holds further OpenAI body fields of a replayed request
    (``tools``, ``temperature``...). ``arrival_s``: open loop, send this many
    seconds after the measured phase began (None: closed loop). ``after``:
    the ``index`` of a request that must have finished before this one is
    sent (the previous turn of a conversation).
    """

    index: int
    messages: list[dict[str, Any]] = Field(default_factory=list)
    prompt: str | None = None
    max_tokens: int
    warmup: bool = False
    request_class: str = "short"
    arrival_s: float | None = None
    after: int | None = None
    conversation: int | None = None
    turn: int | None = None
    extra_body: dict[str, Any] = Field(default_factory=dict)


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
    nnodes: int = Field(1, ge=1, description="nodes of a multi-node launch (--nnodes)")
    node_rank: int = Field(0, ge=0, description="this node's rank (--node-rank)")
    master_addr: str | None = Field(None, description="rank 0 node's IP (--master-addr)")
    master_port: int | None = Field(None, description="rendezvous port (--master-port)")
    executor: Literal["mp", "ray"] = Field(
        "mp",
        description="vLLM's distributed executor: 'mp' (multiprocessing; --nnodes across "
        "nodes) or 'ray' (--distributed-executor-backend ray inside the run's placement group)",
    )
    model_revision: str | None = Field(
        None, description="Hugging Face revision (commit) of a model named by id (--revision)"
    )
    tokenizer_dir: str | None = Field(
        None, description="directory with the tokenizer files when model_dir is not one"
    )
    resolve_model_on_node: bool = Field(
        False,
        description="model_dir is a Hugging Face id: resolve it in this node's HF cache "
        "before the launch (the snapshot directory is served)",
    )

    @property
    def headless(self) -> bool:
        """A follower part of a multi-node launch: no API server (``--headless``)."""
        return self.nnodes > 1 and self.node_rank > 0


class RunJob(BaseModel):
    """Everything one run needs on its node.

    ``goodput_slos_ms``: the experiment's SLOs (``ttft``, ``tpot``, ``e2el`` in ms)
    for ``request_goodput``.
    """

    run_id: str
    launch: EngineLaunch
    workload: WorkloadSpec
    goodput_slos_ms: dict[str, float] = Field(default_factory=dict)
    scrape_interval_s: float = 1.0
    request_timeout_s: float = 600.0


class RunSegment(BaseModel):
    """One run inside a :class:`BatchJob`: its id and its (client-side) workload.

    ``capacity``: the run is a capacity search under SLOs (:mod:`jobs.capacity.loadsteps`):
    load steps over the workload's request list instead of one measurement.
    """

    run_id: str
    workload: WorkloadSpec
    goodput_slos_ms: dict[str, float] = Field(default_factory=dict)
    capacity: CapacitySpec | None = None


class NodePart(BaseModel):
    """One node's part of a multi-node launch (one ``vllm serve`` process per node)."""

    rank: int = Field(ge=0, description="--node-rank; 0 serves the API")
    node_id: str = Field(description="Ray node id")
    ip: str = Field(description="the node's IP as Ray sees it")
    bundle_index: int = Field(ge=0, description="a placement-group bundle on this node")
    devices: int = Field(ge=1, description="devices (ranks) of this node")
    gpus: int = Field(
        0, ge=0, description="GPUs the launcher on this node holds through Ray (0: none)"
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="node-specific environment (e.g. CPU thread binding)"
    )
    engine_python: str | None = Field(
        None,
        description="the engine python on this node (VLAB_ENGINE__PYTHON_BY_NODE); "
        "None: the launch's engine_python",
    )


class BatchJob(BaseModel):
    """Runs that share one vLLM server (they differ only in client-side settings).

    The server is started once for ``launch``; the segments run in order, each
    with its own warm-up and measurement, and the prefix cache is reset
    (``POST /reset_prefix_cache``) before each segment's measured requests.
    ``nodes`` (two or more) makes it a multi-node launch: the supervisor on
    rank 0 starts the followers' headless parts on their nodes first.
    """

    launch: EngineLaunch
    segments: list[RunSegment] = Field(min_length=1)
    nodes: list[NodePart] = Field(default_factory=list)
    scrape_interval_s: float = 1.0
    request_timeout_s: float = 600.0
    max_failed_fraction: float = Field(
        0.05,
        ge=0,
        le=1,
        description="a run whose share of failed measured requests is above this fails",
    )


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
    cached_tokens: int | None = Field(
        None, description="usage.prompt_tokens_details.cached_tokens, when the server reports it"
    )
    scheduled_s: float | None = Field(
        None, description="open loop: when the request was due (offset like start_s)"
    )
    conversation: int | None = None
    turn: int | None = None


class MetricSample(BaseModel):
    """One scrape of the server's ``/metrics``; ``t_s`` seconds since run start.

    ``values`` keys: see :data:`jobs.signals.enginemetrics.SAMPLE_KEYS`.
    """

    t_s: float
    phase: Literal["before", "during", "after"]
    values: dict[str, float]


class RunResult(BaseModel):
    """Outcome of one run. ``status`` is ``succeeded`` or ``failed``/``cancelled``."""

    run_id: str
    status: Literal["succeeded", "failed", "cancelled"]
    error: str | None = None
    partial: bool = Field(
        False, description="ended early (server stopped answering): what was measured is kept"
    )
    metrics: dict[str, float] = Field(default_factory=dict)
    requests: list[RequestRecord] = Field(default_factory=list)
    samples: list[MetricSample] = Field(default_factory=list)
    engine_log: str = ""
    engine_info: dict[str, Any] = Field(default_factory=dict)
    timings: dict[str, float] = Field(default_factory=dict)
    capacity: CapacityResult | None = Field(
        None, description="the capacity search's result and every step (a capacity run only)"
    )


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
