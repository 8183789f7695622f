"""GPU telemetry of a run: utilisation, memory, power and energy of the GPUs it holds.

:class:`GpuReader` reads the node's NVIDIA GPUs, once per call, from one of two
backends, in this order:

1. **NVML** (``pynvml``, package ``nvidia-ml-py``), when it loads and
   ``nvmlInit()`` succeeds: utilisation (``nvmlDeviceGetUtilizationRates``, %),
   memory (``nvmlDeviceGetMemoryInfo``, bytes -> MiB), power
   (``nvmlDeviceGetPowerUsage``, mW -> W) and the cumulative energy counter
   (``nvmlDeviceGetTotalEnergyConsumption``, mJ since the driver was loaded ->
   J; Volta and newer, otherwise ``None``).
2. **nvidia-smi** ``--query-gpu=index,uuid,name,utilization.gpu,memory.used,
   memory.total,power.draw --format=csv,noheader,nounits``: the same numbers
   except the energy counter, which nvidia-smi does not offer (``energy_j`` is
   ``None``); ``[N/A]`` / ``[Not Supported]`` values are ``None``.

Without either, readings are empty lists and :attr:`GpuReader.note` says why;
nothing here raises for a missing or failing backend.

A run's GPUs are the entries of its ``CUDA_VISIBLE_DEVICES``
(:func:`visible_devices`), indices or UUIDs, mapped to the node's readings by
:func:`resolve_visible`. :func:`gpu_sample_values` turns the readings of one
sampling instant into keys of the run's ``/metrics`` time series
(:class:`jobs.schemas.MetricSample` ``values``): per GPU ``gpu{k}_*`` (``k`` =
position in the run's GPU list) and the aggregates documented in
:data:`jobs.signals.enginemetrics.SAMPLE_KEYS`. :func:`summarize_gpu_samples` turns a run's
samples into run metrics (energy, energy per output token, mean power, peak
memory, mean utilisation) and an info dict for ``engine_info["gpu_telemetry"]``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from jobs.schemas import MetricSample

__all__ = [
    "GPU_AGGREGATE_KEYS",
    "NVIDIA_SMI_QUERY",
    "NVIDIA_SMI_TIMEOUT_S",
    "GpuReader",
    "GpuReading",
    "gpu_sample_values",
    "is_gpu_counter",
    "is_gpu_key",
    "parse_nvidia_smi",
    "resolve_visible",
    "summarize_gpu_samples",
    "visible_devices",
]

_log = logging.getLogger(__name__)

NVIDIA_SMI_QUERY = (
    "--query-gpu=index,uuid,name,utilization.gpu,memory.used,memory.total,power.draw",
    "--format=csv,noheader,nounits",
)
"""Arguments of the ``nvidia-smi`` call of the fallback backend (seven fields per line)."""

NVIDIA_SMI_TIMEOUT_S = 5.0
"""Seconds one ``nvidia-smi`` call may take before it counts as failed."""

GPU_AGGREGATE_KEYS = (
    "gpu_utilization_pct",
    "gpu_memory_used_mib",
    "gpu_power_w",
    "gpu_energy_j",
)
"""Aggregate sample keys over a run's GPUs (documented in
:data:`jobs.signals.enginemetrics.SAMPLE_KEYS`)."""

_PER_GPU_KEY = re.compile(r"gpu(\d+)_(utilization_pct|memory_used_mib|power_w|energy_j)")
_PER_GPU_MEMORY_KEY = re.compile(r"gpu\d+_memory_used_mib")
_NA_VALUES = frozenset({"", "n/a", "[n/a]", "[not supported]", "not supported", "[unknown error]"})
_MIB = 1024.0 * 1024.0

_UNSET: Any = object()


@dataclass(frozen=True)
class GpuReading:
    """One GPU at one instant.

    Attributes:
        index: physical index as nvidia-smi and NVML number it (PCI bus order).
        uuid: ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``.
        name: model name, e.g. ``NVIDIA H200``.
        utilization_pct: percent of the last sample period a kernel ran (0-100).
        memory_used_mib: device memory in use, MiB.
        memory_total_mib: device memory, MiB.
        power_w: power draw, W.
        energy_j: cumulative energy counter, J since the driver was loaded (NVML
            reports mJ); ``None`` when the counter is not available (nvidia-smi
            backend, GPUs older than Volta).

    Any numeric field is ``None`` when the backend cannot read it.
    """

    index: int
    uuid: str
    name: str
    utilization_pct: float | None
    memory_used_mib: float | None
    memory_total_mib: float | None
    power_w: float | None
    energy_j: float | None


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _smi_number(field: str) -> float | None:
    """A number of nvidia-smi CSV output, ``None`` for ``[N/A]`` and the like."""
    field = field.strip()
    if field.lower() in _NA_VALUES:
        return None
    try:
        value = float(field)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def parse_nvidia_smi(text: str) -> list[GpuReading]:
    """Readings from the output of ``nvidia-smi`` with :data:`NVIDIA_SMI_QUERY`.

    One line per GPU: ``index, uuid, name, utilization.gpu (%), memory.used
    (MiB), memory.total (MiB), power.draw (W)``. A name containing commas is
    kept whole (the first two fields are split from the left, the last four
    from the right). Lines that do not parse are skipped. ``energy_j`` is
    always ``None``.
    """
    out: list[GpuReading] = []
    for line in text.splitlines():
        head = line.split(",", 2)
        if len(head) != 3:
            continue
        tail = head[2].rsplit(",", 4)
        if len(tail) != 5:
            continue
        try:
            index = int(head[0].strip())
        except ValueError:
            continue
        name, util, mem_used, mem_total, power = tail
        out.append(
            GpuReading(
                index=index,
                uuid=head[1].strip(),
                name=name.strip(),
                utilization_pct=_smi_number(util),
                memory_used_mib=_smi_number(mem_used),
                memory_total_mib=_smi_number(mem_total),
                power_w=_smi_number(power),
                energy_j=None,
            )
        )
    return out


class GpuReader:
    """Reads the node's NVIDIA GPUs through NVML, else ``nvidia-smi``, else nothing.

    Args:
        nvml: the NVML module to use; by default ``import pynvml`` (package
            ``nvidia-ml-py``) and ``nvmlInit()``, and a failure of either is
            a note, not an error. ``None`` disables NVML. Tests pass a fake
            object with the ``nvml*`` functions used here.
        nvidia_smi: path of the ``nvidia-smi`` executable; by default
            ``shutil.which("nvidia-smi")``. ``None`` disables the fallback.

    Attributes:
        source: ``"nvml"``, ``"nvidia-smi"`` or ``None`` (no backend).
        note: why nothing (or less) can be read: which backend failed and why;
            empty when NVML works. Updated when a read fails.

    Never raises for a missing or failing backend; call :meth:`close` when done.
    """

    def __init__(self, nvml: Any | None = _UNSET, nvidia_smi: str | None = _UNSET) -> None:
        self.source: Literal["nvml", "nvidia-smi"] | None = None
        self.note = ""
        self._nvml: Any | None = None
        self._smi: str | None = None

        nvml_reason: str
        if nvml is None:
            nvml_reason = "NVML disabled"
        else:
            if nvml is _UNSET:
                try:
                    # deferred: pynvml (NVML) is optional and loads the NVIDIA driver library
                    import pynvml  # type: ignore[import-untyped,unused-ignore]

                    nvml = pynvml
                except Exception as exc:  # ImportError, or anything its import raises
                    nvml = None
                    nvml_reason = f"NVML did not load ({exc!r})"
            if nvml is not None:
                try:
                    nvml.nvmlInit()
                except Exception as exc:  # pynvml.NVMLError_LibraryNotFound etc.
                    nvml_reason = f"NVML did not load ({exc})"
                else:
                    self._nvml = nvml
                    self.source = "nvml"
                    return

        if nvidia_smi is _UNSET:
            nvidia_smi = shutil.which("nvidia-smi")
        if nvidia_smi:
            self._smi = nvidia_smi
            self.source = "nvidia-smi"
            self.note = f"{nvml_reason}; reading nvidia-smi (no energy counter, power is sampled)"
        else:
            self.note = (
                f"no NVIDIA GPU telemetry on this node: {nvml_reason} and nvidia-smi is not on PATH"
            )
        _log.debug("GPU telemetry: source=%s note=%s", self.source, self.note)

    # ------------------------------------------------------------------ public

    def devices(self) -> list[GpuReading]:
        """All GPUs of the node, in index order; ``[]`` without a backend or on failure."""
        if self._nvml is not None:
            try:
                count = int(self._nvml.nvmlDeviceGetCount())
            except Exception as exc:
                self.note = f"NVML nvmlDeviceGetCount failed ({exc})"
                return []
            return [r for r in (self._nvml_read(i) for i in range(count)) if r is not None]
        if self._smi is not None:
            return self._smi_read()
        return []

    def read(self, indices: Sequence[int]) -> list[GpuReading]:
        """The GPUs with these physical indices, in the given order.

        Indices the node does not have are skipped; ``[]`` without a backend.
        """
        if not indices:
            return []
        if self._nvml is not None:
            try:
                count = int(self._nvml.nvmlDeviceGetCount())
            except Exception as exc:
                self.note = f"NVML nvmlDeviceGetCount failed ({exc})"
                return []
            wanted = [i for i in indices if 0 <= i < count]
            return [r for r in (self._nvml_read(i) for i in wanted) if r is not None]
        if self._smi is not None:
            by_index = {r.index: r for r in self._smi_read()}
            return [by_index[i] for i in indices if i in by_index]
        return []

    def close(self) -> None:
        """Release NVML (``nvmlShutdown``) when it was used; safe to call twice."""
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._nvml = None
            self._smi = None
            self.source = None
            self.note = "closed"

    def __enter__(self) -> GpuReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- backends

    def _nvml_read(self, index: int) -> GpuReading | None:
        nvml = self._nvml
        assert nvml is not None
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as exc:
            _log.debug("NVML handle of GPU %d: %s", index, exc)
            return None

        def get(fn: str) -> Any:
            try:
                return getattr(nvml, fn)(handle)
            except Exception:  # NVMLError_NotSupported, a lost GPU, ...
                return None

        util = get("nvmlDeviceGetUtilizationRates")
        mem = get("nvmlDeviceGetMemoryInfo")
        power_mw = get("nvmlDeviceGetPowerUsage")
        energy_mj = get("nvmlDeviceGetTotalEnergyConsumption")
        uuid = get("nvmlDeviceGetUUID")
        name = get("nvmlDeviceGetName")
        return GpuReading(
            index=index,
            uuid=_text(uuid) if uuid is not None else "",
            name=_text(name) if name is not None else "",
            utilization_pct=_number(getattr(util, "gpu", None)),
            memory_used_mib=_scaled(getattr(mem, "used", None), _MIB),
            memory_total_mib=_scaled(getattr(mem, "total", None), _MIB),
            power_w=_scaled(power_mw, 1000.0),
            energy_j=_scaled(energy_mj, 1000.0),
        )

    def _smi_read(self) -> list[GpuReading]:
        assert self._smi is not None
        try:
            proc = subprocess.run(
                [self._smi, *NVIDIA_SMI_QUERY],
                capture_output=True,
                text=True,
                timeout=NVIDIA_SMI_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            self.note = f"nvidia-smi failed: {exc!r}"
            return []
        if proc.returncode != 0:
            tail = (proc.stdout.strip() or proc.stderr.strip())[-300:]
            self.note = f"nvidia-smi exited with {proc.returncode}: {tail}"
            return []
        return parse_nvidia_smi(proc.stdout)


def _number(value: Any) -> float | None:
    if value is None:
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def _scaled(value: Any, divisor: float) -> float | None:
    number = _number(value)
    return None if number is None else number / divisor


# --------------------------------------------------------------- visible devices


def visible_devices(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The entries of ``CUDA_VISIBLE_DEVICES`` in ``environ`` (default ``os.environ``).

    ``None`` when the variable is unset (every GPU is visible), ``[]`` when it
    is set to an empty string (no GPU is visible); otherwise the comma-separated
    entries with spaces stripped, e.g. ``"0, 2"`` -> ``["0", "2"]``.
    """
    env = os.environ if environ is None else environ
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    if not value.strip():
        return []
    return [entry.strip() for entry in value.split(",")]


