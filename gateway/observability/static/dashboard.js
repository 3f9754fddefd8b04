// kvgate dashboard: reads /dashboard/api/summary with the admin key kept in sessionStorage and
// draws tiles, SVG line charts and tables. No dependencies; all text goes in through textContent.
"use strict";

const KEY = "kvgate-admin-key";
const REFRESH_MS = 10000;
const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#2f6fde", "#e0862b", "#2aa876", "#c0392b"];
let timer = null;

const $ = (id) => document.getElementById(id);

function pct(v) { return v === null || v === undefined ? "–" : (100 * v).toFixed(1) + "%"; }
function num(v) {
  if (v === null || v === undefined) return "–";
  if (Math.abs(v) >= 1e9) return (v / 1e9).toFixed(2) + "G";
  if (Math.abs(v) >= 1e6) return (v / 1e6).toFixed(2) + "M";
  if (Math.abs(v) >= 1e4) return (v / 1e3).toFixed(1) + "k";
  return Number.isInteger(v) ? String(v) : v.toFixed(2);
}
function bytes(v) {
  if (v === null || v === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return v.toFixed(i ? 1 : 0) + " " + units[i];
}
function ms(v) { return v === null || v === undefined ? "–" : v.toFixed(v < 10 ? 1 : 0) + " ms"; }
// null: no request in the window had a price (local models are not priced unless configured).
function usd(v) { return v === null || v === undefined ? "not priced" : "$" + v.toFixed(v >= 100 ? 0 : 4); }
// An upstream's retries by cause ("3 stale_connection, 1 server_error"), 0 when none.
function retries(byCause) {
  const parts = Object.entries(byCause || {}).filter(([, n]) => n > 0).map(([cause, n]) => num(n) + " " + cause);
  return parts.length ? parts.join(", ") : "0";
}
function sum(a, b) { return a === null || b === null ? (a === null ? b : a) : a + b; }

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function svgEl(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  return node;
}

// One line chart: `series` is [{name, values: [number|null]}], `labels` the x labels (ISO times).
function lineChart(container, labels, series, yMax) {
  container.replaceChildren();
  const W = 600, H = 160, L = 40, R = 8, T = 8, B = 20;
  const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img" });
  let top = yMax;
  if (top === undefined) {
    top = 0;
    for (const s of series) for (const v of s.values) if (v !== null && v > top) top = v;
    top = top > 0 ? top * 1.15 : 1;
  }
  const n = Math.max(labels.length - 1, 1);
  const x = (i) => L + (i / n) * (W - L - R);
  const y = (v) => T + (1 - v / top) * (H - T - B);
  for (const f of [0, 0.5, 1]) {
    svg.appendChild(svgEl("line", { x1: L, x2: W - R, y1: y(top * f), y2: y(top * f), class: "axis" }));
    const t = svgEl("text", { x: L - 4, y: y(top * f) + 3, "text-anchor": "end" });
    t.textContent = yMax === 1 ? Math.round(100 * f) + "%" : num(top * f);
    svg.appendChild(t);
  }
  [0, labels.length - 1].forEach((i, k) => {
    if (!labels[i]) return;
    const t = svgEl("text", { x: x(i), y: H - 4, "text-anchor": k ? "end" : "start" });
    t.textContent = new Date(labels[i]).toLocaleTimeString();
    svg.appendChild(t);
  });
  series.forEach((s, k) => {
    let d = "";
    let pen = false;
    s.values.forEach((v, i) => {
      if (v === null || v === undefined) { pen = false; return; }
      d += (pen ? "L" : "M") + x(i).toFixed(1) + " " + y(v).toFixed(1) + " ";
      pen = true;
    });
    const path = svgEl("path", { d: d.trim() || "M0 0", fill: "none", stroke: COLORS[k % COLORS.length],
                                 "stroke-width": 2, "vector-effect": "non-scaling-stroke", "data-series": s.name });
    svg.appendChild(path);
    // Points make single samples visible (a line needs two).
    s.values.forEach((v, i) => {
      if (v === null || v === undefined) return;
      svg.appendChild(svgEl("circle", { cx: x(i), cy: y(v), r: 2, fill: COLORS[k % COLORS.length],
                                        class: "point", "data-series": s.name }));
    });
  });
  container.appendChild(svg);
  if (series.length > 1) {
    const legend = el("div", null, "legend");
    series.forEach((s, k) => {
      const item = el("span");
      const swatch = el("i");
      swatch.setAttribute("data-color", COLORS[k % COLORS.length]);
      swatch.style.background = COLORS[k % COLORS.length];
      item.append(swatch, s.name);
      legend.appendChild(item);
    });
    container.appendChild(legend);
  }
}

function table(node, columns, rows, empty = "nothing yet") {
  node.replaceChildren();
  const head = el("tr");
  for (const c of columns) head.appendChild(el("th", c[0]));
  node.appendChild(el("thead")).appendChild(head);
  const body = node.appendChild(el("tbody"));
  if (!rows.length) {
    const tr = body.appendChild(el("tr"));
    const td = tr.appendChild(el("td", empty, "empty"));
    td.colSpan = columns.length;
    return;
  }
  for (const r of rows) {
    const tr = body.appendChild(el("tr"));
    for (const c of columns) tr.appendChild(el("td", c[1](r)));
  }
}

function tiles(o, writes, responseCache, requestLog) {
  const t = $("tiles");
  t.replaceChildren();
  const saved = sum(o.cost_saved_usd.response_cache, o.cost_saved_usd.kv_cache);
  const items = [
    ["Requests / s", num(o.requests_per_second), num(o.requests) + " requests, " + num(o.errors) + " errors"],
    ["Refused", num(o.refused), refusedHint(o)],
    ["Exact hit rate", pct(o.exact_hit_rate), num(o.response_cache_lookups) + " lookups"],
    ["Semantic hit rate", pct(o.semantic_hit_rate), ""],
    ["Semantic skipped busy", responseCache && responseCache.semantic ? pct(o.semantic_busy_rate) : "–",
     busyHint(o, responseCache)],
    ["Prefix hit rate", pct(o.prefix_hit_rate), "of prompt tokens sent upstream"],
    ["Cache efficiency", pct(o.cache_efficiency), "read / (read + creation)"],
    ["Tokens saved", num(o.tokens_saved.response_cache + o.tokens_saved.kv_cache),
     num(o.tokens_saved.response_cache) + " response cache, " + num(o.tokens_saved.kv_cache) + " KV"],
    ["Cost saved", usd(saved), saved === null ? "set KVGATE_USAGE__PRICES to price a model"
                                              : usd(o.cost_saved_usd.response_cache) + " response cache"],
    ["Tokens condensed", num(o.tokens_saved.condensing ?? 0),
     (o.cost_saved_usd.condensing == null ? "" : usd(o.cost_saved_usd.condensing) + " saved: ")
     + "context cut by the small model before the upstream"],
    ["TTFT cached", ms(o.ttft_ms.cached.p50), "p50; p95 " + ms(o.ttft_ms.cached.p95)],
    ["TTFT uncached", ms(o.ttft_ms.uncached.p50), "p50; p95 " + ms(o.ttft_ms.uncached.p95)],
  ];
  if (writes) {
    // Provider prompt-cache writes (billed at a premium) that expired unread, and stored answers never served.
    items.push(["Cache writes never read", num(writes.writes_never_read),
                num(writes.write_tokens_never_read) + " provider write tokens; " +
                num(writes.entries_never_read) + " response-cache entries unserved"]);
  }
  if (requestLog) {
    // This replica's rows not yet in the database; past max_queue they are dropped (KVGATE_REQUEST_LOG_MAX_QUEUE).
    const oldest = requestLog.oldest_age_s == null ? "none waiting" : "oldest waited " + requestLog.oldest_age_s.toFixed(1) + " s";
    items.push(["Request log queued", num(requestLog.num_queued),
                oldest + "; " + num(requestLog.num_dropped) + " dropped, " + num(requestLog.num_written) +
                " written (this replica, since start; queue of " + num(requestLog.max_queue) + ")"]);
  }
  const feedback = responseCache && responseCache.feedback;
  if (feedback) {
    // Clients' verdicts on hits (POST /v1/kvgate/feedback); an entry reported wrong is no longer served semantically.
    items.push(["Hits reported wrong", num(feedback.wrong),
                num(feedback.entries_reported_wrong) + " entries reported, now served on exact repeats only; " +
                num(feedback.correct) + " hits confirmed"]);
  }
  for (const [label, value, sub] of items) {
    const tile = el("div", null, "tile");
    tile.append(el("div", label, "label"), el("div", value, "value"), el("div", sub, "sub"));
    t.appendChild(tile);
  }
}

// Requests refused before any upstream, by reason: their key (auth), a limit (requests, tokens, parallel), a budget.
function refusedHint(o) {
  const reasons = Object.entries(o.refused_by_reason || {}).map(([reason, n]) => reason + " " + num(n));
  return reasons.length ? reasons.join(", ") : "for their key, a limit or a budget";
}

// Lookups forwarded unjudged because the semantic cache's CPU budget was spent, and what to change.
function busyHint(o, responseCache) {
  if (!responseCache || !responseCache.semantic) return "the semantic cache is off";
  const share = responseCache.semantic_cpu_share;
  const setting = "KVGATE_RESPONSECACHE__SEMANTIC_CPU_SHARE (now " + (share ? share + (share > 1 ? " cores" : " of a core") : "0, no limit") + ")";
  return o.semantic_busy ? num(o.semantic_busy) + " of " + num(o.response_cache_lookups) +
                           " lookups forwarded unjudged, CPU budget spent: raise " + setting
                         : "of lookups; CPU budget: " + setting;
}

// Where the semantic lookups of exact misses ended (x-kvgate-semantic-stage / -skipped), one step a row.
function funnelRows(f, responseCache) {
  if (!responseCache || !responseCache.semantic) return [];
  const share = (n) => pct(f.lookups ? n / f.lookups : null);
  return [
    ["lookups", f.lookups, share(f.lookups), "exact misses the semantic cache was asked about"],
    ["ruled out", f.ruled_out, share(f.ruled_out), "by the cheap stage: nothing embedded"],
    ["judged", f.judged, share(f.judged), "embedded and judged"],
    ["hits", f.hits, share(f.hits), "judged and served: " + pct(f.judged ? f.hits / f.judged : null) + " of judged"],
    ["variants", f.variants, share(f.variants), "a stored question in other case or punctuation: served, not judged"],
    ["busy", f.busy, share(f.busy), "forwarded unjudged: the semantic CPU budget was spent"],
  ].map(([step, count, of, what]) => ({ step, count, of, what }));
}

// A key's budget: what it spent of it in the period it is in, and when that period renews.
function budget(b) {
  if (!b) return "–";
  const renews = b.renews_at ? ", renews " + b.renews_at.slice(0, 10) : "";
  return usd(b.spent_usd) + " of " + usd(b.budget_usd) + renews + (b.exhausted ? " (spent)" : "");
}

const GROUP_COLUMNS = [
  ["requests", (r) => num(r.requests)],
  ["errors", (r) => num(r.errors)],
  ["refused", (r) => num(r.refused)],
  ["exact hits", (r) => pct(r.exact_hit_rate)],
  ["semantic hits", (r) => pct(r.semantic_hit_rate)],
  ["prefix hits", (r) => pct(r.prefix_hit_rate)],
  ["efficiency", (r) => pct(r.cache_efficiency)],
  ["prompt tok", (r) => num(r.tokens.prompt)],
  ["cached tok", (r) => num(r.tokens.cached)],
  ["completion tok", (r) => num(r.tokens.completion)],
  ["spent", (r) => usd(r.cost_usd)],
  ["saved", (r) => usd(sum(r.cost_saved_usd.response_cache, r.cost_saved_usd.kv_cache))],
  ["TTFT p50", (r) => ms(r.ttft_ms.uncached.p50)],
];

function render(data) {
  tiles(data.overview, data.cache_writes, data.response_cache, data.request_log);
  const pts = data.series.points;
  const labels = pts.map((p) => p.t);
  lineChart($("chart-rps"), labels, [{ name: "requests/s", values: pts.map((p) => p.rps) }]);
  lineChart($("chart-hits"), labels, [
    { name: "exact", values: pts.map((p) => p.exact_hit_rate) },
    { name: "semantic", values: pts.map((p) => p.semantic_hit_rate) },
    { name: "prefix", values: pts.map((p) => p.prefix_hit_rate) },
    { name: "semantic busy", values: pts.map((p) => p.semantic_busy_rate) },
  ], 1);
  lineChart($("chart-efficiency"), labels, [{ name: "efficiency", values: pts.map((p) => p.cache_efficiency) }], 1);
  table($("table-funnel"), [
    ["semantic lookups", (r) => r.step], ["count", (r) => num(r.count)], ["of lookups", (r) => r.of],
    ["", (r) => r.what],
  ], funnelRows(data.overview.semantic_funnel, data.response_cache),
  data.response_cache && data.response_cache.semantic ? "nothing yet" : "the semantic cache is off");
  table($("table-tenants"), [["tenant", (r) => r.tenant], ...GROUP_COLUMNS], data.tenants);
  table($("table-models"), [["model", (r) => r.model], ...GROUP_COLUMNS], data.models);
  table($("table-keys"), [
    ["key", (r) => r.key || "(no key)"], ["tenant", (r) => r.tenant || "–"], ["requests", (r) => num(r.requests)],
    ["cache hits", (r) => num(r.cache_hits)], ["spent", (r) => usd(r.cost_usd)], ["saved", (r) => usd(r.saved_usd)],
    ["limits", (r) => r.limits || "–"], ["budget", (r) => budget(r.budget)],
  ], data.keys, "no requests in this window");
  table($("table-tiers"), [
    ["tier", (r) => r.name], ["up", (r) => (r.up ? "yes" : "no")], ["blocks", (r) => (r.files != null ? num(r.files) + " files" : num(r.num_blocks))],
    ["used", (r) => bytes(r.used_bytes)], ["capacity", (r) => bytes(r.capacity_bytes)],
    ["occupancy", (r) => pct(r.occupancy)], ["hit ratio", (r) => pct(r.hit_ratio)],
    ["evictions", (r) => num(r.evictions)], ["refused", (r) => num(r.admission_rejects)],
    ["read", (r) => bytes(r.bytes_read)],
    ["written", (r) => bytes(r.bytes_written)], ["codec ratio", (r) => (r.codec_ratio ? r.codec_ratio.toFixed(2) + "x" : "–")],
  ], data.kv_tiers);
  table($("table-upstreams"), [
    ["upstream", (r) => r.name], ["up", (r) => (r.up === null ? "–" : r.up ? "yes" : "no")],
    ["circuit", (r) => r.state || "–"], ["in flight", (r) => num(r.in_flight)],
    ["retries", (r) => retries(r.retries)],
  ], data.upstreams);
  table($("table-breaks"), [
    ["time", (r) => new Date(r.time * 1000).toLocaleTimeString()], ["reason", (r) => r.reason],
    ["tenant", (r) => r.tenant], ["model", (r) => r.model || "–"], ["block", (r) => num(r.block_index)],
  ], data.prefix_breaks);
  $("updated").textContent = "updated " + new Date().toLocaleTimeString();
  document.body.setAttribute("data-loaded", "true");
}

function showLogin(message) {
  if (timer) { clearTimeout(timer); timer = null; }
  $("dashboard").hidden = true;
  $("controls").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
}

async function refresh() {
  if (timer) { clearTimeout(timer); timer = null; }
  const key = sessionStorage.getItem(KEY);
  try {
    // Without a key, ask anyway: a gateway serving without keys (kvgate serve --no-auth) answers,
    // and then there is nothing to sign in to; any other answers 401 and the form shows.
    const res = await fetch("/dashboard/api/summary?since=" + encodeURIComponent($("window").value), {
      headers: key ? { Authorization: "Bearer " + key } : {}, cache: "no-store",
    });
    if ((res.status === 401 || res.status === 403) && !key) { showLogin(); return; }
    if (res.status === 401 || res.status === 403) {
      sessionStorage.removeItem(KEY);
      let reason = res.status === 401 ? "That key was not accepted." : "That key is not an admin key.";
      try { reason = (await res.json()).error.message || reason; } catch (e) { /* keep the generic reason */ }
      showLogin(reason);
      return;
    }
    if (!res.ok) throw new Error("HTTP " + res.status);
    const data = await res.json();
    $("login").hidden = true;
    $("dashboard").hidden = false;
    $("controls").hidden = false;
    $("error").textContent = "";
    render(data);
  } catch (err) {
    $("error").textContent = "Could not load data: " + err.message;
  }
  if (!document.hidden) timer = setTimeout(refresh, REFRESH_MS);
}

document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY, $("admin-key").value.trim());
    $("admin-key").value = "";
    refresh();
  });
  $("logout").addEventListener("click", () => { sessionStorage.removeItem(KEY); showLogin(); });
  $("window").addEventListener("change", refresh);
  // A hidden tab stops polling; it catches up when shown again.
  document.addEventListener("visibilitychange", () => { if (!document.hidden) refresh(); });
  refresh();
});
