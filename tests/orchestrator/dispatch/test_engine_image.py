"""The engine's container image and what joining a cluster ships: Ray cannot have both.

Ray 2.60 refuses ``image_uri`` beside any runtime_env field but ``config`` and
``env_vars`` (``ray/runtime_env/runtime_env.py``: "The 'image_uri' field currently
cannot be used together with other fields of runtime_env";
``ray/_private/runtime_env/image_uri.py``, ``ImageURIPlugin.get_compatible_keys``), and
a task's runtime_env is merged into the job's per field, so an engine image cannot run
where joining the cluster shipped ``py_modules``/``pip`` (the shape of
``JoinReport.runtime_env`` from ``orchestrator.dispatch.ray.join.plan_runtime_env``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ray.runtime_env import RuntimeEnv

from orchestrator.core.settings import EngineSettings, Settings
from orchestrator.dispatch.ray.backend import engine_runtime_env, image_conflict

IMAGE = "registry.example.com/vlab/engine@sha256:" + "4f" * 32
SHIPPED = {
    "py_modules": ["/srv/vlab/jobs", "/srv/vlab/orchestrator"],
    "pip": {"packages": ["numpy==2.3.5"], "pip_check": False},
}


def _settings(tmp_path: Path, image: str | None) -> Settings:
    python = Path("/opt/vllm/bin/python")
    return Settings(home=tmp_path, engine=EngineSettings(python=python, image_uri=image))


def test_ray_itself_refuses_an_image_beside_shipped_code() -> None:
    with pytest.raises(ValueError, match="'image_uri' field currently cannot be used"):
        RuntimeEnv(image_uri=IMAGE, **SHIPPED)
    RuntimeEnv(image_uri=IMAGE, env_vars={"HF_HOME": "/hf"})  # allowed beside it


def test_the_engine_runtime_env_is_the_image(tmp_path: Path) -> None:
    assert engine_runtime_env(_settings(tmp_path, IMAGE)) == {"image_uri": IMAGE}
    assert engine_runtime_env(_settings(tmp_path, None)) is None


def test_an_image_where_the_join_shipped_code_is_refused_at_start(tmp_path: Path) -> None:
    said = image_conflict(_settings(tmp_path, IMAGE), SHIPPED)
    assert said is not None
    assert said.startswith(f"VLAB_ENGINE__IMAGE_URI={IMAGE}:")
    assert "(pip, py_modules)" in said and "install vlab in the nodes' Python" in said
    # nothing shipped, or only what Ray allows beside an image: no conflict
    assert image_conflict(_settings(tmp_path, IMAGE), None) is None
    assert image_conflict(_settings(tmp_path, IMAGE), {"env_vars": {"A": "1"}}) is None
    # no image: whatever was shipped is fine
    assert image_conflict(_settings(tmp_path, None), SHIPPED) is None
