"""Reaching an existing Ray cluster's address: what is refused, and why, in one line.

A Ray Client address (``ray://``) is refused (:func:`refuse_ray_client`); the GCS is
checked first, so that an address nothing answers on, or where something other than a
GCS answers (one gRPC call, :func:`_not_a_gcs`), fails in seconds rather than in
``ray.init``'s minutes of retries (:func:`check_gcs_reachable`); Ray's authentication
failure becomes a line saying what to set (:func:`auth_problem`); :func:`init_ray` does
all three. What is checked
after connecting: :mod:`orchestrator.dispatch.ray.join`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import ray
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    ResponseReceived,
    StreamEnded,
    StreamReset,
    TrailersReceived,
)
from h2.exceptions import H2Error
from hyperframe.exceptions import HyperframeError
from hyperframe.frame import Frame, SettingsFrame
from ray.exceptions import AuthenticationError

from orchestrator.core.errors import RayClusterError
from orchestrator.dispatch.ray.supervisor import NAMESPACE

__all__ = [
    "GCS_CONNECT_TIMEOUT_S",
    "auth_problem",
    "check_gcs_reachable",
    "init_ray",
    "refuse_ray_client",
]


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


#: The gRPC method the probe calls: every Ray GCS serves it (``gcs_service.proto``), and
#: its first client, Ray's ``GcsClient``, calls it too.
GCS_PROBE_METHOD = "/ray.rpc.NodeInfoGcsService/GetClusterId"
#: gRPC's status UNIMPLEMENTED: a gRPC server without that service.
_GRPC_UNIMPLEMENTED = "12"
_NOT_HTTP2 = "it does not speak HTTP/2, the protocol of Ray's gRPC"


def _not_a_gcs(sock: socket.socket, authority: str, timeout_s: float) -> str | None:
    """Why the server on ``sock`` is not a Ray GCS, or None when it may be one.

    Makes one gRPC call a GCS answers (:data:`GCS_PROBE_METHOD`, an empty request, no
    token sent) over HTTP/2 (the ``h2`` library) and reads the answer's headers and
    trailers: any gRPC status but UNIMPLEMENTED is a GCS's (OK; UNAUTHENTICATED from a
    cluster with token authentication, left to ``ray.init`` to say what to set). Not
    one: no HTTP/2 (Redis, Postgres, HTTP/1: the first frame it sends is not SETTINGS),
    an HTTP/2 answer without a gRPC status (a web server), a gRPC server without Ray's
    GCS service, or no answer within ``timeout_s`` (``ray.init`` would wait minutes). A
    TLS GCS (``RAY_USE_TLS``) is not probed."""
    if (os.environ.get("RAY_USE_TLS") or "").strip().lower() in ("1", "true"):
        return None
    conn = H2Connection(H2Configuration(client_side=True, header_encoding="latin-1"))
    conn.initiate_connection()
    stream = conn.get_next_available_stream_id()
    conn.send_headers(
        stream,
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", GCS_PROBE_METHOD),
            (":authority", authority),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ],
    )
    conn.send_data(stream, b"\x00\x00\x00\x00\x00", end_stream=True)  # an empty message
    try:
        sock.sendall(conn.data_to_send())
    except OSError:
        return "it closed the connection (not HTTP/2, the protocol of Ray's gRPC)"
    fields: dict[str, str | None] = {}
    head = b""  # the server's first bytes, up to its first frame's header
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return f"no answer to a gRPC call within {timeout_s:g} s"
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return f"no answer to a gRPC call within {timeout_s:g} s"
        except OSError:
            chunk = b""  # reset: what it said so far decides
        if not chunk:
            return _NOT_HTTP2 if len(head) < 9 else _answer(fields)
        if len(head) < 9:
            # an HTTP/2 server's first frame is its SETTINGS (RFC 9113 section 3.4); h2
            # would wait for the whole of a "frame" that Redis's or HTTP/1's reply makes up
            head += chunk[: 9 - len(head)]
            if len(head) == 9:
                try:
                    first, _ = Frame.parse_frame_header(memoryview(head))
                except HyperframeError:
                    return _NOT_HTTP2
                if not isinstance(first, SettingsFrame):
                    return _NOT_HTTP2
        try:
            events = conn.receive_data(chunk)
        except H2Error as exc:
            return f"its HTTP/2 answer does not decode ({exc})"
        for event in events:
            if isinstance(event, ResponseReceived | TrailersReceived):
                fields.update((str(k), str(v)) for k, v in event.headers)  # str: decoded
            elif isinstance(event, DataReceived):
                conn.acknowledge_received_data(event.flow_controlled_length, stream)
            elif isinstance(event, StreamEnded | StreamReset | ConnectionTerminated):
                return _answer(fields)
        with contextlib.suppress(OSError):
            sock.sendall(conn.data_to_send())  # its SETTINGS acknowledged, window updates


def _answer(fields: dict[str, str | None]) -> str | None:
    """Why the headers of a finished answer are not a GCS's (see :func:`_not_a_gcs`)."""
    status = fields.get("grpc-status")
    if "grpc-status" in fields and status != _GRPC_UNIMPLEMENTED:
        return None
    if status == _GRPC_UNIMPLEMENTED:
        return "a gRPC server without Ray's GCS service"
    http = fields.get(":status")
    said = f" (HTTP {http})" if http else ""
    return f"an HTTP/2 server that does not answer gRPC{said}"


def check_gcs_reachable(address: str, timeout_s: float = GCS_CONNECT_TIMEOUT_S) -> None:
    """Resolve and TCP-connect to the GCS that ``address`` names, and check that a GCS
    answers there (:func:`_not_a_gcs`: one gRPC call), each within ``timeout_s``.

    Raises :class:`RayClusterError` (``cannot join the Ray cluster at HOST:PORT
    (RAY_ADDRESS): connection refused | name does not resolve | timed out | what
    answers there is not a Ray GCS (why...)``). No-op for ``auto``, ``local`` and
    addresses without a port.
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
            why = _not_a_gcs(sock, f"{host}:{port}", timeout_s)
            if why is not None:
                raise RayClusterError(
                    f"{where}: what answers there is not a Ray GCS ({why}; Redis, Postgres, "
                    "a web or another gRPC server on that port?): give the head's GCS "
                    "address, `ray start --head --port` (default 6379), not the Ray Client "
                    "(10001) or dashboard port"
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
