"""Joining an existing Ray cluster, without a cluster: the rules of
:mod:`orchestrator.dispatch.ray.join` and :mod:`orchestrator.dispatch.ray.nodefacts`.

The end-to-end join (``ray start`` nodes with Ray only, ``vlab up``, runs through REST)
is ``tests/test_external_ray_cluster.py``; here: the Ray Client refusal, the one-line
authentication messages for every shape Ray 2.60 raises, what a node lacks and what is
shipped for it, the node check pickled by value, and the list of requirements shipped
against what the remote modules import.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import hpack
import pytest
import ray.cloudpickle
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import RequestReceived, StreamEnded
from hyperframe.frame import ContinuationFrame, HeadersFrame, SettingsFrame
from ray.exceptions import AuthenticationError

from orchestrator.core.errors import RayClusterError
from orchestrator.dispatch.ray import connect, join, nodefacts
from orchestrator.dispatch.ray.connect import auth_problem, refuse_ray_client
from orchestrator.dispatch.ray.join import (
    PACKAGES,
    REMOTE_MODULES,
    WORKER_REQUIREMENTS,
    local_environment,
    node_lacks,
    plan_runtime_env,
)

ADDRESS = "10.1.2.3:6379"

# What Ray 2.60 raises when the driver sends no (or a wrong) token, as seen against a
# `ray start --head` with RAY_AUTH_MODE=token (tests/test_external_ray_cluster.py):
# ray/_private/worker.py `init` -> ConnectionError from ray/_private/node.py
# `_init_gcs_client`'s RuntimeError, which holds the last AuthenticationError's traceback.
GCS_RETRY_TEXT = (
    "Failed to connect to GCS. Last connection error: Traceback (most recent call last):\n"
    '  File ".../ray/_private/node.py", line 996, in _init_gcs_client\n'
    "    client = GcsClient(\n"
    '  File "python/ray/includes/common.pxi", line 119, in ray._raylet.check_status\n'
    "ray.exceptions.AuthenticationError: RPC error: InvalidAuthToken: Authentication token "
    "is missing or incorrect. Note: RAY_AUTH_MODE is currently 'disabled' (not 'token').\n"
)


def _connection_error(cause: BaseException) -> ConnectionError:
    try:
        raise ConnectionError("Failed to connect to Ray cluster at 192.0.2.2:45227") from cause
    except ConnectionError as exc:
        return exc


@pytest.fixture
def no_ray_auth(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token
    return monkeypatch


def test_a_ray_client_address_is_refused_with_the_reason() -> None:
    with pytest.raises(RayClusterError) as err:
        refuse_ray_client("ray://raycluster-head-svc:10001")
    text = err.value.detail
    assert "RAY_ADDRESS=ray://raycluster-head-svc:10001 is a Ray Client address" in text
    assert "RAY_ADDRESS=raycluster-head-svc:6379" in text
    assert "\n" not in text
    for fine in ("10.0.0.5:6379", "auto", "raycluster-head-svc:6379"):
        refuse_ray_client(fine)


@pytest.mark.parametrize(
    "raised",
    [
        _connection_error(RuntimeError(GCS_RETRY_TEXT)),
        _connection_error(AuthenticationError("RPC error: InvalidAuthToken: missing")),
    ],
    ids=["gcs-retries-text", "authentication-error-cause"],
)
def test_auth_failure_without_a_token_says_what_to_set(
    raised: BaseException, no_ray_auth: pytest.MonkeyPatch
) -> None:
    line = auth_problem(raised, ADDRESS)
    assert line is not None and "\n" not in line
    assert line.startswith(f"the Ray cluster at {ADDRESS} requires token authentication")
    assert "set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN=<the cluster's token>" in line
    assert "RAY_AUTH_TOKEN_PATH" in line and "~/.ray/auth_token" in line


def test_auth_failure_with_a_token_but_no_mode(no_ray_auth: pytest.MonkeyPatch) -> None:
    no_ray_auth.setenv("RAY_AUTH_TOKEN", "abc")
    line = auth_problem(_connection_error(RuntimeError(GCS_RETRY_TEXT)), ADDRESS)
    assert line is not None and "set RAY_AUTH_MODE=token as well" in line


def test_auth_failure_with_a_wrong_token_names_where_it_came_from(
    no_ray_auth: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    raised = _connection_error(RuntimeError(GCS_RETRY_TEXT))
    no_ray_auth.setenv("RAY_AUTH_MODE", "token")
    no_ray_auth.setenv("RAY_AUTH_TOKEN", "wrong")
    assert f"the Ray cluster at {ADDRESS} rejected the token from RAY_AUTH_TOKEN" in str(
        auth_problem(raised, ADDRESS)
    )
    no_ray_auth.delenv("RAY_AUTH_TOKEN")
    no_ray_auth.setenv("RAY_AUTH_TOKEN_PATH", "/etc/ray/token")
    assert "rejected the token from RAY_AUTH_TOKEN_PATH=/etc/ray/token" in str(
        auth_problem(raised, ADDRESS)
    )
    no_ray_auth.delenv("RAY_AUTH_TOKEN_PATH")
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("wrong")
    assert f"rejected the token from {tmp_path / '.ray' / 'auth_token'}" in str(
        auth_problem(raised, ADDRESS)
    )


def test_token_mode_without_any_token(no_ray_auth: pytest.MonkeyPatch) -> None:
    """``ensure_token_if_auth_enabled`` raises the AuthenticationError itself (Ray 2.60
    ``authentication_constants.TOKEN_AUTH_ENABLED_BUT_NO_TOKEN_FOUND_ERROR_MESSAGE``)."""
    no_ray_auth.setenv("RAY_AUTH_MODE", "token")
    raised = AuthenticationError(
        "Token authentication is enabled but no authentication token was found"
    )
    line = auth_problem(raised, ADDRESS)
    assert line is not None
    assert line.startswith(f"RAY_AUTH_MODE=token but no token for the Ray cluster at {ADDRESS}")


def test_other_connection_failures_are_not_auth(no_ray_auth: pytest.MonkeyPatch) -> None:
    unreachable = _connection_error(
        RuntimeError("Failed to connect to GCS. Last connection error: ... Connection refused")
    )
    assert auth_problem(unreachable, ADDRESS) is None


def test_code_digest_is_of_the_files_not_the_byte_code(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub" / "__pycache__").mkdir(parents=True)
    (pkg / "__init__.py").write_text("A = 1\n")
    (pkg / "sub" / "m.py").write_text("B = 2\n")
    first = nodefacts.code_digest(pkg)
    assert first.startswith("sha256:") and len(first) == len("sha256:") + 64
    (pkg / "sub" / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"\0\1")
    (pkg / "sub" / "m.pyc").write_bytes(b"\0\1")
    assert nodefacts.code_digest(pkg) == first
    (pkg / "sub" / "m.py").write_text("B = 3\n")
    assert nodefacts.code_digest(pkg) != first
    (pkg / "sub" / "m.py").write_text("B = 2\n")
    (pkg / "sub" / "m.py").rename(pkg / "sub" / "n.py")
    assert nodefacts.code_digest(pkg) != first


def test_node_facts_here() -> None:
    facts = nodefacts.node_facts(
        ["jobs", "no_such_pkg_xyz"], ["numpy", "no-such-dist-xyz"], ["json", "no_such_mod_xyz"]
    )
    jobs_dir = Path(importlib.util.find_spec("jobs").submodule_search_locations[0])  # type: ignore[union-attr,index]
    assert facts["packages"]["jobs"] == {
        "path": str(jobs_dir),
        "digest": nodefacts.code_digest(jobs_dir),
    }
    assert facts["packages"]["no_such_pkg_xyz"] == {"path": None, "digest": None}
    assert facts["dists"] == {
        "numpy": importlib.metadata.version("numpy"),
        "no-such-dist-xyz": None,
    }
    assert facts["import_errors"] == {
        "no_such_mod_xyz": "ModuleNotFoundError: No module named 'no_such_mod_xyz'"
    }
    assert facts["executable"] == sys.executable


def test_the_node_check_runs_where_our_packages_cannot_be_imported(tmp_path: Path) -> None:
    """Pickled by value, :func:`nodefacts.node_facts` loads and runs in a Python that
    cannot import ``jobs`` or ``orchestrator`` (a node with Ray only)."""
    ray.cloudpickle.register_pickle_by_value(nodefacts)
    blob = tmp_path / "check.pkl"
    blob.write_bytes(ray.cloudpickle.dumps(nodefacts.node_facts))
    script = (
        "import json, pickle, sys\n"
        "sys.modules['jobs'] = None; sys.modules['orchestrator'] = None  # not importable\n"
        f"check = pickle.loads(open({str(blob)!r}, 'rb').read())\n"
        "print(json.dumps(check(['jobs', 'orchestrator'], ['numpy'], ['orchestrator.x'])))\n"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    facts = json.loads(out.stdout)
    assert facts["packages"] == {
        "jobs": {"path": None, "digest": None},
        "orchestrator": {"path": None, "digest": None},
    }
    assert facts["import_errors"]["orchestrator.x"].startswith("ModuleNotFoundError")


def _bare_node(local: dict[str, Any], **dists: str | None) -> dict[str, Any]:
    """A node with Ray only, shaped as :func:`nodefacts.node_facts` answers."""
    return {
        "hostname": "gpu-7",
        "python": local["python"],
        "executable": "/opt/ray/bin/python3",
        "platform": "linux-x86_64",
        "packages": {p: {"path": None, "digest": None} for p in PACKAGES},
        "dists": {d: dists.get(d) for d in WORKER_REQUIREMENTS},
        "import_errors": {
            m: "ModuleNotFoundError: No module named 'orchestrator'" for m in REMOTE_MODULES
        },
    }


def test_a_node_with_this_service_code_lacks_nothing() -> None:
    local = local_environment()
    here = nodefacts.node_facts(list(PACKAGES), list(WORKER_REQUIREMENTS), list(REMOTE_MODULES))
    assert node_lacks(here, local) == []
    assert plan_runtime_env({"n1": here}, local) == (None, [], [])


def test_a_bare_node_gets_our_code_and_the_pinned_requirements() -> None:
    local = local_environment()
    pydantic = local["dists"]["pydantic"]
    bare = _bare_node(local, pydantic=pydantic, numpy="1.26.4")
    lacks = node_lacks(bare, local)
    assert lacks[0] == "vlab's code (jobs, orchestrator: not importable)"
    assert f"numpy=={local['dists']['numpy']} (has 1.26.4)" in lacks
    assert f"tokenizers=={local['dists']['tokenizers']} (absent)" in lacks
    assert not any(x.startswith("pydantic==") for x in lacks)
    assert not any(x.startswith("import ") for x in lacks)  # a consequence, not said twice

    env, code, pip = plan_runtime_env({"n1": bare}, local)
    assert code == ["jobs", "orchestrator"]
    assert env is not None
    assert env["py_modules"] == [local["packages"][p]["path"] for p in PACKAGES]
    assert f"numpy=={local['dists']['numpy']}" in pip
    assert not any(x.startswith("pydantic==") for x in pip)
    assert env["pip"]["packages"] == pip
    assert "--no-cache-dir" not in env["pip"]["pip_install_options"]


def test_a_node_with_other_code_or_python() -> None:
    local = local_environment()
    node = nodefacts.node_facts(list(PACKAGES), list(WORKER_REQUIREMENTS))
    node["packages"]["jobs"] = {"path": "/srv/old/jobs", "digest": "sha256:" + "0" * 64}
    node["python"] = "3.12.1"
    lacks = node_lacks(node, local)
    assert f"Python {'.'.join(local['python'].split('.')[:2])} (has 3.12.1)" in lacks
    assert "this service's jobs (imports /srv/old/jobs, whose code differs)" in lacks
    env, code, pip = plan_runtime_env({"n1": node}, local)
    assert code == ["jobs", "orchestrator"] and pip == [] and env is not None
    assert "pip" not in env


def _runtime_imports(module: str) -> list[ast.stmt]:
    """The import statements a module runs when imported (not in functions, not under
    ``if TYPE_CHECKING``)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    found: list[ast.stmt] = []

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                found.append(node)
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    walk(node.body)
                walk(node.orelse)
            elif isinstance(node, ast.Try):
                walk(node.body)
                for handler in node.handlers:
                    walk(handler.body)
                walk(node.orelse)
                walk(node.finalbody)

    walk(ast.parse(Path(spec.origin).read_text()).body)
    return found


