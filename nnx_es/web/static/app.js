// The pages of `nnx-es serve`, drawn from its JSON API (nnx_es/web/app.py). Every string from a run is
// inserted as text (append / textContent), never as markup; links are built from encoded run ids.
"use strict";

const main = document.getElementById("main");
const COLORS = ["#2b5797", "#d9480f", "#2f9e44", "#9c36b5", "#e67700", "#0c8599", "#c2255c", "#5f3dc4"];
let timer = null;
let drawn = 0;  // how many times a run's page was drawn: an older drawing stops asking for its curves

function h(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") e.className = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v === true ? "" : v);
  }
  for (const kid of kids.flat()) if (kid !== undefined && kid !== null) e.append(kid instanceof Node ? kid : String(kid));
  return e;
}

const enc = encodeURIComponent;
const runHref = (id, view) => "/runs/" + enc(id) + (view ? "/" + view : "");
const eventHref = (id, seq) => runHref(id, "events/" + seq);
const studyHref = (name) => "/studies/" + enc(name);

function fmt(v) {
  if (v === null || v === undefined) return "–";
  if (typeof v === "number") return Number.isInteger(v) ? String(v) : Number(v.toPrecision(6)).toString();
  if (typeof v === "boolean") return v ? "true" : "false";
  if (typeof v === "string") return /^[0-9a-f]{64}$/.test(v) ? v.slice(0, 12) : v;
  return JSON.stringify(v);
}

// a number cell: shown to 6 significant digits, the exact value in data-value
function num(v) { return h("td", { class: "num", "data-value": v === null || v === undefined ? "" : String(v) }, fmt(v)); }

async function api(path) {
  const r = await fetch(path, { headers: { Accept: "application/json" } });
  const doc = await r.json();
  if (!r.ok) throw new Error((doc.error && (doc.error.type + ": " + doc.error.message)) || r.statusText);
  return doc;
}

function show(...nodes) { main.replaceChildren(...nodes.flat(2).filter((n) => n !== null && n !== undefined)); }
function fail(err) { show(h("p", { class: "error", id: "error" }, String(err.message || err))); }
function poll(fn, ms) { clearTimeout(timer); timer = setTimeout(fn, ms); }
function liveNote(text) { document.getElementById("live").textContent = text || ""; }

function statusBadge(row) {
  const s = row.status;
  if (row.writer_alive === false && ["new", "running", "failing"].includes(s)) {
    return h("span", { class: "badge nowriter", title: "not finalized, and no process on this machine holds its writer lease: killed or crashed?" }, s + " (no writer)");
  }
  return h("span", { class: "badge " + s + (row.live ? " live" : "") }, s + (row.live ? " · live" : ""));
}

function nav(runId, here) {
  const n = document.getElementById("nav");
  const items = [["runs", "/"]];
  if (runId) {
    for (const [label, view] of [["overview", ""], ["events", "events"], ["time travel", "at"], ["audit", "audit"], ["rows", "rows"]]) {
      items.push([label, runHref(runId, view)]);
    }
  }
  items.push(["diff", "/diff" + (runId ? "?a=" + enc(runId) : "")]);
  items.push(["studies", "/studies"]);
  n.replaceChildren(...items.map(([label, href]) => h("a", { href, class: label === here ? "here" : null }, label)));
}

function kvTable(pairs) {
  return h("table", { class: "kv" }, pairs.map(([k, v]) => h("tr", {}, h("td", {}, k), v instanceof Node ? h("td", {}, v) : h("td", {}, fmt(v)))));
}

function pointer(p) {
  if (!p) return "–";
  return "epoch " + p.epoch + ", step " + p.step + (p.value !== null && p.value !== undefined ? ", value " + fmt(p.value) : "") + ", manifest " + fmt(p.manifest);
}

// ---------------------------------------------------------------- runs

function lineageCell(row) {
  const parts = [];
  const src = row.lineage && row.lineage.source;
  const init = row.lineage && row.lineage.init_from;
  if (src) parts.push(h("div", {}, (src.state === "full" ? "forked from " : "continues "), h("a", { href: runHref(src.run_id) }, src.run_id), " @ seq " + src.last_seq));
  if (init && init.run_id) parts.push(h("div", {}, "weights from ", h("a", { href: runHref(init.run_id) }, init.run_id), " (" + init.checkpoint + ", epoch " + init.epoch + ")"));
  else if (init) parts.push(h("div", {}, "weights from a state dict"));
  if (row.children && row.children.length) parts.push(h("div", {}, "→ ", row.children.flatMap((c, i) => [i ? ", " : "", h("a", { href: runHref(c) }, c)])));
  return h("td", {}, parts.length ? parts : "–");
}

