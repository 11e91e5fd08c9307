"""The scheduler's live page, served at ``/ui``: one self-contained HTML document.

Inline CSS and vanilla JS, no build step, no CDN (clusters often have no internet). It polls
``status`` (relative, so it also works behind a path prefix) every second, with the trainer
token from ``/ui?token=...`` as a bearer header when the scheduler has one, and draws:

- ``#workers``: one ``tr.worker`` per worker (id, state, policy version, running/capacity,
  queued, tokens/s, share of time busy / idle / drafting);
- ``#timelines``: for the running step and the last finished one, a ``div.timeline`` with an
  SVG row per worker; each ``rect.segment`` is a busy / idle / drafting / loading interval of
  ``workers[].timeline``, clipped to the step's ``started_at .. finished_at`` (all on the
  scheduler's monotonic clock, like ``now``);
- ``#steps``: one ``tr.step`` per step with makespan, tokens, forward passes per token, bubble
  share and acceptance by draft source (``span.source``).

Everything the page shows comes from ``/status``; element ids and classes are stable for tests.
"""

from __future__ import annotations

__all__ = ["PAGE"]

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>BubbleSpec scheduler</title>
<style>
  :root { --busy:#2f9e44; --idle:#e03131; --drafting:#4263eb; --loading:#f59f00; --fg:#212529;
          --muted:#868e96; --line:#dee2e6; --bg:#f8f9fa; }
  * { box-sizing: border-box; }
  body { margin:0; font:14px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif; color:var(--fg);
         background:var(--bg); }
  header { display:flex; align-items:baseline; gap:16px; padding:12px 20px; background:#fff;
           border-bottom:1px solid var(--line); }
  header h1 { font-size:18px; margin:0; }
  header .meta { color:var(--muted); }
  #conn { margin-left:auto; font-size:12px; padding:2px 8px; border-radius:10px; background:#e9ecef; }
  #conn.ok { background:#d3f9d8; color:#2b8a3e; } #conn.down { background:#ffe3e3; color:#c92a2a; }
  main { padding:16px 20px; display:grid; gap:16px; }
  section { background:#fff; border:1px solid var(--line); border-radius:6px; padding:12px 16px; }
  section h2 { font-size:15px; margin:0 0 8px; }
  #cards { display:flex; gap:12px; flex-wrap:wrap; }
  .card { background:#fff; border:1px solid var(--line); border-radius:6px; padding:8px 14px; min-width:140px; }
  .card .v { font-size:20px; font-weight:600; } .card .k { color:var(--muted); font-size:12px; }
  table { border-collapse:collapse; width:100%; }
  th, td { text-align:left; padding:4px 8px; border-bottom:1px solid var(--line); white-space:nowrap; }
  th { font-weight:600; color:var(--muted); font-size:12px; }
  td.num, th.num { text-align:right; font-variant-numeric:tabular-nums; }
  .state { display:inline-block; padding:0 8px; border-radius:10px; color:#fff; font-size:12px; }
  .state.busy { background:var(--busy); } .state.idle { background:var(--idle); }
  .state.drafting { background:var(--drafting); } .state.loading { background:var(--loading); }
  .bar { display:inline-flex; width:120px; height:10px; border-radius:2px; overflow:hidden; background:#e9ecef;
         vertical-align:middle; }
  .bar span { height:100%; } .bar .busy { background:var(--busy); } .bar .idle { background:var(--idle); }
  .bar .drafting { background:var(--drafting); }
  .legend { display:flex; gap:14px; font-size:12px; color:var(--muted); margin-bottom:6px; }
  .legend i { display:inline-block; width:10px; height:10px; margin-right:4px; border-radius:2px; }
  .timeline { margin:8px 0 14px; }
  .timeline h3 { font-size:13px; margin:0 0 4px; font-weight:600; }
  .timeline h3 .meta { color:var(--muted); font-weight:400; }
  svg { display:block; width:100%; }
  svg text { font-size:11px; fill:var(--fg); } svg .axis text { fill:var(--muted); }
  svg .grid { stroke:var(--line); }
  .segment.busy { fill:var(--busy); } .segment.idle { fill:var(--idle); }
  .segment.drafting { fill:var(--drafting); } .segment.loading { fill:var(--loading); }
  .source { display:inline-block; margin-right:8px; } .source b { font-weight:600; }
  .empty { color:var(--muted); font-style:italic; }
  #error { color:#c92a2a; }
</style>
</head>
<body>
<header>
  <h1>BubbleSpec scheduler</h1>
  <span class="meta" id="version">policy version -</span>
  <span class="meta" id="error"></span>
  <span id="conn">connecting</span>
</header>
<main>
  <div id="cards">
    <div class="card"><div class="v" id="workers-live">-</div><div class="k">workers live</div></div>
    <div class="card"><div class="v" id="requests-running">-</div><div class="k">requests running</div></div>
    <div class="card"><div class="v" id="requests-waiting">-</div><div class="k">requests waiting</div></div>
    <div class="card"><div class="v" id="drafts-covered">-</div><div class="k">upcoming prompts with drafts</div></div>
  </div>
  <section>
    <h2>Workers</h2>
    <table id="workers">
      <thead><tr><th>worker</th><th>state</th><th class="num">policy</th><th class="num">running / capacity</th>
        <th class="num">queued</th><th class="num">draft jobs</th><th class="num">tokens/s</th>
        <th>time busy / idle / drafting</th></tr></thead>
      <tbody></tbody>
    </table>
  </section>
  <section>
    <h2>Step timelines</h2>
    <div class="legend"><span><i style="background:var(--busy)"></i>busy</span>
      <span><i style="background:var(--idle)"></i>idle (bubble)</span>
      <span><i style="background:var(--drafting)"></i>drafting</span>
      <span><i style="background:var(--loading)"></i>loading weights</span></div>
    <div id="timelines"><p class="empty">no step yet</p></div>
  </section>
  <section>
    <h2>Steps</h2>
    <table id="steps">
      <thead><tr><th>step</th><th class="num">policy</th><th>scheduling</th><th class="num">done / requests</th>
        <th class="num">makespan s</th><th class="num">tokens</th><th class="num">fwd passes / token</th>
        <th class="num">bubble share</th><th>accepted / drafted by source</th></tr></thead>
      <tbody></tbody>
    </table>
  </section>
</main>
<script>
"use strict";
const STATES = ["busy", "idle", "drafting", "loading"];
const ROW = 22, LABEL = 130, AXIS = 18;

function el(tag, attrs, ...children) {
  const svg = ["svg", "rect", "text", "g", "line", "title"].includes(tag);
  const node = svg ? document.createElementNS("http://www.w3.org/2000/svg", tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}
const fmt = (x, d = 2) => (x === null || x === undefined || Number.isNaN(x)) ? "-" : Number(x).toFixed(d);
const pct = x => fmt(100 * x, 1) + "%";
const text = (id, v) => { document.getElementById(id).textContent = v; };

function renderWorkers(snap) {
  const body = document.querySelector("#workers tbody");
  body.replaceChildren();
  if (!snap.workers.length) {
    body.append(el("tr", {}, el("td", {colspan: 8, class: "empty"}, "no worker connected")));
  }
  for (const w of snap.workers) {
    const s = w.seconds, total = s.busy + s.idle + s.drafting;
    const bar = el("span", {class: "bar", title:
      `busy ${fmt(s.busy)} s, idle ${fmt(s.idle)} s, drafting ${fmt(s.drafting)} s`});
    for (const k of ["busy", "idle", "drafting"]) {
      bar.append(el("span", {class: k, style: `width:${total > 0 ? 100 * s[k] / total : 0}%`}));
    }
    const version = w.loading !== null ? `${w.policy_version} -> ${w.loading}` :
      (w.load_failed !== null ? `${w.policy_version} (v${w.load_failed} failed)` : String(w.policy_version));
    body.append(el("tr", {class: "worker", "data-worker": w.worker_id},
      el("td", {class: "id"}, w.worker_id),
      el("td", {}, el("span", {class: "state " + w.state}, w.state)),
      el("td", {class: "num version"}, version),
      el("td", {class: "num load"}, `${w.running} / ${w.capacity}`),
      el("td", {class: "num"}, w.queued),
      el("td", {class: "num"}, w.drafting),
      el("td", {class: "num tps"}, fmt(w.tokens_per_second, 1)),
      el("td", {}, bar, " ", total > 0 ? pct(s.idle / total) + " idle" : "")));
  }
}

// A round tick spacing (1, 2 or 5 times a power of ten) of at least `raw` seconds.
function niceStep(raw) {
  const p = Math.pow(10, Math.floor(Math.log10(Math.max(raw, 1e-3))));
  for (const m of [1, 2, 5, 10]) if (m * p >= raw) return m * p;
  return 10 * p;
}

// Segments of one worker clipped to [t0, t1]; the last one is the open state up to `now`.
function clip(timeline, t0, t1) {
  const out = [];
  for (const [state, a, b] of timeline) {
    const s = Math.max(a, t0), e = Math.min(b, t1);
    if (e > s) out.push([state, s, e]);
  }
  return out;
}

function renderTimeline(snap, step) {
  const t0 = step.started_at, t1 = step.finished_at === null ? snap.now : step.finished_at;
  const span = Math.max(t1 - t0, 1e-6);
  const box = document.getElementById("timelines");
  const width = Math.max(400, box.clientWidth || 900), plot = width - LABEL - 10;
  const height = AXIS + ROW * Math.max(1, snap.workers.length);
  const svg = el("svg", {width: width, height: height, viewBox: `0 0 ${width} ${height}`});
  const axis = el("g", {class: "axis"});
  const tick = niceStep(span / 6);
  for (let t = 0; t <= span + 1e-9; t += tick) {
    const x = LABEL + plot * t / span;
    axis.append(el("line", {class: "grid", x1: x, x2: x, y1: AXIS - 4, y2: height}));
    if (plot * (span - t) / span > 30 || t === 0) {
      axis.append(el("text", {x: x, y: AXIS - 6, "text-anchor": t === 0 ? "start" : "middle"},
        fmt(t, tick < 1 ? 1 : 0) + " s"));
    }
  }
  svg.append(axis);
  const totals = {busy: 0, idle: 0, drafting: 0, loading: 0};
  snap.workers.forEach((w, row) => {
    const y = AXIS + row * ROW;
    const g = el("g", {class: "lane", "data-worker": w.worker_id});
    g.append(el("text", {x: 0, y: y + ROW / 2 + 4}, w.worker_id));
    for (const [state, a, b] of clip(w.timeline, t0, t1)) {
      totals[state] = (totals[state] || 0) + (b - a);
      const x = LABEL + plot * (a - t0) / span, wd = Math.max(0.5, plot * (b - a) / span);
      const kind = STATES.includes(state) ? state : "idle";
      g.append(el("rect", {class: "segment " + kind, "data-state": state, x: x, y: y + 3, width: wd,
        height: ROW - 6}, el("title", {}, `${w.worker_id}: ${state} ${fmt(b - a)} s (at ${fmt(a - t0)} s)`)));
    }
    svg.append(g);
  });
  const all = totals.busy + totals.idle + totals.drafting + totals.loading;
  const bubble = step.summary ? step.summary.bubble_share : (all > 0 ? totals.idle / all : 0);
  const label = step.finished_at === null ? "running" : (step.cancelled ? "cancelled" : "finished");
  return el("div", {class: "timeline " + label, "data-step": step.step_id},
    el("h3", {}, `step ${step.step_id} `, el("span", {class: "meta"},
      `${label}, ${fmt(t1 - t0)} s, ${step.completed}/${step.requests} done, bubble share ${pct(bubble)}`)),
    svg);
}

function renderTimelines(snap) {
  const box = document.getElementById("timelines");
  const running = snap.steps.filter(s => s.finished_at === null);
  const finished = snap.steps.filter(s => s.finished_at !== null);
  // The running step and the last finished one; with none running, the last two finished.
  const shown = [...running.slice(-1), ...finished.slice(running.length ? -1 : -2).reverse()];
  box.replaceChildren(...(shown.length ? shown.map(s => renderTimeline(snap, s)) :
    [el("p", {class: "empty"}, "no step yet")]));
}

function renderSteps(snap) {
  const body = document.querySelector("#steps tbody");
  body.replaceChildren();
  if (!snap.steps.length) body.append(el("tr", {}, el("td", {colspan: 9, class: "empty"}, "no step yet")));
  for (const s of [...snap.steps].reverse()) {
    const sum = s.summary;
    const acc = el("td", {class: "acceptance"});
    const sources = sum ? sum.provenance.sources : [];
    if (!sources.length) acc.append(el("span", {class: "empty"}, sum ? "no drafts" : "-"));
    for (const src of sources) {
      const r = src.drafted_tokens ? src.accepted_tokens / src.drafted_tokens : 0;
      acc.append(el("span", {class: "source", "data-source": src.source}, el("b", {}, src.source), " ",
        `${src.accepted_tokens}/${src.drafted_tokens} (${pct(r)})`));
    }
    body.append(el("tr", {class: "step", "data-step": s.step_id},
      el("td", {}, s.step_id + (s.cancelled ? " (cancelled)" : "")),
      el("td", {class: "num"}, s.policy_version),
      el("td", {}, s.policy),
      el("td", {class: "num"}, `${s.completed} / ${s.requests}`),
      el("td", {class: "num"}, fmt(sum ? sum.makespan_seconds : s.elapsed_seconds)),
      el("td", {class: "num"}, sum ? sum.generated_tokens : "-"),
      el("td", {class: "num"}, sum ? fmt(sum.forward_passes_per_token, 3) : "-"),
      el("td", {class: "num bubble"}, sum ? pct(sum.bubble_share) : "-"),
      acc));
  }
}

function render(snap) {
  text("version", `policy version ${snap.policy_version}`);
  text("workers-live", snap.workers.length);
  text("requests-running", snap.requests_running);
  text("requests-waiting", snap.requests_waiting);
  text("drafts-covered", `${snap.drafts.prompts_covered} / ${snap.drafts.prompts_announced}`);
  renderWorkers(snap);
  renderTimelines(snap);
  renderSteps(snap);
}

// With a trainer token set, the page is opened as /ui?token=TOKEN: the token moves to this
// tab's sessionStorage, leaves the address bar, and goes to /status as a bearer header.
const TOKEN = (() => {
  const url = new URL(location.href);
  const fromUrl = url.searchParams.get("token");
  if (fromUrl !== null) {
    sessionStorage.setItem("bubblespec-token", fromUrl);
    url.searchParams.delete("token");
    history.replaceState(null, "", url.pathname + url.search + url.hash);
  }
  return sessionStorage.getItem("bubblespec-token") || "";
})();

async function poll() {
  const conn = document.getElementById("conn");
  try {
    const headers = TOKEN ? {Authorization: `Bearer ${TOKEN}`} : {};
    const resp = await fetch("status", {cache: "no-store", headers});
    if (resp.status === 401 || resp.status === 403)
      throw new Error(`status ${resp.status}: open this page as /ui?token=<trainer token>`);
    if (!resp.ok) throw new Error(`status ${resp.status}`);
    render(await resp.json());
    conn.className = "ok"; conn.textContent = "live";
    text("error", "");
  } catch (err) {
    conn.className = "down"; conn.textContent = "disconnected";
    text("error", String(err.message || err));
  } finally {
    setTimeout(poll, 1000);
  }
}
poll();
</script>
</body>
</html>
"""