def test_worker_requirements_are_what_the_remote_modules_import() -> None:
    """:data:`WORKER_REQUIREMENTS` against the third-party imports of every module of
    ours a Ray worker imports (the closure of :data:`REMOTE_MODULES`)."""
    ours = set(PACKAGES)
    todo, seen, third = list(REMOTE_MODULES), set(), set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))  # parent packages
        for node in _runtime_imports(module):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"relative import in {module}"
                names = [str(node.module)]
                names += [f"{node.module}.{a.name}" for a in node.names]
            else:
                names = [a.name for a in node.names]
            for name in names:
                top = name.split(".")[0]
                if top in ours:
                    try:  # a submodule, or a name defined in a module
                        if importlib.util.find_spec(name) is not None:
                            todo.append(name)
                    except ModuleNotFoundError:
                        pass
                elif top not in sys.stdlib_module_names and top not in ("ray", "__future__"):
                    third.add(top)
    dists = importlib.metadata.packages_distributions()

    def norm(name: str) -> str:
        return name.lower().replace("_", "-")

    needed = {norm(d) for top in third for d in dists.get(top, [top])}
    shipped = {norm(d) for d in WORKER_REQUIREMENTS}
    assert "orchestrator.dispatch.ray.supervisor" in seen and "jobs.run.runner" in seen
    assert needed <= shipped, needed - shipped
    # imported only where present (jobs.signals.gpus: NVML telemetry, else nvidia-smi)
    assert shipped - needed == {"nvidia-ml-py"}