async function pageRuns() {
  nav(null, "runs");
  let doc;
  try { doc = await api("/api/runs"); } catch (e) { return fail(e); }
  const rows = doc.runs.map((r) => h("tr", { class: "clickable run", "data-run": r.run_id, onclick: (ev) => { if (ev.target.tagName !== "A") location.href = runHref(r.run_id); } },
    h("td", {}, h("a", { href: runHref(r.run_id) }, r.run_id)),
    h("td", {}, statusBadge(r), r.error ? h("div", { class: "error" }, (r.error_type ? r.error_type + ": " : "") + r.error) : null),
    num(r.epochs),
    num(r.best ? r.best.value : null),
    h("td", { class: "num" }, r.best ? String(r.best.epoch) : "–"),
    num(r.events),
    h("td", {}, r.started || "–"),
    lineageCell(r)));
  const ids = doc.runs.map((r) => r.run_id);
  const pick = (name, i) => h("select", { name }, ids.map((id, j) => h("option", { value: id, selected: j === i ? true : null }, id)));
  const a = pick("a", 0), b = pick("b", Math.min(1, ids.length - 1));
  show(h("h1", {}, "runs under ", h("code", {}, doc.root)),
    doc.runs.length ? h("table", { id: "runs" }, h("tr", {}, ["run", "status", "epochs", "best", "best epoch", "events", "started (UTC)", "lineage"].map((t, i) => h("th", { class: [2, 3, 4, 5].includes(i) ? "num" : null }, t))), rows)
      : h("p", { class: "muted" }, "no runs here yet: a run's directory appears when it starts."),
    doc.studies && doc.studies.length ? h("p", { id: "studies-link" }, "searches (nnx-es search): ",
      doc.studies.flatMap((n, i) => [i ? ", " : "", h("a", { href: studyHref(n) }, n)]), " · ", h("a", { href: "/studies" }, "all studies")) : null,
    ids.length > 1 ? h("div", { class: "controls" }, h("label", {}, "run A", a), h("label", {}, "run B", b),
      h("button", { onclick: () => { location.href = "/diff?a=" + enc(a.value) + "&b=" + enc(b.value); } }, "diff")) : null);
  liveNote(doc.live ? "a run is training: refreshing every 2 s" : "");
  poll(pageRuns, doc.live ? 2000 : 15000);
}

// ---------------------------------------------------------------- one run

function chart(title, xLabel, x, series, width) {
  const box = h("div", { class: "chart", "data-chart": title });
  if (!x.length || !series.length) { box.append(h("div", { class: "muted" }, title + ": nothing yet")); return box; }
  const opts = {
    title, width: width || 440, height: 240,
    scales: { x: { time: false } },
    axes: [{ label: xLabel }, {}],
    series: [{ label: xLabel }, ...series.map(([label], i) => ({ label, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true, points: { show: x.length < 60 } }))],
  };
  // eslint-disable-next-line no-undef
  new uPlot(opts, [x, ...series.map(([, y]) => y)], box);
  return box;
}

function epochCharts(c) {
  const s = c.epoch.series, x = c.epoch.x;
  const names = Object.keys(s);
  const losses = names.filter((n) => n.includes("loss") && !n.startsWith("lr/"));
  const lrs = names.filter((n) => n.startsWith("lr/"));
  const metrics = names.filter((n) => !losses.includes(n) && !lrs.includes(n));
  return [chart("loss per epoch", "epoch", x, losses.map((n) => [n, s[n]])),
    chart("metrics per epoch", "epoch", x, metrics.map((n) => [n, s[n]])),
    chart("learning rate per epoch", "epoch", x, lrs.map((n) => [n, s[n]]))];
}

function updateCharts(u) {
  const groups = [["loss/", "training loss per update"], ["grad_norm/", "gradient norm per update"], ["lr/", "learning rate per update"]];
  const per = u.steps_per_bucket;
  return groups.map(([prefix, title]) => {
    const names = Object.keys(u.series).filter((n) => n.startsWith(prefix));
    if (!names.length) return null;
    // eslint-disable-next-line no-undef
    const joined = uPlot.join(names.map((n) => [u.series[n].x, u.series[n].y]));
    return chart(title + (per > 1 ? " (min–max per " + per + " steps)" : ""), "step", joined[0], names.map((n, i) => [n, joined[i + 1]]));
  }).filter(Boolean);
}

