"""The GPUs of a run as the run page shows them (:mod:`web.pages.run`): a table row per
GPU each node held (or per node that held none, with why), the telemetry facts (source,
energy source, measured-phase figures) and the empty-state text. GPU figures that were
not measured are left out, never shown as zeros.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

#: ``engine_info["gpu_telemetry"]["source"]`` / a node's ``telemetry``, explained.
TELEMETRY_SOURCES = {
    "nvml": "NVML (nvidia-ml-py)",
    "nvidia-smi": "nvidia-smi (no energy counter)",
}

#: ``engine_info["gpu_telemetry"]["energy_source"]``, explained.
ENERGY_SOURCES = {
    "nvml_energy_counter": "NVML energy counter (delta between the before and after samples)",
    "power_integral": "integral of the sampled power (bursts between samples are missed)",
}

#: GPU summary metrics in the telemetry facts: (metric, label, unit, digits).
GPU_FACTS: tuple[tuple[str, str, str, int], ...] = (
    ("gpu_energy_j", "Energy, all GPUs", "J", 1),
    ("energy_per_output_token_j", "Energy per output token", "J/token", 3),
    ("gpu_mean_power_w", "Mean power per GPU", "W", 1),
    ("gpu_peak_memory_used_mib", "Peak memory used (one GPU)", "MiB", 0),
    ("gpu_mean_utilization_pct", "Mean utilisation", "%", 1),
)

NOT_MEASURED_ON_CPU = (
    "GPU utilisation, memory, power and energy are not measured on CPU hosts: "
    "this run has none of those metrics or charts (they are left out, never shown as zeros)."
)


@dataclass(frozen=True)
class GpuRow:
    """One row of the GPU table: a GPU of the run, or a node that holds none.

    ``ordinal``: the GPU's position in the run (nodes in rank order, then the
    node's list), the ``k`` of the ``gpu{k}_*`` sample keys; None on a node row
    without GPUs, whose ``note`` says why.
    """

    ordinal: int | None
    node_rank: int | None
    node_id: str
    cuda_visible_devices: str | None
    ray_gpu_ids: list[str]
    index: int | None = None
    uuid: str | None = None
    name: str | None = None
    memory_total_mib: float | None = None
    local_rank: int | None = None
    rank: int | None = None
    note: str = ""


@dataclass
class GpuView:
    """What the run page shows about the run's GPUs.

    ``recorded``: a GPU assignment is stored (``engine_info["gpu_assignment"]``,
    or while the run is active the one its placement recorded for rank 0);
    ``rows``: :class:`GpuRow` in rank order; ``facts``: ``(label, text)`` of the
    telemetry (source, energy source, measured-phase figures); ``notes``: the
    nodes' and the telemetry's notes; ``empty_text``: why there is no GPU row;
    ``labels``: the chart series name per GPU ordinal.
    """

    recorded: bool
    rows: list[GpuRow]
    facts: list[tuple[str, str]]
    notes: list[str]
    empty_text: str
    labels: list[str]

    @property
    def gpus(self) -> int:
        return sum(1 for r in self.rows if r.ordinal is not None)


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float_or_none(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def gpu_view(
    engine_info: dict[str, Any],
    placement: dict[str, Any] | None,
    metrics: dict[str, float],
    *,
    active: bool = False,
) -> GpuView:
    """The GPU table, telemetry facts and empty-state text of a run.

    ``engine_info``: the run's ``gpu_assignment`` (one entry per node in rank
    order, see :func:`orchestrator.dispatch.ray.supervisor.held_devices`) and
    ``gpu_telemetry``; without an assignment, the rank-0 one of the placement
    (``placement["nodes"][0]["gpu_assignment"]``, stored at launch). GPU figures
    absent from ``metrics`` are left out, never shown as zero.
    """
    assignment = engine_info.get("gpu_assignment")
    if not isinstance(assignment, list):
        nodes = (placement or {}).get("nodes") or []
        held = [n.get("gpu_assignment") for n in nodes if isinstance(n, dict)]
        assignment = [h for h in held if isinstance(h, dict)] or None
    telemetry = engine_info.get("gpu_telemetry")
    telemetry = telemetry if isinstance(telemetry, dict) else {}
    notes: list[str] = []
    rows = _gpu_rows(assignment or [], notes)
    for note in [telemetry.get("note"), *(telemetry.get("notes") or [])]:
        if note and str(note) not in notes:
            notes.append(str(note))
    gpu_rows = [r for r in rows if r.ordinal is not None]
    empty = "" if gpu_rows else _empty_text(assignment, placement, notes, active)
    labels = [
        f"gpu{r.ordinal} (node {r.node_rank}"
        + (f", index {r.index})" if r.index is not None else ")")
        for r in gpu_rows
    ]
    return GpuView(
        recorded=bool(assignment),
        rows=rows,
        facts=_telemetry_facts(telemetry, assignment or [], metrics),
        notes=notes,
        empty_text=empty,
        labels=labels,
    )


def _gpu_rows(assignment: list[Any], notes: list[str]) -> list[GpuRow]:
    """A row per GPU of each node (ordinals across the run), or one for a node without;
    the nodes' notes appended to ``notes``."""
    rows: list[GpuRow] = []
    ordinal = 0
    for node in assignment:
        if not isinstance(node, dict):
            continue
        cvd = node.get("cuda_visible_devices")
        note = str(node.get("note") or "")
        base = GpuRow(
            ordinal=None,
            node_rank=_int_or_none(node.get("node_rank")),
            node_id=str(node.get("node_id") or ""),
            cuda_visible_devices=None if cvd is None else str(cvd),
            ray_gpu_ids=[str(i) for i in node.get("ray_gpu_ids") or []],
            note=note,
        )
        if note and note not in notes:
            notes.append(note)
        gpus = [g for g in node.get("gpus") or [] if isinstance(g, dict)]
        if not gpus:
            rows.append(dataclasses.replace(base, note=note or "no GPU held"))
        for g in gpus:
            rows.append(
                dataclasses.replace(
                    base,
                    ordinal=ordinal,
                    index=_int_or_none(g.get("index")),
                    uuid=None if g.get("uuid") is None else str(g["uuid"]),
                    name=None if g.get("name") is None else str(g["name"]),
                    memory_total_mib=_float_or_none(g.get("memory_total_mib")),
                    local_rank=_int_or_none(g.get("local_rank")),
                    rank=_int_or_none(g.get("rank")),
                    note="",
                )
            )
            ordinal += 1
    return rows


