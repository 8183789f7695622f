// Schedules pages: the enable/disable button.
// PATCH /api/v1/schedules/{id} {"enabled": ...} (with the CSRF token); on success the page parts named in the
// button's data-swap (element ids) are replaced by freshly server-rendered ones from
// data-refresh (so times and outcomes are formatted in one place, the server); on failure
// the problem+json `detail` is shown next to the button. The API commits its unit of work
// just after answering, so a re-render that still shows the old state is fetched again.
"use strict";
(() => {
  async function problemText(r) {
    try {
      const body = await r.json();
      return body.detail || body.title || `HTTP ${r.status}`;
    } catch (e) {
      return `HTTP ${r.status}`;
    }
  }

  function showError(button, text) {
    let box = button.parentElement.querySelector(".toggle-error");
    if (!box) {
      box = document.createElement("span");
      box.className = "toggle-error error";
      box.setAttribute("role", "alert");
      button.insertAdjacentElement("afterend", box);
    }
    box.textContent = text;
  }

  async function swap(url, ids) {
    const r = await fetch(url, { headers: { accept: "text/html" } });
    if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
    const tpl = document.createElement("template");
    tpl.innerHTML = await r.text();
    for (const id of ids) {
      const fresh = tpl.content.getElementById(id);
      const old = document.getElementById(id);
      if (fresh && old) old.replaceWith(fresh);
    }
  }

  // Live: fires and next fire times change with the clock; re-render them every 20 s
  // (the parts named by data-live-swap), without a reload.
  const live = document.querySelector("[data-live-swap]");
  if (live) {
    const ids = live.dataset.liveSwap.split(/\s+/);
    vlab.poll(async () => {
      await swap(location.href, ids);
      return true;
    }, Number(live.dataset.liveMs || 20000));
  }

  document.addEventListener("click", async (ev) => {
    const button = ev.target.closest ? ev.target.closest("button.toggle") : null;
    if (!button) return;
    const enable = button.dataset.enabled !== "true";
    button.disabled = true;
    let r;
    try {
      r = await vlab.send(`/api/v1/schedules/${encodeURIComponent(button.dataset.id)}`, "PATCH", {
        enabled: enable,
      });
    } catch (e) {
      button.disabled = false;
      showError(button, `could not reach the server: ${e.message}`);
      return;
    }
    if (!r.ok) {
      button.disabled = false;
      showError(button, `could not ${enable ? "enable" : "disable"}: ${await problemText(r)}`);
      return;
    }
    const want = String((await r.json()).enabled);
    const id = button.dataset.id;
    const ids = button.dataset.swap.split(/\s+/);
    try {
      for (let attempt = 0; attempt < 10; attempt++) {
        await swap(button.dataset.refresh, ids);
        const now = document.querySelector(`button.toggle[data-id="${CSS.escape(id)}"]`);
        if (!now || now.dataset.enabled === want) return;
        await new Promise((done) => setTimeout(done, 150));
      }
      location.reload();
    } catch (e) {
      // the change is stored; reloading shows it
      location.reload();
    }
  });
})();
