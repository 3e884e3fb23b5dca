// Bourse's page: /api/fleet read again whenever /api/stream says the view changed
// (server-sent events), the market's events added as they come. No build step, no library.
"use strict";

const $ = (sel) => document.querySelector(sel);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k === "title") node.title = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function fill(tbody, rows) {
  tbody.replaceChildren(...rows);
}

function ago(ms) {
  if (!ms) return "";
  const s = Math.max(0, Math.round((Date.now() - ms) / 1000));
  return s < 120 ? `${s}s` : s < 7200 ? `${Math.round(s / 60)}m` : `${Math.round(s / 3600)}h`;
}

function amount(key, v) {
  return key === "cpu" ? `${+v.toFixed(2)}` : v >= 1024 ? `${+(v / 1024).toFixed(1)}G` : `${v}M`;
}

function bar(key, b) {
  const pct = (v) => (b.capacity ? (100 * v) / b.capacity : 0).toFixed(1) + "%";
  const used = el("span", { class: "used" });
  used.style.width = pct(b.used);
  const held = el("span", { class: "held" });
  held.style.width = pct(b.held);
  const title = `used ${amount(key, b.used)}, held ${amount(key, b.held)}, free ${amount(key, b.free)} of ${amount(key, b.capacity)}`;
  return el("div", { class: "bar", title, "data-used": b.used, "data-held": b.held, "data-free": b.free }, used, held);
}

function renderRegions(regions) {
  $("#regions").replaceChildren(
    ...regions.map((r) => {
      const rows = ["cpu", "memory_mb"].map((key) => {
        const b = r.bars[key];
        const free = b.capacity === undefined ? "" : `${amount(key, b.free)} free of ${amount(key, b.capacity)}`;
        return el("div", { class: "row" }, el("span", { class: "what" }, key === "cpu" ? "cpu" : "memory"),
          b.capacity === undefined ? el("span", { class: "muted" }, "no live worker") : bar(key, b),
          el("span", { class: "muted" }, free));
      });
      const gone = r.gone ? el("span", { class: "state-gone" }, ` ${r.gone} gone`) : null;
      return el("div", { class: "region", "data-region": r.region },
        el("div", { class: "name" }, r.region, el("div", { class: "muted" }, `${r.workers} workers`, gone)),
        el("div", {}, ...rows));
    })
  );
}

function renderWorkers(workers) {
  fill($("#workers tbody"), workers.map((w) => {
    const state = w.state === "gone" ? `gone ${ago(w.gone_since_ms)}` : w.state;
    const labels = Object.entries(w.labels).map(([k, v]) => `${k}=${v}`).join(" ");
    return el("tr", { "data-worker": w.worker_id, class: w.state === "gone" ? "gone" : "" },
      el("td", { class: "mono" }, w.worker_id), el("td", {}, w.region),
      el("td", { class: `state state-${w.state}`, title: w.drain_reason }, state),
      el("td", {}, w.machines), el("td", {}, bar("cpu", w.bars.cpu)),
      el("td", {}, bar("memory_mb", w.bars.memory_mb)), el("td", {}, w.driver),
      el("td", { class: "muted" }, labels));
  }));
}

function renderMachines(doc) {
  const m = doc.machines;
  $("#matched").textContent = doc.matched > m.length ? `${m.length} of ${doc.matched}` : `${m.length}`;
  fill($("#machines tbody"), m.map((x) => el("tr", { "data-machine": x.machine_id, class: x.worker_gone ? "gone" : "" },
    el("td", { class: "mono" }, x.machine_id),
    el("td", { class: `state state-${x.state}` }, x.state + (x.worker_gone ? " (worker gone)" : "")),
    el("td", { class: `health health-${x.health}`, title: x.health_detail }, x.health),
    el("td", {}, x.region), el("td", { class: "mono" }, x.worker_id),
    el("td", {}, x.app ? `${x.app}${x.tenant ? "." + x.tenant : ""}` : ""),
    el("td", { title: x.image_digest }, x.image),
    el("td", { class: "mono" }, x.address || (x.private_address ? `private ${x.private_address}` : "")),
    el("td", {}, x.restarts), el("td", {}, x.last_exit))));
}