def resolve_visible(readings_of_all: list[GpuReading], entries: list[str]) -> list[GpuReading]:
    """The readings named by ``CUDA_VISIBLE_DEVICES`` entries, in entry order.

    An entry is a physical index (``"2"``) or a UUID (``"GPU-5113..."``), or a
    unique prefix of one, as CUDA accepts (compared without case). As in CUDA,
    the first entry that names no GPU of ``readings_of_all`` (or an ambiguous
    prefix) ends the list: ``"0,2,-1,1"`` gives GPUs 0 and 2. An entry naming a
    GPU already listed is skipped. Indices are NVML / nvidia-smi numbering,
    which is what Ray and vLLM put in the variable.
    """
    out: list[GpuReading] = []
    seen: set[int] = set()
    by_index = {r.index: r for r in readings_of_all}
    for entry in entries:
        match: GpuReading | None = None
        if re.fullmatch(r"\d+", entry):
            match = by_index.get(int(entry))
        elif entry.upper().startswith("GPU-"):
            wanted = entry.lower()
            hits = [r for r in readings_of_all if r.uuid.lower().startswith(wanted)]
            exact = [r for r in hits if r.uuid.lower() == wanted]
            if exact:
                match = exact[0]
            elif len(hits) == 1:
                match = hits[0]
        if match is None:
            break
        if match.index in seen:
            continue
        seen.add(match.index)
        out.append(match)
    return out


