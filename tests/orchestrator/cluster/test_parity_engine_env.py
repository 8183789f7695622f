"""The engine environment in the parity check: present on every node, the same everywhere.

Fingerprints carry ``engine_env`` in the shape the probe gives it
(:func:`jobs.engine.envfacts.engine_env_facts` on the node, plus the launcher's
``{"digest", "distributions"}``; the digest below is the one ``jobs/launcher/vllm_launcher.py
fingerprint`` printed for this machine's ``.engine-venv``: vLLM 0.32.0 CPU build, 149
distributions). A container image that Ray cannot start on a node is reported as Ray's
image plugin words it: ``RuntimeError("Podman command failed: cmd=..., returncode=...,
stdout=..., stderr=...")`` (``ray/_private/runtime_env/image_uri.py``, ``_create_impl``,
Ray 2.60), wrapped by ``RuntimeEnvSetupError``.
"""

from __future__ import annotations

from typing import Any

from orchestrator.cluster.parity import check_parity, rules_for
from orchestrator.cluster.parity_engineenv import engine_env_problem, engine_only, is_pinned

DIGEST = "sha256:c3ec27dade49c1193f053bcf933230b9cae874d794e1dc79dfaa39bdd54ac684"
IMAGE = "registry.example.com/vlab/engine:0.32"
PINNED = "registry.example.com/vlab/engine@sha256:" + "4f" * 32


def _env(python: str = "/opt/vllm/bin/python", **extra: Any) -> dict[str, Any]:
    env: dict[str, Any] = {
        "kind": "path",
        "python": python,
        "source": "VLAB_ENGINE__PYTHON",
        "exists": True,
        "is_file": True,
        "executable": True,
        "digest": DIGEST,
        "distributions": 149,
    }
    env.update(extra)
    return env


