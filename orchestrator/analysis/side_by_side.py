"""Any runs side by side: each succeeded run against one reference run, one metric at a
time (the dashboard's ``/compare`` page; :func:`orchestrator.analysis.service.compare_stored_runs`
reads the runs).

Each run is compared alone with the reference alone with
:func:`~orchestrator.analysis.compare.compare_variant` (one repeat per side: a
hierarchical bootstrap that degenerates to a request bootstrap, seed :data:`SEED`); a
metric the comparison lacks falls back to the stored summary metrics (a point ratio, no
interval); flags of either run taint a metric (:mod:`orchestrator.analysis.trust`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from orchestrator.analysis.bootstrap import finite_float
from orchestrator.analysis.compare import MetricComparison, RunData, compare_variant
from orchestrator.analysis.trust import SidesTrust, na_text, trust_of

#: The bootstrap's seed: the same runs give the same intervals.
SEED = 0


@dataclass
class Cell:
    """One run x metric: ``value`` in the metric's unit; the rest vs the reference.

    ``ratio`` = value / reference value. ``ci_low``/``ci_high``: the 95 %
    bootstrap interval of the ratio (``ci_of="ratio"``) or of the difference
    value - reference (``ci_of="difference"``, when the reference is 0).
    ``source``: ``"bootstrap"`` (from :func:`compare_variant`), ``"point"`` (no
    per-request records or a metric one side lacks in the comparison: a point
    ratio of the stored summary metrics, no interval) or ``"reference"``.
    ``untrusted_reason``: why a flag of this run or the reference taints the metric
    (:mod:`orchestrator.analysis.trust`): verdict ``untrusted``, no ratio, no interval;
    ``na``: ``n/a (off)`` when this run cannot have the metric.
    """

    value: float | None = None
    ratio: float | None = None
    difference: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    ci_of: str | None = None
    verdict: str | None = None
    source: str | None = None
    n_requests: int | None = None
    untrusted_reason: str | None = None
    na: str | None = None

    def value_interval(self, reference: float | None) -> tuple[float, float] | None:
        """The interval on the value scale: ratio CI x reference, or reference + difference CI."""
        if self.ci_low is None or self.ci_high is None or reference is None:
            return None
        if self.ci_of == "ratio":
            return reference * self.ci_low, reference * self.ci_high
        if self.ci_of == "difference":
            return reference + self.ci_low, reference + self.ci_high
        return None


def _cell(comp: MetricComparison) -> Cell:
    why = comp.not_applicable.get("variant")
    return Cell(
        value=comp.variant,
        untrusted_reason=comp.untrusted_reason,
        na=na_text(why) if why else None,
        ratio=comp.ratio,
        difference=comp.difference,
        ci_low=comp.ci_low,
        ci_high=comp.ci_high,
        ci_of=comp.ci_of,
        verdict=comp.verdict,
        source="bootstrap",
        n_requests=comp.n_requests,
    )


def compare_runs(
    data: Sequence[RunData], ref: int, n_boot: int, metrics: Sequence[str]
) -> list[dict[str, Cell]]:
    """Every run of ``data`` against ``data[ref]`` on ``metrics`` (names of
    :data:`~orchestrator.analysis.compare.METRICS`).

    Returns one ``{metric name: Cell}`` per run, in ``data`` order (empty for
    runs that did not succeed). Each succeeded run is compared alone with the
    reference alone (``compare_variant([run], [reference], n_boot=n_boot,
    seed=0)``). A metric missing from the comparison (no per-request records,
    or one side lacks it) falls back to the run's stored summary metric, with a
    point ratio and verdict ``"insufficient data"`` when both sides have it.
    The reference's own cells carry its value only (``source="reference"``).
    """
    names = list(metrics)
    reference = data[ref]
    ref_ok = reference.status == "succeeded"
    comps: dict[int, dict[str, MetricComparison]] = {}
    if ref_ok:
        for i, run in enumerate(data):
            if i != ref and run.status == "succeeded":
                found = compare_variant([run], [reference], n_boot=n_boot, seed=SEED)
                comps[i] = {c.metric: c for c in found}
    ref_trust = trust_of(reference)
    ref_values: dict[str, float | None] = {}
    for name in names:
        from_comp = next((c[name].reference for c in comps.values() if name in c), None)
        ref_values[name] = (
            from_comp if from_comp is not None else finite_float(reference.metrics.get(name))
        )
        if name in ref_trust.not_applicable:
            ref_values[name] = None  # prefix caching off: no hit rate, never 0
    out: list[dict[str, Cell]] = []
    for i, run in enumerate(data):
        cells: dict[str, Cell] = {}
        if run.status != "succeeded":
            out.append(cells)
            continue
        mine = trust_of(run)
        for name in names:
            if i == ref:
                off = ref_trust.not_applicable.get(name)
                cells[name] = Cell(
                    value=ref_values[name],
                    source="reference",
                    untrusted_reason=ref_trust.reason(name),
                    na=na_text(off) if off else None,
                )
                continue
            comp = comps.get(i, {}).get(name)
            if comp is not None:
                cells[name] = _cell(comp)
                continue
            off = mine.not_applicable.get(name)
            value = None if off else finite_float(run.metrics.get(name))
            cell = Cell(value=value, na=na_text(off) if off else None)
            base = ref_values[name]
            why = SidesTrust([mine], [ref_trust]).reason(name)
            if ref_ok and why is not None and value is not None:
                cell.verdict, cell.untrusted_reason = "untrusted", why
            elif ref_ok and value is not None and base is not None:
                cell.ratio = value / base if base > 0 else None
                cell.difference = value - base
                cell.verdict = "insufficient data"
                cell.source = "point"
            cells[name] = cell
        out.append(cells)
    return out
