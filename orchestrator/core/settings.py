"""One settings class for the whole service (pydantic-settings).

Environment variables use the ``VLAB_`` prefix and ``__`` for nested groups
(``VLAB_API__PORT=8080``). Two well-known variables are also read without the
prefix: ``DATABASE_URL`` (unset -> an embedded Postgres in ``<home>/pgdata``)
and ``RAY_ADDRESS`` (unset -> a local Ray started by the orchestrator).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, BaseModel, Field
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


class EngineSettings(BaseModel):
    """The engine environment: vLLM in its own venv, launched as a process."""

    python: Path = Field(Path(".engine-venv/bin/python"), description="engine venv python")
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


class OrchestratorSettings(BaseModel):
    poll_interval_s: float = Field(1.0, gt=0)
    max_concurrent_runs: int = Field(1, ge=1)
    device_resource: Literal["auto", "CPU", "GPU"] = Field(
        "auto",
        description="Ray resource one device maps to: auto (GPU when the Ray cluster has GPU "
        "resources, else CPU), CPU or GPU",
    )
    placement_timeout_s: float = Field(60.0, gt=0)
    stale_after_s: float = Field(60.0, gt=0, description="heartbeat age that marks a run orphaned")


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
