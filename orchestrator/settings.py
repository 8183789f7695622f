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
