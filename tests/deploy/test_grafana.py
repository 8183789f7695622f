"""The Grafana dashboard (deploy/grafana/vlab.json) queries only documented series, each
the way its type allows.

Every PromQL expression names at least one ``vlab_*`` series, and each name is one of the
table in docs/OPERATIONS.md (a histogram through its ``_bucket``/``_sum``/``_count``);
``rate``/``increase`` take counters or histogram series only, ``delta`` gauges only, and
``histogram_quantile`` a ``_bucket`` series. No Prometheus runs here: the expressions are
checked as text, not evaluated.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.api.test_metrics import documented_series

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "vlab.json"
SERIES = re.compile(r"\bvlab_[a-z0-9_]+")
HISTOGRAM_PARTS = ("_bucket", "_sum", "_count")


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from _panels(p.get("panels", []))


def expressions() -> list[tuple[str, str]]:
    """``(where, PromQL)`` of every target and of the templating queries."""
    doc = json.loads(DASHBOARD.read_text())
    out = [
        (f"panel {p['title']!r} {t['refId']}", t["expr"])
        for p in _panels(doc["panels"])
        for t in p.get("targets", [])
    ]
    for var in doc["templating"]["list"]:
        if var["type"] == "query":
            out.append((f"variable {var['name']}", var["definition"]))
    return out


def resolve(name: str, documented: dict[str, str]) -> tuple[str, str] | None:
    """The documented ``(series, type)`` a name in a query refers to, or None."""
    if name in documented:
        return name, documented[name]
    for part in HISTOGRAM_PARTS:
        base = name.removesuffix(part)
        if base != name and documented.get(base) == "histogram":
            return base, "histogram"
    return None


def test_dashboard_is_importable_json() -> None:
    doc = json.loads(DASHBOARD.read_text())
    assert doc["uid"] and doc["title"] == "vlab"
    panels = [p for p in _panels(doc["panels"]) if p["type"] != "row"]
    assert len({p["id"] for p in _panels(doc["panels"])}) == len(list(_panels(doc["panels"])))
    for p in panels:
        assert p["targets"], p["title"]
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]), p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]


@pytest.mark.parametrize("where,expr", expressions())
def test_every_query_uses_documented_series_as_their_type_allows(where: str, expr: str) -> None:
    documented = documented_series()
    names = SERIES.findall(expr)
    assert names, f"{where}: no vlab_ series in {expr!r}"
    for name in names:
        assert resolve(name, documented) is not None, f"{where}: {name} is not documented"
    for a, b in (("(", ")"), ("{", "}"), ("[", "]")):
        assert expr.count(a) == expr.count(b), f"{where}: unbalanced {a}{b}"
    for fn, name in re.findall(r"\b(rate|increase|delta|histogram_quantile)\(([^)]*)", expr):
        inner = SERIES.search(name) or SERIES.search(expr[expr.index(name) :])
        assert inner is not None, f"{where}: {fn} of no series"
        series, kind = resolve(inner.group(0), documented) or ("", "")
        if fn in ("rate", "increase"):
            assert kind in ("counter", "histogram"), f"{where}: {fn} of a {kind} ({series})"
        elif fn == "delta":
            assert kind == "gauge", f"{where}: delta of a {kind} ({series})"
        else:
            assert inner.group(0).endswith("_bucket"), f"{where}: quantile of {inner.group(0)}"


def test_every_documented_series_is_on_the_dashboard() -> None:
    used = {
        resolved[0]
        for _, expr in expressions()
        for name in SERIES.findall(expr)
        if (resolved := resolve(name, documented_series()))
    }
    assert set(documented_series()) - used == set()