# ------------------------------------------------------------------ sample keys


def is_gpu_key(key: str) -> bool:
    """True for a sample key written by :func:`gpu_sample_values` (aggregate or ``gpu{k}_*``)."""
    return key in GPU_AGGREGATE_KEYS or _PER_GPU_KEY.fullmatch(key) is not None


def is_gpu_counter(key: str) -> bool:
    """True for the cumulative energy keys ``gpu_energy_j`` and ``gpu{k}_energy_j``."""
    return key == "gpu_energy_j" or (
        (m := _PER_GPU_KEY.fullmatch(key)) is not None and m.group(2) == "energy_j"
    )


def gpu_sample_values(readings: Sequence[GpuReading]) -> dict[str, float]:
    """Sample keys for one reading of a run's GPUs (``readings`` in run order).

    Per GPU at position ``k``: ``gpu{k}_utilization_pct`` (%),
    ``gpu{k}_memory_used_mib`` (MiB), ``gpu{k}_power_w`` (W) and
    ``gpu{k}_energy_j`` (J, cumulative counter), each only when read.
    Aggregates, each only when *every* GPU has the value (a partial sum would
    pass for the whole): ``gpu_utilization_pct`` (mean), ``gpu_memory_used_mib``
    (sum), ``gpu_power_w`` (sum), ``gpu_energy_j`` (sum). No readings give ``{}``.
    """
    out: dict[str, float] = {}
    fields = (
        ("utilization_pct", "utilization_pct"),
        ("memory_used_mib", "memory_used_mib"),
        ("power_w", "power_w"),
        ("energy_j", "energy_j"),
    )
    for k, reading in enumerate(readings):
        for attr, suffix in fields:
            value = getattr(reading, attr)
            if value is not None:
                out[f"gpu{k}_{suffix}"] = float(value)
    if not readings:
        return out

    def every(attr: str) -> list[float] | None:
        values = [getattr(r, attr) for r in readings]
        return None if any(v is None for v in values) else [float(v) for v in values]

    if (util := every("utilization_pct")) is not None:
        out["gpu_utilization_pct"] = sum(util) / len(util)
    if (mem := every("memory_used_mib")) is not None:
        out["gpu_memory_used_mib"] = sum(mem)
    if (power := every("power_w")) is not None:
        out["gpu_power_w"] = sum(power)
    if (energy := every("energy_j")) is not None:
        out["gpu_energy_j"] = sum(energy)
    return out


