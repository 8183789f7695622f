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
  // The dashboard session's CSRF token (a <meta> the server renders when signed in with
  // the session cookie); sent back in X-CSRF-Token on every request that changes state.
  csrfToken() {
    const m = document.querySelector('meta[name="csrf-token"]');
    return m ? m.content : "";
  },
  // fetch() for a state-changing JSON API call: adds the CSRF header (and a JSON body).
  send(url, method, body) {
    const headers = { accept: "application/json", "X-CSRF-Token": vlab.csrfToken() };
    const init = { method, headers };
    if (body !== undefined) {
      headers["content-type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    return fetch(url, init);
  },
  // Whether the signed-in role may do what `needed` (viewer < operator < admin) may do.
  allows(needed) {
    const order = ["viewer", "operator", "admin"];
    const m = document.querySelector('meta[name="vlab-role"]');
    return order.indexOf(m ? m.content : "admin") >= order.indexOf(needed);
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
