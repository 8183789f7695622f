// Capacity under SLOs charts (Chart.js + the vendored error-bar plugin), shared by the
// run page (latency vs load of one search) and the experiment page (the runs' curves
// overlaid, and the Pareto chart of output tokens/s per device against tokens/s per user).
// The chart documents are built on the server (web/capacity_view.py) and embedded as JSON.
"use strict";
const vlabCapacity = (() => {
  Chart.register(ChartErrorBars.ScatterWithErrorBarsController, ChartErrorBars.PointWithErrorBar);

  const VERDICT = {
    pass: { color: "#1a7f37", style: "circle" },
    fail: { color: "#cf222e", style: "crossRot" },
    uncertain: { color: "#9a6700", style: "triangle" },
  };
  const SLO_COLOR = "#cf222e";
  const GREY = "#8c959f";

  function fmtY(unit, v, digits = 1) {
    if (v === null || v === undefined) return "–";
    return unit === "fraction" ? vlab.pct(v, digits) : `${vlab.fmt(v, digits)} ms`;
  }
  function fmtLoad(v) {
    if (v === null || v === undefined) return "–";
    return Number.isInteger(v) ? String(v) : vlab.fmt(v, Math.abs(v) >= 10 ? 1 : 2);
  }

  // Shades the bracket [low, high] and draws a dashed vertical line at the capacity
  // (options.plugins.capacityBracket = {capacity, low, high, label}); nothing when unset.
  const bracket = {
    id: "capacityBracket",
    beforeDatasetsDraw(chart, _args, o) {
      if (!o || o.capacity === null || o.capacity === undefined) return;
      const { ctx, chartArea: a, scales: { x } } = chart;
      ctx.save();
      if (o.low !== null && o.high !== null && o.high > o.low) {
        const x0 = Math.max(a.left, x.getPixelForValue(o.low));
        const x1 = Math.min(a.right, x.getPixelForValue(o.high));
        ctx.fillStyle = "rgba(26, 127, 55, 0.10)";
        if (x1 > x0) ctx.fillRect(x0, a.top, x1 - x0, a.bottom - a.top);
      }
      const px = x.getPixelForValue(o.capacity);
      if (px >= a.left && px <= a.right) {
        ctx.strokeStyle = "#1a7f37";
        ctx.setLineDash([3, 3]);
        ctx.beginPath(); ctx.moveTo(px, a.top); ctx.lineTo(px, a.bottom); ctx.stroke();
        ctx.setLineDash([]);
        ctx.font = "11px system-ui, sans-serif";
        const w = ctx.measureText(o.label).width;
        const tx = px + 4 + w > a.right ? px - 4 - w : px + 4;
        ctx.fillStyle = "rgba(255, 255, 255, 0.85)";
        ctx.fillRect(tx - 1, a.top + 2, w + 2, 13);
        ctx.fillStyle = "#1a7f37";
        ctx.fillText(o.label, tx, a.top + 12);
      }
      ctx.restore();
    },
  };

  // Writes each point's `name` next to it, for the datasets with `$labels: true`.
  const pointNames = {
    id: "pointNames",
    afterDatasetsDraw(chart) {
      const { ctx, chartArea: a } = chart;
      ctx.save();
      ctx.font = "600 11px system-ui, sans-serif";
      chart.data.datasets.forEach((ds, i) => {
        if (!ds.$labels || !chart.isDatasetVisible(i)) return;
        chart.getDatasetMeta(i).data.forEach((el, k) => {
          const name = ds.data[k] && ds.data[k].name;
          if (!name) return;
          const w = ctx.measureText(name).width;
          const tx = el.x + 10 + w > a.right ? el.x - 10 - w : el.x + 10;
          ctx.fillStyle = "rgba(255, 255, 255, 0.85)";
          ctx.fillRect(tx - 1, el.y - 16, w + 2, 13);
          ctx.fillStyle = "#1f2328";
          ctx.fillText(name, tx, el.y - 6);
        });
      });
      ctx.restore();
    },
  };

  function verdictStyle(points, key) {
    return points.map((p) => (VERDICT[p.verdict] || { color: GREY, style: "circle" })[key]);
  }

  function xMax(values) {
    const m = Math.max(...values.filter((v) => v !== null && v !== undefined), 0);
    return m > 0 ? m * 1.08 : 1;
  }

  function sloDatasets(objectives, max) {
    return objectives.filter((o) => o.objective !== null).map((o) => ({
      type: "scatter", label: `SLO ${o.label}`, $slo: true,
      data: [{ x: 0, y: o.objective }, { x: max, y: o.objective }],
      showLine: true, borderColor: SLO_COLOR, backgroundColor: SLO_COLOR, borderDash: [6, 4],
      borderWidth: 1.5, pointRadius: 0, pointHoverRadius: 0,
    }));
  }

  function errorBarPoints(points) {
    return points.filter((p) => p.y !== null).map((p) => ({
      x: p.x, y: p.y, yMin: p.lo ?? p.y, yMax: p.hi ?? p.y,
      verdict: p.verdict, step: p.step, lo: p.lo, hi: p.hi,
    }));
  }

  function options(xTitle, unit, max, extra) {
    return {
      animation: false, responsive: true, maintainAspectRatio: false,
      scales: {
        x: { type: "linear", min: 0, max, title: { display: true, text: xTitle } },
        y: {
          beginAtZero: true,
          title: { display: true, text: unit === "fraction" ? "fraction of requests" : "ms" },
          ticks: { callback: (v) => (unit === "fraction" ? vlab.pct(v, 0) : v) },
        },
      },
      plugins: {
        legend: { position: "bottom", labels: { boxWidth: 12, usePointStyle: true } },
        ...extra,
      },
    };
  }

  /**
   * The latency-vs-load chart of one objective metric of one search.
   * doc: web.capacity_view.curves(); chart: one of doc.charts.
   */
  function curveChart(canvas, doc, chart) {
    const old = Chart.getChart(canvas);
    if (old) old.destroy();
    const loads = chart.series.flatMap((s) => s.points.map((p) => p.x));
    const max = xMax([...loads, doc.high]);
    const datasets = [];
    chart.series.forEach((s, i) => {
      const pts = errorBarPoints(s.points);
      const name = s.percentile || "value";
      if (s.checked) {
        datasets.push({
          label: `${name} (SLO checked)`, $checked: true, data: pts, showLine: true,
          borderColor: vlab.color(i === 0 ? 0 : i + 3), backgroundColor: vlab.color(i === 0 ? 0 : i + 3),
          borderWidth: 1.5, pointRadius: 6, pointHoverRadius: 8, pointBorderWidth: 2,
          pointStyle: verdictStyle(pts, "style"),
          pointBackgroundColor: verdictStyle(pts, "color"), pointBorderColor: verdictStyle(pts, "color"),
          errorBarColor: "#59636e", errorBarWhiskerColor: "#59636e", errorBarWhiskerSize: 10,
        });
      } else {
        datasets.push({
          type: "scatter", label: name, data: pts.map((p) => ({ x: p.x, y: p.y, step: p.step })),
          showLine: true, borderColor: GREY, backgroundColor: GREY, borderWidth: 1,
          pointRadius: 2, pointHoverRadius: 4,
        });
      }
    });
    datasets.push(...sloDatasets(chart.objectives, max));
    const xTitle = `${doc.variable_label} (${doc.unit})`;
    return new Chart(canvas, {
      type: "scatterWithErrorBars",
      data: { datasets },
      plugins: [bracket],
      options: options(xTitle, chart.unit, max, {
        capacityBracket: doc.capacity === null ? {} : {
          capacity: doc.capacity, low: doc.low, high: doc.high,
          label: `capacity ${fmtLoad(doc.capacity)} ${doc.unit}`,
        },
        tooltip: { callbacks: { label(ctx) {
          const ds = ctx.dataset, p = ctx.raw;
          if (ds.$slo) return ds.label;
          const head = `${ds.label}: ${fmtY(chart.unit, p.y)} at ${fmtLoad(p.x)} ${doc.unit} (step ${p.step})`;
          if (!ds.$checked) return head;
          const ci = p.lo !== null && p.lo !== undefined ? ` [${fmtY(chart.unit, p.lo)}, ${fmtY(chart.unit, p.hi)}]` : "";
          return [head + ci, `verdict: ${p.verdict || "–"}`];
        } } },
      }),
    });
  }

  /** The experiment page's overlay: one objective, one series per capacity run. */
  function overlayChart(canvas, doc, objective, colorOf) {
    const old = Chart.getChart(canvas);
    if (old) old.destroy();
    const max = xMax(objective.runs.flatMap((r) => r.points.map((p) => p.x)));
    const datasets = objective.runs.map((r) => {
      const pts = errorBarPoints(r.points);
      const color = colorOf(r);
      return {
        label: r.label, $checked: true, $run: r.run_id, data: pts, showLine: true,
        borderColor: color, backgroundColor: color, borderWidth: 1.5,
        pointRadius: 5, pointHoverRadius: 7, pointBorderWidth: 2,
        pointStyle: verdictStyle(pts, "style"),
        errorBarColor: color, errorBarWhiskerColor: color, errorBarWhiskerSize: 8,
      };
    });
    datasets.push(...sloDatasets([objective], max));
    return new Chart(canvas, {
      type: "scatterWithErrorBars",
      data: { datasets },
      options: options(`${doc.variable_label} (${doc.unit})`, objective.unit, max, {
        tooltip: { callbacks: { label(ctx) {
          const ds = ctx.dataset, p = ctx.raw;
          if (ds.$slo) return ds.label;
          const ci = p.lo !== null && p.lo !== undefined ? ` [${fmtY(objective.unit, p.lo)}, ${fmtY(objective.unit, p.hi)}]` : "";
          return `${ds.label}: ${fmtY(objective.unit, p.y)}${ci} at ${fmtLoad(p.x)} ${doc.unit} — ${p.verdict || "–"}`;
        } } },
      }),
    });
  }

  /**
   * The Pareto chart (web.capacity_view.pareto()): a point per run, coloured per variant;
   * the non-dominated runs ringed, joined by the frontier line and named.
   */
  function paretoChart(canvas, doc) {
    const old = Chart.getChart(canvas);
    if (old) old.destroy();
    const colors = Object.fromEntries(doc.variants.map((v, i) => [v, vlab.color(i)]));
    const datasets = doc.variants.map((v) => {
      const pts = doc.points.filter((p) => p.variant === v);
      return {
        type: "scatter", label: v, $variant: v,
        data: pts.map((p) => ({ x: p.x, y: p.y, name: p.label, run_id: p.run_id, frontier: p.frontier, source: p.source, devices: p.devices })),
        backgroundColor: colors[v], borderColor: colors[v], pointRadius: 6, pointHoverRadius: 8,
        pointStyle: pts.map((p) => (p.frontier ? "rectRot" : "circle")),
      };
    }).filter((d) => d.data.length);
    const front = doc.points.filter((p) => p.frontier).sort((a, b) => a.x - b.x || b.y - a.y);
    datasets.push({
      type: "scatter", label: "Pareto frontier (non-dominated)", $frontier: true, $labels: true,
      data: front.map((p) => ({ x: p.x, y: p.y, name: p.label, run_id: p.run_id })),
      showLine: true, borderColor: "#1f2328", backgroundColor: "rgba(0, 0, 0, 0)",
      borderWidth: 1.5, borderDash: [4, 3], pointRadius: 11, pointHoverRadius: 11, pointBorderWidth: 2,
    });
    return new Chart(canvas, {
      type: "scatter",
      data: { datasets },
      plugins: [pointNames],
      options: {
        animation: false, responsive: true, maintainAspectRatio: false,
        scales: {
          x: { type: "linear", beginAtZero: true, title: { display: true, text: "output tokens/s per user (1000 / mean TPOT ms)" } },
          y: { beginAtZero: true, title: { display: true, text: "output tokens/s per device" } },
        },
        plugins: {
          legend: { position: "bottom", labels: { boxWidth: 12, usePointStyle: true } },
          tooltip: { callbacks: { label(ctx) {
            const p = ctx.raw;
            if (ctx.dataset.$frontier) return `${p.name}: non-dominated`;
            return [`${p.name}: ${vlab.fmt(p.x, 1)} tok/s per user, ${vlab.fmt(p.y, 1)} tok/s per device`,
              `${p.devices} device${p.devices === 1 ? "" : "s"} · ${p.source}${p.frontier ? " · non-dominated" : ""}`];
          } } },
        },
      },
    });
  }

  return { curveChart, overlayChart, paretoChart, VERDICT };
})();