# -------------------------------------------------------------------- summary


def summarize_gpu_samples(
    samples: Sequence[MetricSample],
    output_tokens: int | None,
    gpus: int,
    *,
    source: str | None = None,
) -> tuple[dict[str, float], dict[str, Any]]:
    """Run metrics and telemetry info from the GPU keys of a run's samples.

    The measured window runs from the last ``before`` sample to the first
    ``after`` sample (``t_s``, seconds); without those, from the first to the
    last sample.

    Metrics (each only when it can be computed, never zero-filled):

    - ``gpu_energy_j`` (J, all the run's GPUs): the ``gpu_energy_j`` counter
      delta between the ``before`` and ``after`` samples when both carry it
      (``energy_source`` ``"nvml_energy_counter"``); otherwise the trapezoid
      integral of ``gpu_power_w`` over the window's samples in time order
      (``"power_integral"``: sampled power, so short bursts between samples are
      missed). Needs two usable points, else left out with a note.
    - ``energy_per_output_token_j`` (J/token) = ``gpu_energy_j / output_tokens``,
      only when ``output_tokens > 0``.
    - ``gpu_mean_power_w`` (W per GPU) = ``gpu_energy_j`` / the span of the
      points used / ``gpus``.
    - ``gpu_peak_memory_used_mib`` (MiB): max of any single ``gpu{k}_memory_used_mib``.
    - ``gpu_mean_utilization_pct`` (%): mean of ``gpu_utilization_pct`` over
      ``during`` samples.

    Returns:
        ``(metrics, info)``; ``info`` is for ``engine_info["gpu_telemetry"]``:
        ``available`` (bool), ``source`` (the argument, or ``"nvml"`` when an
        energy counter is present; absent when unknown), ``energy_source``
        (when energy was computed), ``notes`` (list of str). When no sample
        carries a GPU key: ``({}, {"available": False, "note": ..., "notes": [...]})``.
    """
    gpu_samples = [s for s in samples if any(is_gpu_key(k) for k in s.values)]
    if not gpu_samples:
        note = "no GPU telemetry in the run's samples (no NVIDIA GPU, NVML or nvidia-smi)"
        return {}, {"available": False, "note": note, "notes": [note]}

    ordered = sorted(samples, key=lambda s: s.t_s)
    metrics: dict[str, float] = {}
    notes: list[str] = []
    info: dict[str, Any] = {"available": True}
    has_counter = any("gpu_energy_j" in s.values for s in gpu_samples)
    if source is not None:
        info["source"] = source
    elif has_counter:
        info["source"] = "nvml"

    energy, span = _energy(ordered, info, notes)
    if energy is not None:
        metrics["gpu_energy_j"] = energy
        if output_tokens is not None and output_tokens > 0:
            metrics["energy_per_output_token_j"] = energy / output_tokens
        else:
            notes.append("no output tokens: energy_per_output_token_j left out")
        if gpus > 0 and span > 0:
            metrics["gpu_mean_power_w"] = energy / span / gpus
        elif gpus <= 0:
            notes.append("GPU count unknown: gpu_mean_power_w left out")

    memory = [
        v for s in gpu_samples for k, v in s.values.items() if _PER_GPU_MEMORY_KEY.fullmatch(k)
    ]
    if memory:
        metrics["gpu_peak_memory_used_mib"] = max(memory)
    util = [
        s.values["gpu_utilization_pct"]
        for s in gpu_samples
        if s.phase == "during" and "gpu_utilization_pct" in s.values
    ]
    if util:
        metrics["gpu_mean_utilization_pct"] = sum(util) / len(util)

    info["notes"] = notes
    return metrics, info


