"""Joining an existing Ray cluster (``RAY_ADDRESS``): address, authentication, and our code.

The run supervisor, the engine parts, the node probe and the model resolution are
Ray actors and tasks (:data:`REMOTE_MODULES`): every node that runs them imports
``jobs`` and ``orchestrator`` and the third-party packages ``jobs`` needs
(:data:`WORKER_REQUIREMENTS`). A cluster the service did not start may have Ray and
nothing else. :func:`join_cluster` therefore, before anything is placed:

1. refuses a Ray Client address (``ray://``) with the reason (:func:`refuse_ray_client`);
2. connects, turning Ray's authentication failure (a ``ConnectionError`` traceback
   whose cause is ``ray.exceptions.AuthenticationError``) into one line that says
   what to set (:func:`auth_problem`);
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
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import ray.cloudpickle
from ray.exceptions import AuthenticationError, RayError, RuntimeEnvSetupError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import jobs
from orchestrator.core.errors import RayClusterError
from orchestrator.core.settings import Settings
from orchestrator.dispatch.ray import nodefacts
from orchestrator.dispatch.ray.supervisor import NAMESPACE

__all__ = [
    "PACKAGES",
    "REMOTE_MODULES",
    "WORKER_REQUIREMENTS",
    "JoinReport",
    "auth_problem",
    "check_gcs_reachable",
    "ensure_nodes_ready",
    "forget",
    "init_ray",
    "join_cluster",
    "node_lacks",
    "plan_runtime_env",
    "refuse_ray_client",
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


def refuse_ray_client(address: str) -> None:
    """Raise :class:`RayClusterError` for a Ray Client address (``ray://host:10001``).

    The orchestrator is a long-running Ray driver: through Ray Client its runs' named
    supervisor actors live only as long as the client's connection (a drop longer than
    ``RAY_CLIENT_RECONNECT_GRACE_PERIOD``, 30 s by default in Ray 2.60
    ``ray_constants.DEFAULT_CLIENT_RECONNECT_GRACE_PERIOD``, ends the session and
    its actors: ray-project/ray#14618, #60600), and Ray Client cannot answer
    ``ray._private.state.available_resources_per_node()`` ("Ray has not been started
    yet"), so placement could not tell a busy node from a free one. It also needs
    ``ray[client]`` (grpcio), which the service does not install.
    """
    if address.strip().lower().startswith("ray://"):
        host = address.strip()[len("ray://") :].split(":")[0] or "<head>"
        raise RayClusterError(
            f"RAY_ADDRESS={address} is a Ray Client address, which vlab does not use: its "
            "runs' supervisor actors would end with the client connection (a drop of more "
            "than 30 s ends the session) and Ray Client cannot report each node's free "
            "devices, which placement needs; use the cluster's GCS address instead, "
            f"RAY_ADDRESS={host}:6379 (`ray start --head --port`; KubeRay: the head "
            "service's gcs-server port), from a machine the nodes can reach (e.g. the head)"
        )


#: Ray's words for a token failure (``ray/_private/authentication/authentication_constants.py``,
#: the gRPC status ``InvalidAuthToken``), as they appear in a wrapped traceback's text.
_AUTH_MARKERS = (
    "ray.exceptions.AuthenticationError",
    "InvalidAuthToken",
    "Token authentication is enabled but",
)


def _is_auth_failure(exc: BaseException) -> bool:
    cause: BaseException | None = exc
    for _ in range(10):
        if cause is None:
            return False
        if isinstance(cause, AuthenticationError) or any(m in str(cause) for m in _AUTH_MARKERS):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def auth_problem(exc: BaseException, address: str) -> str | None:
    """One line saying what to set when ``exc`` is Ray's token-authentication failure.

    Ray 2.60 raises ``ConnectionError("Failed to connect to Ray cluster at ...")`` whose
    cause is either ``ray.exceptions.AuthenticationError`` ("RPC error:
    InvalidAuthToken: Authentication token is missing or incorrect") or, after its GCS
    connection retries (``ray/_private/node.py``, ``_init_gcs_client``: about 20 s), a
    ``RuntimeError("Failed to connect to GCS. Last connection error: <traceback>")``
    whose text holds that ``AuthenticationError``; or the ``AuthenticationError``
    itself when ``RAY_AUTH_MODE=token`` and no token is found. With an explicit
    address Ray sends a token only when ``RAY_AUTH_MODE=token`` is set in this process
    (``ray._private.worker.init``: "an explicit address never" auto-enables auth); the
    token is read from ``RAY_AUTH_TOKEN``, else the file ``RAY_AUTH_TOKEN_PATH``, else
    ``~/.ray/auth_token``. Returns None for other errors.
    """
    if not _is_auth_failure(exc):
        return None
    mode = (os.environ.get("RAY_AUTH_MODE") or "").strip().lower()
    where = "`ray get-auth-token` on the head prints it"
    if mode != "token":
        if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
            return (
                f"the Ray cluster at {address} requires token authentication: set "
                "RAY_AUTH_MODE=token as well (a token is set, but Ray sends it to an "
                "explicit RAY_ADDRESS only in token mode)"
            )
        return (
            f"the Ray cluster at {address} requires token authentication: set "
            "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN=<the cluster's token> (or "
            "RAY_AUTH_TOKEN_PATH=<a file holding it>; default ~/.ray/auth_token; "
            f"{where})"
        )
    if os.environ.get("RAY_AUTH_TOKEN"):
        source = "RAY_AUTH_TOKEN"
    elif os.environ.get("RAY_AUTH_TOKEN_PATH"):
        source = f"RAY_AUTH_TOKEN_PATH={os.environ['RAY_AUTH_TOKEN_PATH']}"
    elif (Path.home() / ".ray" / "auth_token").is_file():
        source = str(Path.home() / ".ray" / "auth_token")
    else:
        return (
            f"RAY_AUTH_MODE=token but no token for the Ray cluster at {address}: set "
            "RAY_AUTH_TOKEN=<the cluster's token> (or RAY_AUTH_TOKEN_PATH=<a file holding "
            f"it>; default ~/.ray/auth_token; {where})"
        )
    return (
        f"the Ray cluster at {address} rejected the token from {source}: set the "
        f"cluster's token ({where})"
    )


#: Seconds to reach the GCS of ``RAY_ADDRESS`` before ``ray.init`` (which retries an
#: unreachable GCS for a long time, printing warnings).
GCS_CONNECT_TIMEOUT_S = 5.0


def _gcs_host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a GCS address ``host:port`` / ``[v6]:port``; None otherwise
    (``auto``, ``local``, no port: left to Ray)."""
    text = address.strip()
    if not text or text.lower() in ("auto", "local") or "://" in text:
        return None
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or ":" in host:
            return None
    try:
        port = int(port_text)
    except ValueError:
        return None
    return (host, port) if host and 0 < port < 65536 else None


#: HTTP/2's client connection preface and an empty SETTINGS frame (RFC 9113 section 3.4).
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def _speaks_http2(sock: socket.socket) -> bool:
    """Whether the server on ``sock`` answers HTTP/2's preface with a SETTINGS frame, as
    every gRPC server (Ray's GCS) does; a TLS GCS (``RAY_USE_TLS``) is not probed."""
    if (os.environ.get("RAY_USE_TLS") or "").strip().lower() in ("1", "true"):
        return True
    try:
        sock.sendall(_H2_PREFACE)
        head = b""
        while len(head) < 9:
            chunk = sock.recv(9 - len(head))
            if not chunk:
                return False
            head += chunk
    except OSError:
        return False
    return head[3] == 0x04  # frame type SETTINGS


def check_gcs_reachable(address: str, timeout_s: float = GCS_CONNECT_TIMEOUT_S) -> None:
    """Resolve and TCP-connect to the GCS that ``address`` names, within ``timeout_s``.

    Raises :class:`RayClusterError` (``cannot join the Ray cluster at HOST:PORT
    (RAY_ADDRESS): connection refused | name does not resolve | timed out``). No-op
    for ``auto``, ``local`` and addresses without a port.
    """
    target = _gcs_host_port(address)
    if target is None:
        return
    host, port = target
    where = f"cannot join the Ray cluster at {address.strip()} (RAY_ADDRESS)"
    # getaddrinfo has no timeout of its own: resolve in a daemon thread, bounded
    result: dict[str, Any] = {}

    def resolve() -> None:
        try:
            result["addrs"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            result["error"] = exc

    resolver = threading.Thread(target=resolve, name="vlab-gcs-resolve", daemon=True)
    resolver.start()
    resolver.join(timeout_s)
    if resolver.is_alive():
        raise RayClusterError(f"{where}: timed out resolving {host} after {timeout_s:g} s")
    if "error" in result or not result.get("addrs"):
        raise RayClusterError(f"{where}: name does not resolve ({host})")
    last = "connection refused"
    for family, kind, proto, _, sockaddr in result["addrs"]:
        sock = socket.socket(family, kind, proto)
        sock.settimeout(timeout_s)
        try:
            sock.connect(sockaddr)
            if not _speaks_http2(sock):
                raise RayClusterError(
                    f"{where}: what answers there is not a Ray GCS (it does not speak "
                    "HTTP/2, the protocol of Ray's gRPC; Redis, Postgres or a web server "
                    "on that port?): give the head's GCS address, `ray start --head "
                    "--port` (default 6379), not the Ray Client (10001) or dashboard port"
                )
            return
        except ConnectionRefusedError:
            last = "connection refused"
        except TimeoutError:
            last = f"timed out after {timeout_s:g} s"
        except OSError as exc:
            last = exc.strerror or type(exc).__name__
        finally:
            sock.close()
    raise RayClusterError(f"{where}: {last}")


def init_ray(
    address: str,
    runtime_env: dict[str, Any] | None = None,
    connect_timeout_s: float = GCS_CONNECT_TIMEOUT_S,
) -> None:
    """``ray.init`` on an existing cluster; Ray's connection failures become one line.

    The GCS is reached first (:func:`check_gcs_reachable`, ``connect_timeout_s``): an
    address nothing answers on fails at once instead of Ray's long retries. Raises
    :class:`RayClusterError` (unreachable; authentication: :func:`auth_problem`;
    anything else Ray raises while connecting: its first line).
    """
    check_gcs_reachable(address, connect_timeout_s)
    try:
        ray.init(
            address=address,
            namespace=NAMESPACE,
            runtime_env=runtime_env,
            log_to_driver=False,
            configure_logging=False,
        )
    except (ConnectionError, AuthenticationError, RuntimeError, ValueError) as exc:
        problem = auth_problem(exc, address)
        if problem is None:
            said = " ".join(str(exc).split())[:500] or type(exc).__name__
            problem = f"cannot join the Ray cluster at {address} (RAY_ADDRESS): {said}"
        raise RayClusterError(problem) from None


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
            unusable = [a for a in answers.values() if isinstance(a, str)]
            if unusable:  # the node did not even answer: shipping cannot help
                raise RayClusterError(
                    f"Ray cluster at {address}: cannot check every node: " + "; ".join(problems)
                )
            facts = {k: v for k, v in answers.items() if isinstance(v, dict)}
            runtime_env, code, pip = plan_runtime_env(facts, local)
            if runtime_env is None:  # nothing shipping could give them
                raise RayClusterError(
                    f"Ray cluster at {address}: not every node can run vlab's tasks: "
                    + "; ".join(problems)
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
        report.ready = {str(n["NodeID"]) for n in nodes}
    except BaseException:
        ray.shutdown()
        raise
    _joined = report
    log.info("%s", report.summary())
    return report


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
