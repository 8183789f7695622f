// Shared helpers for the dashboard pages (no dependencies).
"use strict";
const vlab = {
  fmt(v, digits = 1) {
    if (v === undefined || v === null || Number.isNaN(v)) return "–";
    return Number(v).toLocaleString("en-US", { minimumFractionDigits: digits, maximumFractionDigits: digits });
  },
  pct(v, digits = 1) {
    return v === undefined || v === null ? "–" : (v * 100).toFixed(digits) + " %";
  },
  async json(url) {
    const r = await fetch(url, { headers: { accept: "application/json" } });
    if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
    return r.json();
  },
  // Poll fn every `ms` while it returns true (e.g. while a run is active).
  poll(fn, ms = 2000) {
    const tick = async () => {
      let again = false;
      try { again = await fn(); } catch (e) { console.warn("poll:", e.message); again = true; }
      if (again) setTimeout(tick, ms);
    };
    setTimeout(tick, ms);
  },
  ACTIVE: new Set(["queued", "preparing", "running"]),
  // A consistent colour per series index.
  color(i) {
    const c = ["#0969da", "#cf222e", "#1a7f37", "#9a6700", "#8250df", "#bf3989", "#1b7c83", "#6e7781"];
    return c[i % c.length];
  },
};