// what the per-update curves show: downsampled or not, by how much, and how much of the log is read yet
function updateNote(u) {
  const loss = Object.keys(u.series).find((n) => n.startsWith("loss/"));
  const updates = loss ? u.series[loss].updates : 0, points = loss ? u.series[loss].x.length : 0;
  const n = (v) => v.toLocaleString("en-US");
  const parts = [u.steps_per_bucket > 1
    ? "downsampled: each curve keeps the least and the greatest value of each bucket of " + n(u.steps_per_bucket) + " steps (" + n(points) + " points for " + n(updates) + " committed updates)"
    : "every committed update (" + n(updates) + "), not downsampled"];
  if (!u.complete) parts.push("read " + u.parts_read + " of " + u.parts + " parts of the log (the newest and the first first, then the gaps): reading on…");
  return parts.join(" · ");
}

function historyTable(records) {
  const train = [...new Set(records.flatMap((r) => Object.keys(r.train)))].sort();
  const val = [...new Set(records.flatMap((r) => Object.keys(r.val)))].sort();
  const lrs = [...new Set(records.flatMap((r) => Object.entries(r.lrs).flatMap(([o, v]) => v.map((_, g) => o + "/" + g))))].sort();
  const head = ["epoch", ...train, ...val, "monitor", "improved", ...lrs.map((l) => "lr/" + l)];
  return h("table", { id: "history" }, h("tr", {}, head.map((t) => h("th", { class: "num" }, t))),
    records.map((r) => h("tr", { "data-epoch": r.epoch }, num(r.epoch), train.map((k) => num(r.train[k])), val.map((k) => num(r.val[k])),
      num(r.monitor_value), h("td", { class: "num" }, r.improved === null ? "–" : r.improved ? "yes" : "no"),
      lrs.map((l) => { const [o, g] = [l.slice(0, l.lastIndexOf("/")), +l.slice(l.lastIndexOf("/") + 1)]; return num((r.lrs[o] || [])[g]); }))));
}

async function pageRun(runId) {
  nav(runId, "overview");
  let doc;
  try { doc = await api("/api/runs/" + enc(runId)); } catch (e) { return fail(e); }
  const d = doc.declared || {};
  const lin = [];
  if (doc.lineage.source) lin.push(["source", h("span", {}, h("a", { href: runHref(doc.lineage.source.run_id) }, doc.lineage.source.run_id), " LAST seq " + doc.lineage.source.last_seq + " (" + doc.lineage.source.state + ")")]);
  if (doc.lineage.init_from) lin.push(["initial weights", doc.lineage.init_from.run_id ? h("span", {}, h("a", { href: runHref(doc.lineage.init_from.run_id) }, doc.lineage.init_from.run_id), " " + doc.lineage.init_from.checkpoint + " epoch " + doc.lineage.init_from.epoch) : "a state dict " + fmt(doc.lineage.init_from.state_sha256)]);
  const status = h("span", {}, statusBadge(doc), doc.stop_reason ? " stop: " + doc.stop_reason : "", doc.error ? h("div", { class: "error" }, doc.error_type + ": " + doc.error) : null);
  const summary = kvTable([
    ["status", status], ["epochs", doc.epochs], ["LAST", pointer(doc.last)], ["BEST", pointer(doc.best)],
    ...Object.entries(doc.phases || {}).map(([k, p]) => ["phase " + k, pointer(p)]),
    ["counters", Object.entries(doc.counters).map(([k, v]) => k + "=" + v).join(" ")],
    ["events", h("span", { id: "events-count", "data-value": String(doc.events) }, String(doc.events))], ["uncommitted tail", doc.tail],
    ["checksums", doc.checksums + (doc.damaged ? " — DAMAGED" : "")], ["started (UTC)", doc.started],
    ["seed", d.seed], ["optimizers", (d.optimizers || []).join(", ")], ["callbacks", (d.callbacks || []).join(", ")],
    ["monitor", d.monitor ? d.monitor.name + " (" + d.monitor.mode + ")" : "–"], ["world size", d.world_size], ...lin,
  ]);
  // the curves are drawn when they arrive, the summary and the history first
  const perEpoch = h("div", { class: "charts", id: "epoch-charts" }, h("p", { class: "muted" }, "reading the curves…"));
  const note = h("p", { class: "muted", id: "update-note" }, "reading the committed updates…");
  const perUpdate = h("div", { class: "charts", id: "update-charts" });
  show(h("h1", {}, "run ", h("code", { id: "run-id" }, runId)), summary,
    h("h2", {}, "per epoch"), perEpoch, h("h2", {}, "per committed update"), note, perUpdate,
    h("h2", {}, "history (committed epochs)"), doc.history.length ? historyTable(doc.history) : h("p", { class: "muted" }, "no committed epoch yet"));
  liveNote(doc.live ? "training: refreshing every 2 s" : "");
  const drawing = ++drawn;
  try {  // per epoch: the history projection (from a snapshot); per update: a bounded part of the log an answer
    perEpoch.replaceChildren(...epochCharts(await api("/api/runs/" + enc(runId) + "/curves?per=epoch")));
    for (;;) {
      const u = (await api("/api/runs/" + enc(runId) + "/curves?per=update")).update;
      if (drawing !== drawn) return;  // redrawn meanwhile (a live run)
      perUpdate.replaceChildren(...updateCharts(u));
      note.textContent = updateNote(u);
      note.dataset.complete = String(u.complete);
      note.dataset.stepsPerBucket = String(u.steps_per_bucket);
      if (u.complete) break;
    }
  } catch (e) { perUpdate.replaceChildren(h("p", { class: "error" }, String(e.message || e))); }
  if (doc.live) poll(() => pageRun(runId), 2000);
}

