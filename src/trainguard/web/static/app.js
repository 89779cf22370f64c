// trainguard dashboard: polls /api/state and redraws. No framework, no build step.
"use strict";

const TOKEN = new URLSearchParams(location.search).get("token");
// The server answered the page's ?token= with an HttpOnly cookie: take the token out of the address
// bar (and so out of history and shared screenshots); API calls carry it as a Bearer header too.
if (TOKEN) history.replaceState(null, "", location.pathname);
const POLL_MS = 2000;
const MAX_ROWS = 300;
const TIMELINE_KINDS = new Set(["job_started", "restart", "worker_failed", "worker_lost_peer", "hang_detected",
  "straggler_detected", "diagnosis", "node_excluded", "job_succeeded", "job_failed", "node_held", "checkpoint_loaded"]);
let lastId = 0;
const events = [];

const $ = (sel) => document.querySelector(sel);
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k.startsWith("data-")) e.setAttribute(k, v); else e[k] = v;
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(c == null ? "" : String(c)));
  return e;
}
const clock = (t) => (t == null ? "-" : new Date(t * 1000).toLocaleTimeString([], { hour12: false }));
const ms = (s) => (s == null ? "-" : (s * 1000).toFixed(1) + " ms");

async function api(path) {
  const headers = TOKEN ? { Authorization: `Bearer ${TOKEN}` } : {};
  const r = await fetch(path, { headers, cache: "no-store", credentials: "same-origin" });
  if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
  return r;
}

function drawSummary(s, runDir) {
  const st = $("#job-state");
  st.textContent = s.state;
  st.className = "badge " + s.state;
  $("#run-dir").textContent = runDir;
  $("#max-restarts").textContent = s.max_restarts == null ? "-" : s.max_restarts;
  $("#restarts-used").textContent = s.restarts_used;
  $("#hw-reschedules").textContent = s.hardware_reschedules;
  $("#hangs").textContent = s.hangs;
  $("#ckpt-step").textContent = s.checkpoint_last_step == null ? "-" : s.checkpoint_last_step;
  $("#goodput").textContent = s.goodput_line || "";
}

function drawRanks(rows) {
  const body = $("#ranks tbody");
  body.replaceChildren(...rows.map((r) => el("tr", { class: r.straggler ? "straggler" : "", "data-rank": r.rank },
    el("td", { class: "num" }, r.rank), el("td", {}, r.node || "-"), el("td", { class: "num" }, r.pid || "-"),
    el("td", { class: "num" }, r.step == null ? "-" : r.step), el("td", { class: "num" }, ms(r.step_time)),
    el("td", { class: "num" }, (r.straggler_score == null ? "-" : r.straggler_score.toFixed(2)) + (r.straggler ? " ⚑" : "")),
    el("td", {}, r.last_event ? `${clock(r.last_event.time)} ${r.last_event.kind}: ${r.last_event.message}` : "-"))));
}

// Cell colour: the step time against the median of all cells (white = median or faster, red = 3x).
function heatColor(v, median) {
  const x = Math.max(0, Math.min(1, (v / median - 1) / 2));
  const g = Math.round(245 - 200 * x), b = Math.round(235 - 205 * x);
  return `rgb(${Math.round(250 - 40 * x)}, ${g}, ${b})`;
}

function drawHeatmap(h, stragglers) {
  const box = $("#heatmap");
  if (!h.ranks.length) { box.replaceChildren(el("div", { class: "muted" }, "no step records yet")); return; }
  const ncols = h.cells[0].length;
  box.style.gridTemplateColumns = `max-content repeat(${ncols}, minmax(3px, 1fr))`;
  const flagged = new Map();
  for (const s of stragglers) if (s.rank != null) flagged.set(s.rank, s);
  const cells = [];
  h.ranks.forEach((rank, i) => {
    const f = flagged.get(rank);
    cells.push(el("div", { class: "rowlabel" + (f ? " flagged" : ""), title: f ? f.message : "" }, `rank ${rank}` + (f ? " ⚑" : "")));
    const markCol = f ? Math.floor((f.time - h.t0) / h.width) : -1;
    h.cells[i].forEach((v, j) => {
      const t0 = h.t0 + j * h.width;
      const c = el("div", { class: "cell" + (v == null ? " empty" : "") + (j === markCol ? " mark" : ""),
        "data-rank": rank, "data-col": j, title: v == null ? `rank ${rank} ${clock(t0)}: no steps`
          : `rank ${rank} ${clock(t0)}: ${ms(v)} per step` });
      if (v != null) { c.setAttribute("data-value", v.toFixed(6)); c.style.backgroundColor = heatColor(v, h.median); }
      cells.push(c);
    });
  });
  box.replaceChildren(...cells);
  $("#heat-legend").textContent = `${ncols} columns of ${h.width.toFixed(1)} s from ${clock(h.t0)}; median step ${ms(h.median)}; ⚑ = straggler detected`;
}

