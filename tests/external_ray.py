"""An existing Ray cluster for tests: ``ray start`` processes from a venv with Ray only.

The nodes run ``.ray-only-venv`` (``make ray-only``: ``ray[default]`` at the service's
Ray version and Python, nothing of vlab's; :func:`ray_only_python` builds it when
missing), so a service that joins them must ship its own code. Each node is a
``ray start`` process of its own, as on a real cluster; it never touches the default
Ray temp dir (``/tmp/ray``), so ``ray.init()`` elsewhere cannot find it:

- every node has its own ``--temp-dir`` (nodes on one machine would otherwise build
  the same runtime environment in the same folder at once) and free ports (GCS,
  dashboard, dashboard agent, Ray Client server);
- every node runs with ``HOME`` in the cluster's folder, so a token the machine's user
  has in ``~/.ray/auth_token`` does not switch token authentication on (Ray 2.60
  ``ray start --head`` does when one exists), and pip's cache is the user's own
  (``PIP_CACHE_DIR``), so a rebuilt runtime environment installs from the cache.

:meth:`RayOnlyCluster.stop` ends only this cluster's processes: each ``ray start``
runs in a session of its own (its process group holds the GCS, raylet, agents), and
Ray's workers, which start sessions of their own, carry :data:`MARK_ENV` in their
environment. ``ray stop`` is never used: it stops every Ray on the machine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from tests.ports import free_port

REPO = Path(__file__).resolve().parents[1]
RAY_ONLY_VENV = REPO / ".ray-only-venv"
SETUP_SCRIPT = REPO / "scripts" / "setup_ray_only_venv.sh"

#: Environment variable naming a test cluster in every process it starts.
MARK_ENV = "VLAB_TEST_RAY_CLUSTER"

#: Variables of the test process a node must not inherit.
_DROPPED = ("RAY_ADDRESS", "VIRTUAL_ENV", "PYTHONPATH", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")


def ray_only_python() -> Path:
    """The Ray-only venv's python, built by ``scripts/setup_ray_only_venv.sh`` if missing
    (about 20 s of CPU with pip's cache warm; ``make test`` builds it first)."""
    subprocess.run(
        ["bash", str(SETUP_SCRIPT), str(RAY_ONLY_VENV), sys.executable],
        cwd=REPO,
        check=True,
        timeout=900,
    )
    return RAY_ONLY_VENV / "bin" / "python"


class RayOnlyCluster:
    """A head and worker nodes started with ``ray start`` from ``python``'s venv.

    ``env`` (per node) is added to the node's environment, which Ray's workers
    inherit (simulated GPUs: :mod:`tests.simgpu`; a ``PATH`` there is put first);
    ``auth_token`` gives every node ``RAY_AUTH_MODE=token`` and that
    ``RAY_AUTH_TOKEN`` (otherwise ``RAY_AUTH_MODE=disabled``).
    """

    def __init__(self, python: Path, *, auth_token: str | None = None) -> None:
        self.python = python
        self.ray = python.parent / "ray"
        # short: Ray's unix sockets live under the temp dir (108-byte path limit)
        self.root = Path(tempfile.mkdtemp(prefix="vrt-", dir="/tmp"))
        self.home = self.root / "home"
        self.home.mkdir()
        self.mark = uuid.uuid4().hex
        self.auth_token = auth_token
        self.port = 0
        self.client_port = 0
        self.node_dirs: list[Path] = []
        self._groups: list[int] = []

    @property
    def address(self) -> str:
        """The head's GCS address (``RAY_ADDRESS``)."""
        return f"127.0.0.1:{self.port}"

    def _env(self, extra: dict[str, str] | None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _DROPPED}
        path = [p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p]
        env["PATH"] = os.pathsep.join([str(self.ray.parent), *path])
        env["PIP_CACHE_DIR"] = os.environ.get("PIP_CACHE_DIR", str(Path.home() / ".cache" / "pip"))
        env["HOME"] = str(self.home)
        env[MARK_ENV] = self.mark
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        if self.auth_token is not None:
            env["RAY_AUTH_MODE"] = "token"
            env["RAY_AUTH_TOKEN"] = self.auth_token
        else:
            env["RAY_AUTH_MODE"] = "disabled"
        extra = dict(extra or {})
        if "PATH" in extra:  # folders to put first (e.g. the simulated nvidia-smi)
            env["PATH"] = os.pathsep.join([extra.pop("PATH"), env["PATH"]])
        env.update(extra)
        return env

    def _start(self, args: list[str], env: dict[str, str] | None) -> None:
        temp = self.root / f"n{len(self.node_dirs)}"
        temp.mkdir()
        self.node_dirs.append(temp)
        cmd = [
            str(self.ray),
            "start",
            f"--temp-dir={temp}",
            f"--dashboard-agent-listen-port={free_port()}",
            "--disable-usage-stats",
            *args,
        ]
        log = (self.root / f"ray-start-{len(self.node_dirs)}.log").open("w")
        proc = subprocess.Popen(
            cmd,
            env=self._env(env),
            cwd=self.root,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._groups.append(proc.pid)
        try:
            rc = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            rc = None
        if rc != 0:
            raise RuntimeError(
                f"`ray start` failed ({rc}):\n" + (self.root / log.name).read_text()[-3000:]
            )

    def start_head(self, num_cpus: int, num_gpus: int, env: dict[str, str] | None = None) -> str:
        """Start the head node; returns its GCS address."""
        self.port, self.client_port = free_port(), free_port()
        self._start(
            [
                "--head",
                f"--port={self.port}",
                f"--ray-client-server-port={self.client_port}",
                f"--dashboard-port={free_port()}",
                "--include-dashboard=false",
                f"--num-cpus={num_cpus}",
                f"--num-gpus={num_gpus}",
            ],
            env,
        )
        return self.address

    def add_node(self, num_cpus: int, num_gpus: int, env: dict[str, str] | None = None) -> None:
        """Start a worker node joining the head."""
        self._start(
            [f"--address={self.address}", f"--num-cpus={num_cpus}", f"--num-gpus={num_gpus}"],
            env,
        )

    def wait_for_nodes(self, count: int, timeout_s: float = 60) -> None:
        """Until ``count`` nodes are alive, asked from a driver in the Ray-only venv."""
        probe = (
            "import ray, sys, time\n"
            f"ray.init(address={self.address!r}, log_to_driver=False)\n"
            f"deadline = time.monotonic() + {timeout_s}\n"
            f"while sum(n['Alive'] for n in ray.nodes()) < {count}:\n"
            "    if time.monotonic() > deadline: sys.exit(f'only {ray.nodes()}')\n"
            "    time.sleep(0.5)\n"
        )
        subprocess.run(
            [str(self.python), "-I", "-c", probe],
            env=self._env(None),
            cwd=self.root,
            check=True,
            timeout=timeout_s + 60,
            capture_output=True,
        )

    def _marked(self) -> list[int]:
        mark = f"{MARK_ENV}={self.mark}".encode()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:
                continue
            if mark in environ.split(b"\0"):
                found.append(int(entry))
        return found

    def _alive(self) -> list[int]:
        alive = set(self._marked())
        for group in self._groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, 0)
                alive.add(-group)
        return sorted(alive)

    def stop(self, grace_s: float = 10) -> None:
        """End every process of this cluster (SIGTERM, then SIGKILL) and remove its folder."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for group in self._groups:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(group, sig)
            for pid in self._marked():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + grace_s
            while self._alive() and time.monotonic() < deadline:
                time.sleep(0.2)
        shutil.rmtree(self.root, ignore_errors=True)