// ---------------------------------------------------------------- events

async function pageEvents(runId) {
  nav(runId, "events");
  const q = new URLSearchParams(location.search);
  const stack = (q.get("back") || "").split(",").filter(Boolean);
  const params = new URLSearchParams();
  for (const k of ["from", "limit", "kind", "epoch"]) if (q.get(k)) params.set(k, q.get(k));
  let doc;
  try { doc = await api("/api/runs/" + enc(runId) + "/events?" + params); } catch (e) { return fail(e); }
  const kind = h("select", { name: "kind", id: "kind" }, h("option", { value: "" }, "every kind"), doc.kinds.map((k) => h("option", { value: k, selected: q.get("kind") === k ? true : null }, k)));
  const epoch = h("input", { name: "epoch", id: "epoch", placeholder: "A or A:B", size: 8, value: q.get("epoch") || "" });
  const from = h("input", { name: "from", id: "from", type: "number", min: 0, size: 10, value: q.get("from") || "0" });
  const limit = h("select", { name: "limit", id: "limit" }, [50, 100, 500, 1000].map((n) => h("option", { value: n, selected: String(n) === (q.get("limit") || "100") ? true : null }, String(n))));
  const go = (start, back) => {
    const p = new URLSearchParams();
    p.set("from", start); p.set("limit", limit.value);
    if (kind.value) p.set("kind", kind.value);
    if (epoch.value.trim()) p.set("epoch", epoch.value.trim());
    if (back && back.length) p.set("back", back.join(","));
    location.href = runHref(runId, "events") + "?" + p;
  };
  const start = doc.from;
  const controls = h("div", { class: "controls" }, h("label", {}, "kind", kind), h("label", {}, "epoch", epoch), h("label", {}, "from seq", from), h("label", {}, "page", limit),
    h("button", { id: "apply", onclick: () => go(from.value || 0, []) }, "show"),
    h("button", { id: "prev", disabled: stack.length ? null : true, onclick: () => go(stack[stack.length - 1], stack.slice(0, -1)) }, "← previous"),
    h("button", { id: "next", disabled: doc.next === null ? true : null, onclick: () => go(doc.next, [...stack, start]) }, "next →"),
    h("button", { id: "last", onclick: () => go(Math.max(0, doc.total - (+limit.value)), []) }, "end"));
  const rows = doc.events.map((r) => h("tr", { class: "clickable event", "data-seq": r.seq, onclick: () => { location.href = eventHref(runId, r.seq); } },
    h("td", { class: "num" }, h("a", { href: eventHref(runId, r.seq) }, String(r.seq))), h("td", {}, r.kind || "<undecodable>"),
    h("td", { class: "num" }, r.epoch === null ? "" : String(r.epoch)), h("td", { class: "fields" }, r.kind ? r.fields : "error: " + r.error)));
  const note = doc.next !== null && doc.events.length < (+limit.value) ? "read up to seq " + doc.scanned_to + " of " + doc.total + " looking for matches: next → goes on from there" : "";
  show(h("h1", {}, "events of ", h("code", {}, runId), h("span", { class: "muted" }, " — " + doc.total + " in the log")), controls,
    h("table", { id: "events" }, h("tr", {}, h("th", { class: "num" }, "seq"), h("th", {}, "kind"), h("th", { class: "num" }, "epoch"), h("th", {}, "fields")), rows),
    doc.events.length ? null : h("p", { class: "muted" }, "no event matches here"), note ? h("p", { class: "muted" }, note) : null);
}

function valueCell(v) {
  return h("td", {}, h("pre", { class: "value" }, typeof v === "string" ? v : JSON.stringify(v, null, 1)));
}

