"""The CLI reports user mistakes in one line with exit code 2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from orchestrator.cli.main import app, load_spec_file


def test_broken_yaml_is_one_line_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [oops\n")
    result = CliRunner().invoke(app, ["submit", str(bad), "--api", "http://127.0.0.1:9"])
    assert result.exit_code == 2
    assert "invalid YAML" in result.output and "Traceback" not in result.output


def test_unreachable_api_is_one_line_error(tmp_path: Path) -> None:
    spec = Path(__file__).resolve().parents[3] / "examples" / "quick-tiny.yaml"
    result = CliRunner().invoke(app, ["submit", str(spec), "--api", "http://127.0.0.1:9"])
    assert result.exit_code == 4  # the service unreachable (docs/USAGE.md, exit codes)
    assert "cannot reach the API" in result.output


def test_yaml_and_json_specs_load_alike(tmp_path: Path) -> None:
    y = tmp_path / "s.yaml"
    y.write_text("name: a\nmodel: tiny\n")
    j = tmp_path / "s.json"
    j.write_text('{"name": "a", "model": "tiny"}')
    assert load_spec_file(y) == load_spec_file(j) == {"name": "a", "model": "tiny"}


def test_replay_file_is_inlined_relative_to_the_spec(tmp_path: Path) -> None:
    (tmp_path / "traffic.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "hi"}], "timestamp": 0.5}\n'
        "# a comment\n"
        '{"prompt": "Once upon a time", "max_tokens": 4}\n'
    )
    spec = tmp_path / "s.yaml"
    spec.write_text(
        "name: r\nmodel: tiny\nbaseline:\n  workload:\n    kind: replay\n"
        "    replay_file: traffic.jsonl\n"
    )
    doc = load_spec_file(spec)
    workload = doc["baseline"]["workload"]
    assert "replay_file" not in workload
    assert [sorted(b) for b in workload["replay"]] == [
        ["messages", "timestamp"],
        ["max_tokens", "prompt"],
    ]


def test_malformed_replay_file_names_every_bad_line(tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "ok"}]}\n{oops\n{"prompt": 3}\n'
    )
    spec = tmp_path / "s.json"
    spec.write_text(
        '{"name": "r", "model": "tiny", "baseline": {"workload": '
        '{"kind": "replay", "replay_file": "bad.jsonl"}}}'
    )
    result = CliRunner().invoke(app, ["submit", str(spec), "--api", "http://127.0.0.1:9"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "line 2" in result.output and "line 3" in result.output
    assert "cannot reach the API" not in result.output  # refused before anything is sent


def test_replay_and_replay_file_together_are_refused(tmp_path: Path) -> None:
    (tmp_path / "t.jsonl").write_text('{"prompt": "hi"}\n')
    spec = tmp_path / "s.yaml"
    spec.write_text(
        "name: r\nmodel: tiny\nbaseline:\n  workload:\n    kind: replay\n"
        "    replay_file: t.jsonl\n    replay: [{prompt: x}]\n"
    )
    result = CliRunner().invoke(app, ["submit", str(spec), "--api", "http://127.0.0.1:9"])
    assert result.exit_code == 2 and "not both" in result.output


def test_ttft_ratio_text_says_slower_when_slower() -> None:
    from orchestrator.cli.report import ttft_ratio_text

    assert ttft_ratio_text(66.8, 45.7) == "1.46x slower"
    assert ttft_ratio_text(20.0, 40.0) == "2.00x faster"
    assert ttft_ratio_text(5.0, 5.0) == "same"


def test_long_errors_stay_on_one_line(tmp_path: Path) -> None:
    spec = tmp_path / ("a-rather-long-spec-file-name-" * 4 + ".yaml")
    spec.write_text("name: [oops\n")
    result = CliRunner().invoke(app, ["submit", str(spec), "--api", "http://127.0.0.1:9"])
    assert result.exit_code == 2
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output


def _settings_error_case(monkeypatch: Any, env: dict[str, str], args: list[str]) -> Any:
    from orchestrator.core.settings import get_settings

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    get_settings.cache_clear()
    try:
        return CliRunner().invoke(app, args)
    finally:
        get_settings.cache_clear()


def test_invalid_settings_are_one_line_errors(monkeypatch: Any) -> None:
    cases = [
        (
            {"VLAB_ENGINE__PYTHON_BY_NODE": '{"192.0.2.2": "relative/bin/python"}'},
            "error: invalid setting VLAB_ENGINE__PYTHON_BY_NODE: ",
            "is not an absolute path",
        ),
        (
            {"VLAB_ENGINE__PYTHON_BY_NODE": "not json"},
            "error: invalid setting VLAB_ENGINE__PYTHON_BY_NODE: ",
            "not valid JSON",
        ),
        (
            # `make test` exports VLAB_ENGINE__PYTHON (a path, never JSON-decoded): the
            # one-line error still names the dict setting whose value is not JSON
            {"VLAB_ENGINE__PYTHON": "/opt/engine/bin/python", "VLAB_ENGINE__PYTHON_BY_NODE": "{"},
            "error: invalid setting VLAB_ENGINE__PYTHON_BY_NODE: ",
            "not valid JSON",
        ),
        ({"VLAB_API__PORT": "abc"}, "error: invalid setting VLAB_API__PORT: ", "valid integer"),
    ]
    for env, start, part in cases:
        with monkeypatch.context() as m:
            result = _settings_error_case(m, env, ["up"])
        out = result.output.strip()
        assert result.exit_code == 2, out
        assert "Traceback" not in out
        assert len(out.splitlines()) == 1, out
        assert out.startswith(start) and part in out, out


def test_unreachable_database_is_one_line_error(monkeypatch: Any) -> None:
    import socket

    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"postgresql://postgres:secret@127.0.0.1:{port}/x"
    result = _settings_error_case(monkeypatch, {"DATABASE_URL": url}, ["serve"])
    out = result.output.strip()
    assert result.exit_code == 2, out
    assert "Traceback" not in out and "secret" not in out
    assert len(out.splitlines()) == 1, out
    assert out.startswith(
        f"error: cannot reach the database at postgresql://postgres:***@127.0.0.1:{port}/x: "
    )
    assert "refused" in out.lower()