def _node(name: str, ip: str, engine_env: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
    node: dict[str, Any] = {
        "node": name,
        "ip": ip,
        "python": "3.11.7",
        "ray": "2.60.0",
        "vllm": "0.32.0",
        "torch": "2.13.0+cpu",
    }
    if engine_env is not None:
        node["engine_env"] = engine_env
    node.update(extra)
    return node


def _missing(python: str, source: str) -> dict[str, Any]:
    """What the probe reports for a python that is not on the node (nothing was run)."""
    return {
        "kind": "path",
        "python": python,
        "source": source,
        "exists": False,
        "is_file": None,
        "executable": False,
    }


def _verdicts(report: dict[str, Any], field: str) -> dict[str, str]:
    return {e["rule"]: e["verdict"] for e in report["evaluations"] if e["field"] == field}


def test_same_engine_everywhere_is_ok_and_every_field_has_a_rule() -> None:
    nodes = [
        _node("rank0:a", "10.0.0.1", _env()),
        _node("rank1:b", "10.0.0.2", _env("/srv/vllm/bin/python", source="X")),
    ]
    report = check_parity(nodes)
    assert report["verdict"] == "ok", report["mismatches"]
    assert report["warnings"] == []
    assert report["unchecked_fields"] == []
    # the python may be somewhere else on each node: reported, never compared
    assert _verdicts(report, "engine_env.python") == {"engine_env_where": "ignored"}
    assert _verdicts(report, "engine_env") == {"engine_env": "ok"}
    assert _verdicts(report, "engine_env.digest") == {"engine_env_packages": "ok"}


def test_missing_engine_blocks_naming_the_node_and_the_path() -> None:
    source = "VLAB_ENGINE__PYTHON_BY_NODE[vlab-engine=broken]"
    nodes = [
        _node("rank0:a", "10.0.0.1", _env()),
        engine_only(_node("rank1:b", "10.0.0.2", _missing("/nonexistent/bin/python", source))),
    ]
    report = check_parity(nodes)
    assert report["verdict"] == "blocked"
    first = report["mismatches"][0]
    assert first["field"] == "engine_env" and first["rule_name"] == "engine_env"
    assert first["odd_nodes"] == ["rank1:b"]
    problem = first["problems"]["rank1:b"]
    assert "/nonexistent/bin/python does not exist on this node" in problem
    assert source in problem
    assert first["values"]["rank1:b"]["python"] == "/nonexistent/bin/python"
    # nothing else is blamed on the node without an engine: its packages were not read
    assert [m["field"] for m in report["mismatches"]] == ["engine_env"]
    digest = [u for u in report["unknown"] if u["field"] == "engine_env.digest"]
    assert digest and digest[0]["not_captured_on"] == ["rank1:b"]


def test_missing_engine_on_rank0_still_names_rank0() -> None:
    """With two nodes a tie decides nothing: the per-node rule names the node without it."""
    nodes = [
        engine_only(_node("rank0:a", "10.0.0.1", _missing("/opt/vllm/bin/python", "X"))),
        _node("rank1:b", "10.0.0.2", _env()),
    ]
    report = check_parity(nodes)
    (finding,) = report["mismatches"]
    assert finding["odd_nodes"] == ["rank0:a"]


def test_not_a_file_and_not_executable_are_problems() -> None:
    assert "is not a file" in str(engine_env_problem(_env(is_file=False, executable=False)))
    assert "is not executable" in str(engine_env_problem(_env(executable=False)))
    assert engine_env_problem(_env()) is None
    assert engine_env_problem(None) is None


def test_different_vllm_versions_block_with_the_version_rule() -> None:
    nodes = [
        _node("rank0:a", "10.0.0.1", _env()),
        _node("rank1:b", "10.0.0.2", _env(digest="sha256:" + "11" * 32), vllm="0.31.1"),
    ]
    report = check_parity(nodes)
    assert report["verdict"] == "blocked"
    (vllm,) = [m for m in report["mismatches"] if m["field"] == "vllm"]
    assert vllm["values"] == {"rank0:a": "0.32.0", "rank1:b": "0.31.1"}
    assert vllm["rule_name"] == "vllm"
    # the packages differ too: a warning of its own, every rule evaluated
    (packages,) = [w for w in report["warnings"] if w["field"] == "engine_env.digest"]
    assert packages["rule_name"] == "engine_env_packages"
    assert _verdicts(report, "engine_env") == {"engine_env": "ok"}


def test_different_torch_builds_block() -> None:
    nodes = [
        _node("rank0:a", "10.0.0.1", _env()),
        _node("rank1:b", "10.0.0.2", _env(), torch="2.13.0+cu128"),
    ]
    report = check_parity(nodes)
    assert [m["field"] for m in report["mismatches"]] == ["torch"]


def test_an_image_on_one_node_and_a_path_on_another_blocks() -> None:
    image = _env(kind="image", image_uri=PINNED)
    path = _env(image_uri=None)  # a python on the node: no image
    report = check_parity([_node("rank0:a", "10.0.0.1", image), _node("rank1:b", "10.0.0.2", path)])
    assert report["verdict"] == "blocked"
    fields = {m["field"]: m for m in report["mismatches"]}
    assert set(fields) == {"engine_env.kind", "engine_env.image_uri"}
    assert fields["engine_env.kind"]["values"] == {"rank0:a": "image", "rank1:b": "path"}
    assert fields["engine_env.kind"]["rule_name"] == "engine_env_kind"
    assert fields["engine_env.image_uri"]["values"] == {"rank0:a": PINNED, "rank1:b": None}


def test_two_images_block_and_a_tag_warns() -> None:
    a = _env(kind="image", image_uri=IMAGE)
    b = _env(kind="image", image_uri=IMAGE.replace("0.32", "0.31"))
    report = check_parity([_node("rank0:a", "10.0.0.1", a), _node("rank1:b", "10.0.0.2", b)])
    (m,) = report["mismatches"]
    assert m["field"] == "engine_env.image_uri" and m["rule_name"] == "engine_env_kind"
    verdicts = {v["rule"]: v["verdict"] for v in m["rules"]}
    assert verdicts == {"engine_env_kind": "blocking", "engine_image_pinned": "warning"}
    assert "pin it by digest" in m["problems"]["rank0:a"]
    # the same image by digest on every node: ok, no warning
    same = _env(kind="image", image_uri=PINNED)
    report = check_parity([_node("rank0:a", "10.0.0.1", same), _node("rank1:b", "10.0.0.2", same)])
    assert report["verdict"] == "ok" and report["warnings"] == []
    assert is_pinned(PINNED) and not is_pinned(IMAGE)


def test_image_that_does_not_start_blocks_with_rays_words() -> None:
    said = (
        "Ray could not set up the runtime environment: RuntimeError: Podman command "
        "failed: cmd=['podman', 'run', '--rm', ...], returncode=125, stdout=, "
        "stderr=Error: initializing source docker://registry.example.com/vlab/engine:0.32: "
        "manifest unknown"
    )
    broken = {
        "kind": "image",
        "python": "/opt/vllm/bin/python",
        "source": "VLAB_ENGINE__PYTHON",
        "image_uri": IMAGE,
        "error": said,
    }
    nodes = [
        _node("rank0:a", "10.0.0.1", _env(kind="image", image_uri=IMAGE)),
        engine_only(_node("rank1:b", "10.0.0.2", broken)),
    ]
    report = check_parity(nodes)
    first = report["mismatches"][0]
    assert first["field"] == "engine_env" and first["odd_nodes"] == ["rank1:b"]
    assert first["problems"]["rank1:b"].startswith(
        f"engine environment in the image {IMAGE} not usable on this node: Ray could not"
    )


def test_a_node_that_did_not_report_its_engine_is_unknown_never_ok() -> None:
    nodes = [_node("rank0:a", "10.0.0.1", _env()), _node("rank1:b", "10.0.0.2", None)]
    report = check_parity(nodes)
    assert report["mismatches"] == []  # nothing known against it...
    assert report["verdict"] == "unknown"  # ...but not ok
    assert _verdicts(report, "engine_env") == {"engine_env": "unknown"}
    assert any(r.startswith("engine_env: engine_env undecided") for r in report["verdict_reasons"])
    unknown = {(u["field"], u["rule"]) for u in report["unknown"]}
    assert ("engine_env", "engine_env") in unknown
    assert ("engine_env.kind", "engine_env_kind") in unknown


def test_engine_fields_are_matched_by_their_rules() -> None:
    assert [r.name for r in rules_for("engine_env")] == ["engine_env"]
    assert [r.name for r in rules_for("engine_env.image_uri")] == [
        "engine_env_kind",
        "engine_image_pinned",
    ]
    assert [r.name for r in rules_for("engine_env.exists")] == ["engine_env_where"]
