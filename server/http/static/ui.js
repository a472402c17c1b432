// Parrot serve's live view: polls the read-only view routes with the credential the user gives, and draws
// engines, sessions and one session's DAG. Every text from the server goes in through textContent (model
// output is data, never markup); the page's CSP allows no other script.
"use strict";

const POLL_MS = 700;
const STREAM_TIMEOUT_S = 300;
const SVG_NS = "http://www.w3.org/2000/svg";
const COL_W = 190, ROW_H = 66, STEP_W = 168, STEP_H = 52, VAR_W = 150, VAR_H = 28, PAD = 16;

const view = { token: "", session: "", cluster: false, selected: null, dag: null, stream: null, timer: null };

const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, text = "") {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== "") node.textContent = text;
  return node;
}

function svg(tag, attrs = {}, text = "") {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== "") node.textContent = text;
  return node;
}

function setStatus(message, isError = false) {
  $("status").textContent = message;
  $("status").className = isError ? "error" : "";
}

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path, init = {}) {
  const response = await fetch(path, {
    ...init, cache: "no-store", headers: { Authorization: `Bearer ${view.token}` },
  });
  if (!response.ok) {
    let message = `${response.status} ${response.statusText}`;
    try { message = (await response.json()).error.message || message; } catch (_) { /* not JSON */ }
    throw new ApiError(response.status, message);
  }
  return response;
}

const seconds = (s) => (s === null || s === undefined ? "—" : s < 1 ? `${(s * 1000).toFixed(0)} ms` : `${s.toFixed(2)} s`);
const counts = (byState) => Object.entries(byState).map(([k, n]) => `${n} ${k}`).join(" · ") || "—";
const short = (id) => id.slice(0, 8);

// ------------------------------------------------------------------------------------------- cluster
function renderCluster(cluster) {
  const engines = $("engines").tBodies[0];
  engines.replaceChildren();
  for (const e of cluster.engines) {
    const s = e.stats;
    const row = el("tr", { "data-engine": e.engine_id });
    const state = !e.alive ? "down" : s.draining ? "draining" : "serving";
    const bar = el("span", { class: "bar" });
    const fill = el("span");
    fill.style.width = `${s.blocks_total ? (100 * s.blocks_used) / s.blocks_total : 0}%`;
    bar.append(fill);
    const blocks = el("td");
    blocks.append(bar, document.createTextNode(`${s.blocks_used} / ${s.blocks_total}`));
    row.append(el("td", {}, `${e.engine_id}: ${e.name}`), el("td", {}, s.role), el("td", {}, state), blocks,
      el("td", {}, String(s.running)), el("td", {}, String(s.waiting)), el("td", {}, String(e.prefix_hits)),
      el("td", {}, String(e.prefill_tokens_saved)), el("td", {}, String(s.prefill_tokens_computed)));
    engines.append(row);
  }
  const sessions = $("sessions").tBodies[0];
  sessions.replaceChildren();
  for (const s of cluster.sessions) {
    const row = el("tr", { class: "clickable", "data-session": s.session_id, title: s.session_id });
    row.append(el("td", {}, short(s.session_id)), el("td", {}, seconds(s.age_s)), el("td", {}, String(s.calls)),
      el("td", {}, counts(s.steps)), el("td", {}, counts(s.variables)));
    row.addEventListener("click", () => openSession(s.session_id));
    sessions.append(row);
  }
}

// ----------------------------------------------------------------------------------------------- DAG
function layout(dag) {
  // Columns by longest path from the sources (set variables), rows in submission order within a column.
  const steps = new Map(dag.steps.map((s) => [`${s.call_id}:${s.index}`, s]));
  const vars = new Map(dag.variables.map((v) => [v.var_id, v]));
  const rank = new Map();
  const visiting = new Set();
  const rankOf = (key) => {
    if (rank.has(key)) return rank.get(key);
    if (visiting.has(key)) return 0;  // (the server refuses cycles; never loop on a bad answer)
    visiting.add(key);
    let r = 0;
    if (key.startsWith("v:")) {
      const v = vars.get(key.slice(2));
      if (v && v.producer && steps.has(v.producer)) r = rankOf(`s:${v.producer}`) + 1;
    } else {
      const s = steps.get(key.slice(2));
      for (const input of s.inputs) r = Math.max(r, rankOf(`v:${input}`) + 1);
      if (s.index > 0) r = Math.max(r, rankOf(`s:${s.call_id}:${s.index - 1}`) + 2);
    }
    visiting.delete(key);
    rank.set(key, r);
    return r;
  };
  const keys = [...dag.variables.map((v) => `v:${v.var_id}`), ...[...steps.keys()].map((k) => `s:${k}`)];
  const rows = new Map();
  const at = new Map();
  for (const key of keys) {
    const r = rankOf(key);
    const row = rows.get(r) || 0;
    rows.set(r, row + 1);
    const middle = key.startsWith("v:") ? (STEP_H - VAR_H) / 2 : 0;  // a variable sits mid-row
    at.set(key, { x: PAD + r * COL_W, y: PAD + row * ROW_H + middle });
  }
  return { steps, vars, at, width: PAD * 2 + (Math.max(0, ...rows.keys()) + 1) * COL_W,
    height: PAD * 2 + Math.max(1, ...rows.values()) * ROW_H };
}

