"""Where the engine's python is on each node: the settings and how a node is matched.

``VLAB_ENGINE__PYTHON`` (every node), ``VLAB_ENGINE__PYTHON_BY_NODE`` (a JSON object
``{selector: absolute path}``: a selector is a node IP, Ray's ``NodeManagerAddress``,
or a Ray node label ``key=value``; the first match in the order written wins) and
``VLAB_ENGINE__IMAGE_URI`` (Ray's ``image_uri`` runtime_env; the shape of a reference
is Docker's: distribution/reference ``reference.go``, and Ray's own example
``rayproject/ray:2.39.0-py312-cu123`` in ``ray/runtime_env/runtime_env.py``).

The labels are in the shape ``ray.nodes()`` gives them in Ray 2.60: Ray's own
``ray.io/node-id`` next to the ones ``ray start --labels`` set (seen on this machine
with ``ray.cluster_utils.Cluster.add_node(labels={"vlab-engine": "b"})``).
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from orchestrator.core.settings import EngineSettings, Settings, node_selector_kind

NODE_ID = "b4d4c253bfb6174acf9192a5e48c2f23c5f45a6ef804c33886e9a1c5"
#: ``ray.nodes()[i]["Labels"]`` of a worker started with ``--labels='{"vlab-engine": "b"}'``
LABELS = {"ray.io/node-id": NODE_ID, "vlab-engine": "b"}


def test_by_node_from_the_environment_keeps_the_order_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLAB_ENGINE__PYTHON", "/opt/default/bin/python")
    monkeypatch.setenv(
        "VLAB_ENGINE__PYTHON_BY_NODE",
        '{"vlab-engine=b": "/opt/b/bin/python", "10.0.0.2": "/opt/ip/bin/python"}',
    )
    engine = Settings().engine
    assert list(engine.python_by_node) == ["vlab-engine=b", "10.0.0.2"]
    # a node that matches both: the first entry wins
    assert engine.python_for_node("10.0.0.2", LABELS) == (
        "/opt/b/bin/python",
        "VLAB_ENGINE__PYTHON_BY_NODE[vlab-engine=b]",
    )
    assert engine.python_for_node("10.0.0.2", {"ray.io/node-id": "x"}) == (
        "/opt/ip/bin/python",
        "VLAB_ENGINE__PYTHON_BY_NODE[10.0.0.2]",
    )
    # no entry matches: the default python
    assert engine.python_for_node("10.0.0.3", {}) == (
        "/opt/default/bin/python",
        "VLAB_ENGINE__PYTHON",
    )
    # the caller's default (the launch's absolute python) stands in for VLAB_ENGINE__PYTHON
    assert engine.python_for_node("10.0.0.3", None, "/abs/py") == ("/abs/py", "VLAB_ENGINE__PYTHON")
    assert engine.kind == "path"


def test_node_id_is_a_label_and_ips_compare_as_addresses() -> None:
    engine = EngineSettings(
        python_by_node={
            f"ray.io/node-id={NODE_ID}": "/opt/one/bin/python",
            "fd00::2": "/opt/v6/bin/python",
        }
    )
    assert engine.python_for_node("10.0.0.9", LABELS)[0] == "/opt/one/bin/python"
    assert engine.python_for_node("fd00:0::2", {})[0] == "/opt/v6/bin/python"
    # a label value that differs, or a label the node lacks, does not match
    assert engine.python_for_node("10.0.0.9", {"vlab-engine": "c"})[1] == "VLAB_ENGINE__PYTHON"
    # get_node_labels() in a Ray task may hand lists of values
    multi = EngineSettings(python_by_node={"zone=a": "/opt/a/bin/python"})
    assert multi.python_for_node(None, {"zone": ["b", "a"]})[0] == "/opt/a/bin/python"


@pytest.mark.parametrize(
    ("key", "kind"),
    [("10.0.0.2", "ip"), ("::1", "ip"), ("vlab-engine=b", "label"), ("ray.io/node-id=ab", "label")],
)
def test_selector_kinds(key: str, kind: str) -> None:
    assert node_selector_kind(key) == kind


@pytest.mark.parametrize(
    ("by_node", "said"),
    [
        ({"gpu-node-1": "/opt/x/bin/python"}, "neither a node IP"),
        ({"=b": "/opt/x/bin/python"}, "label selector is <label key>=<value>"),
        ({"10.0.0.2": "venv/bin/python"}, "not an absolute path"),
    ],
)
def test_bad_by_node_entries_are_refused_naming_them(by_node: dict[str, str], said: str) -> None:
    with pytest.raises(ValidationError) as info:
        EngineSettings(python_by_node=by_node)
    text = str(info.value)
    assert "VLAB_ENGINE__PYTHON_BY_NODE" in text and said in text
    assert next(iter(by_node)) in text


@pytest.mark.parametrize(
    "image",
    [
        "rayproject/ray:2.39.0-py312-cu123",  # Ray's own example (runtime_env.py)
        "registry.example.com:5000/vlab/engine:0.32",
        "ghcr.io/acme/vllm-engine@sha256:" + "0a" * 32,
        "localhost/vlab-engine:cpu",
    ],
)
def test_image_references_are_accepted(image: str) -> None:
    engine = EngineSettings(python="/opt/vllm/bin/python", image_uri=f"  {image} ")
    assert engine.image_uri == image
    assert engine.kind == "image"
    assert engine.python_for_node("10.0.0.2", {}) == ("/opt/vllm/bin/python", "VLAB_ENGINE__PYTHON")


@pytest.mark.parametrize(
    ("image", "said"),
    [
        ("docker://rayproject/ray:2.60.0", "without a scheme"),
        ("rayproject/ray:2.60.0 --privileged", "not a container image reference"),
        ("acme/Engine:1", "not a container image reference"),
        ("acme/engine:", "not a container image reference"),
    ],
)
def test_bad_image_references_are_refused(image: str, said: str) -> None:
    with pytest.raises(ValidationError, match=said):
        EngineSettings(python="/opt/vllm/bin/python", image_uri=image)


def test_empty_image_is_no_image(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLAB_ENGINE__IMAGE_URI", "")
    assert Settings().engine.image_uri is None


def test_image_needs_the_python_inside_it_and_no_per_node_paths() -> None:
    with pytest.raises(ValidationError, match="absolute path"):
        EngineSettings(image_uri="acme/engine:1")  # default python: .engine-venv/bin/python
    with pytest.raises(ValidationError, match="exclude each other"):
        EngineSettings(
            python="/opt/vllm/bin/python",
            image_uri="acme/engine:1",
            python_by_node={"10.0.0.2": "/opt/x/bin/python"},
        )


@pytest.mark.parametrize("blank", ["", "   "])
def test_an_empty_metrics_token_is_refused_not_an_open_door(
    monkeypatch: pytest.MonkeyPatch, blank: str
) -> None:
    """Trial of 2026-12-04: VLAB_API__METRICS_TOKEN= (set, empty) let an empty bearer in."""
    monkeypatch.setenv("VLAB_API__METRICS_TOKEN", blank)
    with pytest.raises(ValidationError, match="is empty"):
        Settings()