def test_joined_cluster_state_is_dropped_on_forget() -> None:
    join._joined = join.JoinReport(address=ADDRESS, mode="auto", ready={"n1"})
    join.ensure_nodes_ready(["n1"], 1)  # known node: no Ray call
    join.forget()
    assert join._joined is None
    join.ensure_nodes_ready(["n2"], 1)  # local Ray: nothing to check


def _no_ray_init(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_a: Any, **_k: Any) -> None:
        pytest.fail("ray.init called for an unreachable RAY_ADDRESS")

    monkeypatch.setattr(connect.ray, "init", fail)


def test_unreachable_gcs_is_refused_before_ray_init(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    _no_ray_init(monkeypatch)
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RayClusterError) as caught:
        connect.init_ray(f"127.0.0.1:{port}", connect_timeout_s=3)
    text = str(caught.value)
    assert text == (
        f"cannot join the Ray cluster at 127.0.0.1:{port} (RAY_ADDRESS): connection refused"
    )
    assert "\n" not in text


def test_unresolvable_gcs_host_is_refused_before_ray_init(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _no_ray_init(monkeypatch)
    with pytest.raises(RayClusterError) as caught:
        connect.init_ray("nosuchhost.invalid:6379", connect_timeout_s=3)
    text = str(caught.value)
    assert text.startswith("cannot join the Ray cluster at nosuchhost.invalid:6379 (RAY_ADDRESS): ")
    assert "name does not resolve" in text or "timed out" in text
    assert "\n" not in text


@pytest.mark.parametrize("address", ["auto", "local", "", "ray://h:10001", "hostonly"])
def test_gcs_check_skips_addresses_without_host_and_port(address: str) -> None:
    connect.check_gcs_reachable(address, 0.5)  # nothing to check: no error, no network


def _one_shot_server(reply: bytes | None) -> tuple[int, Any]:
    """A TCP server that reads what the client sends first, then answers ``reply`` (None:
    says nothing) once."""
    import contextlib
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        # the client hangs up with our reply unread (a reset): nothing to report
        with conn, contextlib.suppress(OSError):
            conn.recv(64)
            if reply is not None:
                conn.sendall(reply)
            while conn.recv(4096):  # hold the connection until the client is done
                pass

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1], srv