def _telemetry_facts(
    telemetry: dict[str, Any], assignment: list[Any], metrics: dict[str, float]
) -> list[tuple[str, str]]:
    """``(label, text)`` of the telemetry: recorded or not, its source, the energy
    source, and the GPU figures of :data:`GPU_FACTS` that were measured."""
    facts: list[tuple[str, str]] = []
    if telemetry:
        facts.append(("Telemetry", "recorded" if telemetry.get("available") else "not recorded"))
    sources = [n.get("telemetry") for n in assignment if isinstance(n, dict)]
    source = telemetry.get("source") or next((s for s in sources if s), None)
    if source:
        facts.append(("Source", TELEMETRY_SOURCES.get(str(source), str(source))))
    if telemetry.get("energy_source"):
        energy = str(telemetry["energy_source"])
        facts.append(("Energy source", ENERGY_SOURCES.get(energy, energy)))
    for metric, label, unit, digits in GPU_FACTS:
        if metric in metrics:
            facts.append((label, f"{metrics[metric]:,.{digits}f} {unit}"))
    return facts


def _empty_text(
    assignment: list[Any] | None, placement: dict[str, Any] | None, notes: list[str], active: bool
) -> str:
    """Why the run shows no GPU row: no assignment yet or at all, a CPU host, no figures."""
    resource = str((placement or {}).get("resource") or "")
    cpu = resource == "CPU" or any("CPU" in n for n in notes)
    why = [n.rstrip(".") + "." for n in notes]
    if not assignment:
        why.insert(
            0,
            "No GPU assignment recorded"
            + (
                ": the run has not been placed yet."
                if active
                else " (the run ran before GPU assignments were recorded, or was never placed)."
            ),
        )
    if cpu or not resource:
        why.append(NOT_MEASURED_ON_CPU)
    else:
        why.append(
            "No GPU utilisation, memory, power or energy figures for this run "
            "(left out, never shown as zeros)."
        )
    return " ".join(why)
