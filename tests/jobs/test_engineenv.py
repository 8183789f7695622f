"""What a node has of the engine environment: a stat of its python, and its packages.

``engine_env_facts`` runs nothing: the shapes are a venv's python (a symlink to the
base interpreter, as ``python -m venv`` makes it), one whose base is gone (a dangling
link: the venv was copied without its interpreter), a file without the execute bit and
a folder given by mistake. The packages' digest is the launcher's (``fingerprint``'s
``engine_env``), computed with ``importlib.metadata`` in the engine's own interpreter.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

from jobs.engine.command import LAUNCHER_PATH
from jobs.engine.envfacts import engine_env_facts
from orchestrator.cluster.parity_engineenv import engine_env_problem


def test_a_venv_python_is_there(tmp_path: Path) -> None:
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)
    facts = engine_env_facts(str(python), source="VLAB_ENGINE__PYTHON")
    assert facts == {
        "kind": "path",
        "python": str(python),
        "source": "VLAB_ENGINE__PYTHON",
        "exists": True,
        "is_file": True,
        "executable": True,
    }
    assert engine_env_problem(facts) is None


def test_absent_dangling_not_executable_and_folder(tmp_path: Path) -> None:
    absent = engine_env_facts("/nonexistent/bin/python", source="S")
    assert absent["exists"] is False and absent["is_file"] is None
    assert engine_env_problem(absent) == (
        "engine python /nonexistent/bin/python does not exist on this node (S)"
    )
    dangling = tmp_path / "python"
    dangling.symlink_to(tmp_path / "gone" / "python3.11")
    assert engine_env_facts(str(dangling))["exists"] is False
    plain = tmp_path / "python-noexec"
    plain.write_text("#!/bin/sh\n")
    plain.chmod(0o644)
    facts = engine_env_facts(str(plain))
    assert facts["executable"] is False  # root too: X_OK needs an execute bit
    assert "is not executable" in str(engine_env_problem(facts))
    folder = engine_env_facts(str(tmp_path))
    assert folder["exists"] is True and folder["is_file"] is False
    assert "is not a file" in str(engine_env_problem(folder))


def test_an_image_is_reported_as_such() -> None:
    facts = engine_env_facts("/opt/vllm/bin/python", kind="image", image_uri="acme/engine:1")
    assert facts["kind"] == "image" and facts["image_uri"] == "acme/engine:1"


def test_the_launchers_packages_digest_is_name_version_lines() -> None:
    """The launcher run by this interpreter reports the digest of the ``name==version``
    lines the same interpreter lists (a separate process: the test's own ``sys.path``
    is pytest's)."""
    proc = subprocess.run(
        [sys.executable, str(LAUNCHER_PATH), "fingerprint"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    engine_env = json.loads(proc.stdout.strip().splitlines()[-1])["engine_env"]
    listed = subprocess.run(
        [sys.executable, "-c", _LIST_DISTRIBUTIONS],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    lines = json.loads(listed)
    assert len(lines) > 10 and all(re.fullmatch(r"[a-z0-9-]+==\S+", ln) for ln in lines)
    text = "".join(f"{ln}\n" for ln in sorted(lines, key=lambda ln: ln.split("==")[0]))
    assert engine_env == {
        "digest": "sha256:" + hashlib.sha256(text.encode()).hexdigest(),
        "distributions": len(lines),
    }


_LIST_DISTRIBUTIONS = """
import importlib.metadata, json, re
seen = {}
for dist in importlib.metadata.distributions():
    name = re.sub(r"[-_.]+", "-", str(dist.metadata["Name"] or "")).lower()
    if name and name not in seen:
        seen[name] = str(dist.version)
print(json.dumps([f"{n}=={v}" for n, v in seen.items()]))
"""
