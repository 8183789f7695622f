"""Joining an existing Ray cluster (``RAY_ADDRESS``): address, authentication, and our code.

The run supervisor, the engine parts, the node probe and the model resolution are
Ray actors and tasks (:data:`REMOTE_MODULES`): every node that runs them imports
``jobs`` and ``orchestrator`` and the third-party packages ``jobs`` needs
(:data:`WORKER_REQUIREMENTS`). A cluster the service did not start may have Ray and
nothing else. :func:`join_cluster` therefore, before anything is placed:

1. refuses a Ray Client address (``ray://``) with the reason
   (:func:`orchestrator.dispatch.ray.connect.refuse_ray_client`);
2. connects, turning Ray's authentication failure (a ``ConnectionError`` traceback
   whose cause is ``ray.exceptions.AuthenticationError``) into one line that says
   what to set (:func:`orchestrator.dispatch.ray.connect.auth_problem`);
3. asks every live node what it has (:func:`orchestrator.dispatch.ray.nodefacts.node_facts`,
   pickled by value: it runs where our packages are absent): the code digest of our
   packages and the version of each requirement;
4. with ``VLAB_ORCHESTRATOR__SHIP_TO_NODES=auto`` (default), reconnects with a
   job-level Ray ``runtime_env`` holding what any node lacks: ``py_modules`` with the
   ``jobs`` and ``orchestrator`` folders of this service (uploaded once to the GCS,
   content-addressed) when a node's code differs from ours, and ``pip`` with the
   requirements a node lacks or has at another version, pinned to this service's
   versions; then asks every node again, now importing :data:`REMOTE_MODULES`;
5. refuses (:class:`orchestrator.core.errors.RayClusterError`, one line) naming each
   node and what it lacks or why its environment could not be set up; with
   ``never`` it ships nothing and refuses a node that lacks anything.

Why ``pip`` for the third-party packages and ``py_modules`` only for ours: ours are
pure Python; ``numpy``, ``tokenizers``, ``pydantic-core`` and ``httptools`` are compiled
wheels, and only pip picks the wheel of each node's own platform and Python (copying
this service's site-packages would break on an ``aarch64`` node). They are pinned to
this service's versions because pydantic models cross the Ray boundary pickled. Ray
builds the pip environment once per node and requirement set, on top of the node's
own Python (``--system-site-packages``, so Ray itself is the node's); pip needs a
package index on the nodes (``PIP_INDEX_URL``/``PIP_FIND_LINKS`` in the nodes'
environment for a mirror); vlab keeps pip's cache (Ray's default options pass
``--no-cache-dir``). Nodes whose Python already has our code at this digest and the
requirements at these versions (vlab installed on them) get nothing shipped.

A node that joins later is checked before the first run placed on it
(:func:`ensure_nodes_ready`). Local Ray (no ``RAY_ADDRESS``) is started by the
service from its own environment: nothing is checked or shipped.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import ray.cloudpickle
from ray.exceptions import RayError, RuntimeEnvSetupError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import jobs
from orchestrator.core.errors import RayClusterError
from orchestrator.core.settings import Settings
from orchestrator.dispatch.ray import nodefacts
from orchestrator.dispatch.ray.connect import init_ray, refuse_ray_client

__all__ = [
    "PACKAGES",
    "REMOTE_MODULES",
    "WORKER_REQUIREMENTS",
    "JoinReport",
    "ensure_nodes_ready",
    "forget",
    "join_cluster",
    "node_lacks",
    "plan_runtime_env",
]

log = logging.getLogger(__name__)

#: Our packages Ray workers import (shipped as ``py_modules``).
PACKAGES = ("jobs", "orchestrator")

#: Modules whose functions and actor classes Ray runs on the nodes (pickled by reference).
REMOTE_MODULES = (
    "orchestrator.dispatch.ray.supervisor",
    "orchestrator.dispatch.ray.probe",
    "orchestrator.dispatch.ray.model_locator",
)

#: Distributions :data:`REMOTE_MODULES` import beyond Ray and the standard library
#: (``tests/orchestrator/dispatch/test_join.py`` checks this against their imports);
#: ``nvidia-ml-py`` is imported where present (NVML telemetry, else ``nvidia-smi``);
#: ``uvicorn`` runs the stub server the load generator is calibrated against
#: (jobs.load.loadceiling).
WORKER_REQUIREMENTS = (
    "httptools",
    "httpx",
    "numpy",
    "nvidia-ml-py",
    "prometheus-client",
    "pydantic",
    "pydantic-settings",
    "tokenizers",
    "uvicorn",
)

#: pip options of the shipped environment: Ray's default adds ``--no-cache-dir``.
PIP_INSTALL_OPTIONS = ["--disable-pip-version-check"]


@dataclass
class JoinReport:
    """What :func:`join_cluster` found and shipped.

    Attributes:
        address: the ``RAY_ADDRESS`` joined.
        mode: ``auto`` or ``never`` (``VLAB_ORCHESTRATOR__SHIP_TO_NODES``).
        runtime_env: the job-level runtime environment set (None: nothing shipped).
        shipped_code: our packages shipped as ``py_modules`` (empty: none).
        pip: pinned requirements shipped with ``pip`` (empty: none).
        nodes: per node checked: ``node_id``, ``ip``, ``hostname``, ``python``,
            ``lacked`` (what it lacked before shipping, human-readable).
        ready: node ids checked and able to run our tasks.
    """

    address: str
    mode: str
    runtime_env: dict[str, Any] | None = None
    shipped_code: list[str] = field(default_factory=list)
    pip: list[str] = field(default_factory=list)
    nodes: list[dict[str, Any]] = field(default_factory=list)
    ready: set[str] = field(default_factory=set)

    def summary(self) -> str:
        """One line for the start-up log."""
        shipped = []
        if self.shipped_code:
            shipped.append(f"py_modules {', '.join(self.shipped_code)}")
        if self.pip:
            shipped.append(f"pip {', '.join(self.pip)}")
        what = (
            "shipped " + " and ".join(shipped) + " with Ray's runtime_env"
            if shipped
            else "shipped nothing (every node has this service's code and requirements)"
        )
        names = ", ".join(f"{n['ip']} ({n['hostname']})" for n in self.nodes)
        return f"Ray cluster at {self.address}: {what}; {len(self.nodes)} node(s) ready: {names}"


#: The cluster this process joined (None: a local Ray, or not connected).
_joined: JoinReport | None = None


def forget() -> None:
    """Drop the record of the joined cluster (on disconnect)."""
    global _joined
    _joined = None


def local_environment() -> dict[str, Any]:
    """This service's side: our package folders and digests, requirement versions, Python."""
    # this file is orchestrator/dispatch/ray/join.py
    dirs = {"jobs": Path(jobs.__file__).parent, "orchestrator": Path(__file__).resolve().parents[2]}
    versions: dict[str, str | None] = {}
    for dist in WORKER_REQUIREMENTS:
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None  # not installed here either: nothing to pin
    return {
        "packages": {
            name: {"path": str(d), "digest": nodefacts.code_digest(d)} for name, d in dirs.items()
        },
        "dists": versions,
        "python": platform.python_version(),
    }


