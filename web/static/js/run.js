// Run page: the latency-vs-load charts of a capacity search (capacity.js), /metrics time-series charts (and the GPU power, utilisation and memory
// charts when the samples carry GPU telemetry), TTFT/E2EL distributions, the filtered
// engine log, and the live refresh (status, progress, cards, charts) while the run is active.
// Everything is read from the /api/v1 JSON; the tables are rendered on the server.
"use strict";
(() => {
  const root = document.getElementById("run");
  const API = `/api/v1/runs/${root.dataset.id}`;
  const GREY = "#8c959f";

  // ---------------------------------------------------------------- chart plugins
  // Shades the measured phase (options.plugins.phaseBand = {from, to}, x values in s).
  const phaseBand = {
    id: "phaseBand",
    beforeDatasetsDraw(chart, _args, opts) {
      if (opts.from === undefined || opts.from === null || opts.to === null) return;
      const { ctx, chartArea: a, scales: { x } } = chart;
      const x0 = Math.max(a.left, x.getPixelForValue(opts.from));
      const x1 = Math.min(a.right, x.getPixelForValue(opts.to));
      if (!(x1 > x0)) return;
      ctx.save();
      ctx.fillStyle = "rgba(9, 105, 218, 0.07)";
      ctx.fillRect(x0, a.top, x1 - x0, a.bottom - a.top);
      ctx.fillStyle = "#59636e";
      ctx.font = "11px system-ui, sans-serif";
      ctx.fillText("measured", x0 + 4, a.top + 12);
      ctx.restore();
    },
  };
  // Vertical dashed lines (options.plugins.markers = {lines: [{x, label}]}).
  const markers = {
    id: "markers",
    afterDatasetsDraw(chart, _args, opts) {
      const lines = opts.lines || [];
      const { ctx, chartArea: a, scales: { x } } = chart;
      ctx.save();
      lines.forEach((m, i) => {
        const px = x.getPixelForValue(m.x);
        if (px < a.left - 1 || px > a.right + 1) return;
        ctx.strokeStyle = m.color || "#1f2328";
        ctx.setLineDash([5, 4]);
        ctx.beginPath(); ctx.moveTo(px, a.top); ctx.lineTo(px, a.bottom); ctx.stroke();
        ctx.setLineDash([]);
        ctx.font = "11px system-ui, sans-serif";
        const w = ctx.measureText(m.label).width;
        const tx = px + 3 + w > a.right ? px - 3 - w : px + 3;
        const ty = a.top + 12 + 13 * i;
        ctx.fillStyle = "rgba(255, 255, 255, 0.85)";
        ctx.fillRect(tx - 1, ty - 10, w + 2, 13);
        ctx.fillStyle = m.color || "#1f2328";
        ctx.fillText(m.label, tx, ty);
      });
      ctx.restore();
    },
  };
  Chart.register(phaseBand, markers);

  function emptyState(id, empty) {
    const el = document.querySelector(`.chart-empty[data-for="${id}"]`);
    if (el) el.hidden = !empty;
  }

  const pointColor = (i) => (c) => (c.raw && c.raw.phase && c.raw.phase !== "during" ? GREY : vlab.color(i));

  function lineChart(id, yTitle, labels, yMax) {
    const datasets = labels.map((label, i) => ({
      label, data: [], borderColor: vlab.color(i), backgroundColor: vlab.color(i),
      pointBackgroundColor: pointColor(i), pointBorderColor: pointColor(i),
      pointRadius: 2.5, borderWidth: 1.5, tension: 0, spanGaps: false,
    }));
    return new Chart(document.getElementById(id), {
      type: "line",
      data: { datasets },
      options: {
        animation: false, responsive: true, maintainAspectRatio: false, parsing: { xAxisKey: "x", yAxisKey: "y" },
        interaction: { mode: "nearest", intersect: false },
        scales: {
          x: { type: "linear", title: { display: true, text: "t (s since run start)" } },
          y: { beginAtZero: true, max: yMax, title: { display: true, text: yTitle } },
        },
        plugins: {
          legend: { display: labels.length > 1, position: "bottom", labels: { boxWidth: 12 } },
          phaseBand: {},
          markers: {},
          tooltip: { callbacks: { afterLabel: (c) => (c.raw.phase ? `phase: ${c.raw.phase}` : "") } },
        },
      },
    });
  }

  const charts = {
    kv: lineChart("chart-kv", "KV cache usage (%)", ["KV cache usage"], 100),
    queue: lineChart("chart-queue", "requests", ["running", "waiting"]),
    throughput: lineChart("chart-throughput", "tokens/s", ["output (generation) tok/s", "prompt (prefill) tok/s"]),
    hit: lineChart("chart-hit", "hit rate (%)", ["per interval", "cumulative since measured start"], 100),
  };

  /**
   * Chart series from /metrics samples ({t_s, phase, values}).
   * Gauges are plotted as scraped; rates are counter deltas between consecutive
   * samples (tokens/s), the hit rate is delta hits / delta queries (tokens, %).
   */
  function seriesFrom(samples) {
    const pt = (p, y) => ({ x: p.t_s, y, phase: p.phase });
    const has = (p, k) => typeof p.values[k] === "number";
    const out = { kv: [[]], queue: [[], []], throughput: [[], []], hit: [[], []] };
    const before = samples.find((p) => p.phase === "before");
    samples.forEach((p, i) => {
      if (has(p, "kv_cache_usage")) out.kv[0].push(pt(p, p.values.kv_cache_usage * 100));
      if (has(p, "num_requests_running")) out.queue[0].push(pt(p, p.values.num_requests_running));
      if (has(p, "num_requests_waiting")) out.queue[1].push(pt(p, p.values.num_requests_waiting));
      if (i === 0) return;
      const q = samples[i - 1];
      const dt = p.t_s - q.t_s;
      const delta = (k) => (has(p, k) && has(q, k) ? p.values[k] - q.values[k] : null);
      if (dt > 0) {
        const gen = delta("generation_tokens");
        const prompt = delta("prompt_tokens");
        if (gen !== null) out.throughput[0].push(pt(p, gen / dt));
        if (prompt !== null) out.throughput[1].push(pt(p, prompt / dt));
      }
      const dq = delta("prefix_cache_queries");
      const dh = delta("prefix_cache_hits");
      if (dq !== null && dh !== null) out.hit[0].push(pt(p, dq > 0 ? (100 * dh) / dq : null));
      if (before && p.t_s > before.t_s && has(p, "prefix_cache_queries") && has(before, "prefix_cache_queries")) {
        const cq = p.values.prefix_cache_queries - before.values.prefix_cache_queries;
        const ch = p.values.prefix_cache_hits - before.values.prefix_cache_hits;
        if (cq > 0) out.hit[1].push(pt(p, (100 * ch) / cq));
      }
    });
    return out;
  }

  // ---------------------------------------------------------------- GPU telemetry
  // Per GPU ordinal k (position in the run, rank order): gpu{k}_power_w,
  // gpu{k}_utilization_pct, gpu{k}_memory_used_mib; aggregates gpu_power_w etc.
  // The charts are made when the samples first carry GPU keys (the block is hidden
  // on CPU runs) and remade when the set of GPUs changes.
  const gpuBlock = document.getElementById("gpu-charts");
  let gpuLabels = JSON.parse((gpuBlock && gpuBlock.dataset.labels) || "[]");
  const GPU_KEY = /^gpu(\d+)_(power_w|utilization_pct|memory_used_mib|energy_j)$/;
  const GPU_CHARTS = {
    power: { id: "chart-gpu-power", y: "power (W)", field: "power_w", scale: 1 },
    util: { id: "chart-gpu-util", y: "utilisation (%)", field: "utilization_pct", scale: 1, max: 100 },
    mem: { id: "chart-gpu-mem", y: "memory used (GiB)", field: "memory_used_mib", scale: 1 / 1024 },
  };
  const gpuCharts = {};
  let lastGpu = null;

  /** {power|util|mem: {labels, data: [[points]]}}: one series per GPU, or the
   * aggregate ("all GPUs") when the samples carry no per-GPU key. */
  function gpuSeriesFrom(samples) {
    const pt = (p, y) => ({ x: p.t_s, y, phase: p.phase });
    const ordinals = new Set();
    for (const p of samples) {
      for (const k of Object.keys(p.values)) {
        const m = GPU_KEY.exec(k);
        if (m) ordinals.add(Number(m[1]));
      }
    }
    const ks = [...ordinals].sort((a, b) => a - b);
    const out = {};
    for (const [name, spec] of Object.entries(GPU_CHARTS)) {
      const keys = ks.length ? ks.map((k) => `gpu${k}_${spec.field}`) : [`gpu_${spec.field}`];
      const data = keys.map((key) => samples
        .filter((p) => typeof p.values[key] === "number")
        .map((p) => pt(p, p.values[key] * spec.scale)));
      const labels = ks.length ? ks.map((k) => gpuLabels[k] || `gpu${k}`) : ["all GPUs"];
      out[name] = data.some((d) => d.length) ? { labels, data } : { labels: [], data: [] };
    }
    return out;
  }

  function drawGpu(samples, band) {
    if (!gpuBlock) return;
    lastGpu = { samples, band };
    const s = gpuSeriesFrom(samples);
    const any = Object.values(s).some((c) => c.data.length);
    if (any) gpuBlock.hidden = false;
    const none = document.getElementById("gpu-charts-none");
    if (none) none.hidden = !gpuBlock.hidden;
    if (gpuBlock.hidden) return;
    for (const [name, spec] of Object.entries(GPU_CHARTS)) {
      const { labels, data } = s[name];
      let chart = gpuCharts[name];
      if (labels.length && (!chart || chart.data.datasets.map((d) => d.label).join("\n") !== labels.join("\n"))) {
        if (chart) chart.destroy();
        chart = gpuCharts[name] = lineChart(spec.id, spec.y, labels, spec.max);
      }
      if (chart) {
        chart.data.datasets.forEach((d, i) => { d.data = data[i] || []; });
        chart.options.plugins.phaseBand = band;
        chart.update("none");
      }
      emptyState(spec.id, !data.some((d) => d.some((p) => p.y !== null)));
    }
  }

  function drawSeries(samples, total) {
    const s = seriesFrom(samples);
    const before = samples.find((p) => p.phase === "before");
    const after = samples.find((p) => p.phase === "after");
    const during = samples.filter((p) => p.phase === "during");
    const band = {
      from: before ? before.t_s : during.length ? during[0].t_s : null,
      to: after ? after.t_s : during.length ? during[during.length - 1].t_s : null,
    };
    for (const [key, chart] of Object.entries(charts)) {
      s[key].forEach((data, i) => { chart.data.datasets[i].data = data; });
      chart.options.plugins.phaseBand = band;
      chart.update("none");
      emptyState(chart.canvas.id, !s[key].some((d) => d.some((p) => p.y !== null)));
    }
    drawGpu(samples, band);
    const info = document.getElementById("samples-info");
    info.textContent = total ? `${total.toLocaleString("en-US")} samples stored, ${samples.length} shown.` : "";
  }

  // ---------------------------------------------------------------- cards and header
  function updateCards(metrics) {
    for (const card of document.querySelectorAll("#cards .card[data-metric]")) {
      const v = metrics[card.dataset.metric];
      const digits = Number(card.dataset.digits || 1);
      card.querySelector(".v").textContent = card.dataset.kind === "pct" ? vlab.pct(v) : vlab.fmt(v, digits);
      card.classList.toggle("missing", v === undefined || v === null);
    }
    const none = document.getElementById("no-metrics");
    if (none) none.hidden = Object.keys(metrics).length > 0;
  }

  function progressText(p) {
    if (!p) return "";
    const parts = p.phase ? [p.phase] : [];
    if (p.requests_total) parts.push(`${p.requests_done || 0} / ${p.requests_total} requests`);
    if (p.message && p.message !== p.phase) parts.push(p.message);
    return parts.join(" · ");
  }

  function updateHead(run) {
    const active = vlab.ACTIVE.has(run.status);
    const status = document.getElementById("status");
    status.textContent = run.status;
    status.className = `status ${run.status}`;
    root.dataset.status = run.status;
    document.getElementById("partial").hidden = !run.partial;
    document.getElementById("cancel-requested").hidden = !(run.cancel_requested && active);
    const cancel = document.getElementById("cancel-run");
    if (cancel) cancel.hidden = !active || run.cancel_requested;
    document.getElementById("live").hidden = !active;
    const reason = document.getElementById("status-reason");
    const why = [run.status_reason, run.error && run.error !== run.status_reason ? run.error : null].filter(Boolean);
    reason.textContent = why.join(" — ");
    reason.hidden = why.length === 0;
    document.getElementById("progress").hidden = !active;
    const p = run.progress || {};
    const bar = document.getElementById("progress-bar");
    bar.max = p.requests_total || 1;
    bar.value = p.requests_done || 0;
    document.getElementById("progress-text").textContent = progressText(p) || "waiting for the orchestrator";
    const started = document.getElementById("started");
    if (run.started_at && started.textContent.trim() === "–") {
      // the same form as the server's: 2026-11-30 18:40:12 UTC
      started.textContent = run.started_at.replace("T", " ").replace(/(\.\d+)?(Z|\+00:00)$/, "") + " UTC";
    }
  }

  // ---------------------------------------------------------------- cancel
  // POST /api/v1/runs/{id}/cancel with the session's CSRF token (vlab.send); then the
  // server-rendered head (status, who cancelled) replaces this one. Delegated: the head
  // is re-rendered when the run ends.
  document.addEventListener("click", async (ev) => {
    const button = ev.target.closest ? ev.target.closest("#cancel-run") : null;
    if (!button) return;
    if (!window.confirm("Cancel this run?")) return;
    button.disabled = true;
    const box = document.getElementById("cancel-error");
    let r;
    try {
      r = await vlab.send(`${API}/cancel`, "POST");
    } catch (e) {
      r = null;
      box.textContent = `could not reach the server: ${e.message}`;
    }
    if (r && r.ok) {
      updateHead(await r.json());
      const page = await fetch(location.pathname, { headers: { accept: "text/html" } });
      if (page.ok) {
        const doc = new DOMParser().parseFromString(await page.text(), "text/html");
        const fresh = doc.getElementById("run-head");
        if (fresh) document.getElementById("run-head").innerHTML = fresh.innerHTML;
      }
      return;
    }
    if (r) {
      let detail = `HTTP ${r.status}`;
      try { detail = (await r.json()).detail || detail; } catch (e) { /* not JSON */ }
      box.textContent = `could not cancel: ${detail}`;
    }
    box.hidden = false;
    button.disabled = false;
  });

  // ---------------------------------------------------------------- distributions
  async function measuredRequests() {
    const out = [];
    for (let offset = 0; ;) {
      const page = await vlab.json(`${API}/requests?limit=500&offset=${offset}&warmup=false`);
      out.push(...page.items);
      offset += page.items.length;
      if (page.items.length === 0 || offset >= page.total) return out;
    }
  }

  // Linear-interpolated percentile (numpy's default, as vllm bench serve uses).
  function percentile(sorted, q) {
    if (!sorted.length) return null;
    const pos = (sorted.length - 1) * q;
    const lo = Math.floor(pos), hi = Math.ceil(pos);
    return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo);
  }

  const histCharts = {};
  /** Histogram of `values` ({v: ms, cls}) stacked by request class, with p50/p99 lines. */
  function histogram(id, label, values, p50, p99) {
    const all = values.map((d) => d.v).sort((a, b) => a - b);
    const classes = [...new Set(values.map((d) => d.cls))].sort();
    // about sqrt(N) bins (5..40) of a round width (1, 2 or 5 x 10^k ms)
    const target = Math.min(40, Math.max(5, Math.ceil(Math.sqrt(all.length))));
    const span = Math.max(all[all.length - 1] - all[0], all[0] * 0.1, 1e-3);
    const raw = span / target;
    const mag = 10 ** Math.floor(Math.log10(raw));
    const width = [1, 2, 5, 10].map((f) => f * mag).find((w) => w >= raw);
    const lo = Math.floor(all[0] / width) * width;
    const n = Math.max(1, Math.floor((all[all.length - 1] - lo) / width) + 1);
    const hi = lo + n * width;
    const datasets = classes.map((cls, ci) => {
      const counts = new Array(n).fill(0);
      for (const d of values) if (d.cls === cls) counts[Math.min(n - 1, Math.floor((d.v - lo) / width))] += 1;
      return {
        label: classes.length > 1 ? `class ${cls}` : "requests", stack: "all",
        data: counts.map((c, i) => ({ x: lo + (i + 0.5) * width, y: c })),
        backgroundColor: vlab.color(ci) + "b0", borderColor: vlab.color(ci), borderWidth: 1,
        barThickness: "flex", barPercentage: 1, categoryPercentage: 0.96,
      };
    });
    const p50v = p50 ?? percentile(all, 0.5);
    const p99v = p99 ?? percentile(all, 0.99);
    if (histCharts[id]) histCharts[id].destroy();
    histCharts[id] = new Chart(document.getElementById(id), {
      type: "bar",
      data: { datasets },
      options: {
        animation: false, responsive: true, maintainAspectRatio: false,
        scales: {
          x: { type: "linear", min: lo, max: hi, title: { display: true, text: `${label} (ms)` } },
          y: { stacked: true, beginAtZero: true, ticks: { precision: 0 }, title: { display: true, text: "requests" } },
        },
        plugins: {
          legend: { display: classes.length > 1, position: "bottom", labels: { boxWidth: 12 } },
          markers: { lines: [
            { x: p50v, label: `p50 ${vlab.fmt(p50v)} ms`, color: "#1a7f37" },
            { x: p99v, label: `p99 ${vlab.fmt(p99v)} ms`, color: "#cf222e" },
          ] },
          tooltip: { callbacks: { title: (items) => {
            const x = items[0].raw.x;
            return `${vlab.fmt(x - width / 2)}–${vlab.fmt(x + width / 2)} ms`;
          } } },
        },
      },
    });
    emptyState(id, false);
    return { p50: p50v, p99: p99v };
  }

  async function loadDistributions(metrics) {
    const reqs = (await measuredRequests()).filter((r) => r.success);
    const info = document.getElementById("requests-info");
    const cls = (r) => r.request_class || "short";
    const pick = (key) => reqs.filter((r) => r[key] !== null).map((r) => ({ v: r[key] * 1000, cls: cls(r) }));
    const ttft = pick("ttft_s"), e2el = pick("e2el_s");
    const m = metrics || {};
    if (ttft.length) {
      const p = histogram("chart-ttft", "TTFT", ttft, m.p50_ttft_ms ?? m.median_ttft_ms, m.p99_ttft_ms);
      document.getElementById("ttft-pct").textContent = `p50 ${vlab.fmt(p.p50)} · p99 ${vlab.fmt(p.p99)}`;
    }
    if (e2el.length) {
      const p = histogram("chart-e2el", "E2EL", e2el, m.p50_e2el_ms ?? m.median_e2el_ms, m.p99_e2el_ms);
      document.getElementById("e2el-pct").textContent = `p50 ${vlab.fmt(p.p50)} · p99 ${vlab.fmt(p.p99)}`;
    }
    info.textContent = `${reqs.length.toLocaleString("en-US")} successful measured requests (warm-up excluded). ` +
      "Dashed lines: p50 and p99 of the run's stored metrics.";
  }

  // ---------------------------------------------------------------- engine log
  const LEVELS = {
    warn: /\b(WARNING|WARN|ERROR|CRITICAL)\b|Traceback/,
    error: /\b(ERROR|CRITICAL)\b|Traceback/,
  };
  async function loadLog() {
    const pre = document.getElementById("log");
    if (!pre) return;
    const r = await fetch(`${API}/log`);
    if (!r.ok) { pre.textContent = `engine log unavailable (HTTP ${r.status})`; return; }
    const text = await r.text();
    const dropped = Number(r.headers.get("X-Noise-Lines-Dropped") || 0);
    const lines = text.split("\n");
    if (lines.length && lines[lines.length - 1] === "") lines.pop();
    const level = document.getElementById("log-level");
    const filter = document.getElementById("log-filter");
    const count = document.getElementById("log-count");
    const render = () => {
      const re = LEVELS[level.value];
      const needle = filter.value.trim().toLowerCase();
      const shown = lines.filter((l) => (!re || re.test(l)) && (!needle || l.toLowerCase().includes(needle)));
      pre.textContent = shown.length ? shown.join("\n") : "(no line matches the filter)";
      count.textContent = `${shown.length.toLocaleString("en-US")} of ${lines.length.toLocaleString("en-US")} lines` +
        ` · ${dropped.toLocaleString("en-US")} probe line${dropped === 1 ? "" : "s"} (/health, /metrics) dropped`;
    };
    level.addEventListener("change", render);
    filter.addEventListener("input", render);
    render();
  }

  // ---------------------------------------------------------------- capacity under SLOs
  // One latency-vs-load chart per objective metric, from the page's embedded document.
  function drawCapacity() {
    const el = document.getElementById("capacity-data");
    if (!el) return;
    const doc = JSON.parse(el.textContent);
    for (const chart of doc.charts) {
      const canvas = document.getElementById(`chart-capacity-${chart.metric}`);
      if (canvas) vlabCapacity.curveChart(canvas, doc, chart);
    }
  }

  // ---------------------------------------------------------------- start and live
  async function loadMetrics() {
    const m = await vlab.json(`${API}/metrics?max_points=600`);
    drawSeries(m.samples, m.samples_total);
    return m;
  }

  // When the run ends: re-read the server-rendered parts of this page (times, tables,
  // layout, parity, log) instead of a reload, then the distributions and the log.
  async function finish(metrics) {
    const r = await fetch(location.pathname, { headers: { accept: "text/html" } });
    if (r.ok) {
      const doc = new DOMParser().parseFromString(await r.text(), "text/html");
      for (const id of ["run-head", "cards", "capacity-section", "sections", "log-section"]) {
        const fresh = doc.getElementById(id);
        if (fresh) document.getElementById(id).innerHTML = fresh.innerHTML;
      }
      const fresh = doc.getElementById("run");
      if (fresh) root.dataset.hasLog = fresh.dataset.hasLog;
      // the GPU assignment may be stored only now: name the GPU series after it
      const gpu = doc.getElementById("gpu-charts");
      if (gpu && lastGpu) {
        gpuLabels = JSON.parse(gpu.dataset.labels || "[]");
        drawGpu(lastGpu.samples, lastGpu.band);
      }
    }
    drawCapacity();
    await loadDistributions(metrics);
    if (root.dataset.hasLog === "true") await loadLog();
  }

  async function start() {
    drawCapacity();
    const m = await loadMetrics();
    if (root.dataset.active === "true") {
      await loadDistributions(m.metrics);
      vlab.poll(async () => {
        const [run, metrics] = await Promise.all([vlab.json(API), loadMetrics()]);
        updateHead(run);
        updateCards(metrics.metrics);
        if (vlab.ACTIVE.has(run.status)) return true;
        await finish(metrics.metrics);
        return false;
      }, 2000);
    } else {
      await Promise.all([loadDistributions(m.metrics), root.dataset.hasLog === "true" ? loadLog() : null]);
    }
  }
  // data-loaded: the first load (charts, distributions, log) is done, for whoever waits on it
  start()
    .catch((e) => console.warn("run page:", e.message))
    .finally(() => { root.dataset.loaded = "true"; });
})();