def _energy(
    ordered: list[MetricSample], info: dict[str, Any], notes: list[str]
) -> tuple[float | None, float]:
    """The run's GPU energy (J) and the span (s) it covers: the counter's delta from
    the last ``before`` to the first ``after`` sample, else the power integral over the
    window; ``info["energy_source"]`` says which, ``notes`` what was missing."""
    befores = [s for s in ordered if s.phase == "before"]
    afters = [s for s in ordered if s.phase == "after"]
    t_start = befores[-1].t_s if befores else ordered[0].t_s
    t_end = afters[0].t_s if afters else ordered[-1].t_s
    before_e = next((s for s in reversed(befores) if "gpu_energy_j" in s.values), None)
    after_e = next((s for s in afters if "gpu_energy_j" in s.values), None)
    if before_e is not None and after_e is not None:
        delta = after_e.values["gpu_energy_j"] - before_e.values["gpu_energy_j"]
        if delta >= 0 and after_e.t_s > before_e.t_s:
            info["energy_source"] = "nvml_energy_counter"
            return delta, after_e.t_s - before_e.t_s
        notes.append(
            "the energy counter went down between the before and after samples "
            "(driver reload?): using the power integral instead"
        )
    points = [
        (s.t_s, s.values["gpu_power_w"])
        for s in ordered
        if "gpu_power_w" in s.values and t_start <= s.t_s <= t_end
    ]
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        notes.append("fewer than 2 usable GPU power/energy samples: energy metrics left out")
        return None, 0.0
    energy = sum(
        (t1 - t0) * (p0 + p1) / 2.0 for (t0, p0), (t1, p1) in zip(points, points[1:], strict=False)
    )
    span = points[-1][0] - points[0][0]
    info["energy_source"] = "power_integral"
    notes.append(
        "energy is the trapezoid integral of sampled power "
        f"({len(points)} points over {span:.1f} s): bursts between samples are missed"
    )
    if span < (t_end - t_start) - 1e-9:
        notes.append(f"power samples cover {span:.1f} s of the {t_end - t_start:.1f} s window")
    return energy, span