def node_lacks(facts: dict[str, Any], local: dict[str, Any]) -> list[str]:
    """What a node lacks to run our tasks, compared with this service (empty: nothing).

    Each item is human-readable: our code absent or different (``jobs`` found at a path
    whose digest differs), a requirement absent or at another version (the pin it
    needs), a Python of another minor version, an import that failed.
    """
    lacks: list[str] = []
    py_here = ".".join(str(local["python"]).split(".")[:2])
    py_there = ".".join(str(facts.get("python") or "").split(".")[:2])
    if py_there and py_there != py_here:
        lacks.append(f"Python {py_here} (has {facts.get('python')})")
    missing = [p for p in PACKAGES if not (facts.get("packages") or {}).get(p, {}).get("path")]
    if missing:
        lacks.append(f"vlab's code ({', '.join(missing)}: not importable)")
    for name in PACKAGES:
        there = (facts.get("packages") or {}).get(name) or {}
        if there.get("path") and there.get("digest") != local["packages"][name]["digest"]:
            lacks.append(f"this service's {name} (imports {there['path']}, whose code differs)")
    for dist, version in local["dists"].items():
        if version is None:
            continue
        has = (facts.get("dists") or {}).get(dist)
        if has != version:
            lacks.append(f"{dist}=={version} ({'absent' if has is None else 'has ' + has})")
    if not lacks:  # an import fails although code and requirements match: say why
        for module, error in (facts.get("import_errors") or {}).items():
            lacks.append(f"import {module} ({error})")
    return lacks