async function pageEvent(runId, seq) {
  nav(runId, "events");
  let doc;
  try { doc = await api("/api/runs/" + enc(runId) + "/events/" + seq); } catch (e) { return fail(e); }
  const e = doc.event;
  const c = doc.commit;
  const commit = [h("p", { id: "commit-state" }, h("span", { class: "badge " + (c.state === "committed" || c.state === "closing" ? "ok" : "bad") }, c.state), " ", c.why || "")];
  if (c.by && c.by.kind === "last_committed") {
    commit.push(h("p", {}, "committed by ", h("a", { href: eventHref(runId, c.by.seq), id: "committed-by" }, "LAST at seq " + c.by.seq), " (epoch " + c.by.epoch + (c.by.covers >= 0 ? ", deferred: covers up to seq " + c.by.covers : "") + ")"));
    commit.push(h("table", { id: "group" }, h("tr", {}, h("th", { class: "num" }, "seq"), h("th", {}, "kind"), h("th", {}, "its commit group")),
      [c.by, ...c.by.group].map((g) => h("tr", { class: "clickable" + (g.seq === e.seq ? " hit" : ""), onclick: () => { location.href = eventHref(runId, g.seq); } },
        h("td", { class: "num" }, h("a", { href: eventHref(runId, g.seq) }, String(g.seq))), h("td", {}, g.kind), h("td", { class: "fields" }, g.fields)))));
  } else if (c.by) {
    commit.push(h("p", {}, "dropped by ", h("a", { href: eventHref(runId, c.by.seq) }, c.by.kind + " at seq " + c.by.seq)));
  }
  const links = h("p", {}, doc.previous !== null ? h("a", { href: eventHref(runId, doc.previous), id: "prev-event" }, "← seq " + doc.previous) : null, "  ",
    doc.next !== null ? h("a", { href: eventHref(runId, doc.next), id: "next-event" }, "seq " + doc.next + " →") : null, "  ",
    h("a", { href: runHref(runId, "at") + "?seq=" + e.seq, id: "travel" }, "the projections at this event"), "  ",
    h("a", { href: runHref(runId, "events") + "?from=" + Math.max(0, e.seq - 20) }, "in the list"));
  show(h("h1", {}, h("span", { id: "event-kind" }, e.kind), " at seq ", h("span", { id: "event-seq" }, String(e.seq)), h("span", { class: "muted" }, " of " + runId)), links,
    h("table", { id: "fields", class: "kv" }, Object.entries(e).map(([k, v]) => h("tr", { "data-field": k }, h("td", {}, k), valueCell(v)))),
    h("h2", {}, "commit"), commit);
}

// ---------------------------------------------------------------- time travel

function projectionTables(p) {
  const sched = Object.entries(p.schedulers.by_name || {});
  return [
    h("h2", {}, "status and counters"),
    kvTable([["status", p.status.status], ["stop reason", p.status.stop_reason], ["resumes", p.status.resumes],
      ...Object.entries(p.counters).map(([k, v]) => ["counters." + k, h("span", { class: "counter", "data-counter": k, "data-value": String(v) }, String(v))])]),
    h("h2", {}, "checkpoints"),
    kvTable([["LAST", pointer(p.checkpoints.last)], ["BEST", pointer(p.checkpoints.best)], ["commits", p.checkpoints.commits],
      ...Object.entries(p.checkpoints.phases || {}).map(([k, v]) => ["phase " + k, pointer(v)])]),
    h("h2", {}, "schedulers"),
    sched.length ? h("table", {}, h("tr", {}, ["name", "clock", "steps", "lrs", "plateau"].map((t) => h("th", {}, t))),
      sched.map(([n, s]) => h("tr", {}, h("td", {}, n), h("td", {}, s.clock), num(s.steps), h("td", {}, fmt(s.lrs)), h("td", {}, s.plateau ? fmt(s.plateau) : "–")))) : h("p", { class: "muted" }, "none"),
    h("h2", {}, "history"),
    p.history.records.length ? historyTable(p.history.records) : h("p", { class: "muted" }, "no committed epoch at this point"),
  ];
}

