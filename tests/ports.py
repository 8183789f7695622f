"""Ports for the servers the tests start."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_port() -> int:
    """A free TCP port on 127.0.0.1 below the kernel's ephemeral range, for a server that a
    subprocess binds a minute later (``vlab up`` ships its code to the nodes first): a port
    ``bind(0)`` hands out is an ephemeral one, which any outgoing connection of the tests
    beside it may take meanwhile (a fresh-clone CI saw ``address already in use``)."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # nothing free there: an ephemeral one
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
