"""``--json`` of the commands that work on this machine, not through the API:
``vlab engine-args`` and ``vlab model generate`` (their shapes are in docs/USAGE.md)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from jobs.modelgen.generator import model_digest
from orchestrator.cli.main import app
from orchestrator.core.settings import get_settings
from tests.factories import DATA


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``VLAB_HOME`` in ``tmp_path`` with the vLLM 0.32.0 argument catalogue cached for
    an engine python that does not exist (the cache is all the command may read)."""
    home = tmp_path / "home"
    home.mkdir()
    python = tmp_path / "engine-python-placeholder"
    doc = json.loads((DATA / "engine_args_vllm032cpu.json").read_text())
    doc["engine_python"] = str(python)
    (home / "engine_args.json").write_text(json.dumps(doc))
    monkeypatch.setenv("VLAB_HOME", str(home))
    monkeypatch.setenv("VLAB_ENGINE__PYTHON", str(python))
    get_settings.cache_clear()
    yield home
    get_settings.cache_clear()


def test_engine_args_json_is_the_catalogue(home: Path) -> None:
    result = CliRunner().invoke(app, ["engine-args", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)  # JSON alone on stdout
    assert set(doc) == {"vllm_version", "count", "args"}
    assert doc["vllm_version"] == "0.32.0+cpu"
    assert doc["count"] == len(doc["args"]) > 100
    names = [a["name"] for a in doc["args"]]
    assert names == sorted(names) and len(set(names)) == len(names)
    keys = {"name", "options", "type", "default", "choices", "is_bool_flag", "group", "help"}
    assert all(set(a) == keys for a in doc["args"])
    by_name = {a["name"]: a for a in doc["args"]}
    apc = by_name["enable_prefix_caching"]
    assert "--enable-prefix-caching" in apc["options"]
    assert isinstance(apc["is_bool_flag"], bool)
    assert by_name["max_num_seqs"]["options"] == ["--max-num-seqs"]

    plain = CliRunner().invoke(app, ["engine-args"])
    assert plain.exit_code == 0
    assert f"vLLM 0.32.0+cpu: {doc['count']} engine arguments" in plain.stdout


def test_engine_args_without_an_engine_is_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLAB_HOME", str(tmp_path / "empty"))
    monkeypatch.setenv("VLAB_ENGINE__PYTHON", str(tmp_path / "no-python"))
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(app, ["engine-args", "--json"])
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 2
    assert result.stdout == ""
    assert "engine environment not found" in result.stderr


def test_model_generate_json(home: Path) -> None:
    result = CliRunner().invoke(app, ["model", "generate", "tiny", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert set(doc) == {"shape", "path", "digest"}
    assert doc["shape"] == "tiny"
    path = Path(doc["path"])
    assert path == (home / "models" / "tiny").resolve()
    assert (path / "config.json").is_file()
    assert doc["digest"] == model_digest(path)
    assert len(doc["digest"]) == 64

    again = CliRunner().invoke(app, ["model", "generate", "tiny", "--json"])
    assert again.exit_code == 2  # exists, not overwritten
    assert again.stdout == ""
    assert "exists (--overwrite replaces it)" in again.stderr


def test_model_generate_unknown_shape_is_one_line_error(home: Path) -> None:
    result = CliRunner().invoke(app, ["model", "generate", "huge", "--json"])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert "unknown model shape 'huge'" in result.stderr