async function pageAt(runId) {
  nav(runId, "time travel");
  const q = new URLSearchParams(location.search);
  let seq = q.has("seq") ? +q.get("seq") : null;
  let first;
  try { first = await api("/api/runs/" + enc(runId) + "/at?seq=" + (seq === null ? 0 : seq)); } catch (e) { return fail(e); }
  if (seq === null) { seq = first.total - 1; first = await api("/api/runs/" + enc(runId) + "/at?seq=" + seq); }
  const slider = h("input", { type: "range", id: "slider", min: 0, max: Math.max(0, first.total - 1), value: seq, step: 1 });
  const box = h("input", { type: "number", id: "seq", min: 0, max: Math.max(0, first.total - 1), value: seq, size: 10 });
  const out = h("div", { id: "state" });
  let pending = null, shownSeq = null;
  const render = (doc) => {
    shownSeq = doc.at;
    const ev = doc.event;
    out.replaceChildren(
      h("p", { id: "at-line", "data-seq": String(doc.at) }, "after seq ", h("b", {}, String(doc.at)), ev ? [" (", h("a", { href: eventHref(runId, ev.seq), id: "at-event" }, ev.kind || "<undecodable>"), ev.epoch !== null && ev.epoch !== undefined ? ", epoch " + ev.epoch : "", ")"] : "",
        ": " + doc.events + " events read, " + doc.tail + " uncommitted; LAST then: " + pointer(doc.checkpoint)),
      ...projectionTables(doc.projections));
  };
  const load = (s) => {
    clearTimeout(pending);
    pending = setTimeout(async () => {
      try {
        const doc = await api("/api/runs/" + enc(runId) + "/at?seq=" + s);
        if (+slider.value !== doc.at) return; // a later position was asked meanwhile
        render(doc);
        history.replaceState(null, "", runHref(runId, "at") + "?seq=" + doc.at);
      } catch (e) { out.replaceChildren(h("p", { class: "error" }, String(e.message || e))); }
    }, 120);
  };
  slider.addEventListener("input", () => { box.value = slider.value; load(+slider.value); });
  box.addEventListener("change", () => { slider.value = box.value; load(+slider.value); });
  const step = (d) => h("button", { onclick: () => { slider.value = Math.min(+slider.max, Math.max(0, +slider.value + d)); box.value = slider.value; load(+slider.value); } }, (d > 0 ? "+" : "") + d);
  show(h("h1", {}, "time travel in ", h("code", {}, runId)),
    h("p", { class: "muted" }, "every projection after the log up to a seq: what tools/inspect RUN --at SEQ prints"),
    slider, h("div", { class: "controls" }, h("label", {}, "seq", box), step(-100), step(-1), step(1), step(100)), out);
  render(first);
  void shownSeq;
}

// ---------------------------------------------------------------- audit

async function pageAudit(runId) {
  nav(runId, "audit");
  show(h("p", { class: "muted" }, "auditing every event from seq 0 (tools/replay)…"));
  let doc;
  try { doc = await api("/api/runs/" + enc(runId) + "/audit"); } catch (e) { return fail(e); }
  const v = doc.violations;
  show(h("h1", {}, "audit of ", h("code", {}, runId)),
    h("p", {}, h("span", { id: "verdict", class: "badge " + (doc.ok ? "ok" : "bad") }, doc.ok ? "ok" : "FAILED"), " ", v.length + " violation" + (v.length === 1 ? "" : "s") + "; status " + doc.status),
    kvTable([["events", doc.events], ["committed epoch", doc.committed_epoch], ["uncommitted tail", doc.tail]]),
    v.length ? h("table", { id: "violations" }, h("tr", {}, ["seq", "invariant", "message", "expected", "found"].map((t) => h("th", {}, t))),
      v.map((x) => h("tr", { class: "violation" }, h("td", { class: "num" }, x.seq === null ? "–" : h("a", { href: eventHref(runId, x.seq) }, String(x.seq))),
        h("td", { title: doc.invariants[String(x.invariant)] }, x.invariant + ". " + doc.invariants[String(x.invariant)]), h("td", {}, x.message), h("td", { class: "fields" }, x.expected || ""), h("td", { class: "fields" }, x.found || ""))))
      : h("p", {}, "every invariant holds."),
    doc.notes.length ? h("div", {}, h("h2", {}, "notes"), doc.notes.map((n) => h("p", { class: "muted" }, n))) : null,
    h("h2", {}, "the invariants"), h("ol", {}, Object.values(doc.invariants).map((t) => h("li", {}, t))));
}

// ---------------------------------------------------------------- rows

