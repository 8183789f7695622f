// Experiment page: the metric-per-level chart (with 95 % CI error bars), the capacity
// curves and the Pareto chart (capacity.js), and live run statuses.
"use strict";
(() => {
  Chart.register(ChartErrorBars.LineWithErrorBarsController, ChartErrorBars.PointWithErrorBar);

  const root = document.getElementById("experiment");
  const select = document.getElementById("metric");
  const canvas = document.getElementById("chart");
  const empty = document.getElementById("chart-empty");
  // untrusted (a flagged value: no verdict) and n/a points are grey, never green or red
  const VERDICT_COLOR = {
    better: "#1a7f37", worse: "#cf222e", untrusted: "#8c959f", "not applicable": "#8c959f",
  };
  let doc = readChartData(document);
  let chart = null;

  function readChartData(from) {
    return JSON.parse(from.getElementById("chart-data").textContent);
  }

  function format(metric, v) {
    if (v === null || v === undefined) return "–";
    if (metric.unit === "fraction") return vlab.pct(v);
    const digits = Math.abs(v) >= 100 ? 1 : Math.abs(v) >= 1 ? 2 : 3;
    return `${vlab.fmt(v, digits)} ${metric.unit}`;
  }

  // Chart.js points: {y, yMin, yMax}; a level without a value is a gap (y null).
  function series(metric) {
    return metric.points.map((p) => {
      if (p.value === null) return { y: null, yMin: null, yMax: null };
      const lo = p.ci_low ?? p.value;
      const hi = p.ci_high ?? p.value;
      return { y: p.value, yMin: Math.min(lo, p.value), yMax: Math.max(hi, p.value) };
    });
  }

  function draw() {
    const metric = doc.metrics.find((m) => m.name === select.value) || doc.metrics[0];
    const data = series(metric);
    const colors = metric.points.map((p) => VERDICT_COLOR[p.verdict] || vlab.color(0));
    empty.hidden = data.some((d) => d.y !== null);
    const yTitle = metric.label;
    if (chart) {
      chart.data.labels = doc.labels;
      const ds = chart.data.datasets[0];
      ds.label = metric.label;
      ds.data = data;
      ds.pointBackgroundColor = colors;
      ds.pointBorderColor = colors;
      chart.options.scales.y.title.text = yTitle;
      chart.$metric = metric;
      chart.update();
      return;
    }
    chart = new Chart(canvas, {
      type: "lineWithErrorBars",
      data: {
        labels: doc.labels,
        datasets: [{
          label: metric.label,
          data,
          borderColor: vlab.color(0),
          backgroundColor: vlab.color(0),
          pointBackgroundColor: colors,
          pointBorderColor: colors,
          pointRadius: 5,
          pointHoverRadius: 7,
          borderWidth: 1.5,
          tension: 0,
          spanGaps: false,
          errorBarColor: "#59636e",
          errorBarWhiskerColor: "#59636e",
          errorBarWhiskerSize: 14,
        }],
      },
      options: {
        responsive: true,
        maintainAspectRatio: false,
        animation: false,
        scales: {
          x: { title: { display: true, text: "level (ladder order) and its changed variable" } },
          y: {
            title: { display: true, text: yTitle },
            ticks: {
              callback(v) {
                const m = chart ? chart.$metric : metric;
                return m.unit === "fraction" ? vlab.pct(v, 0) : v;
              },
            },
          },
        },
        plugins: {
          legend: { display: false },
          tooltip: {
            callbacks: {
              label(ctx) {
                const m = chart.$metric;
                const p = m.points[ctx.dataIndex];
                const lines = [`${m.label}: ${format(m, p.value)}`];
                if (p.ci_low !== null) {
                  const src = p.ci_source === "own" ? "own 95 % CI" : `95 % CI vs ${p.reference}`;
                  lines.push(`${src}: [${format(m, p.ci_low)}, ${format(m, p.ci_high)}]`);
                } else {
                  lines.push("no interval");
                }
                if (p.untrusted_reason) lines.push(`untrusted, no verdict: ${p.untrusted_reason}`);
                else if (p.verdict) lines.push(`verdict vs ${p.reference}: ${p.verdict}`);
                return lines;
              },
            },
          },
        },
      },
    });
    chart.$metric = metric;
  }

  select.addEventListener("change", draw);
  draw();

  // Capacity under SLOs: the runs' latency-vs-load curves per objective (a colour per
  // level, as in the Pareto chart) and the Pareto chart.
  function drawCapacity() {
    const el = document.getElementById("capacity-data");
    if (!el) return;
    const cap = JSON.parse(el.textContent);
    const colorIndex = Object.fromEntries(cap.pareto.variants.map((v, i) => [v, i]));
    const colorOf = (r) => {
      const level = r.label.replace(/ #\d+$/, "");
      if (!(level in colorIndex)) colorIndex[level] = Object.keys(colorIndex).length;
      return vlab.color(colorIndex[level]);
    };
    cap.curves.objectives.forEach((o, i) => {
      const canvas = document.getElementById(`chart-curve-${i}`);
      if (canvas) vlabCapacity.overlayChart(canvas, cap.curves, o, colorOf);
    });
    const pareto = document.getElementById("chart-pareto");
    if (pareto) vlabCapacity.paretoChart(pareto, cap.pareto);
  }
  drawCapacity();

  // Swap in the server-rendered ladder, findings and chart data (after a run finished).
  async function refreshAnalysis() {
    const r = await fetch(location.pathname, { headers: { accept: "text/html" } });
    if (!r.ok) throw new Error(`${location.pathname}: HTTP ${r.status}`);
    const fresh = new DOMParser().parseFromString(await r.text(), "text/html");
    for (const id of ["summary", "ladder-section", "capacity-section", "findings-section"]) {
      const src = fresh.getElementById(id);
      if (src) document.getElementById(id).innerHTML = src.innerHTML;
    }
    doc = readChartData(document);
    draw();
    drawCapacity();
  }

  function setStatus(el, status, suffix = "") {
    el.textContent = status + suffix;
    el.className = `status ${status}`;
    el.dataset.status = status;
  }

  // Live: while a run is queued/preparing/running, poll the experiment every 3 s.
  if (root.dataset.active === "true") {
    const live = document.getElementById("live");
    vlab.poll(async () => {
      const exp = await vlab.json(`/api/v1/experiments/${root.dataset.id}`);
      let finished = false;
      for (const run of exp.runs) {
        const el = document.querySelector(`li[data-run-id="${run.id}"] .status`);
        if (!el) { finished = true; continue; } // a level added since the page was built
        const before = el.dataset.status;
        if (before !== run.status) {
          setStatus(el, run.status, run.partial ? " (partial)" : "");
          if (vlab.ACTIVE.has(before) && !vlab.ACTIVE.has(run.status)) finished = true;
        }
      }
      setStatus(document.getElementById("exp-status"), exp.status);
      if (finished) await refreshAnalysis();
      const active = exp.runs.some((run) => vlab.ACTIVE.has(run.status));
      live.hidden = !active;
      return active;
    }, 3000);
  }
})();
