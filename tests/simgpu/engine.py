"""SIMULATION: a stand-in for the engine environment's python on simulated GPU nodes.

Nothing here runs vLLM or touches a real GPU. The orchestrator starts engines as
``[engine_python, jobs/launcher/vllm_launcher.py, <command>, ...]``; a test points
``VLAB_ENGINE__PYTHON`` at a wrapper that runs this module instead (see
:func:`write_engine_python`). It behaves like vLLM where the orchestrator depends
on it:

- ``serve``: reads ``CUDA_VISIBLE_DEVICES`` as vLLM does (unset or empty: "No CUDA
  GPUs are available"; fewer GPUs than this node's ranks: vLLM's world-size error),
  takes every GPU it computes on (an exclusive ``flock`` on the simulated GPU's
  lock file, :func:`tests.simgpu.lock_path`) and fails like vLLM with CUDA out of
  memory when another engine already holds one; logs the devices it got; then
  serves the OpenAI API with the project's stub server (:mod:`jobs.stub.stubserver`).
  A follower (``--headless``) only holds its GPUs. With
  ``--distributed-executor-backend ray`` it does what vLLM's Ray executor does
  first: join ``RAY_ADDRESS``, take the current placement group (vLLM:
  ``ray.util.get_current_placement_group()``; a new group of one-GPU bundles when
  there is none, which waits for free GPUs), check its bundles as vLLM does, and
  place one worker actor per rank (``num_gpus=1``) in it; each worker holds the GPU
  Ray gives it.
- ``engine-args``: the argument list vLLM 0.32 (CPU build) reported
  (``tests/data/engine_args_vllm032cpu.json``).
- anything else (``fingerprint``, ``resolve-model``): the real launcher, run by
  this interpreter (no vLLM here: the fingerprint says so).

The simulated node is named by ``VLAB_SIM_GPU_NODE`` and its GPUs listed under
``VLAB_SIM_GPU_STATE`` (:func:`tests.simgpu.write_inventory`); the simulated
``nvidia-smi`` reports a held GPU as busy.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import signal
import stat
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.simgpu import NODE_ENV, STATE_ENV  # noqa: E402

ENGINE_ARGS = REPO / "tests" / "data" / "engine_args_vllm032cpu.json"
#: Seconds the simulated Ray executor waits for a placement group it created itself.
OWN_GROUP_WAIT_S = 15.0


def write_engine_python(path: Path) -> Path:
    """An executable that runs this module with the service's interpreter (the engine's
    environment drops ``PYTHONPATH``, so the wrapper sets it)."""
    path.write_text(
        "#!/bin/sh\n"
        f'PYTHONPATH="{REPO}" exec "{sys.executable}" "{Path(__file__).resolve()}" "$@"\n'
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def _opt(argv: list[str], name: str, default: str | None = None) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else default


def _say(message: str) -> None:
    print(message, flush=True)


def _fail(message: str) -> None:
    _say(f"ERROR {time.strftime('%m-%d %H:%M:%S')} [sim engine] {message}")
    sys.exit(1)


def _hold(indices: list[int]) -> list[Any]:
    """Take the simulated GPUs ``indices`` of this node, as CUDA contexts would."""
    state, node = os.environ.get(STATE_ENV), os.environ.get(NODE_ENV)
    if not state or not node:
        _fail(f"RuntimeError: no simulated GPU node ({STATE_ENV}/{NODE_ENV} unset)")
    held = []
    for local, index in enumerate(indices):
        # tests.simgpu.lock_path, spelled out: this also runs in Ray workers of the
        # simulated Ray executor, which cannot import the tests package
        path = Path(str(state)) / str(node) / f"gpu{index}.lock"
        handle = path.open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            _fail(
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. "
                f"GPU {local} has a total capacity of 139.81 GiB of which 0 bytes is free. "
                f"(simulated GPU {index} of node {node} is in use by another engine)"
            )
        held.append(handle)
    return held


def _visible() -> list[int]:
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None or not raw.strip():
        _fail("RuntimeError: No CUDA GPUs are available (CUDA_VISIBLE_DEVICES is unset or empty)")
    return [int(x) for x in str(raw).split(",") if x.strip()]


def _launcher() -> Any:
    """Import the real launcher by path (its module-level code runs, as in vLLM's
    processes, which re-import the launcher as their main module)."""
    spec = importlib.util.spec_from_file_location(
        "vllm_launcher", REPO / "jobs/launcher/vllm_launcher.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ray_executor(world: int) -> list[str]:
    """vLLM's Ray executor start-up, simulated: the devices each rank's worker got."""
    _launcher()  # installs the hand-over of the run's placement group, if any
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
    pg = ray.util.get_current_placement_group()
    if pg is None:
        _say("INFO [sim engine] No current placement group found. Creating a new one.")
        pg = placement_group([{"GPU": 1.0} for _ in range(world)], strategy="PACK")
        ready, _ = ray.wait([pg.ready()], timeout=OWN_GROUP_WAIT_S)
        if not ready:
            _fail(
                "ValueError: Cannot provide a placement group of "
                f"placement_group_specs={[{'GPU': 1.0}] * world} within {OWN_GROUP_WAIT_S:g} "
                "seconds (the GPUs are held by another placement group)"
            )
    else:
        _say("INFO [sim engine] Using the existing placement group")
    bundles = pg.bundle_specs
    if any(b.get("GPU", 0) > 1 for b in bundles):
        _fail("ValueError: Placement group bundle cannot have more than 1 GPU.")
    gpu_bundles = [i for i, b in enumerate(bundles) if b.get("GPU", 0)]
    if world > len(gpu_bundles):
        _fail(f"ValueError: The number of required GPUs exceeds the total ({len(gpu_bundles)})")

    @ray.remote(num_cpus=0, num_gpus=1)
    class Worker:
        def __init__(self) -> None:
            # the worker's own node (its raylet's environment) and the GPU Ray gave it
            self.held = _hold(_visible())

        def devices(self) -> str:
            return os.environ.get("CUDA_VISIBLE_DEVICES", "")

    workers = [
        Worker.options(  # type: ignore[attr-defined]
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=i
            )
        ).remote()
        for i in gpu_bundles[:world]
    ]
    devices: list[str] = ray.get([w.devices.remote() for w in workers], timeout=60)
    globals()["_workers"] = workers  # keep them alive while serving
    return devices


def serve(argv: list[str]) -> None:
    tp = int(_opt(argv, "--tensor-parallel-size", "1") or 1)
    pp = int(_opt(argv, "--pipeline-parallel-size", "1") or 1)
    nnodes = int(_opt(argv, "--nnodes", "1") or 1)
    backend = _opt(argv, "--distributed-executor-backend", "mp")
    node = os.environ.get(NODE_ENV, "?")
    _say(f"INFO {time.strftime('%m-%d %H:%M:%S')} [sim engine] SIMULATED vLLM, node {node}")
    from jobs.stub.stubserver import listen_socket
    from jobs.stub.stubserver import main as stub_main

    host = _opt(argv, "--host", "127.0.0.1") or "127.0.0.1"
    # vLLM's API server binds its port before it builds the engine (``setup_server`` in
    # vllm/entrypoints/openai/api_server.py), so the Ray executor's workers cannot take it
    sock = (
        None if "--headless" in argv else listen_socket(host, int(_opt(argv, "--port", "0") or 0))
    )
    if backend == "ray":
        devices = _ray_executor(tp * pp)
        _say(f"INFO [sim engine] Ray executor workers' CUDA_VISIBLE_DEVICES: {devices}")
        held: list[Any] = []
    else:
        visible = _visible()
        local_world = tp * pp // nnodes
        if len(visible) < local_world:
            _fail(
                f"ValueError: World size ({local_world}) is larger than the number of "
                f"available GPUs ({len(visible)}) in this node."
            )
        held = _hold(visible[:local_world])
        _say(
            f"INFO [sim engine] CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')} "
            f"ranks on this node: {local_world}"
        )
    if "--headless" in argv:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        while True:
            time.sleep(1)
    args = ["--host", host, "--model", _opt(argv, "--served-model-name", "model") or "model"]
    args += ["--ttft-ms", "20", "--itl-ms", "5"]
    with contextlib.ExitStack() as stack:
        for handle in held:
            stack.callback(handle.close)
        stub_main(args, sock=sock)


def main(argv: list[str]) -> None:
    command = argv[1] if len(argv) > 1 else ""
    if command == "serve":
        serve(argv[2:])
    elif command == "engine-args":
        print(ENGINE_ARGS.read_text(), flush=True)
    else:
        os.execv(sys.executable, [sys.executable, *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