// Same time axis as the heatmap below it (the server lays both over the run's whole span).
function drawTimeline(h, first, last) {
  const t0 = h.t0 != null ? h.t0 : first, t1 = h.t0 != null ? h.t0 + h.width * h.cells[0].length : last;
  const span = Math.max(1, t1 - t0);
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", "0 0 1000 46");
  svg.setAttribute("preserveAspectRatio", "none");
  let lastLabel = -100;
  for (const e of events) {
    if (!TIMELINE_KINDS.has(e.kind)) continue;
    const x = (1000 * (e.time - t0)) / span;
    const line = document.createElementNS(ns, "line");
    line.setAttribute("x1", x); line.setAttribute("x2", x); line.setAttribute("y1", 14); line.setAttribute("y2", 46);
    line.setAttribute("class", "tick " + e.severity);
    const tip = document.createElementNS(ns, "title");
    tip.textContent = `${clock(e.time)} ${e.kind}: ${e.message}`;
    line.append(tip);
    svg.append(line);
    if (x - lastLabel > 70) {
      const label = document.createElementNS(ns, "text");
      label.setAttribute("x", Math.min(x + 2, 940)); label.setAttribute("y", 10);
      label.textContent = e.kind;
      svg.append(label);
      lastLabel = x;
    }
  }
  $("#timeline").replaceChildren(svg);
}

function listOr(target, items, render) {
  target.replaceChildren(...(items.length ? items.map(render) : [el("li", { class: "muted" }, "none")]));
}

function drawLists(s, reports) {
  listOr($("#diagnoses"), s.diagnoses.slice(-20).reverse(), (d) => el("li", { class: "diagnosis" },
    el("b", {}, d.category), ` ${clock(d.time)} node ${d.node}${d.rank != null ? " rank " + d.rank : ""}: ${d.summary}`,
    d.fix ? el("div", { class: "muted" }, "fix: " + d.fix) : ""));
  listOr($("#stragglers"), s.stragglers.slice(-20).reverse(), (x) => el("li", { class: "straggler" }, `${clock(x.time)} ${x.message}`));
  listOr($("#hang-reports"), reports.slice().reverse(), (r) => {
    const a = el("a", { href: "#", textContent: r.name });
    a.addEventListener("click", async (ev) => {
      ev.preventDefault();
      const text = await (await api(`api/hang?name=${encodeURIComponent(r.name)}`)).text();
      const pre = $("#hang-text"); pre.textContent = text; pre.hidden = false;
    });
    return el("li", { class: "hang-report" }, a);
  });
  // Loads and failures are rare and matter: all of them; of the frequent persists, the newest.
  const persisted = s.checkpoints.filter((c) => c.kind === "persisted").slice(-10);
  const shown = s.checkpoints.filter((c) => c.kind !== "persisted").slice(-20).concat(persisted).sort((a, b) => b.time - a.time);
  const rows = shown.map((c) => el("tr", { class: "ckpt-" + c.kind },
    el("td", {}, clock(c.time)), el("td", {}, c.kind), el("td", { class: "num" }, c.step == null ? "-" : c.step),
    el("td", {}, c.kind === "persisted" ? `${((c.bytes || 0) / 1e6).toFixed(1)} MB in ${(c.seconds || 0).toFixed(2)} s (${c.trigger})`
      : c.kind === "loaded" ? `from ${c.source}` : (c.message || ""))));
  $("#checkpoints tbody").replaceChildren(...rows);
}

function drawEvents() {
  const rows = events.slice(-MAX_ROWS).reverse().map((e) => el("tr", { class: "event sev-" + e.severity, "data-kind": e.kind, "data-id": e.id },
    el("td", {}, clock(e.time)), el("td", {}, e.severity), el("td", {}, e.kind), el("td", {}, e.node),
    el("td", { class: "num" }, e.rank == null ? "" : e.rank), el("td", {}, e.message)));
  $("#events tbody").replaceChildren(...rows);
  $("#event-count").textContent = `(${events.length}${events.length > MAX_ROWS ? ", newest " + MAX_ROWS + " shown" : ""})`;
}

async function poll() {
  try {
    const data = await (await api(`api/state?after=${lastId}&columns=80`)).json();
    for (const e of data.events) events.push(e);
    if (events.length > 5000) events.splice(0, events.length - 5000);
    lastId = data.last_id;
    const s = data.summary;
    drawSummary(s, data.run_dir);
    drawRanks(s.ranks);
    drawHeatmap(s.heatmap, s.stragglers);
    drawTimeline(s.heatmap, s.first_time || data.now, Math.max(s.last_time || 0, data.now));
    drawLists(s, data.hang_reports);
    drawEvents();
    $("#updated").textContent = "updated " + clock(data.now);
  } catch (err) {
    $("#updated").textContent = "update failed: " + err.message;
  }
  setTimeout(poll, POLL_MS);
}
poll();
