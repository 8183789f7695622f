"""The terminal comparison table shows capacity under SLOs: ratio, bracket interval, verdict."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from orchestrator.cli.report import capacity_rows, comparison_table


def _render(comp: dict[str, Any]) -> str:
    console = Console(record=True, width=400, color_system=None)
    console.print(comparison_table(comp))
    return console.export_text()


def _capacity(**kw: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "variable": "request_rate",
        "unit": "requests/s",
        "capacity": 8.0,
        "reference_capacity": 4.0,
        "ratio": 2.0,
        "ci_low": 1.9,
        "ci_high": 2.1,
        "verdict": "higher",
        "capacity_per_device": 8.0,
        "reference_capacity_per_device": 4.0,
        "per_device_ratio": 2.0,
        "per_device_ci_low": 1.9,
        "per_device_ci_high": 2.1,
        "per_device_verdict": "higher",
        "binding_slo": {"reference": "ttft_ms p99", "variant": "tpot_ms p99"},
        "devices": {"reference": 1, "variant": 1},
        "reason": None,
        "notes": [],
    }
    doc.update(kw)
    return doc


def _comparison(capacity: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "experiment_id": "e1",
        "repeats": 1,
        "chain": [
            {"variant": "baseline", "reference": None},
            {
                "variant": "apc-on",
                "reference": "baseline",
                "reference_value": False,
                "variant_value": True,
            },
        ],
        "variants": [
            {
                "variant": "apc-on",
                "reference": "baseline",
                "variable": "engine_args.enable_prefix_caching",
                "metrics": [
                    {
                        "metric": "median_ttft_ms",
                        "reference": 200.0,
                        "variant": 50.0,
                        "ratio": 0.25,
                        "ci_low": 0.2,
                        "ci_high": 0.3,
                        "ci_of": "ratio",
                        "verdict": "better",
                    }
                ],
                "capacity": capacity,
            }
        ],
        "findings": [],
    }


def test_capacity_row_with_ratio_interval_and_verdict() -> None:
    text = _render(_comparison(_capacity()))
    line = next(ln for ln in text.splitlines() if "capacity (requests/s)" in ln)
    for part in ("4", "8", "2.00", "[1.90, 2.10]", "higher", "ttft_ms p99 / tpot_ms p99"):
        assert part in line
    assert "median_ttft_ms" in text  # the metric rows stay
    assert "searches' brackets" in text  # the caption says where the interval comes from
    assert "capacity per device" not in text  # same devices: the per-device row adds nothing


def test_unknown_capacity_shows_the_reason() -> None:
    cap = _capacity(
        capacity=8.0,
        reference_capacity=None,
        ratio=None,
        ci_low=None,
        ci_high=None,
        verdict="unknown",
        per_device_ratio=None,
        reason="reference: uncertain",
    )
    text = _render(_comparison(cap))
    line = next(ln for ln in text.splitlines() if "capacity (requests/s)" in ln)
    assert "unknown (reference: uncertain)" in line


def test_per_device_row_when_devices_differ() -> None:
    cap = _capacity(
        capacity=15.0,
        reference_capacity=10.0,
        ratio=1.5,
        ci_low=1.43,
        ci_high=1.55,
        capacity_per_device=7.5,
        reference_capacity_per_device=10.0,
        per_device_ratio=0.75,
        per_device_ci_low=0.71,
        per_device_ci_high=0.78,
        per_device_verdict="lower",
        devices={"reference": 1, "variant": 2},
    )
    rows = capacity_rows(cap)
    assert len(rows) == 2
    assert rows[0][-1] == "higher" and rows[1][-1] == "lower"
    assert rows[1][0] == "capacity per device (1 -> 2)" and rows[1][3] == "0.75"
    assert "[0.71, 0.78]" in _render(_comparison(cap))


def test_no_capacity_no_row() -> None:
    assert capacity_rows(None) == []
    text = _render(_comparison(None))
    assert "capacity" not in text and "median_ttft_ms" in text


def test_the_capacity_interval_is_labelled_a_bracket_not_a_ci() -> None:
    text = _render(_comparison(_capacity()))
    header = next(ln for ln in text.splitlines() if "variant value" in ln)
    assert "interval" in header and "95 %" not in header and "CI" not in header
    assert "95 % bootstrap interval" not in text
    line = next(ln for ln in text.splitlines() if "capacity (requests/s)" in ln)
    assert "bracket [1.90, 2.10]" in line
    metric = next(ln for ln in text.splitlines() if "median_ttft_ms" in ln)
    assert "[0.20, 0.30]" in metric and "bracket" not in metric
    flat = " ".join(text.split())
    assert "(highest pass .. lowest fail), not a 95 % CI" in flat  # the caption


def test_nan_prints_a_dash_and_no_verdict_without_a_ratio() -> None:
    nan = float("nan")
    (row,) = capacity_rows(_capacity(capacity=nan, ratio=nan, ci_low=nan, ci_high=2.1))
    assert row[2] == "\u2013" and row[3] == "\u2013"
    assert row[4] == "at most 2.10 (one-sided)"  # the end that is there, said as such
    assert row[-1] == "unknown (no ratio)"  # "higher" needs a lower end above 1
    (row,) = capacity_rows(_capacity(ratio=None, ci_low=None, ci_high=None))
    assert row[-1] == "unknown (no ratio)" and "nan" not in " ".join(row).lower()
    (row,) = capacity_rows(_capacity(ratio=True))  # a bool is not a number
    assert row[3] == "\u2013" and row[-1] == "higher"  # the interval carries the verdict
    (row,) = capacity_rows(_capacity(ci_low=0.9))  # "higher" with an interval around 1
    assert row[-1] == "unknown (no ratio)"
    # the per-device row the same way
    rows = capacity_rows(
        _capacity(
            devices={"reference": 1, "variant": 2},
            per_device_ratio=0.75,
            per_device_ci_low=None,
            per_device_ci_high=None,
            per_device_verdict="lower",
        )
    )
    assert rows[1][4] == "\u2013" and rows[1][-1] == "unknown (no ratio)"


def test_unit_never_prints_none() -> None:
    (row,) = capacity_rows(_capacity(unit=None, variable=None))
    assert row[0].startswith("capacity (unknown unit)") and "None" not in row[0]


def test_one_sided_capacity_row_states_the_bound() -> None:
    cap = _capacity(
        capacity=None,
        ratio=None,
        ci_low=24.0 / 8.4,
        ci_high=None,
        verdict="higher",
        statement="higher: at least 2.86x",
        bounds={"reference": "found 8 [8, 8.4]", "variant": "at least 24"},
        reference_capacity=8.0,
        per_device_ratio=None,
    )
    (row,) = capacity_rows(cap)
    assert row[1] == "8" and row[2] == "at least 24"
    assert row[3] == "\u2013" and row[4] == "at least 2.86 (one-sided)"
    assert row[-1] == "higher: at least 2.86x"
    lower = _capacity(
        capacity=None,
        ratio=None,
        ci_low=None,
        ci_high=0.25,
        verdict="lower",
        statement="lower: at most 0.25x",
        bounds={"reference": "found 4 [4, 4.2]", "variant": "below 1"},
    )
    (row,) = capacity_rows(lower)
    assert row[2] == "below 1" and row[4] == "at most 0.25 (one-sided)"
    assert row[-1] == "lower: at most 0.25x"


def test_untrusted_capacity_has_no_verdict() -> None:
    cap = _capacity(
        ratio=None,
        ci_low=None,
        ci_high=None,
        verdict="untrusted",
        trustworthy=False,
        untrusted_reason="variant run v0: measured on a warm prefix cache",
    )
    (row,) = capacity_rows(cap)
    assert row[3] == "\u2013" and row[4] == "\u2013"
    assert row[-1] == "untrusted (variant run v0: measured on a warm prefix cache)"
    assert "higher" not in " ".join(row)