function edge(from, fromW, fromH, to, toH, cls) {
  const x1 = from.x + fromW, y1 = from.y + fromH / 2, x2 = to.x, y2 = to.y + toH / 2, mid = (x1 + x2) / 2;
  return svg("path", { class: cls, d: `M${x1},${y1} C${mid},${y1} ${mid},${y2} ${x2},${y2}` });
}

function renderDag(dag) {
  const { steps, vars, at, width, height } = layout(dag);
  const root = $("dag");
  root.replaceChildren();
  root.setAttribute("width", width);
  root.setAttribute("height", height);
  const edges = svg("g");
  const nodes = svg("g");
  for (const [key, s] of steps) {
    const p = at.get(`s:${key}`);
    for (const input of s.inputs) {
      if (at.has(`v:${input}`)) edges.append(edge(at.get(`v:${input}`), VAR_W, VAR_H, p, STEP_H, "edge"));
    }
    const prev = at.get(`s:${s.call_id}:${s.index - 1}`);
    if (prev) edges.append(edge(prev, STEP_W, STEP_H, p, STEP_H, "edge order"));
    if (at.has(`v:${s.var_id}`)) edges.append(edge(p, STEP_W, STEP_H, at.get(`v:${s.var_id}`), VAR_H, "edge"));
    const node = svg("g", { class: `node step ${s.state}`, transform: `translate(${p.x},${p.y})`,
      "data-step": key, "data-state": s.state });
    if (view.selected === `s:${key}`) node.classList.add("selected");
    node.append(svg("rect", { width: STEP_W, height: STEP_H, rx: 3 }),
      svg("text", { x: 8, y: 15 }, `${s.function || `call ${short(s.call_id)}`}${s.index ? ` #${s.index}` : ""}`),
      svg("text", { x: 8, y: 30 }, `${s.state}${s.engine ? ` · ${s.engine.replace(/ \(.*$/, "")}` : ""}`),
      svg("text", { x: 8, y: 45 }, s.prompt_tokens ? `prefill ${s.prompt_tokens - s.prefill_tokens_saved} · saved ${s.prefill_tokens_saved}` : ""));
    node.addEventListener("click", () => select(`s:${key}`, s.var_id));
    nodes.append(node);
  }
  for (const [id, v] of vars) {
    const p = at.get(`v:${id}`);
    const node = svg("g", { class: `node var ${v.status}`, transform: `translate(${p.x},${p.y})`,
      "data-var": id, "data-status": v.status });
    if (view.selected === `v:${id}`) node.classList.add("selected");
    node.append(svg("rect", { width: VAR_W, height: VAR_H, rx: 14 }),
      svg("text", { x: 12, y: 18 }, `${v.name || short(id)}${v.status === "ready" ? " ✓" : v.status === "failed" ? " ✗" : ""}`));
    node.addEventListener("click", () => select(`v:${id}`, id));
    nodes.append(node);
  }
  root.append(edges, nodes);
  const total = dag.steps.reduce((a, s) => a + s.prompt_tokens, 0);
  const saved = dag.steps.reduce((a, s) => a + s.prefill_tokens_saved, 0);
  const byState = {};
  for (const s of dag.steps) byState[s.state] = (byState[s.state] || 0) + 1;
  $("dag-totals").textContent = `${dag.steps.length} steps (${counts(byState)}) · prompt tokens ${total}: ` +
    `${total - saved} computed, ${saved} forked from shared contexts`;
}

// ------------------------------------------------------------------------------------------- details
function showFields(title, fields) {
  $("details").hidden = false;
  $("details-title").textContent = title;
  const list = $("details-fields");
  list.replaceChildren();
  for (const [k, v] of fields) {
    if (v === null || v === undefined || v === "") continue;
    list.append(el("dt", {}, k), el("dd", {}, String(v)));
  }
}

function showSelected(dag) {
  // The selected step's or variable's fields, from the latest DAG (its text streams on, see showText).
  const key = view.selected;
  if (!key) return;
  const step = key.startsWith("s:") ? dag.steps.find((s) => `s:${s.call_id}:${s.index}` === key) : null;
  const variable = key.startsWith("v:") ? dag.variables.find((v) => `v:${v.var_id}` === key) : null;
  if (step) {
    showFields(`step ${step.index} of ${step.function || "call"} ${short(step.call_id)}`, [
      ["state", step.state], ["engine", step.engine], ["attempts", step.attempts], ["objective", step.criteria],
      ["task group", step.task_group], ["prompt tokens", step.prompt_tokens],
      ["computed", step.prompt_tokens - step.prefill_tokens_saved], ["saved by sharing", step.prefill_tokens_saved],
      ["queued", seconds(step.queue_s)], ["ran", seconds(step.run_s)], ["reads", step.inputs.join(", ")],
      ["writes", step.var_id], ["error", step.error]]);
  } else if (variable) {
    showFields(`variable ${variable.name || variable.var_id}`, [
      ["id", variable.var_id], ["status", variable.status], ["kind", variable.kind],
      ["producer", variable.producer || "set by the client"], ["error", variable.error]]);
  }
}

function select(key, varId) {
  view.selected = key;
  if (view.dag) showSelected(view.dag);
  document.querySelectorAll("svg .node.selected").forEach((n) => n.classList.remove("selected"));
  document.querySelector(`[data-${key.startsWith("s:") ? "step" : "var"}="${CSS.escape(key.slice(2))}"]`)
    ?.classList.add("selected");
  showText(varId);
}

async function showText(varId) {
  if (view.stream) view.stream.abort();
  const controller = new AbortController();
  view.stream = controller;
  const out = $("details-text");
  out.textContent = "";
  const base = `/v1/sessions/${encodeURIComponent(view.session)}/dag/variables/${encodeURIComponent(varId)}`;
  try {
    const response = await api(`${base}/stream?timeout=${STREAM_TIMEOUT_S}`, { signal: controller.signal });
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const line = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        if (!line.startsWith("data: ")) continue;
        const event = JSON.parse(line.slice(6));
        if (event.restart) out.textContent = "";
        if (event.delta) out.textContent += event.delta;
        if (event.final) {
          const f = event.final;
          out.textContent = f.status === "ready" ? f.value : f.status === "failed" ? `failed: ${f.error}` : out.textContent;
        }
      }
    }
  } catch (e) {
    if (e.name !== "AbortError") out.textContent = `cannot read it: ${e.message}`;
  }
}