function dataMap(cols, width, height) {
  const c = h("canvas", { class: "map", id: "map", width, height });
  const g = c.getContext("2d");
  const pad = 44;
  const xs = cols.variability, ys = cols.confidence, zs = cols.correctness;
  const xmax = Math.max(1e-9, ...xs) * 1.05;
  const X = (v) => pad + (v / xmax) * (width - pad - 12), Y = (v) => height - pad - v * (height - pad - 12);
  g.strokeStyle = "#999"; g.fillStyle = "#333"; g.font = "11px sans-serif";
  g.beginPath(); g.moveTo(pad, 8); g.lineTo(pad, height - pad); g.lineTo(width - 8, height - pad); g.stroke();
  for (let i = 0; i <= 4; i++) {
    g.fillText((i / 4).toFixed(2), 6, Y(i / 4) + 4);
    g.fillText((xmax * i / 4).toFixed(3), X(xmax * i / 4) - 12, height - pad + 16);
  }
  g.fillText("variability →", width / 2 - 30, height - 8);
  g.save(); g.translate(12, height / 2 + 40); g.rotate(-Math.PI / 2); g.fillText("confidence →", 0, 0); g.restore();
  for (let i = 0; i < xs.length; i++) {
    const z = zs[i];
    g.fillStyle = "rgba(" + Math.round(220 * (1 - z)) + "," + Math.round(60 + 40 * z) + "," + Math.round(220 * z) + ",0.65)";
    g.beginPath(); g.arc(X(xs[i]), Y(ys[i]), 2.6, 0, 2 * Math.PI); g.fill();
  }
  return c;
}

async function pageRows(runId) {
  nav(runId, "rows");
  let doc;
  try { doc = await api("/api/runs/" + enc(runId) + "/rows"); } catch (e) { return fail(e); }
  if (!doc.rows) {
    return show(h("h1", {}, "rows of ", h("code", {}, runId)), h("p", { class: "muted", id: "no-rows" }, "this run has no committed per-row records: its batches carried no row ids (nnx_es.rows.with_row_ids)."));
  }
  const c = doc.columns;
  const hardest = c.row_id.slice(0, 25).map((id, i) => h("tr", {}, num(id), num(c.epochs[i]), num(c.confidence[i]), num(c.variability[i]), num(c.correctness[i])));
  show(h("h1", {}, "data map of ", h("code", {}, runId)),
    h("p", { class: "muted" }, doc.rows + " training rows over " + doc.epochs + " committed epochs" + (doc.shown < doc.rows ? " (" + doc.shown + " shown, an even sample)" : "") + "; colour: fraction of epochs correct (red 0 → blue 1). Swayamdipta et al. (2020), Figure 1."),
    dataMap(c, 640, 460),
    h("h2", {}, "hardest rows (lowest confidence)"),
    h("table", { id: "hardest" }, h("tr", {}, ["row id", "epochs", "confidence", "variability", "correct"].map((t) => h("th", { class: "num" }, t))), hardest));
}

// ---------------------------------------------------------------- diff

function eventsSide(runId, rows, seq) {
  return h("table", { class: "diff-side" }, h("tr", {}, h("th", { class: "num" }, "seq"), h("th", {}, "kind"), h("th", {}, "fields")),
    rows.map((r) => h("tr", { class: "clickable" + (r.seq === seq ? " hit" : ""), onclick: () => { location.href = eventHref(runId, r.seq); } },
      h("td", { class: "num" }, String(r.seq)), h("td", {}, r.kind || "<undecodable>"), h("td", { class: "fields" }, r.fields || ""))));
}

async function pageDiff() {
  const q = new URLSearchParams(location.search);
  nav(q.get("a"), "diff");
  let list;
  try { list = await api("/api/runs"); } catch (e) { return fail(e); }
  const ids = list.runs.map((r) => r.run_id);
  const pick = (name, val) => h("select", { name, id: "pick-" + name }, ids.map((id) => h("option", { value: id, selected: id === val ? true : null }, id)));
  const a = pick("a", q.get("a") || ids[0]), b = pick("b", q.get("b") || ids[1] || ids[0]);
  const head = [h("h1", {}, "where two runs first differ"),
    h("div", { class: "controls" }, h("label", {}, "run A", a), h("label", {}, "run B", b), h("button", { id: "compare", onclick: () => { location.href = "/diff?a=" + enc(a.value) + "&b=" + enc(b.value); } }, "compare"))];
  if (!q.get("a") || !q.get("b")) return show(...head, h("p", { class: "muted" }, "choose two runs"));
  let doc;
  try { doc = await api("/api/diff?a=" + enc(q.get("a")) + "&b=" + enc(q.get("b"))); } catch (e) { return show(...head, h("p", { class: "error", id: "error" }, String(e.message || e))); }
  if (doc.same) return show(...head, h("p", { id: "same" }, "they hold the same events (wall clock times, ids and checkpoint hashes aside)."));
  const f = doc.first_difference;
  show(...head,
    h("p", { id: "difference" }, (f.field === "initial_weights" ? "initial weights differ: " : "") + "first difference at seq ", h("b", {}, String(f.seq)), ": " + (f.kind_a || "(end)") + " / " + (f.kind_b || "(end)") + ", field " + f.field),
    kvTable([["in " + doc.a, h("pre", { class: "value" }, JSON.stringify(f.a))], ["in " + doc.b, h("pre", { class: "value" }, JSON.stringify(f.b))]]),
    h("div", { class: "side" }, h("div", {}, h("h2", {}, h("a", { href: runHref(doc.a) }, doc.a)), eventsSide(doc.a, doc.a_events, f.seq)),
      h("div", {}, h("h2", {}, h("a", { href: runHref(doc.b) }, doc.b)), eventsSide(doc.b, doc.b_events, f.seq))));
}

