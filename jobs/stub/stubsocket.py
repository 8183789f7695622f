"""The stub server's listening socket (:mod:`jobs.stub.stubserver`): bound, listening, Nagle off.

Why Nagle must be off: uvicorn writes a streamed response's headers and each body
chunk separately. With Nagle on, a small write waits until the previous one is
acknowledged, and the client acknowledges late (Linux's delayed ACK, ~40 ms) on a
kept-alive connection: every first token then arrived ~42 ms late whatever the
configured TTFT (measured at a 1 ms TTFT: 44 ms, and 1.5 ms with Nagle off). asyncio
turns Nagle off by itself only on sockets created with ``proto=IPPROTO_TCP``; a
socket made with ``socket.socket(family, SOCK_STREAM)`` has proto 0 and its
accepted connections kept Nagle on. vLLM's own server binds its socket the same
way, but runs on uvloop, which turns Nagle off on every TCP connection.
"""

from __future__ import annotations

import socket

__all__ = ["listen_socket", "no_delay", "url"]


def url(host: str, port: int) -> str:
    """``http://host:port`` (an IPv6 host in brackets)."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (connections queue in its backlog until uvicorn accepts)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return no_delay(sock)


def no_delay(sock: socket.socket) -> socket.socket:
    """``sock`` with TCP_NODELAY (Nagle off); the connections it accepts inherit it (Linux).

    asyncio sets it only on sockets made with ``proto=IPPROTO_TCP`` (uvloop, which vLLM's
    server uses, on all): without it, each small write after the response headers waited
    for the client's delayed ACK, ~40 ms on a kept-alive connection.
    """
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
