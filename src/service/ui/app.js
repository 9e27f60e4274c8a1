// The admin console: reads /top, /status and /config, asks /explain and /counters. Every
// value it shows is set as text (textContent, setAttribute on SVG numbers), never as markup:
// request values are whatever clients sent.
"use strict";

const TOKEN = "sluice-admin-token";
const HISTORY_SECONDS = 600;
const history = new Map();
let rulesHash = null;
let rulesConfig = null;
// When each calendar rule's window ends (ms since the Unix epoch), by domain and rule path.
let calendarEnds = new Map();
let dryRun = null;
// Set when the admin port refused the page for want of the token: it asks nothing more until
// one is entered (each refusal makes the port wait a second for this client).
let needToken = false;

function token() {
  return sessionStorage.getItem(TOKEN);
}

async function call(path, init = {}) {
  const headers = new Headers(init.headers || {});
  const t = token();
  if (t) headers.set("Authorization", "Bearer " + t);
  const answer = await fetch(path, { ...init, headers, cache: "no-store" });
  if (answer.status === 401) {
    askToken();
    throw new Error("the admin token is needed");
  }
  return answer;
}

async function json(path) {
  const answer = await call(path);
  if (!answer.ok) throw new Error(path + ": " + answer.status + " " + (await answer.text()));
  return answer.json();
}

function askToken() {
  needToken = true;
  document.getElementById("token-form").hidden = false;
  setState("the admin token is needed", "bad");
}

function setState(text, kind) {
  const state = document.getElementById("state");
  state.textContent = text;
  state.className = "state " + (kind || "");
}

function el(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}

function fill(tableId, rows, cells) {
  const body = document.querySelector("#" + tableId + " tbody");
  body.replaceChildren(...rows.map((row) => {
    const tr = el("tr");
    for (const cell of cells(row)) {
      const td = el("td");
      if (cell instanceof Node) td.append(cell);
      else td.textContent = String(cell);
      tr.append(td);
    }
    return tr;
  }));
}

function rate(x) {
  return x === undefined || x === null ? "–" : x.toFixed(1);
}

function ms(x) {
  return x === undefined || x === null ? "–" : x.toFixed(2) + " ms";
}

// Each rule's hits and denials per second, one sample a second, for the last 10 minutes the
// page has been open; a rule seen in none of them is forgotten.
function remember(rows, now) {
  for (const r of rows) {
    const key = r.domain + "\u0000" + r.rule;
    const samples = history.get(key) || [];
    if (!samples.length || samples[samples.length - 1][0] !== now) {
      samples.push([now, r.hits_per_second, r.denied_per_second]);
    }
    history.set(key, samples);
  }
  for (const [key, samples] of history) {
    while (samples.length && samples[0][0] < now - HISTORY_SECONDS) samples.shift();
    if (!samples.length) history.delete(key);
  }
}

function sparkline(row) {
  const svgNs = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(svgNs, "svg");
  svg.setAttribute("width", "120");
  svg.setAttribute("height", "24");
  svg.setAttribute("class", "spark");
  const samples = history.get(row.domain + "\u0000" + row.rule) || [];
  if (samples.length < 2) return svg;
  // The span held, at least a minute, at most the 10 minutes kept.
  const start = samples[0][0];
  const span = Math.max(60, samples[samples.length - 1][0] - start);
  const top = Math.max(1, ...samples.map((s) => Math.max(s[1], s[2])));
  for (const [index, className] of [[1, "hits"], [2, "denied"]]) {
    const line = document.createElementNS(svgNs, "polyline");
    const points = samples.map((s) => {
      const x = ((s[0] - start) / span) * 120;
      const y = 23 - (s[index] / top) * 22;
      return x.toFixed(1) + "," + y.toFixed(1);
    });
    line.setAttribute("points", points.join(" "));
    line.setAttribute("class", className);
    svg.append(line);
  }
  return svg;
}

function showTop(report) {
  const period = report.periods[0];
  if (!period) return;
  const now = Math.floor(Date.now() / 1000);
  remember(period.rules_by_hits.concat(period.rules_by_denied), now);
  document.getElementById("rate").textContent = rate(period.decisions_per_second);
  document.getElementById("store-p50").textContent = ms(period.store_p50_ms);
  document.getElementById("store-p99").textContent = ms(period.store_p99_ms);
  const p = period.policy_answers;
  document.getElementById("policy").textContent =
    "error " + p.error + ", allow " + p.allow + ", deny " + p.deny;
  fill("rules-denied", period.rules_by_denied, (r) => [
    r.domain, r.rule, rate(r.denied_per_second), rate(r.hits_per_second), sparkline(r),
  ]);
  fill("rules-hit", period.rules_by_hits, (r) => [
    r.domain, r.rule, rate(r.hits_per_second), rate(r.denied_per_second), sparkline(r),
  ]);
  fill("values-denied", period.denied, (v) => [
    v.value, v.domain, v.rule, rate(v.per_second), v.error,
  ]);
}

function showStatus(status) {
  const list = document.getElementById("store-status");
  const facts = [
    ["store", status.store.kind],
    ["reachable", status.store.reachable ? "yes" : "no"],
  ];
  const optional = [
    ["circuit breakers open", status.store.breakers_open],
    ["primaries short of replicas", status.store.unreplicated_primaries],
    ["clock skew against Redis", status.store.clock_skew_ms, " ms"],
    ["live counters", status.store.live_counters],
    ["live split replicas", status.replicas.live],
    ["quota buckets tracked", status.quota.buckets],
    ["quota streams", status.quota.streams],
  ];
  for (const [name, value, unit] of optional) {
    if (value !== null && value !== undefined) facts.push([name, String(value) + (unit || "")]);
  }
  list.replaceChildren(...facts.flatMap(([name, value]) => [el("dt", name), el("dd", value)]));
  list.dataset.reachable = String(status.store.reachable);
  fill("quota", status.quota.rules, (q) => [q.domain, q.rule, q.subscribed, rate(q.rate)]);
  const ends = new Map(status.calendar_ends.map((c) => [c.domain + "\u0000" + c.rule, c.ends_ms]));
  const endsChanged = JSON.stringify([...ends]) !== JSON.stringify([...calendarEnds]);
  calendarEnds = ends;
  if (status.rules_hash !== rulesHash) {
    rulesHash = status.rules_hash;
    json("/config").then(showRules).catch(showError);
  } else if (endsChanged && rulesConfig) {
    showRules(rulesConfig);
  }
}

