"""Serve an app over real HTTP for a test: uvicorn in a thread, as ``Runtime.start_api_thread``."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from tests.ports import free_port


@contextmanager
def live_server(app: Any) -> Iterator[str]:
    """Serve ``app`` on a free loopback port; yields its base URL; stops it afterwards."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, name="test-api", daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not t.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the API server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        t.join(timeout=30)
