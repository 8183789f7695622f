// Run page: the engine events (out of memory, NCCL/Gloo errors, engine or worker died,
// preemptions...) on the time-series charts. A Chart.js plugin, registered before run.js
// makes its charts, draws a dotted vertical line coloured by type at each placed event's
// t_s (seconds since the run began, the charts' x) on the /metrics and GPU charts, with
// the type as a label where there is room, and widens their x range to show every
// event. The events are the page's embedded #engine-events-data (the table is rendered
// on the server); they are read again when the run ends and run.js re-renders #sections.
"use strict";
(() => {
  const TIMELINE = ["chart-kv", "chart-queue", "chart-throughput", "chart-hit", "chart-gpu-power", "chart-gpu-util", "chart-gpu-mem"];
  let events = [];

  function read() {
    const el = document.getElementById("engine-events-data");
    try {
      const data = el ? JSON.parse(el.textContent) : [];
      events = Array.isArray(data) ? data.filter((e) => typeof e.t_s === "number") : [];
    } catch (e) {
      events = [];
    }
  }

  const onTimeline = (chart) => TIMELINE.includes(chart.canvas.id)
    && chart.data.datasets.some((d) => d.data && d.data.length);

  const engineEvents = {
    id: "engineEvents",
    afterDataLimits(chart, args) {
      const s = args.scale;
      if (s.id !== "x" || !events.length || !onTimeline(chart)) return;
      for (const e of events) {
        if (e.t_s < s.min) s.min = e.t_s;
        if (e.t_s > s.max) s.max = e.t_s;
      }
    },
    afterDatasetsDraw(chart) {
      if (!events.length || !onTimeline(chart)) return;
      const { ctx, chartArea: a, scales: { x } } = chart;
      ctx.save();
      ctx.font = "10px system-ui, sans-serif";
      let lastLabelEnd = -Infinity;
      let row = 0;
      for (const e of events) {
        const px = x.getPixelForValue(e.t_s);
        if (px < a.left - 1 || px > a.right + 1) continue;
        ctx.strokeStyle = e.color;
        ctx.lineWidth = 1.5;
        ctx.setLineDash([2, 3]);
        ctx.beginPath(); ctx.moveTo(px, a.top); ctx.lineTo(px, a.bottom); ctx.stroke();
        ctx.setLineDash([]);
        const w = ctx.measureText(e.label).width;
        row = px - 2 < lastLabelEnd ? row + 1 : 0;
        if (row > 2) continue; // crowded: the table has every event
        const tx = px + 3 + w > a.right ? px - 3 - w : px + 3;
        const ty = a.bottom - 4 - 12 * row;
        ctx.fillStyle = "rgba(255, 255, 255, 0.85)";
        ctx.fillRect(tx - 1, ty - 9, w + 2, 12);
        ctx.fillStyle = e.color;
        ctx.fillText(e.label, tx, ty);
        lastLabelEnd = Math.max(lastLabelEnd, tx + w);
      }
      ctx.restore();
    },
  };

  function redraw() {
    for (const id of TIMELINE) {
      const chart = Chart.getChart(id);
      if (chart) chart.update("none");
    }
  }

  read();
  Chart.register(engineEvents);
  const sections = document.getElementById("sections");
  if (sections) new MutationObserver(() => { read(); redraw(); }).observe(sections, { childList: true });
  // for the browser tests: what is drawn
  window.vlabEngineEvents = { events: () => events.slice(), redraw };
})();
