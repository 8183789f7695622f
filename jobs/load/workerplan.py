"""What each load-generator worker gets: its cores (off the engine's) and its requests.

The cores a CPU engine is bound to (:func:`engine_cpus`), the cores a load generator
beside it avoids (:func:`cores_off_engine`), each worker's cores (:func:`worker_cpus`) and
its share of the request list and of the in-flight cap (:func:`assign`). The workers
themselves: :mod:`jobs.load.loadpool`.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence

from jobs.schemas import ChatRequest

__all__ = ["assign", "cores_off_engine", "engine_cpus", "worker_cpus"]


def engine_cpus(binding: str | None) -> set[int] | None:
    """The cores a CPU engine is bound to, from ``VLLM_CPU_OMP_THREADS_BIND`` (``"0-3"``,
    ``"0-3|4-7"`` one list per rank, ``"0,2,5-6"``); None when it names no cores
    (unset, ``auto``, ``all``, ``nobind``) or cannot be read."""
    if not binding or not binding.strip() or binding.strip() in ("auto", "all", "nobind"):
        return None
    cores: set[int] = set()
    try:
        for part in binding.replace("|", ",").split(","):
            lo, _, hi = part.strip().partition("-")
            first, last = int(lo), int(hi) if hi else int(lo)
            if first < 0 or last < first:
                return None
            cores.update(range(first, last + 1))
    except ValueError:
        return None
    return cores or None


def cores_off_engine(binding: str | None) -> set[int] | None:
    """``avoid_cpus`` for a load generator beside an engine bound by ``binding``: the
    engine's cores when this process may use others too; None (not pinned) when the
    engine's cores are unknown or it holds every core this process may use."""
    cores = engine_cpus(binding)
    if cores is None or not (os.sched_getaffinity(0) - cores):
        return None
    return cores


def worker_cpus(workers: int, avoid_cpus: Collection[int] | None) -> list[list[int] | None]:
    """The cores each worker is pinned to: the cores this process may use minus
    ``avoid_cpus``, one each while there are enough, else all of them; None each when
    ``avoid_cpus`` is None (not pinned).

    Raises:
        ValueError: no core is left.
    """
    if avoid_cpus is None:
        return [None] * workers
    allowed = sorted(os.sched_getaffinity(0) - set(avoid_cpus))
    if not allowed:
        raise ValueError(
            f"no core left for the load generator: this process may use "
            f"{sorted(os.sched_getaffinity(0))}, all of them in avoid_cpus"
        )
    if len(allowed) >= workers:
        return [[allowed[w]] for w in range(workers)]
    return [list(allowed) for _ in range(workers)]


def assign(
    requests: Sequence[ChatRequest], workers: int, concurrency: int
) -> list[tuple[list[int], int]]:
    """How a request list is dealt to workers: ``(positions, slots)`` per used worker.

    Requests joined by ``after`` (to an index anywhere in the list) form one group and
    go to one worker; groups are dealt in the order of their first request, each to
    the worker with the fewest requests per slot (ties: the lowest number). Positions
    are in list order; the slots add up to ``concurrency``.
    """
    parent = list(range(len(requests)))

    def root(pos: int) -> int:
        while parent[pos] != pos:
            parent[pos] = parent[parent[pos]]
            pos = parent[pos]
        return pos

    position = {r.index: pos for pos, r in enumerate(requests)}
    for pos, r in enumerate(requests):
        if r.after is not None and r.after in position:
            a, b = root(pos), root(position[r.after])
            parent[max(a, b)] = min(a, b)
    groups: dict[int, list[int]] = {}
    for pos in range(len(requests)):
        groups.setdefault(root(pos), []).append(pos)
    k = max(1, min(workers, concurrency, len(groups)))
    slots = [concurrency // k + (1 if w < concurrency % k else 0) for w in range(k)]
    dealt: list[list[int]] = [[] for _ in range(k)]
    for members in groups.values():  # insertion order: by first position
        w = min(range(k), key=lambda i: (len(dealt[i]) / slots[i], i))
        dealt[w].extend(members)
    return [(sorted(d), s) for d, s in zip(dealt, slots, strict=True) if d]