function renderApps(apps) {
  if (!apps.length) {
    $("#apps").replaceChildren(el("p", { class: "muted" }, "no app"));
    return;
  }
  $("#apps").replaceChildren(...apps.map((a) => {
    const name = a.tenant ? `${a.app} (tenant ${a.tenant})` : a.app;
    const rows = a.slots.map((s) => el("tr", { "data-machine": s.machine_id },
      el("td", {}, s.region), el("td", {}, s.slot), el("td", {}, s.role),
      el("td", { class: "mono" }, s.machine_id),
      el("td", { class: `state state-${s.state}` }, s.state + (s.worker_gone ? " (worker gone)" : "")),
      el("td", {}, s.generation)));
    return el("div", { class: "app", "data-app": a.app },
      el("h3", {}, name, el("span", { class: "count" },
        `  generation ${a.generation ?? "-"}, ${a.started} of ${a.machines} started, ${a.spares} spares`)),
      el("table", {}, el("thead", {}, el("tr", {}, ...["region", "slot", "role", "machine", "state", "generation"].map((h) => el("th", {}, h)))),
        el("tbody", {}, ...rows)));
  }));
}

function renderCaches(caches) {
  const size = (b) => {
    const units = [[1 << 30, "GiB"], [1 << 20, "MiB"], [1 << 10, "KiB"]];
    for (const [n, unit] of units) if (b >= n) return `${(b / n).toFixed(1)} ${unit}`;
    return `${b} B`;
  };
  fill($("#caches tbody"), caches.map((c) => {
    const cache = c.budget_bytes ? `${size(c.bytes)} of ${size(c.budget_bytes)}` : size(c.bytes);
    return el("tr", { class: c.gone ? "gone" : "" }, el("td", { class: "mono" }, c.worker_id),
      el("td", {}, c.region), el("td", {}, cache), el("td", { class: "muted" }, c.images.join(", ")));
  }));
}

function renderFilters(filters) {
  const form = $("#filters");
  for (const [name, values] of [["region", filters.regions], ["app", filters.apps], ["state", filters.states]]) {
    const select = form.elements[name];
    const chosen = select.value;
    const first = select.options[0];
    select.replaceChildren(first, ...values.map((v) => el("option", { value: v }, v)));
    select.value = values.includes(chosen) ? chosen : "";
  }
}

// One read at a time, at most one a second: a busy market changes the view many times.
const EVERY_MS = 1000;
let fetching = false;
let again = false;
let last = 0;

async function refresh() {
  if (fetching) {
    again = true;
    return;
  }
  const wait = last + EVERY_MS - Date.now();
  if (wait > 0) {
    if (!again) setTimeout(() => { again = false; refresh(); }, wait);
    again = true;
    return;
  }
  fetching = true;
  last = Date.now();
  try {
    const params = new URLSearchParams();
    for (const name of ["region", "app", "state"]) {
      const v = $("#filters").elements[name].value;
      if (v) params.set(name, v);
    }
    const answer = await fetch(`/api/fleet?${params}`, { credentials: "same-origin" });
    const doc = await answer.json();
    if (!answer.ok) {
      $("#freshness").textContent = doc.error || `error ${answer.status}`;
      return;
    }
    $("#viewer").textContent = doc.viewer;
    $("#freshness").textContent = `view as of seq ${doc.view.seq}`;
    renderRegions(doc.regions);
    renderWorkers(doc.workers);
    renderMachines(doc);
    renderApps(doc.apps);
    renderCaches(doc.caches);
    renderFilters(doc.filters);
    document.body.dataset.seq = doc.view.seq;
    if (doc.behind) again = true; // the view changed since this answer was read: ask again
  } catch (e) {
    $("#freshness").textContent = `cannot read the fleet: ${e}`;
  } finally {
    fetching = false;
    if (again) {
      again = false;
      refresh();
    }
  }
}

function addEvent(e) {
  const list = $("#events");
  const when = new Date(e.at_ms).toLocaleTimeString();
  const what = [e.machine_id, e.health, e.detail].filter(Boolean).join("  ");
  list.prepend(el("li", { "data-kind": e.kind }, el("span", { class: "muted" }, when, " "),
    el("span", { class: "kind" }, e.kind), el("span", { class: "mono" }, `${e.worker_id} `), what));
  while (list.children.length > 200) list.lastChild.remove();
}

function connect() {
  const stream = new EventSource("/api/stream");
  stream.addEventListener("open", () => {
    $("#live").textContent = "live";
    $("#live").className = "on";
  });
  stream.addEventListener("error", () => {
    $("#live").textContent = "reconnecting";
    $("#live").className = "off";
  });
  stream.addEventListener("fleet", refresh);
  stream.addEventListener("event", (m) => addEvent(JSON.parse(m.data)));
}

$("#filters").addEventListener("change", () => { last = 0; refresh(); });
refresh();
connect();
