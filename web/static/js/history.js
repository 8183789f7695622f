// Run history: selection for comparison (kept across pages) and live refresh of active rows.
"use strict";
(() => {
  const KEY = "vlab.compare.selection";
  const load = () => JSON.parse(sessionStorage.getItem(KEY) || "[]");
  const save = (ids) => sessionStorage.setItem(KEY, JSON.stringify(ids));
  const button = document.getElementById("compare-selected");

  function sync() {
    const chosen = new Set(load());
    for (const box of document.querySelectorAll("input.pick")) box.checked = chosen.has(box.value);
    button.textContent = `Compare selected (${chosen.size})`;
    button.disabled = chosen.size < 2;
  }
  document.getElementById("rows").addEventListener("change", (ev) => {
    const box = ev.target;
    if (!box.classList || !box.classList.contains("pick")) return;
    const ids = load().filter((id) => id !== box.value);
    if (box.checked) ids.push(box.value);
    save(ids);
    sync();
  });
  button.addEventListener("click", () => {
    const q = new URLSearchParams();
    for (const id of load()) q.append("run", id);
    location.href = "/compare?" + q.toString();
  });
  document.getElementById("clear-selected").addEventListener("click", () => { save([]); sync(); });
  sync();

  // Live: while a row on this page is queued/preparing/running, refresh the rows.
  const table = document.getElementById("runs");
  if (table.dataset.active === "true") {
    vlab.poll(async () => {
      const q = new URLSearchParams(location.search);
      q.set("fragment", "rows");
      const r = await fetch("/?" + q.toString());
      if (!r.ok) return true;
      document.getElementById("rows").innerHTML = await r.text();
      sync();
      const active = [...document.querySelectorAll("#rows tr[data-status]")]
        .some((tr) => vlab.ACTIVE.has(tr.dataset.status));
      document.getElementById("live").hidden = !active;
      return active;
    }, 3000);
  }
})();