def plan_runtime_env(
    facts: dict[str, dict[str, Any]], local: dict[str, Any]
) -> tuple[dict[str, Any] | None, list[str], list[str]]:
    """The job-level ``runtime_env`` that gives every node what it lacks.

    Returns ``(runtime_env or None, packages shipped as py_modules, pip pins)``: our
    packages when any node's code is absent or differs (both, always together: they
    import each other), and ``dist==version`` for each requirement some node lacks
    or has at another version.
    """
    ship_code = False
    pins: dict[str, str] = {}
    for doc in facts.values():
        packages = doc.get("packages") or {}
        for name in PACKAGES:
            if (packages.get(name) or {}).get("digest") != local["packages"][name]["digest"]:
                ship_code = True
        for dist, version in local["dists"].items():
            if version is not None and (doc.get("dists") or {}).get(dist) != version:
                pins[dist] = f"{dist}=={version}"
    env: dict[str, Any] = {}
    code = list(PACKAGES) if ship_code else []
    if code:
        env["py_modules"] = [local["packages"][name]["path"] for name in code]
    pip = [pins[d] for d in sorted(pins)]
    if pip:
        env["pip"] = {
            "packages": pip,
            "pip_check": False,
            "pip_install_options": list(PIP_INSTALL_OPTIONS),
        }
    return (env or None), code, pip


def _node_name(node: dict[str, Any], facts: dict[str, Any] | None) -> str:
    """``<ip> (host <hostname>, Ray node <id>, python <executable>)``."""
    ip = node.get("NodeManagerAddress") or "?"
    parts = [f"host {facts['hostname']}"] if facts and facts.get("hostname") else []
    parts.append(f"Ray node {str(node.get('NodeID'))[:12]}")
    if facts and facts.get("executable"):
        parts.append(f"python {facts['executable']}")
    return f"{ip} ({', '.join(parts)})"


def _setup_error(exc: RuntimeEnvSetupError) -> str:
    """The useful lines of Ray's runtime-env failure (pip's ``ERROR:`` lines, else the tail)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "ERROR" in ln or "No matching distribution" in ln]
    picked = errors[-3:] if errors else lines[-3:]
    return " / ".join(picked)[:1500]


def _ask_nodes(
    nodes: list[dict[str, Any]], modules: list[str], timeout_s: float
) -> dict[str, dict[str, Any] | str]:
    """Run :func:`nodefacts.node_facts` on each node; ``{node_id: facts | error text}``."""
    if not nodes:
        return {}
    ray.cloudpickle.register_pickle_by_value(nodefacts)
    remote = ray.remote(num_cpus=0, max_retries=0)(nodefacts.node_facts)
    refs = {
        str(n["NodeID"]): remote.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(str(n["NodeID"]), soft=False),
            name="vlab-node-check",
        ).remote(list(PACKAGES), list(WORKER_REQUIREMENTS), modules)
        for n in nodes
    }
    _, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    answers: dict[str, dict[str, Any] | str] = {}
    for node_id, ref in refs.items():
        if ref in pending:
            ray.cancel(ref, force=True)
            answers[node_id] = (
                f"did not answer within {timeout_s:g} s (VLAB_ORCHESTRATOR__NODE_SETUP_TIMEOUT_S;"
                " a pip install still running? see runtime_env_setup-*.log in the node's "
                "Ray session logs)"
            )
            continue
        try:
            answers[node_id] = dict(ray.get(ref))
        except RuntimeEnvSetupError as exc:
            answers[node_id] = "could not set up the runtime environment: " + _setup_error(exc)
        except RayError as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            answers[node_id] = f"{type(exc).__name__}: {first}"[:1500]
    return answers


def _live_nodes(node_ids: list[str] | None = None) -> list[dict[str, Any]]:
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if node_ids is not None:
        wanted = set(node_ids)
        nodes = [n for n in nodes if str(n["NodeID"]) in wanted]
    return nodes


def _problems(
    nodes: list[dict[str, Any]], answers: dict[str, dict[str, Any] | str], local: dict[str, Any]
) -> tuple[list[str], list[dict[str, Any]]]:
    """Per node: one problem text (or none) and the node's record for the report."""
    problems: list[str] = []
    records: list[dict[str, Any]] = []
    for node in nodes:
        answer = answers.get(str(node["NodeID"]), "gave no answer")
        facts = answer if isinstance(answer, dict) else None
        name = _node_name(node, facts)
        if facts is None:
            problems.append(f"node {name} {answer}")
            continue
        lacks = node_lacks(facts, local)
        if lacks:
            problems.append(f"node {name} lacks {', '.join(lacks)}")
        records.append(
            {
                "node_id": str(node["NodeID"]),
                "ip": node.get("NodeManagerAddress"),
                "hostname": facts.get("hostname"),
                "python": facts.get("python"),
                "lacked": lacks,
            }
        )
    return problems, records


