"""An OpenAI-compatible stub of a vLLM server with known timing, for loopback benchmarks and tests.

This is the named test double for "a GPU server with known timing": it generates
nothing, but streams exactly like vLLM's OpenAI server (``vllm/entrypoints/openai``,
``serving_chat.py`` / ``serving_completion.py``) on a fixed timetable:

- the first content token is sent ``ttft_s`` seconds after the request body
  arrived, token ``k`` (0-based) at ``ttft_s + k * itl_s``. Due times are
  absolute from the arrival (no drift from accumulated sleeps); each token is
  late by the event loop's timer granularity (~1 ms) at most when the process
  keeps up. Its own lateness is counted (:meth:`StubServer.stats`,
  ``emit_lag_*``) so a benchmark can tell the stub's error from the client's.
  Connections have Nagle off (:mod:`jobs.stub.stubsocket` says why), so a write
  leaves when it is made, on kept-alive connections too.
- it sends ``max_completion_tokens`` (else ``max_tokens``, else 16) tokens,
  as with ``ignore_eos``: the length never depends on the content.

Endpoints:

``POST /v1/chat/completions``, ``POST /v1/completions``
    streamed (``"stream": true``) as Server-Sent Events in vLLM's chunk format:
    chat sends a role chunk (``delta: {"role": "assistant", "content": ""}``)
    right before the first token, as vLLM does; then one chunk per token (the
    last one with ``finish_reason: "length"``); with
    ``stream_options.include_usage`` a final chunk with ``choices: []`` and
    ``usage`` (``prompt_tokens``, ``completion_tokens``, ``total_tokens``,
    ``prompt_tokens_details.cached_tokens``); then ``data: [DONE]``. Without
    ``stream`` one JSON body is returned when the last token is due.
    ``prompt_tokens`` is approximate: whitespace-separated words of the
    prompt (or of all message contents) plus one; ``cached_tokens`` is the
    constructor's value capped at ``prompt_tokens`` (with a simulated prefix cache,
    what it found; ``report_cached_tokens=False`` leaves ``prompt_tokens_details``
    out, as vLLM does without ``--enable-prompt-tokens-details``). A body that is
    not JSON gives HTTP 400 with vLLM's ``{"error": {...}}`` shape.
``GET /v1/models``
    one model, ``model`` (requests may name any model).
``GET /health``
    200, empty body.
``GET /metrics``
    Prometheus text with vLLM's names: ``vllm:num_requests_running``,
    ``vllm:num_requests_waiting`` (always 0, except in capacity mode),
    ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
    ``vllm:request_success_total``; with a simulated prefix cache also
    ``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total`` (tokens).
``POST /reset_prefix_cache``
    200 (nothing to reset; with a simulated prefix cache it is emptied, unless
    ``reset_keeps_cache``: then the answer is the same 200 and the cache stays, as
    when vLLM's block pool refused the reset and an older API server answered 200
    anyway).
``GET /stub/stats``
    JSON of :meth:`StubServer.stats`.
``POST /stub/reset``
    start a new window for the windowed stats (:meth:`StubServer.reset_stats`).

**Capacity mode** (``slots`` set): a server with a known service capacity. At most
``slots`` requests are served at once; the others wait in arrival order (FIFO). A
request's service starts when it gets a slot and lasts a fixed ``ttft_s + (n - 1) *
itl_s`` (its timetable above, counted from the service start instead of the
arrival); its slot is freed when the service time is over. The client's TTFT is
counted from the arrival, so queueing shows in it. ``vllm:num_requests_running``
is then the busy slots and ``vllm:num_requests_waiting`` the queue. With requests of
``n`` tokens the service capacity is ``slots / (ttft_s + (n - 1) * itl_s)``
requests/s, or ``slots`` concurrent requests.

**Prefix cache** (``prefix_cache=True``, any mode): vLLM's prefix caching simulated by
:class:`jobs.stub.stubengine.PrefixCache`; ``reset_keeps_cache=True`` simulates a reset that
reports success but leaves the blocks, so the first measured request of a run finds the
warm-up's prefix and the hit counter grows.

**Noise** (``noise_s`` > 0, any mode): each request's stream is delayed by a seeded
random extra latency, lognormal with median ``noise_s`` and shape ``noise_sigma``
(draws in arrival order from ``random.Random(seed)``). The delay is outside the
service slot (it models the network, not the server), so the capacity stays the
same while TTFT (and E2EL) become noisy.

Run it with :class:`StubServer` (a context manager; in a background thread, or in
a subprocess so that it has its own interpreter and GIL), or in the foreground::

    python -m jobs.stub.stubserver --ttft-ms 50 --itl-ms 10 --port 8001
    python -m jobs.stub.stubserver --ttft-ms 20 --itl-ms 4 --slots 4 --noise-ms 5 --seed 1

It is an ASGI app served by uvicorn (a project dependency); per-token work is
one pre-encoded chunk write.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

import uvicorn

from jobs.stub.stubapp import DEFAULT_MAX_TOKENS, StubApp
from jobs.stub.stubsocket import listen_socket, no_delay, url

__all__ = ["DEFAULT_MAX_TOKENS", "StubServer", "listen_socket", "main"]

_READY_PREFIX = "stubserver listening on "


class StubServer:
    """Run the stub on ``host:port`` in a background thread or a subprocess.

    Args:
        ttft_s: seconds from a request's arrival to its first token (>= 0).
        itl_s: seconds between successive tokens (>= 0).
        host: address to bind.
        port: TCP port; 0 picks a free one (see :attr:`base_url`).
        model: the model name ``/v1/models`` lists.
        cached_tokens: reported as ``usage.prompt_tokens_details.cached_tokens``
            (capped at the prompt's token count).
        process: run in a subprocess (``python -m jobs.stub.stubserver``) instead of a
            thread of this process: it then has its own GIL, so a client in this
            process does not share a core with it (benchmarks); a thread starts
            faster (tests).
        slots: capacity mode: at most this many requests served at once, the others
            wait FIFO (see the module docstring); None: every request is served at
            once (no queue).
        noise_s: median of a seeded lognormal extra delay of each stream (seconds;
            0: none), outside the service slot.
        noise_sigma: the lognormal's shape (sigma of its log).
        seed: seed of the noise draws.
        prefix_cache: simulate vLLM's prefix cache (module docstring): cached tokens
            and the ``vllm:prefix_cache_*`` counters come from it.
        reset_keeps_cache: ``POST /reset_prefix_cache`` answers success and keeps the
            simulated cache (a warm cache left after a reset).
        report_cached_tokens: False leaves ``usage.prompt_tokens_details`` out.
        block_size: tokens per block of the simulated prefix cache.

    Use as a context manager (``with StubServer(0.05, 0.01) as stub: stub.base_url``)
    or call :meth:`start` and :meth:`stop`.

    Raises:
        ValueError: a negative delay, ``cached_tokens``, ``noise_s`` or ``noise_sigma``,
            or ``slots`` or ``block_size`` < 1.
    """

    def __init__(
        self,
        ttft_s: float,
        itl_s: float,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        model: str = "stub",
        cached_tokens: int = 0,
        process: bool = False,
        slots: int | None = None,
        noise_s: float = 0.0,
        noise_sigma: float = 0.5,
        seed: int = 0,
        prefix_cache: bool = False,
        reset_keeps_cache: bool = False,
        report_cached_tokens: bool = True,
        block_size: int = 16,
    ) -> None:
        if ttft_s < 0 or itl_s < 0 or cached_tokens < 0 or noise_s < 0 or noise_sigma < 0:
            raise ValueError(
                f"ttft_s, itl_s, cached_tokens, noise_s and noise_sigma must be >= 0, got "
                f"{ttft_s}, {itl_s}, {cached_tokens}, {noise_s}, {noise_sigma}"
            )
        if slots is not None and slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.prefix_cache = prefix_cache
        self.reset_keeps_cache = reset_keeps_cache
        self.report_cached_tokens = report_cached_tokens
        self.block_size = block_size
        self.slots = slots
        self.noise_s = noise_s
        self.noise_sigma = noise_sigma
        self.seed = seed
        self.ttft_s = ttft_s
        self.itl_s = itl_s
        self.host = host
        self.port = port
        self.model = model
        self.cached_tokens = cached_tokens
        self.process = process
        self._base_url: str | None = None
        self._app: StubApp | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[str] | None = None

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the running server.

        Raises:
            RuntimeError: not started.
        """
        if self._base_url is None:
            raise RuntimeError("StubServer is not started")
        return self._base_url

    @property
    def pid(self) -> int | None:
        """Process id of the subprocess (``process=True`` and started), else None."""
        return self._proc.pid if self._proc is not None else None

    def start(self, timeout_s: float = 30.0) -> StubServer:
        """Start serving; returns once connections are accepted.

        Raises:
            RuntimeError: already started, or the server did not come up within
                ``timeout_s`` seconds (the subprocess's exit status is in the message).
        """
        if self._base_url is not None:
            raise RuntimeError("StubServer is already started")
        if self.process:
            self._start_process(timeout_s)
        else:
            self._start_thread(timeout_s)
        return self

    def _start_thread(self, timeout_s: float) -> None:
        self._app = StubApp(
            self.ttft_s,
            self.itl_s,
            self.model,
            self.cached_tokens,
            slots=self.slots,
            noise_s=self.noise_s,
            noise_sigma=self.noise_sigma,
            seed=self.seed,
            **self._cache_options(),
        )
        self._sock = listen_socket(self.host, self.port)
        self._server = uvicorn.Server(_uvicorn_config(self._app))
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._sock]},
            name="stubserver",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                self.stop()
                raise RuntimeError("stub server thread did not start")
            time.sleep(0.005)
        self._base_url = url(self.host, self._sock.getsockname()[1])

    def _start_process(self, timeout_s: float) -> None:
        cmd = [sys.executable, "-m", "jobs.stub.stubserver"]
        cmd += ["--ttft-ms", repr(self.ttft_s * 1000), "--itl-ms", repr(self.itl_s * 1000)]
        cmd += ["--host", self.host, "--port", str(self.port), "--model", self.model]
        cmd += ["--cached-tokens", str(self.cached_tokens)]
        if self.slots is not None:
            cmd += ["--slots", str(self.slots)]
        cmd += ["--noise-ms", repr(self.noise_s * 1000), "--noise-sigma", repr(self.noise_sigma)]
        cmd += ["--seed", str(self.seed), "--block-size", str(self.block_size)]
        cmd += ["--prefix-cache"] * self.prefix_cache
        cmd += ["--reset-keeps-cache"] * self.reset_keeps_cache
        cmd += ["--no-cached-tokens"] * (not self.report_cached_tokens)
        root = str(Path(__file__).resolve().parents[1])
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
        }
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        line = self._proc.stdout.readline() if ready else ""
        if not line.startswith(_READY_PREFIX):
            self.stop()
            raise RuntimeError(
                f"stub server subprocess did not start within {timeout_s:g} s "
                f"(exit status {self._proc.poll()}, said {line!r})"
            )
        self._base_url = line[len(_READY_PREFIX) :].strip()

    def _cache_options(self) -> dict[str, Any]:
        return {
            "prefix_cache": self.prefix_cache,
            "reset_keeps_cache": self.reset_keeps_cache,
            "report_cached_tokens": self.report_cached_tokens,
            "block_size": self.block_size,
        }

    def stop(self) -> None:
        """Stop serving (streams in flight are cut after ~1 s); safe to call twice."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.send_signal(signal.SIGTERM)  # uvicorn's graceful exit
                try:
                    self._proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            if self._proc.stdout is not None:
                self._proc.stdout.close()
        self._base_url = None

    def kill(self) -> None:
        """SIGKILL the subprocess: the server vanishes mid-stream, as a crashed one does.

        Raises:
            RuntimeError: not running as a subprocess.
        """
        if self._proc is None:
            raise RuntimeError("kill() needs process=True and a started server")
        self._proc.kill()
        self._proc.wait()

    def stats(self) -> dict[str, Any]:
        """What the stub did: counters since start, ``requests`` (received),
        ``success`` (completed), ``prompt_tokens`` and ``generation_tokens`` (totals),
        ``running`` (in flight now); since start or the last :meth:`reset_stats`,
        ``max_running`` (most in flight at once), ``disconnects`` (clients gone
        mid-stream), ``emits`` (token writes) with ``emit_lag_mean_s`` /
        ``emit_lag_max_s`` (how late the stub wrote tokens against their due time,
        seconds); and the configured ``ttft_s`` / ``itl_s``.

        Raises:
            RuntimeError: not started.
            OSError: the subprocess does not answer ``GET /stub/stats``.
        """
        if self._app is not None and self._base_url is not None:
            return self._app.stats()
        with urllib.request.urlopen(self.base_url + "/stub/stats", timeout=10) as resp:
            stats: dict[str, Any] = json.loads(resp.read())
        return stats

    def reset_stats(self) -> None:
        """Start a new window for ``max_running``, ``disconnects`` and the emit stats.

        Raises:
            RuntimeError: not started.
            OSError: the server does not answer ``POST /stub/reset``.
        """
        # over HTTP in both modes: the reset then runs on the server's event loop
        req = urllib.request.Request(self.base_url + "/stub/reset", method="POST")
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()

    def __enter__(self) -> StubServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _uvicorn_config(app: StubApp) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        http="h11",
        loop="asyncio",
        lifespan="off",
        access_log=False,
        log_level="warning",
        backlog=2048,
        timeout_graceful_shutdown=1,
    )


def main(argv: list[str] | None = None, sock: socket.socket | None = None) -> None:
    """``python -m jobs.stub.stubserver``: serve in the foreground until SIGINT/SIGTERM.

    Prints ``stubserver listening on http://HOST:PORT`` on stdout once it accepts
    connections (``--port 0`` picks a free port). ``sock``: a socket already bound and
    listening (see :func:`listen_socket`), as vLLM's API server binds its port before
    it starts the engine; ``--host``/``--port`` are then ignored.
    """
    ap = argparse.ArgumentParser(
        prog="python -m jobs.stub.stubserver", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--ttft-ms", type=float, default=50.0, help="time to first token, ms")
    ap.add_argument("--itl-ms", type=float, default=10.0, help="inter-token delay, ms")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model", default="stub", help="model name listed by /v1/models")
    ap.add_argument("--cached-tokens", type=int, default=0, help="reported cached prompt tokens")
    ap.add_argument(
        "--slots", type=int, default=None, help="capacity mode: requests served at once (FIFO)"
    )
    ap.add_argument("--noise-ms", type=float, default=0.0, help="median extra delay, ms")
    ap.add_argument("--noise-sigma", type=float, default=0.5, help="lognormal shape of the noise")
    ap.add_argument("--seed", type=int, default=0, help="seed of the noise")
    ap.add_argument("--prefix-cache", action="store_true", help="simulate a prefix cache")
    ap.add_argument(
        "--reset-keeps-cache",
        action="store_true",
        help="POST /reset_prefix_cache answers success but keeps the simulated cache",
    )
    ap.add_argument(
        "--no-cached-tokens",
        action="store_true",
        help="leave usage.prompt_tokens_details out (vLLM without --enable-prompt-tokens-details)",
    )
    ap.add_argument("--block-size", type=int, default=16, help="tokens per prefix cache block")
    args = ap.parse_args(argv)
    if min(args.ttft_ms, args.itl_ms, args.cached_tokens, args.noise_ms, args.noise_sigma) < 0:
        ap.error("--ttft-ms, --itl-ms, --cached-tokens, --noise-ms, --noise-sigma must be >= 0")
    if args.slots is not None and args.slots < 1:
        ap.error("--slots must be >= 1")
    if args.block_size < 1:
        ap.error("--block-size must be >= 1")
    app = StubApp(
        args.ttft_ms / 1000,
        args.itl_ms / 1000,
        args.model,
        args.cached_tokens,
        slots=args.slots,
        noise_s=args.noise_ms / 1000,
        noise_sigma=args.noise_sigma,
        seed=args.seed,
        prefix_cache=args.prefix_cache,
        reset_keeps_cache=args.reset_keeps_cache,
        report_cached_tokens=not args.no_cached_tokens,
        block_size=args.block_size,
    )
    sock = listen_socket(args.host, args.port) if sock is None else no_delay(sock)
    print(_READY_PREFIX + url(args.host, sock.getsockname()[1]), flush=True)
    server = uvicorn.Server(_uvicorn_config(app))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled: a normal stop
        pass
    finally:
        sock.close()


if __name__ == "__main__":
    main()