#: what an HTTP/2 server answers the preface with first: its SETTINGS frame
_H2_SETTINGS = SettingsFrame(0, settings={SettingsFrame.MAX_CONCURRENT_STREAMS: 100}).serialize()


def test_an_http2_server_that_never_answers_the_call_is_refused_within_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It says HTTP/2's SETTINGS and nothing more: ``ray.init`` would wait for minutes."""
    _no_ray_init(monkeypatch)
    port, srv = _one_shot_server(_H2_SETTINGS)
    started = time.monotonic()
    with srv, pytest.raises(RayClusterError) as caught:
        connect.init_ray(f"127.0.0.1:{port}", connect_timeout_s=1.5)
    assert time.monotonic() - started < 1.5 + 1.0
    text = str(caught.value)
    assert text.startswith(
        f"cannot join the Ray cluster at 127.0.0.1:{port} (RAY_ADDRESS): what answers there "
        "is not a Ray GCS (no answer to a gRPC call within 1.5 s;"
    ), text
    assert "\n" not in text


class TinyHttp2Server:
    """A real HTTP/2 server (the ``h2`` library over TCP, in a thread) that is not a gRPC
    one: it answers every request ``404 Not Found`` with a text body, as a web server
    does. Records the header fields of the requests it was sent."""

    def __init__(self) -> None:
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(1)
        self.port = self.srv.getsockname()[1]
        self.requests: list[list[tuple[str, str]]] = []
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        conn, _ = self.srv.accept()
        h2 = H2Connection(H2Configuration(client_side=False, header_encoding="utf-8"))
        h2.initiate_connection()  # our SETTINGS
        with conn, contextlib.suppress(OSError):
            conn.sendall(h2.data_to_send())
            while chunk := conn.recv(65536):
                for event in h2.receive_data(chunk):  # checks the client's preface too
                    if isinstance(event, RequestReceived):
                        self.requests.append([(str(k), str(v)) for k, v in event.headers])
                    if isinstance(event, StreamEnded):  # the request ended: answer it
                        h2.send_headers(
                            event.stream_id,
                            [(":status", "404"), ("content-type", "text/plain"), ("server", "h2")],
                        )
                        h2.send_data(event.stream_id, b"404 page not found\n", end_stream=True)
                conn.sendall(h2.data_to_send())

    def close(self) -> None:
        self.srv.close()


