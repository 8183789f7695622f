"""The CLI parses YAML specs with bounded aliases and a size cap (issue #13): an alias
bomb, a recursive alias, a huge or deeply nested file are one-line errors, fast and
small; ordinary anchors keep working."""

from __future__ import annotations

import resource
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchestrator.cli import specfile
from orchestrator.cli.main import CliError, app, load_spec_file


def billion_laughs(levels: int = 9) -> str:
    lines = ["name: bomb", 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    prev = "a"
    for name in "bcdefghijklmnop"[: levels - 1]:
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
        prev = name
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_a_one_line_error_in_little_memory(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(billion_laughs())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    result = CliRunner().invoke(app, ["submit", str(bomb), "--api", "http://127.0.0.1:9"])
    assert time.monotonic() - started < 10
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 200_000  # was 2.7 GB
    assert result.exit_code == 2
    assert "invalid YAML" in result.output and "alias" in result.output
    assert "Traceback" not in result.output and "cannot reach the API" not in result.output


def test_too_many_aliases_and_recursive_aliases_are_refused(tmp_path: Path) -> None:
    many = tmp_path / "many.yaml"
    many.write_text("name: x\nl: [&a 1, " + ", ".join(["*a"] * 101) + "]\n")
    with pytest.raises(CliError, match="more than 100 aliases"):
        load_spec_file(many)
    recursive = tmp_path / "rec.yaml"
    recursive.write_text("name: x\nl: &r [1, *r]\n")
    with pytest.raises(CliError, match="recursive"):
        load_spec_file(recursive)


def test_ordinary_anchors_still_work(tmp_path: Path) -> None:
    f = tmp_path / "s.yaml"
    f.write_text(
        "name: a\nmodel: tiny\n"
        "baseline:\n  workload: &w {num_requests: 4, concurrency: 1}\n"
        "variants:\n"
        "  - name: v\n    changes:\n      workload: {<<: *w, concurrency: 2}\n"
    )
    doc = load_spec_file(f)
    assert doc["variants"][0]["changes"]["workload"] == {"num_requests": 4, "concurrency": 2}


def test_size_cap_and_deep_nesting_are_one_line_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(specfile, "SPEC_FILE_MAX_BYTES", 1024)
    big = tmp_path / "big.yaml"
    big.write_text("name: x\n" + "# padding\n" * 200)
    with pytest.raises(CliError, match="larger than 1024 bytes"):
        load_spec_file(big)
    monkeypatch.undo()
    deep = tmp_path / "deep.yaml"
    deep.write_text("name: x\nd: " + "[" * 20000 + "]" * 20000 + "\n")
    deep_json = tmp_path / "deep.json"
    deep_json.write_text('{"d": ' + "[" * 100000 + "]" * 100000 + "}")
    for f in (deep, deep_json):
        result = CliRunner().invoke(app, ["submit", str(f), "--api", "http://127.0.0.1:9"])
        assert result.exit_code == 2, result.output
        assert "nested too deeply" in result.output and "Traceback" not in result.output


def test_unsafe_tags_stay_refused(tmp_path: Path) -> None:
    f = tmp_path / "tag.yaml"
    f.write_text("name: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(CliError, match="invalid YAML"):
        load_spec_file(f)