// ---------------------------------------------------------------- studies (nnx-es search)

async function pageStudies() {
  nav(null, "studies");
  let doc;
  try { doc = await api("/api/studies"); } catch (e) { return fail(e); }
  const rows = doc.studies.map((s) => h("tr", { class: "study", "data-study": s.name },
    h("td", {}, h("a", { href: studyHref(s.name) }, s.name)),
    h("td", {}, s.direction || "–", s.error ? h("div", { class: "error" }, s.error) : null),
    num(s.trials), num(s.complete), num(s.best), h("td", { class: "num" }, s.best_trial === null ? "–" : String(s.best_trial))));
  show(h("h1", {}, "studies under ", h("code", {}, doc.root)),
    doc.studies.length ? h("table", { id: "studies" }, h("tr", {}, ["study", "direction", "trials", "complete", "best", "best trial"].map((t, i) => h("th", { class: i >= 2 ? "num" : null }, t))), rows)
      : h("p", { class: "muted" }, "no studies here: nnx-es search keeps each under studies/<name>/."));
  liveNote("");
  poll(pageStudies, 15000);
}

async function pageStudy(name) {
  nav(null, "studies");
  let doc;
  try { doc = await api("/api/studies/" + enc(name)); } catch (e) { return fail(e); }
  const keys = [...new Set(doc.trials.flatMap((t) => Object.keys(t.params)))].sort();
  const rows = doc.trials.map((t) => h("tr", { class: "trial" + (doc.best && doc.best.trial === t.number ? " best" : ""), "data-trial": String(t.number) },
    num(t.number),
    h("td", {}, h("span", { class: "badge " + t.state.toLowerCase() }, t.state), t.error ? h("div", { class: "error" }, t.error) : null),
    num(t.value),
    keys.map((k) => (typeof t.params[k] === "number" ? num(t.params[k]) : h("td", {}, fmt(t.params[k])))),
    h("td", {}, t.run_url ? h("a", { href: t.run_url }, t.run_id) : (t.run_id || "–")),
    h("td", {}, t.run_status ? t.run_status + (t.run_stop_reason ? " (" + t.run_stop_reason + ")" : "") : "–"),
    num(t.run_best)));
  const best = doc.best ? ["trial " + doc.best.trial + ", value " + fmt(doc.best.value) + " (run ", doc.best.run_id ? h("a", { href: runHref(doc.best.run_id) }, doc.best.run_id) : "–", ")"] : "no complete trial yet";
  show(h("h1", {}, "study ", h("code", {}, doc.name), " (" + doc.direction + ")"),
    h("p", {}, "best: ", best),
    h("table", { id: "trials" }, h("tr", {}, ["trial", "state", "value", ...keys, "run", "run status", "run BEST"].map((t) => h("th", {}, t))), rows));
  liveNote(doc.trials.some((t) => t.state === "RUNNING") ? "a trial is running: refreshing every 5 s" : "");
  poll(() => pageStudy(name), doc.trials.some((t) => t.state === "RUNNING") ? 5000 : 15000);
}

// ---------------------------------------------------------------- routing

function route() {
  const parts = location.pathname.split("/").filter(Boolean).map(decodeURIComponent);
  if (!parts.length) return pageRuns();
  if (parts[0] === "diff") return pageDiff();
  if (parts[0] === "studies" && parts.length === 1) return pageStudies();
  if (parts[0] === "studies" && parts.length === 2) return pageStudy(parts[1]);
  if (parts[0] === "runs" && parts.length >= 2) {
    const id = parts[1];
    if (parts.length === 2) return pageRun(id);
    if (parts[2] === "events" && parts.length === 4) return pageEvent(id, +parts[3]);
    const view = { events: pageEvents, at: pageAt, audit: pageAudit, rows: pageRows }[parts[2]];
    if (view) return view(id);
  }
  show(h("p", { class: "error" }, "no such page"));
}

route();