// --------------------------------------------------------------------------------------------- polling
async function poll() {
  try {
    if (view.cluster) renderCluster(await (await api("/v1/view")).json());
    if (view.session) {
      const dag = await (await api(`/v1/sessions/${encodeURIComponent(view.session)}/dag`)).json();
      $("dag-session").textContent = dag.session_id;
      view.dag = dag;
      renderDag(dag);
      showSelected(dag);
    }
    setStatus(`updated ${new Date().toLocaleTimeString()}`);
  } catch (e) {
    setStatus(e.message, true);
    if (e.status === 404 && !view.cluster) return;  // the session ended: nothing more will come
    if (e.status === 404) view.session = "";  // (the operator's list goes on; its DAG stays as last seen)
  }
  view.timer = setTimeout(poll, POLL_MS);
}

function openSession(sessionId) {
  if (view.stream) view.stream.abort();
  Object.assign(view, { session: sessionId, selected: null, dag: null });
  $("dag-view").hidden = false;
  $("details").hidden = true;
}

async function connect(token, session) {
  clearTimeout(view.timer);
  if (view.stream) view.stream.abort();
  Object.assign(view, { token, session: "", cluster: false, selected: null });
  sessionStorage.setItem("parrot-ui", JSON.stringify({ token, session }));
  try {
    await api("/v1/view");
    view.cluster = true;
  } catch (e) {
    if (!session || (e.status !== 401 && e.status !== 403)) { setStatus(e.message, true); return; }
  }
  $("cluster").hidden = !view.cluster;
  if (session) openSession(session);
  poll();
}

document.addEventListener("DOMContentLoaded", () => {
  // A link may carry the credential in its fragment (never sent to a server): take it, then drop it.
  const fromHash = new URLSearchParams(location.hash.slice(1));
  const saved = JSON.parse(sessionStorage.getItem("parrot-ui") || "{}");
  const token = fromHash.get("token") || saved.token || "";
  const session = fromHash.get("session") || saved.session || "";
  if (location.hash) history.replaceState(null, "", location.pathname);
  $("token").value = token;
  $("session").value = session;
  $("login").addEventListener("submit", (e) => {
    e.preventDefault();
    connect($("token").value.trim(), $("session").value.trim());
  });
  if (token) connect(token, session);
});