def test_an_http2_server_that_is_not_grpc_is_refused_in_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RAY_ADDRESS at a web server that speaks HTTP/2 (a gRPC-less proxy, an h2c app):
    its HTTP/2 preface passes, but ``ray.init`` then retries for minutes. The probe's
    gRPC call gets a 404 and no gRPC status: one line, at once."""
    _no_ray_init(monkeypatch)
    server = TinyHttp2Server()
    started = time.monotonic()
    try:
        with pytest.raises(RayClusterError) as caught:
            connect.init_ray(f"127.0.0.1:{server.port}", connect_timeout_s=5)
    finally:
        server.close()
    assert time.monotonic() - started < 2
    text = str(caught.value)
    assert text.startswith(
        f"cannot join the Ray cluster at 127.0.0.1:{server.port} (RAY_ADDRESS): what answers "
        "there is not a Ray GCS (an HTTP/2 server that does not answer gRPC (HTTP 404);"
    ), text
    assert "\n" not in text
    # it was asked the GCS's method, and no token was sent to it
    (request,) = server.requests
    assert (":path", connect.GCS_PROBE_METHOD) in request
    assert "authorization" not in {name.lower() for name, _ in request}


def test_the_probe_reads_a_grpc_status_of_a_header_block_split_over_frames() -> None:
    """Trailers-only answers (``grpc-status`` in the one header block), split into
    HEADERS + CONTINUATION, with padding: UNIMPLEMENTED is not a GCS; UNAUTHENTICATED
    (a token-authenticated GCS, left to ray.init) and OK are."""
    for status, why in (
        ("12", "a gRPC server without Ray's GCS service"),
        ("16", None),
        ("0", None),
    ):
        body = hpack.Encoder().encode(
            [(":status", "200"), ("content-type", "application/grpc"), ("grpc-status", status)]
        )
        # END_STREAM on the HEADERS frame (padded by 3 bytes); its block ends in the
        # CONTINUATION
        headers = HeadersFrame(1, body[:7], flags=["PADDED", "END_STREAM"], pad_length=3)
        reply = (
            _H2_SETTINGS
            + headers.serialize()
            + ContinuationFrame(1, body[7:], flags=["END_HEADERS"]).serialize()
        )
        a, b = socket.socketpair()
        with a, b:
            b.sendall(reply)
            assert connect._not_a_gcs(a, "test:1", 2) == why, status


def test_a_real_ray_gcs_passes_the_probe_in_well_under_a_second() -> None:
    """A real GCS (a local Ray started by a subprocess) passes. Ray 2.60 turns token
    authentication on for a local Ray, so the probe, which never sends a token, gets
    UNAUTHENTICATED: a GCS's answer all the same (``ray.init`` then says what to set)."""
    code = (
        "import sys, ray\n"
        "ray.init(address='local', include_dashboard=False, num_cpus=1)\n"
        "print(ray._private.worker.global_worker.node.gcs_address, flush=True)\n"
        "sys.stdin.read()\n"
    )
    # a short folder: Ray's socket paths under it must fit 107 bytes
    folder = Path(tempfile.mkdtemp(prefix="vj-", dir="/tmp"))
    env = {**os.environ, "RAY_TMPDIR": str(folder), "HOME": str(folder)}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        assert address, "the local Ray did not start"
        started = time.monotonic()
        connect.check_gcs_reachable(address, 5)
        assert time.monotonic() - started < 1
    finally:
        assert proc.stdin is not None
        proc.stdin.close()  # it shuts its Ray down on exit
        proc.wait(timeout=60)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize(
    ("reply", "what"),
    [
        (b"-ERR unknown command 'PRI', with args beginning with: \r\n", "Redis"),
        (b"HTTP/1.1 400 Bad Request\r\n\r\n", "a web server"),
        (None, "a server that says nothing"),
    ],
)
def test_a_port_that_is_not_a_ray_gcs_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, reply: bytes | None, what: str
) -> None:
    """Trial of 2026-12-04: RAY_ADDRESS at Redis's 6379 (Ray's default GCS port, a likely
    mix-up) hung `vlab up` in ray.init's retries with no line of ours."""
    _no_ray_init(monkeypatch)
    port, srv = _one_shot_server(reply)
    with srv, pytest.raises(RayClusterError) as caught:
        connect.init_ray(f"127.0.0.1:{port}", connect_timeout_s=2)
    text = str(caught.value)
    assert text.startswith(f"cannot join the Ray cluster at 127.0.0.1:{port} (RAY_ADDRESS): ")
    assert "not a Ray GCS" in text and "\n" not in text, what


def test_the_project_database_port_is_not_a_ray_gcs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real non-Ray service: the Postgres the tests use over TCP (CI's DATABASE_URL)."""
    import os

    from sqlalchemy.engine import make_url

    if not os.environ.get("DATABASE_URL"):
        pytest.skip("DATABASE_URL unset: the tests' Postgres is embedded (no TCP port)")
    url = make_url(os.environ["DATABASE_URL"])
    if not url.port and not url.host:
        pytest.skip("DATABASE_URL names no TCP address")
    _no_ray_init(monkeypatch)
    with pytest.raises(RayClusterError, match="not a Ray GCS"):
        connect.init_ray(f"{url.host or '127.0.0.1'}:{url.port or 5432}", connect_timeout_s=3)