def join_cluster(settings: Settings) -> JoinReport:
    """Connect to ``settings.ray_address`` and make sure every live node can run our tasks.

    See the module docstring for the steps. Returns the :class:`JoinReport` (also kept
    for :func:`ensure_nodes_ready`). Raises :class:`RayClusterError` (one line) for a
    Ray Client address, a failed connection or authentication, or nodes that lack what
    our tasks need (naming each node and what it lacks); Ray is disconnected then.
    """
    global _joined
    address = str(settings.ray_address)
    refuse_ray_client(address)
    mode = settings.orchestrator.ship_to_nodes
    timeout_s = settings.orchestrator.node_setup_timeout_s
    connect_s = settings.orchestrator.ray_connect_timeout_s
    init_ray(address, connect_timeout_s=connect_s)
    try:
        local = local_environment()
        nodes = _live_nodes()
        modules = list(REMOTE_MODULES)
        answers = _ask_nodes(nodes, modules, timeout_s)
        problems, records = _problems(nodes, answers, local)
        report = JoinReport(address=address, mode=mode, nodes=records)
        if problems and mode == "never":
            raise RayClusterError(
                f"Ray cluster at {address}: {len(problems)} of {len(nodes)} node(s) cannot run "
                "vlab's tasks and VLAB_ORCHESTRATOR__SHIP_TO_NODES=never ships nothing: "
                + "; ".join(problems)
                + "; install them in the nodes' Python, or set "
                "VLAB_ORCHESTRATOR__SHIP_TO_NODES=auto to ship them with Ray's runtime_env"
            )
        if problems:
            nodes = _ship(report, answers, problems, local, connect_s, timeout_s)
        report.ready = {str(n["NodeID"]) for n in nodes}
    except BaseException:
        ray.shutdown()
        raise
    _joined = report
    log.info("%s", report.summary())
    return report


def _ship(
    report: JoinReport,
    answers: dict[str, dict[str, Any] | str],
    problems: list[str],
    local: dict[str, Any],
    connect_s: float,
    timeout_s: float,
) -> list[dict[str, Any]]:
    """Step 4 of :func:`join_cluster`: reconnect with a ``runtime_env`` holding what the
    nodes lack (recorded in ``report``) and ask every node again; the live nodes then.
    Raises :class:`RayClusterError` when shipping cannot help or did not."""
    address = report.address
    modules = list(REMOTE_MODULES)
    unusable = [a for a in answers.values() if isinstance(a, str)]
    if unusable:  # the node did not even answer: shipping cannot help
        raise RayClusterError(
            f"Ray cluster at {address}: cannot check every node: " + "; ".join(problems)
        )
    facts = {k: v for k, v in answers.items() if isinstance(v, dict)}
    runtime_env, code, pip = plan_runtime_env(facts, local)
    if runtime_env is None:  # nothing shipping could give them
        raise RayClusterError(
            f"Ray cluster at {address}: not every node can run vlab's tasks: " + "; ".join(problems)
        )
    report.runtime_env, report.shipped_code, report.pip = runtime_env, code, pip
    log.info(
        "Ray cluster at %s: nodes lack %s; shipping %s",
        address,
        "; ".join(problems),
        runtime_env,
    )
    ray.shutdown()
    init_ray(address, runtime_env, connect_timeout_s=connect_s)
    nodes = _live_nodes()
    answers = _ask_nodes(nodes, modules, timeout_s)
    still, _ = _problems(nodes, answers, local)
    if still:
        shipped = " and ".join(
            x
            for x in (
                f"py_modules {', '.join(code)}" if code else "",
                f"pip {', '.join(pip)}" if pip else "",
            )
            if x
        )
        raise RayClusterError(
            f"Ray cluster at {address}: vlab shipped {shipped or 'nothing'} with Ray's "
            "runtime_env, but not every node can run vlab's tasks: "
            + "; ".join(still)
            + (
                f" (Ray puts the service's working directory {os.getcwd()} on the "
                "workers' path: start vlab from a directory without jobs/ or "
                "orchestrator/)"
                if any("whose code differs" in p for p in still)
                else ""
            )
        )
    return nodes


def ensure_nodes_ready(node_ids: list[str], timeout_s: float) -> None:
    """Check nodes that joined after start-up before a run is placed on them.

    No-op on a local Ray and for nodes already checked. Raises
    :class:`RayClusterError` naming each node and what it lacks (under the runtime
    environment already shipped, which Ray sets up on the new node for the check).
    """
    joined = _joined
    if joined is None:
        return
    new = [n for n in node_ids if n not in joined.ready]
    if not new:
        return
    nodes = _live_nodes(new)
    local = local_environment()
    answers = _ask_nodes(nodes, list(REMOTE_MODULES), timeout_s)
    problems, records = _problems(nodes, answers, local)
    if problems:
        raise RayClusterError(
            f"Ray cluster at {joined.address}: node(s) that joined after start-up cannot run "
            "vlab's tasks: " + "; ".join(problems)
        )
    joined.nodes.extend(records)
    joined.ready.update(str(n["NodeID"]) for n in nodes)
