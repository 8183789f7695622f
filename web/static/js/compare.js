// Compare page: the per-run bar chart (95 % CI error bars) of the chosen metric, the reference
// picker, the paste form, and a reload when an active run finishes.
"use strict";
(() => {
  const KEY = "vlab.compare.selection";
  const MAX_GET_URL = 6000; // longer selections are posted (proxies such as nginx cap URLs at 8 KB)

  // ---------------------------------------------------------------- empty state
  const paste = document.getElementById("paste-form");
  if (paste) {
    paste.addEventListener("submit", (ev) => {
      const ids = paste.elements.run.value.split(/[\s,;]+/).filter(Boolean);
      const q = new URLSearchParams();
      for (const id of ids) q.append("run", id);
      const url = "/compare?" + q.toString();
      if (url.length <= MAX_GET_URL) { ev.preventDefault(); location.href = url; return; }
      paste.method = "post"; // the server splits the textarea the same way
    });
    const stored = JSON.parse(sessionStorage.getItem(KEY) || "[]");
    const here = new URLSearchParams(location.search).getAll("run");
    if (stored.length >= 2 && stored.join(",") !== here.join(",")) {
      const q = new URLSearchParams();
      for (const id of stored) q.append("run", id);
      const p = document.getElementById("stored-selection");
      const a = document.createElement("a");
      a.href = "/compare?" + q.toString();
      a.textContent = `Compare your selection from the run history (${stored.length} runs)`;
      p.append(a);
      p.hidden = false;
    }
    return;
  }

  // ---------------------------------------------------------------- reference picker
  const refSelect = document.getElementById("ref-select");
  if (refSelect) refSelect.addEventListener("change", () => refSelect.form.submit());

  // ---------------------------------------------------------------- chart
  Chart.register(ChartErrorBars.BarWithErrorBarsController, ChartErrorBars.BarWithErrorBar);
  const doc = JSON.parse(document.getElementById("compare-data").textContent);
  const select = document.getElementById("metric");
  const canvas = document.getElementById("chart");
  const box = document.getElementById("chart-box");
  const empty = document.getElementById("chart-empty");
  const COLORS = { reference: "#0969da", better: "#1a7f37", worse: "#cf222e", other: "#8c959f" };
  const many = doc.runs.length > 12;
  let chart = null;
  let current = null; // the metric on show

  // Wide enough for every bar (>= 10 px each); the container scrolls sideways.
  box.style.width = `max(100%, ${doc.runs.length * 12 + 80}px)`;

  function format(metric, v) {
    if (v === null || v === undefined) return "–";
    if (metric.unit === "fraction") return vlab.pct(v);
    const a = Math.abs(v);
    const digits = a >= 1000 ? 0 : a >= 10 ? 1 : a >= 1 ? 2 : 3;
    return `${vlab.fmt(v, digits)} ${metric.unit}`;
  }

  function delta(metric, p) {
    if (p.ratio != null && p.ci_of !== "difference") {
      const ci = p.ci_of === "ratio" ? ` [${p.ci_low.toFixed(2)}, ${p.ci_high.toFixed(2)}]` : " (no interval)";
      return `ratio ×${p.ratio.toFixed(2)}${ci}`;
    }
    if (p.difference == null) return "no ratio";
    const scale = metric.unit === "fraction" ? 100 : 1;
    const unit = metric.unit === "fraction" ? "pp" : metric.unit;
    const sign = (v) => (v >= 0 ? "+" : "") + (v * scale).toFixed(1);
    const ci = p.ci_of === "difference" ? ` [${sign(p.ci_low)}, ${sign(p.ci_high)}]` : " (no interval)";
    return `difference ${sign(p.difference)} ${unit}${ci}`;
  }

  function color(i, p) {
    if (i === doc.reference) return COLORS.reference;
    if (!p) return COLORS.other;
    return COLORS[p.verdict] || COLORS.other;
  }

  function draw() {
    const metric = doc.metrics.find((m) => m.name === select.value) || doc.metrics[0];
    current = metric;
    const points = doc.values[metric.name];
    const data = points.map((p) => (p === null
      ? { y: null, yMin: null, yMax: null }
      : { y: p.v, yMin: p.lo ?? p.v, yMax: p.hi ?? p.v }));
    const colors = points.map((p, i) => color(i, p));
    empty.hidden = points.some((p) => p !== null);
    const title = `${metric.label} (${metric.unit === "fraction" ? "%" : metric.unit})`;
    if (chart) {
      const ds = chart.data.datasets[0];
      ds.label = title;
      ds.data = data;
      ds.backgroundColor = colors;
      chart.options.scales.y.title.text = title;
      chart.update();
      return;
    }
    chart = new Chart(canvas, {
      type: "barWithErrorBars",
      data: {
        labels: doc.runs.map((r) => r.label),
        datasets: [{
          label: title,
          data,
          backgroundColor: colors,
          errorBarColor: "#1f2328",
          errorBarWhiskerColor: "#1f2328",
          errorBarWhiskerRatio: 0.4,
          errorBarLineWidth: 1.2,
          maxBarThickness: 48,
        }],
      },
      options: {
        responsive: true,
        maintainAspectRatio: false,
        animation: false,
        scales: {
          x: {
            title: { display: true, text: many ? "run (# as in the tables)" : "run" },
            ticks: {
              autoSkip: true,
              maxRotation: many ? 0 : 30,
              callback(value, index) { return many ? `#${index + 1}` : this.getLabelForValue(value); },
            },
          },
          y: {
            beginAtZero: true,
            title: { display: true, text: title },
            ticks: {
              callback(v) { return current.unit === "fraction" ? vlab.pct(v, 0) : v; },
            },
          },
        },
        plugins: {
          legend: { display: false },
          tooltip: {
            callbacks: {
              title(items) {
                const i = items[0].dataIndex;
                return `#${i + 1} ${doc.runs[i].label}`;
              },
              label(ctx) {
                const m = current;
                const p = doc.values[m.name][ctx.dataIndex];
                const run = doc.runs[ctx.dataIndex];
                if (run.status !== "succeeded") return `${run.status}: no metrics`;
                if (p === null) return `${m.label}: not measured`;
                const lines = [`${m.label}: ${format(m, p.v)}`];
                if (ctx.dataIndex === doc.reference) {
                  lines.push("reference");
                } else {
                  lines.push(delta(m, p));
                  if (p.lo != null) lines.push(`95 % CI on the value scale: [${format(m, p.lo)}, ${format(m, p.hi)}]`);
                  if (p.untrusted_reason) lines.push(`untrusted, no verdict: ${p.untrusted_reason}`);
                  else if (p.verdict) lines.push(`verdict: ${p.verdict}`);
                }
                return lines;
              },
            },
          },
        },
      },
    });
  }

  select.addEventListener("change", () => {
    draw();
    const hidden = document.querySelector("#ref-form input[name=metric]");
    if (hidden) hidden.value = select.value;
    if (location.search.includes("run=")) {
      const q = new URLSearchParams(location.search);
      q.set("metric", select.value);
      history.replaceState(null, "", "/compare?" + q.toString());
    }
  });
  draw();

  // ---------------------------------------------------------------- live
  // While a compared run is queued/preparing/running, poll it (up to 20) and reload when one ends.
  const active = JSON.parse(document.getElementById("active-runs").textContent).slice(0, 20);
  if (active.length && location.search.includes("run=")) {
    vlab.poll(async () => {
      for (const id of active) {
        const run = await vlab.json(`/api/v1/runs/${id}`);
        if (!vlab.ACTIVE.has(run.status)) { location.reload(); return false; }
      }
      return true;
    }, 5000);
  }
})();