function limitText(l) {
  if (l.unlimited) return "unlimited";
  const parts = [];
  if (l.name) parts.push(l.name + ":");
  const every = l.unit_multiplier > 1 ? l.unit_multiplier + " " + l.unit : l.unit;
  parts.push(l.requests_per_unit + " per " + every, l.algorithm);
  if (l.burst) parts.push("burst " + l.burst);
  if (l.calendar) parts.push("calendar " + JSON.stringify(l.calendar));
  if (l.replaces) parts.push("replaces " + JSON.stringify(l.replaces));
  return parts.join(" ");
}

function ruleItem(domain, d, file, path) {
  const step = { shown: d.value === undefined ? d.key : d.key + "=" + d.value,
                 named: d.value === undefined ? d.key : d.key + "_" + d.value };
  const here = path.concat(step);
  const li = el("li");
  li.append(el("code", here.map((s) => s.shown).join(" → "), "path"));
  for (const l of d.rate_limits || []) li.append(el("span", limitText(l), "limit"));
  const end = calendarEnds.get(domain + "\u0000" + here.map((s) => s.named).join("."));
  if (end) li.append(el("span", "window ends " + new Date(end).toLocaleString(), "flag"));
  for (const flag of ["scope", "lease", "counting"]) {
    if (d[flag]) li.append(el("span", flag + " " + d[flag], "flag"));
  }
  if (d.shadow_mode) li.append(el("span", "shadow mode", "flag"));
  if (d.hold) li.append(el("span", "hold " + JSON.stringify(d.hold), "flag"));
  li.append(el("span", file + (d.line ? ":" + d.line : ""), "source"));
  if (d.descriptors && d.descriptors.length) {
    const ul = el("ul");
    ul.append(...d.descriptors.map((c) => ruleItem(domain, c, file, here)));
    li.append(ul);
  }
  return li;
}

function showRules(config) {
  rulesConfig = config;
  document.getElementById("rules-origin").textContent =
    "hash " + config.hash + ", loaded " + config.loaded_at;
  const list = document.getElementById("rules-list");
  list.replaceChildren(...config.domains.map((d) => {
    const section = el("div", null, "domain");
    section.append(el("h3", d.domain));
    const ul = el("ul");
    ul.append(...d.descriptors.map((r) => ruleItem(d.domain, r, d.file, [])));
    section.append(ul);
    return section;
  }));
}

function showError(e) {
  setState(e.message, "bad");
}

async function refresh() {
  if (needToken) return;
  try {
    const [top, status] = await Promise.all([json("/top?n=10&period=1m"), json("/status")]);
    showTop(top);
    showStatus(status);
    setState("updated " + new Date().toLocaleTimeString(), "good");
  } catch (e) {
    showError(e);
  }
}

async function post(path, body, answerId) {
  const out = document.getElementById(answerId);
  try {
    const answer = await call(path, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body,
    });
    const text = await answer.text();
    let shown = text;
    try {
      shown = JSON.stringify(JSON.parse(text), null, 2);
    } catch (_) {
      // Not JSON: shown as it came.
    }
    out.textContent = answer.status + "\n" + shown;
    return answer.ok;
  } catch (e) {
    out.textContent = e.message;
    return false;
  }
}

function countersBody(apply) {
  let request;
  try {
    request = JSON.parse(document.getElementById("counters-request").value);
  } catch (e) {
    throw new Error("the request is not JSON: " + e.message);
  }
  const body = { ...request, action: document.getElementById("counters-action").value, apply };
  const hits = Number(document.getElementById("counters-hits").value);
  if (body.action === "set" || body.action === "add") body.hits = hits;
  const by = document.getElementById("counters-by").value;
  if (by) body.by = by;
  return JSON.stringify(body);
}

function start() {
  document.getElementById("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(TOKEN, document.getElementById("token").value);
    document.getElementById("token-form").hidden = true;
    needToken = false;
    rulesHash = null;
    refresh();
  });
  document.getElementById("explain-form").addEventListener("submit", (event) => {
    event.preventDefault();
    post("/explain", document.getElementById("explain-request").value, "explain-answer");
  });
  const apply = document.getElementById("counters-apply");
  document.getElementById("counters-form").addEventListener("input", () => {
    apply.disabled = true;
    dryRun = null;
  });
  document.getElementById("counters-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    apply.disabled = true;
    let body;
    try {
      body = countersBody(false);
    } catch (e) {
      document.getElementById("counters-answer").textContent = e.message;
      return;
    }
    const ok = await post("/counters", body, "counters-answer");
    dryRun = ok ? body : null;
    apply.disabled = !ok || JSON.parse(body).action === "show";
  });
  apply.addEventListener("click", async () => {
    if (!dryRun) return;
    apply.disabled = true;
    const body = JSON.stringify({ ...JSON.parse(dryRun), apply: true });
    dryRun = null;
    await post("/counters", body, "counters-answer");
  });
  refresh();
  setInterval(refresh, 1000);
}

document.addEventListener("DOMContentLoaded", start);
