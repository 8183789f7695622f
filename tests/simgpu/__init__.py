"""SIMULATION of NVIDIA GPUs for tests: nothing here touches real hardware.

A simulated node is a folder ``<state>/<node>/`` (``state`` from
:data:`STATE_ENV`, ``node`` from :data:`NODE_ENV`) holding ``gpus.json``, the
node's simulated GPU inventory (:func:`write_inventory`), and one lock file per
GPU (:func:`lock_path`). A simulated engine "uses" a GPU by holding an
exclusive ``fcntl.flock`` on its lock file; the stand-in ``nvidia-smi`` in
:data:`NVIDIA_SMI_DIR` (put that folder first on ``PATH``) then reports the
GPU as busy (utilization 90 %, 60000 MiB used, 400 W) and otherwise as idle
(0 %, 0 MiB, 75 W). Its driver version is ``570.00-sim``.

Each simulated Ray node gets its own :data:`NODE_ENV` value, e.g. through
``Cluster.add_node(env_vars={NODE_ENV: "node-a", STATE_ENV: str(state)})``.
The stand-in uses the standard library only (it runs under whatever
``python3`` a node has) and so repeats the small file layout defined here.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from pathlib import Path
from typing import Any

__all__ = [
    "NODE_ENV",
    "NVIDIA_SMI_DIR",
    "STATE_ENV",
    "held",
    "inventory_path",
    "lock_path",
    "simulated_uuid",
    "write_inventory",
]

STATE_ENV = "VLAB_SIM_GPU_STATE"
"""Environment variable: the directory holding the simulated nodes (shared by a test)."""

NODE_ENV = "VLAB_SIM_GPU_NODE"
"""Environment variable: the simulated node's name (a sub-folder of the state directory)."""

NVIDIA_SMI_DIR: Path = Path(__file__).resolve().parent / "bin"
"""Folder holding the stand-in ``nvidia-smi`` executable (a simulation)."""


def simulated_uuid(node: str, index: int) -> str:
    """Deterministic UUID of simulated GPU ``index`` on ``node``.

    Shaped like a real one, ``GPU-5113xxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` (the
    ``GPU-5113`` prefix marks it as simulated); distinct across nodes and indices.
    """
    h = "5113" + hashlib.sha256(f"{node}/{index}".encode()).hexdigest()[:28]
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def inventory_path(state_dir: Path, node: str) -> Path:
    """``<state>/<node>/gpus.json``."""
    return Path(state_dir) / node / "gpus.json"


def write_inventory(
    state_dir: Path,
    node: str,
    count: int,
    name: str = "NVIDIA H200 (simulated)",
    memory_total_mib: int = 143771,
) -> list[dict[str, Any]]:
    """Create simulated node ``node`` with ``count`` GPUs; returns the inventory written.

    Writes ``<state>/<node>/gpus.json``, a list of ``{"index", "uuid", "name",
    "memory_total_mib"}`` (UUIDs from :func:`simulated_uuid`), replacing any
    earlier inventory of that node atomically.
    """
    inventory = [
        {
            "index": i,
            "uuid": simulated_uuid(node, i),
            "name": name,
            "memory_total_mib": int(memory_total_mib),
        }
        for i in range(count)
    ]
    path = inventory_path(state_dir, node)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".json.tmp{os.getpid()}")
    tmp.write_text(json.dumps(inventory, indent=2) + "\n")
    tmp.replace(path)
    return inventory


def lock_path(state_dir: Path, node: str, index: int) -> Path:
    """``<state>/<node>/gpu<index>.lock``: a simulated engine holds an exclusive flock on it."""
    return Path(state_dir) / node / f"gpu{index}.lock"


def held(state_dir: Path, node: str, index: int) -> bool:
    """True when someone holds an exclusive ``flock`` on the GPU's lock file (GPU busy).

    Tries a non-blocking *shared* lock and releases it at once, so concurrent
    checkers never see each other. A missing lock file means not held. Note
    that ``flock`` locks belong to open file descriptions: a lock held through
    another ``open()`` of the same process counts as held too.
    """
    path = lock_path(state_dir, node, index)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)
