"""One settings class for the whole service (pydantic-settings).

Environment variables use the ``VLAB_`` prefix and ``__`` for nested groups
(``VLAB_API__PORT=8080``). Two well-known variables are also read without the
prefix: ``DATABASE_URL`` (unset -> an embedded Postgres in ``<home>/pgdata``)
and ``RAY_ADDRESS`` (unset -> a local Ray started by the orchestrator).
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Literal

from pydantic import AliasChoices, BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class ApiSettings(BaseModel):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    public_url: str | None = Field(
        None, description="base URL printed in links; default http://<host>:<port>"
    )
    auth: Literal["tokens", "none"] = Field(
        "tokens",
        description="tokens: API tokens (``vlab token create``) are required once one exists; "
        "with none, open access only when bound to a loopback address. none: no "
        "authentication at all, every request acts as an admin (explicit opt-out, warned "
        "about loudly at start)",
    )
    session_ttl_s: float = Field(
        12 * 3600.0, gt=0, description="lifetime of a dashboard sign-in (seconds)"
    )
    max_concurrent_reads: int = Field(
        16,
        ge=1,
        le=30,
        description="GET requests inside the application at once; more wait for a slot "
        "holding no thread and no database connection (:mod:`api.limits`). At most 30: the "
        "database pool (10 + 30 connections, ``orchestrator.core.db.make_engine``) holds "
        "these reads, the writes and the dispatcher of the same process",
    )
    metrics_token: SecretStr | None = Field(
        None,
        description="when set, GET /metrics needs `Authorization: Bearer <this>` (checked "
        "without the database, so a scrape answers during an outage); unset: /metrics is "
        "open, like /healthz",
    )

    @field_validator("metrics_token")
    @classmethod
    def _metrics_token_not_blank(cls, value: SecretStr | None) -> SecretStr | None:
        # an empty token would let `Authorization: Bearer ` (empty) in
        if value is not None and not value.get_secret_value().strip():
            raise ValueError("is empty: give a token, or unset it to leave /metrics open")
        return value


#: A container image reference, Docker's grammar (distribution/reference ``reference.go``):
#: ``[host[:port]/]path[:tag][@algorithm:hex]``, lower-case path components.
_IMAGE_REF = re.compile(
    r"^(?:(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*"
    r"|\[[a-fA-F0-9:]+\])(?::[0-9]+)?/)?"
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
    r"(?::[\w][\w.-]{0,127})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$"
)
#: A Ray node label selector of ``VLAB_ENGINE__PYTHON_BY_NODE``: ``<key>=<value>``.
_LABEL_KEY = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._/-]*[A-Za-z0-9])?=[A-Za-z0-9._-]*$")


def node_selector_kind(key: str) -> Literal["ip", "label"]:
    """``"ip"`` or ``"label"`` for a key of ``VLAB_ENGINE__PYTHON_BY_NODE``.

    Raises ``ValueError`` for anything else (the message names the key and the forms).
    """
    if "=" in key:
        if not _LABEL_KEY.match(key):
            raise ValueError(
                f"{key!r}: a label selector is <label key>=<value> (a Ray node label, "
                "`ray start --labels`), e.g. vlab.io/engine=vllm-0.11"
            )
        return "label"
    try:
        ipaddress.ip_address(key)
    except ValueError:
        raise ValueError(
            f"{key!r} is neither a node IP (Ray's NodeManagerAddress, e.g. 10.0.0.2) nor a "
            "Ray node label selector <key>=<value> (e.g. ray.io/node-id=<id>, "
            "vlab.io/engine=vllm-0.11)"
        ) from None
    return "ip"


def _label_matches(labels: Mapping[str, object], key: str, value: str) -> bool:
    have = labels.get(key)
    if isinstance(have, list | tuple | set | frozenset):
        return value in {str(v) for v in have}
    return have is not None and str(have) == value


class EngineSettings(BaseModel):
    """The engine environment: vLLM in its own venv (or image), launched as a process.

    Where the engine's python is on each node: ``python`` (every node), overridden per
    node by ``python_by_node`` (the first entry, in the order written, whose selector
    matches the node: a node IP or a Ray node label ``key=value``), or inside the
    container image ``image_uri`` (Ray's ``image_uri`` runtime environment) on every
    node. :meth:`python_for_node` resolves it; see docs/OPERATIONS.md.
    """

    python: Path = Field(
        Path(".engine-venv/bin/python"),
        description="engine venv python (every node; inside the image with image_uri)",
    )
    python_by_node: dict[str, str] = Field(
        default_factory=dict,
        description="per-node engine python, JSON {selector: absolute path}: a selector is a "
        "node IP (Ray's NodeManagerAddress) or a Ray node label <key>=<value>; the first "
        "entry in the order written that matches a node wins, else python",
    )
    image_uri: str | None = Field(
        None,
        description="run the engine's Ray tasks and actors in this container image (Ray's "
        "image_uri runtime_env; podman on the nodes); python is then the path inside it",
    )
    kv_cache_space_gib: int = Field(1, ge=1, description="VLLM_CPU_KVCACHE_SPACE on CPU hosts")
    startup_timeout_s: float = Field(600.0, gt=0)
    request_timeout_s: float = Field(600.0, gt=0)
    resolve_configs: bool = Field(
        True, description="ask vLLM for its resolved configuration at submission"
    )
    model_resolve_timeout_s: float = Field(
        120.0, gt=0, description="seconds a node may take to resolve a model id at submission"
    )
    max_failed_request_fraction: float = Field(
        0.05,
        ge=0,
        le=1,
        description="a run whose share of failed measured requests is above this (0-1) "
        "fails (partial): its numbers are no valid measurement",
    )

    @field_validator("python_by_node")
    @classmethod
    def _check_by_node(cls, value: dict[str, str]) -> dict[str, str]:
        problems = []
        for key, path in value.items():
            try:
                node_selector_kind(key)
            except ValueError as exc:
                problems.append(str(exc))
            if not PurePosixPath(path).is_absolute():
                problems.append(
                    f"{key!r}: {path!r} is not an absolute path (the python on that node)"
                )
        if problems:
            raise ValueError("VLAB_ENGINE__PYTHON_BY_NODE: " + "; ".join(problems))
        return value

    @field_validator("image_uri")
    @classmethod
    def _check_image(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        value = value.strip()
        if "://" in value:
            raise ValueError(
                f"VLAB_ENGINE__IMAGE_URI={value!r}: Ray's image_uri is an image reference "
                "without a scheme, e.g. registry.example.com/vlab/engine:0.32@sha256:<digest>"
            )
        if len(value) > 512 or not _IMAGE_REF.match(value):
            raise ValueError(
                f"VLAB_ENGINE__IMAGE_URI={value!r} is not a container image reference "
                "([registry[:port]/]name[:tag][@sha256:<digest>], lower-case name)"
            )
        return value

    @model_validator(mode="after")
    def _check_image_python(self) -> EngineSettings:
        if self.image_uri is None:
            return self
        if self.python_by_node:
            raise ValueError(
                "VLAB_ENGINE__IMAGE_URI and VLAB_ENGINE__PYTHON_BY_NODE exclude each other: "
                "with an image every node runs the engine in it, at VLAB_ENGINE__PYTHON"
            )
        if not PurePosixPath(str(self.python)).is_absolute():
            raise ValueError(
                "VLAB_ENGINE__IMAGE_URI needs VLAB_ENGINE__PYTHON to be the engine's python "
                f"inside the image as an absolute path (got {str(self.python)!r}), e.g. "
                "/opt/vllm/bin/python"
            )
        return self

    @property
    def kind(self) -> Literal["path", "image"]:
        """``"image"`` with :attr:`image_uri`, else ``"path"``."""
        return "image" if self.image_uri else "path"

    def python_for_node(
        self, ip: str | None, labels: Mapping[str, object] | None, default: str | None = None
    ) -> tuple[str, str]:
        """The engine python on the node with ``ip`` and Ray ``labels``, and its setting.

        The first :attr:`python_by_node` entry (in the order written) whose selector
        matches (the node IP, or a label ``key=value`` the node has), else ``default``
        (else :attr:`python`). Returns ``(python, source)``, ``source`` naming the
        setting: ``"VLAB_ENGINE__PYTHON_BY_NODE[<selector>]"`` or
        ``"VLAB_ENGINE__PYTHON"``.
        """
        for key, path in self.python_by_node.items():
            if node_selector_kind(key) == "ip":
                hit = ip is not None and _same_ip(key, ip)
            else:
                label, _, wanted = key.partition("=")
                hit = _label_matches(labels or {}, label, wanted)
            if hit:
                return path, f"VLAB_ENGINE__PYTHON_BY_NODE[{key}]"
        return (default if default is not None else str(self.python)), "VLAB_ENGINE__PYTHON"


def _same_ip(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return a == b


class SubmissionSettings(BaseModel):
    """Back-pressure on submissions (:mod:`orchestrator.experiments.config_check`)."""

    max_concurrent_checks: int = Field(
        2, ge=1, description="submissions (vLLM configuration checks) processed at once"
    )
    max_waiting: int = Field(
        8, ge=0, description="submissions that may wait for a slot; more get 503 submissions_busy"
    )
    wait_timeout_s: float = Field(
        120.0, gt=0, description="longest wait for a slot before 503 submissions_busy"
    )
    retry_after_s: int = Field(10, ge=1, description="Retry-After of a 503 submissions_busy")
    warm_resolver: bool = Field(
        True, description="keep one vLLM process warm for configuration checks (one import)"
    )
    warm_idle_s: float = Field(
        600.0, gt=0, description="seconds the warm vLLM process stays without work"
    )


class PathSettings(BaseModel):
    """Where engine arguments may point on the servers.

    The rules: :mod:`orchestrator.experiments.pathpolicy`.
    """

    allowed_roots: list[Path] = Field(
        default_factory=list,
        description="folders engine arguments may name files in (chat_template, "
        "download_dir, tokenizer...) and, when set, the only places model directories "
        "are served from (besides model_roots); default none: every such path is refused",
    )
    allow_remote_code: bool = Field(
        False,
        description="accept engine arguments that run or import code the server does not "
        "ship (trust_remote_code, worker_cls, middleware, parser plugins...)",
    )


class LimitsSettings(BaseModel):
    """Sizes the API accepts (:mod:`api.limits`)."""

    max_body_bytes: int = Field(
        16 * 2**20,
        ge=1024,
        description="largest request body (bytes); above it 413 payload_too_large",
    )


class MlflowSettings(BaseModel):
    """Export to an MLflow tracking server (:mod:`orchestrator.integrations.mlflow_export`)."""

    tracking_uri: str | None = Field(
        None, description="tracking URI used when an export names none (CLI and API)"
    )
    allow_local_stores: bool = Field(
        False,
        description="let the API export to stores on the service's own disk or to a database "
        "(file://, sqlite:// and other non-http(s) URIs); off: the API accepts http(s) "
        "tracking servers only (the CLI accepts any URI)",
    )
    allowed_uri_prefixes: list[str] = Field(
        default_factory=list,
        description="when set, the API exports only to tracking URIs that start with one "
        "of these (e.g. https://mlflow.internal/)",
    )
    connect_timeout_s: float = Field(
        10.0, gt=0, description="seconds to reach an http(s) tracking server before 502"
    )


class OrchestratorSettings(BaseModel):
    poll_interval_s: float = Field(
        1.0,
        gt=0,
        description="the dispatcher's tick: how often it wakes to run the loops that are due",
    )
    # The dispatcher's loops (orchestrator.dispatch.loops). A loop runs on the first tick
    # at least its interval after its last successful turn; None: on every tick.
    heartbeat_interval_s: float | None = Field(
        5.0, gt=0, description="heartbeat loop: publish liveness and cluster resources"
    )
    active_poll_interval_s: float | None = Field(
        None,
        gt=0,
        description="poll loop: poll active runs, stream their records (None: every tick)",
    )
    reconcile_interval_s: float | None = Field(
        None,
        gt=0,
        description="reconcile loop: adopt or fail lost runs, sweep orphaned engines "
        "(None: stale_after_s / 2)",
    )
    parity_interval_s: float | None = Field(
        None, gt=0, description="parity loop: answer one node parity check (None: every tick)"
    )
    schedules_interval_s: float | None = Field(
        None, gt=0, description="schedules loop: fire due scheduled sweeps (None: every tick)"
    )
    claim_interval_s: float | None = Field(
        None, gt=0, description="claim loop: claim at most one queued run (None: every tick)"
    )
    campaigns_interval_s: float | None = Field(
        5.0,
        gt=0,
        description="campaigns loop: advance running tuning campaigns (queue their next runs, "
        "write their results)",
    )
    max_concurrent_runs: int = Field(1, ge=1)
    device_resource: Literal["auto", "CPU", "GPU"] = Field(
        "auto",
        description="Ray resource one device maps to: auto (GPU when the Ray cluster has GPU "
        "resources, else CPU), CPU or GPU",
    )
    placement_timeout_s: float = Field(60.0, gt=0)
    stale_after_s: float = Field(60.0, gt=0, description="heartbeat age that marks a run orphaned")
    ship_to_nodes: Literal["auto", "never"] = Field(
        "auto",
        description="with RAY_ADDRESS: auto ships what a node lacks to run vlab's Ray tasks "
        "(our code as py_modules, the pinned requirements of jobs with pip, through Ray's "
        "runtime_env); never ships nothing and refuses to start when a node lacks anything",
    )
    node_setup_timeout_s: float = Field(
        600.0,
        gt=0,
        description="seconds a node may take to answer the start-up check, pip install "
        "of the shipped requirements included",
    )
    ray_connect_timeout_s: float = Field(
        5.0,
        gt=0,
        description="seconds to resolve and reach the GCS of RAY_ADDRESS before joining "
        "(an unreachable address fails at once instead of Ray retrying for minutes)",
    )


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="VLAB_", env_nested_delimiter="__", extra="ignore", populate_by_name=True
    )

    home: Path = Field(Path(".vlab"), description="data folder: pgdata, models, run logs")
    database_url: str | None = Field(
        None, validation_alias=AliasChoices("VLAB_DATABASE_URL", "DATABASE_URL")
    )
    ray_address: str | None = Field(
        None, validation_alias=AliasChoices("VLAB_RAY_ADDRESS", "RAY_ADDRESS")
    )
    model_roots: list[Path] = Field(
        default_factory=list, description="extra folders searched for model names"
    )
    api: ApiSettings = Field(default_factory=ApiSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    orchestrator: OrchestratorSettings = Field(default_factory=OrchestratorSettings)
    submissions: SubmissionSettings = Field(default_factory=SubmissionSettings)
    paths: PathSettings = Field(default_factory=PathSettings)
    limits: LimitsSettings = Field(default_factory=LimitsSettings)
    mlflow: MlflowSettings = Field(default_factory=MlflowSettings)

    @property
    def models_dir(self) -> Path:
        return self.home / "models"

    @property
    def runs_dir(self) -> Path:
        return self.home / "runs"

    @property
    def engine_args_cache(self) -> Path:
        return self.home / "engine_args.json"

    def api_base_url(self) -> str:
        return self.api.public_url or f"http://{self.api.host}:{self.api.port}"


def detect_device_resource(setting: str, cluster_resources: dict[str, float]) -> tuple[str, str]:
    """The Ray resource a device maps to, and why.

    ``setting`` ``"CPU"``/``"GPU"`` wins (``"setting"``); ``"auto"`` gives ``"GPU"`` when
    the cluster reports at least one whole GPU (``ray.cluster_resources()["GPU"] >= 1``,
    ``"detected"``), else ``"CPU"``. Returns ``(resource, source)``.
    """
    if setting in ("CPU", "GPU"):
        return setting, "setting"
    gpus = float(cluster_resources.get("GPU", 0) or 0)
    return ("GPU" if gpus >= 1 else "CPU"), "detected"


@functools.lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()
