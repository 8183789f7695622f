"""One level's own estimates (an experiment's variant, its runs pooled): each metric's
value and percentile-bootstrap interval, without a reference to compare with.

The estimators and the metric table are those of :mod:`orchestrator.analysis.compare`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from orchestrator.analysis.bootstrap import (
    MIN_REQUEST_VALUES,
    MIN_RUN_REPEATS,
    hierarchical_counts,
    interval,
    mean_draws,
    weighted_quantiles,
)
from orchestrator.analysis.compare import (
    METRICS,
    RunData,
    by_field,
    field_values,
    quantiles_of,
    run_values,
    side_of,
)


def level_estimates(
    runs: Sequence[RunData],
    *,
    only: Collection[str] | None = None,
    n_boot: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
) -> dict[str, dict[str, float | None]]:
    """One level's own value and percentile-bootstrap CI for every metric of ``METRICS``.

    Same estimators as :func:`orchestrator.analysis.compare.compare_variant`, one side
    only: request-level metrics are percentiles (ms) of the pooled measured
    requests of the succeeded repeats, with a hierarchical bootstrap (repeats,
    then requests within each repeat); run-level metrics are the mean over
    repeats, with a bootstrap over repeats when there are at least
    ``MIN_RUN_REPEATS`` of them (else no interval).

    ``only``: compute just these metric names (default: all).

    Returns:
        ``{metric: {"value": float, "ci_low": float | None, "ci_high": float | None}}``;
        metrics without data are absent.
    """
    rng = np.random.Generator(np.random.PCG64(seed))
    out: dict[str, dict[str, float | None]] = {}
    wanted = [m for m in METRICS if only is None or m.name in only]
    side = side_of(runs)
    if side.requests and any(m.level == "request" for m in wanted):
        counts = hierarchical_counts(rng, side.sizes, n_boot)
        for field, specs in by_field(wanted).items():
            values, owner = field_values(side, field)
            if values.size == 0:
                continue
            values = values * 1000.0
            qs = quantiles_of(specs)
            draws = (
                weighted_quantiles(values, owner, counts, qs)
                if values.size >= MIN_REQUEST_VALUES
                else None
            )
            for k, (spec, q) in enumerate(zip(specs, qs, strict=True)):
                ci = None if draws is None else interval(draws[:, k], confidence)
                out[spec.name] = {
                    "value": float(np.percentile(values, 100.0 * q)),
                    "ci_low": ci[0] if ci else None,
                    "ci_high": ci[1] if ci else None,
                }
    for spec in wanted:
        if spec.level != "run":
            continue
        vals = run_values(runs, spec.name)
        if vals.size == 0:
            continue
        ci = (
            interval(mean_draws(rng, vals, n_boot), confidence)
            if vals.size >= MIN_RUN_REPEATS
            else None
        )
        out[spec.name] = {
            "value": float(vals.mean()),
            "ci_low": ci[0] if ci else None,
            "ci_high": ci[1] if ci else None,
        }
    return out
