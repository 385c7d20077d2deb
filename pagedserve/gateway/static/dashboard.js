// pagedserve dashboard: polls GET /v1/engine/stats and draws it with plain DOM and inline SVG.
// Every field of the stats may be missing; each panel draws what is there.
(function () {
  "use strict";

  var POLL_MS = 500;
  var STEPS = 120;          // steps asked for and charted
  var WATERFALL_ROWS = 24;  // most recent requests drawn
  var SVG_NS = "http://www.w3.org/2000/svg";
  var STAGES = [
    ["gateway", "#8e8cd8"], ["tokenizer", "#4fb0c6"], ["queue", "#f2a541"],
    ["prefill", "#e4572e"], ["network", "#a0a0a0"], ["decode", "#5bb56a"]
  ];
  var COLORS = {tokens: "#3b7dd8", seqs: "#e4572e", kv: "#5bb56a", prefill: "#f2a541", decode: "#3b7dd8",
                preempt: "#d62728"};

  // The key comes in the URL's fragment (#key=…), which browsers never send to a server nor put
  // in a Referer; it is kept for this tab only and wiped from the address bar at once.
  var key = null;
  try { key = window.sessionStorage.getItem("pagedserve-key"); } catch (e) { /* storage off */ }
  var fragment = new URLSearchParams(window.location.hash.replace(/^#/, ""));
  if (fragment.get("key")) {
    key = fragment.get("key");
    try { window.sessionStorage.setItem("pagedserve-key", key); } catch (e) { /* storage off */ }
    history.replaceState(null, "", window.location.pathname + window.location.search);
  }
  var paused = false;
  var kvCells = [];  // the grid's cell elements, reused between polls
  var kvSig = [];    // what each cell shows, to touch only the cells that changed

  // ---- helpers -------------------------------------------------------------------------------
  function $(id) { return document.getElementById(id); }
  function num(v) { return typeof v === "number" && isFinite(v) ? v : null; }
  function obj(v) { return v && typeof v === "object" && !Array.isArray(v) ? v : {}; }
  function arr(v) { return Array.isArray(v) ? v : []; }
  function fmt(v, digits) {
    if (num(v) === null) return "–";
    if (Math.abs(v) >= 1e6) return (v / 1e6).toFixed(1) + "M";
    if (Math.abs(v) >= 1e4) return (v / 1e3).toFixed(1) + "k";
    return digits ? v.toFixed(digits) : String(Math.round(v));
  }
  function pct(v) { return num(v) === null ? "–" : (100 * v).toFixed(1) + "%"; }
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function svg(tag, attrs, text) {
    var e = document.createElementNS(SVG_NS, tag);
    for (var k in attrs) if (Object.prototype.hasOwnProperty.call(attrs, k)) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function titled(e, text) { e.appendChild(svg("title", {}, text)); return e; }
  function clear(e) { while (e.firstChild) e.removeChild(e.firstChild); }
  function hue(id) {  // FNV-1a of the request id -> a stable hue per request
    var h = 2166136261;
    for (var i = 0; i < id.length; i++) { h ^= id.charCodeAt(i); h = Math.imul(h, 16777619); }
    h ^= h >>> 16; h = Math.imul(h, 0x85ebca6b); h ^= h >>> 13; h = Math.imul(h, 0xc2b2ae35); h ^= h >>> 16;
    return (h >>> 0) % 360;
  }
  // A request keeps the hue it was first given: its hash's, turned by the golden angle while that
  // is too close to the hue of another live request (so that neighbours in the grid differ).
  var hues = new Map(), live = [];
  function requestHue(id) {
    id = String(id);
    if (hues.has(id)) return hues.get(id);
    var h = hue(id), taken = live.filter(function (o) { return hues.has(o); }).map(function (o) { return hues.get(o); });
    for (var tries = 0; tries < 16 && taken.some(function (t) {
      var dh = Math.abs(t - h) % 360; return Math.min(dh, 360 - dh) < 24; }); tries++) h = (h + 137.508) % 360;
    hues.set(id, h);
    if (hues.size > 5000) hues.delete(hues.keys().next().value);  // forget the oldest
    return h;
  }
  function liveRequests(d) {  // running first: theirs are the colors the grid shows
    var q = obj(d.queues), ids = [].concat(arr(q.running), Object.keys(obj(obj(d.kv).tables)), arr(q.swapped),
                                           arr(q.waiting));
    live = ids.map(String);
    live.forEach(requestHue);
  }
  function requestColor(id) { return "hsl(" + requestHue(id).toFixed(0) + ", 65%, 52%)"; }
  function shortId(id) {  // "cmpl-3c1e…" ids: the kind and the last characters tell them apart
    id = String(id);
    if (id.length <= 16) return id;
    var dash = id.indexOf("-");
    return (dash > 0 && dash <= 9 ? id.slice(0, dash + 1) : "") + "…" + id.slice(-8);
  }
  function legend(container, items) {
    clear(container);
    items.forEach(function (it) {
      var span = el("span", "legend-item" + (it[2] ? " " + it[2] : ""));
      var sw = el("span", "swatch");
      sw.style.background = it[1];
      span.appendChild(sw);
      span.appendChild(document.createTextNode(it[0]));
      container.appendChild(span);
    });
  }
  function sizeSvg(e, height) {
    var w = Math.max(200, Math.round(e.getBoundingClientRect().width || e.clientWidth || 600));
    e.setAttribute("viewBox", "0 0 " + w + " " + height);
    e.setAttribute("height", height);
    clear(e);
    return w;
  }

  // ---- headline ------------------------------------------------------------------------------
  function renderHeadline(d) {
    var t = obj(d.totals), q = obj(d.queues), kv = obj(d.kv), cfg = obj(d.config), steps = arr(d.steps);
    function qlen(name) { var n = num(obj(d.queue_lengths)[name]); return Math.max(n || 0, arr(q[name]).length); }
    var states = typeof kv.states === "string" ? kv.states : "";
    var nBlocks = num(kv.num_blocks) !== null ? kv.num_blocks : (states.length || num(cfg.num_gpu_blocks));
    var used = states ? states.split("u").length - 1 : null;
    var queries = num(t.prefix_cache_queries), hits = num(t.prefix_cache_hits);
    var hitRate = queries ? hits / queries : null;
    var genRate = null, stepMs = null;
    if (steps.length > 1) {
      var first = steps[0], last = steps[steps.length - 1];
      var span = num(last.time) !== null && num(first.time) !== null ? last.time - first.time : null;
      var decoded = 0, dur = 0;
      steps.slice(1).forEach(function (s) { decoded += num(s.decode_tokens) || 0; dur += num(s.duration_s) || 0; });
      if (span && span > 0) genRate = decoded / span;
      stepMs = 1000 * dur / (steps.length - 1);
    }
    var items = [
      ["running", fmt(qlen("running"))], ["waiting", fmt(qlen("waiting"))], ["swapped", fmt(qlen("swapped"))],
      ["KV blocks used", used === null ? "–" : fmt(used) + " / " + fmt(nBlocks)],
      ["cache hits", pct(hitRate), queries ? fmt(hits) + " / " + fmt(queries) : ""],
      ["preemptions", fmt(num(t.num_preemptions))], ["steps", fmt(num(t.num_steps))],
      ["prompt tokens", fmt(num(t.prompt_tokens))], ["generated", fmt(num(t.generation_tokens))],
      ["decode tok/s", fmt(genRate, genRate !== null && genRate < 100 ? 1 : 0)],
      ["mean step", stepMs === null ? "–" : stepMs.toFixed(1) + " ms"]
    ];
    var box = $("headline-numbers");
    clear(box);
    items.forEach(function (it) {
      var n = el("div", "number");
      n.appendChild(el("div", "value" + (String(it[1]).length > 9 ? " long" : ""), it[1]));
      n.appendChild(el("div", "label", it[0]));
      if (it[2]) n.appendChild(el("div", "hint", it[2]));
      box.appendChild(n);
    });
  }

  // ---- KV block pool -------------------------------------------------------------------------
  function renderKv(d) {
    var kv = obj(d.kv), cfg = obj(d.config);
    var states = typeof kv.states === "string" ? kv.states : "";
    var tables = obj(kv.tables);
    var n = num(kv.num_blocks) !== null ? kv.num_blocks : (states.length || num(cfg.num_gpu_blocks) || 0);
    var owners = {};  // block id -> [request ids]
    var perRequest = [];
    Object.keys(tables).forEach(function (rid) {
      var blocks = arr(tables[rid]);
      perRequest.push([rid, blocks.length]);
      blocks.forEach(function (b) { (owners[b] = owners[b] || []).push(rid); });
    });
    var grid = $("kv-grid");
    grid.dataset.numBlocks = String(n);
    grid.style.setProperty("--cell", (n <= 600 ? 14 : n <= 2500 ? 9 : n <= 10000 ? 5 : 3) + "px");
    if (kvCells.length !== n) {
      clear(grid);
      kvCells = [];
      kvSig = [];
      var frag = document.createDocumentFragment();
      for (var i = 0; i < n; i++) {
        var c = el("div", "kv-cell free");
        c.dataset.block = String(i);
        kvCells.push(c);
        kvSig.push("");
        frag.appendChild(c);
      }
      grid.appendChild(frag);
    }
    var counts = {free: 0, used: 0, cached: 0};
    for (var b = 0; b < n; b++) {
      var ch = states.charAt(b);
      var who = owners[b];
      var state = ch === "u" ? "used" : ch === "c" ? "cached" : ch === "." ? "free" : (who ? "used" : "free");
      counts[state]++;
      var sig = state + "|" + (who ? who.join(",") : "");
      if (kvSig[b] === sig) continue;
      kvSig[b] = sig;
      var cell = kvCells[b];
      cell.className = "kv-cell " + state + (who && who.length > 1 ? " shared" : "");
      if (who && state === "used") {
        cell.dataset.request = who[0];
        cell.style.background = requestColor(who[0]);
      } else {
        delete cell.dataset.request;
        cell.style.background = "";
      }
      var title = "block " + b + ": " + (state === "cached" ? "free, holds a reusable cached prefix" : state);
      if (who) title += "\n" + (who.length > 1 ? "shared by " : "request ") + who.join(", ");
      cell.title = title;
    }
    $("kv-summary").textContent = n ? "— " + n + " blocks" + (num(cfg.block_size) !== null ?
      " × " + cfg.block_size + " tokens" : "") : "— no blocks reported";
    legend($("kv-legend"), [
      ["free " + counts.free, "", "free"], ["cached (reusable) " + counts.cached, "", "cached"],
      ["in use " + counts.used + (n ? " (" + (100 * counts.used / n).toFixed(0) + "%)" : ""), "", "used"]
    ]);
    var ownersBox = $("kv-owners");
    clear(ownersBox);
    perRequest.sort(function (a, b2) { return b2[1] - a[1]; });
    perRequest.slice(0, 32).forEach(function (p) {
      var chip = el("span", "chip", shortId(p[0]) + " · " + p[1] + " blocks");
      chip.style.borderColor = requestColor(p[0]);
      chip.style.background = "hsla(" + requestHue(p[0]).toFixed(0) + ", 65%, 52%, 0.15)";
      chip.title = p[0];
      chip.dataset.request = p[0];
      ownersBox.appendChild(chip);
    });
    if (perRequest.length > 32) ownersBox.appendChild(el("span", "more", "+" + (perRequest.length - 32) + " more"));
  }

  // ---- queues and waiting reasons -------------------------------------------------------------
  function renderQueues(d) {
    var q = obj(d.queues), lengths = obj(d.queue_lengths);
    ["waiting", "running", "swapped"].forEach(function (name) {
      var box = $("queue-" + name), ids = arr(q[name]);
      var count = num(lengths[name]) !== null ? Math.max(lengths[name], ids.length) : ids.length;
      box.querySelector(".count").textContent = String(count);
      var ul = box.querySelector(".ids");
      clear(ul);
      ids.slice(0, 40).forEach(function (id) {
        var li = el("li", "chip", shortId(id));
        li.title = String(id);
        li.dataset.request = String(id);
        li.style.borderColor = requestColor(id);
        ul.appendChild(li);
      });
      if (count > Math.min(ids.length, 40)) ul.appendChild(el("li", "more", "+" + (count - Math.min(ids.length, 40)) +
                                                                 " more"));
      if (!count) ul.appendChild(el("li", "empty", "none"));
    });
    var steps = arr(d.steps), last = steps.length ? obj(steps[steps.length - 1]) : {};
    var now = obj(last.waiting_reasons), total = obj(obj(d.totals).waiting_reasons);
    var box = $("waiting-reasons");
    clear(box);
    var labels = {no_blocks: "no free KV blocks", seq_budget: "sequence budget full", token_budget: "token budget full"};
    var names = Object.keys(labels);
    Object.keys(now).concat(Object.keys(total)).forEach(function (k) { if (names.indexOf(k) < 0) names.push(k); });
    var table = el("table", "reasons-table");
    var head = el("tr");
    ["reason", "last step", "all steps"].forEach(function (h) { head.appendChild(el("th", "", h)); });
    table.appendChild(head);
    names.forEach(function (k) {
      var tr = el("tr");
      tr.appendChild(el("td", "", labels[k] || k));
      var cur = num(now[k]);
      var td = el("td", cur ? "hot" : "", fmt(cur));
      tr.appendChild(td);
      tr.appendChild(el("td", "", fmt(num(total[k]))));
      table.appendChild(tr);
    });
    box.appendChild(table);
  }

  // ---- step budget charts --------------------------------------------------------------------
  function axes(g, w, h, pad, yMax, yLabel, ticks) {
    ticks = ticks || 4;
    for (var i = 0; i <= ticks; i++) {
      var y = pad.t + (h - pad.t - pad.b) * (1 - i / ticks);
      g.appendChild(svg("line", {x1: pad.l, x2: w - pad.r, y1: y, y2: y, "class": "gridline"}));
      g.appendChild(svg("text", {x: pad.l - 4, y: y + 4, "text-anchor": "end", "class": "tick"},
                        yLabel(yMax * i / ticks)));
    }
  }
  function renderBudget(d) {
    var steps = arr(d.steps).slice(-STEPS).map(obj), cfg = obj(d.config);
    var chart = $("budget-chart"), tok = $("tokens-chart");
    var H = 150, w = sizeSvg(chart, H), w2 = sizeSvg(tok, 120);
    legend($("budget-legend"), [["tokens / token budget", COLORS.tokens], ["seqs / seq budget", COLORS.seqs],
                                ["KV blocks in use", COLORS.kv], ["preemption", COLORS.preempt, "mark"]]);
    var lastBudget = steps.length ? num(steps[steps.length - 1].token_budget) : null;
    if (lastBudget === null) lastBudget = num(cfg.max_num_batched_tokens);
    legend($("tokens-legend"), [["prefill tokens", COLORS.prefill], ["decode tokens", COLORS.decode],
                                ["token budget" + (lastBudget !== null ? " " + fmt(lastBudget) : ""), "#888",
                                 "dashed"]]);
    if (!steps.length) {
      chart.appendChild(svg("text", {x: w / 2, y: H / 2, "text-anchor": "middle", "class": "empty"}, "no steps yet"));
      $("budget-summary").textContent = "";
      return;
    }
    var pad = {l: 40, r: 8, t: 8, b: 18};
    var n = steps.length, step = (w - pad.l - pad.r) / Math.max(1, STEPS - 1);
    var x0 = pad.l + (STEPS - n) * step;  // newest step at the right edge
    function x(i) { return x0 + i * step; }
    var g = svg("g");
    chart.appendChild(g);
    axes(g, w, H, pad, 1, function (v) { return Math.round(100 * v) + "%"; });
    function yFrac(v) { return pad.t + (H - pad.t - pad.b) * (1 - Math.max(0, Math.min(1, v))); }
    function budgetOf(s, field, cfgField) { return num(s[field]) || num(cfg[cfgField]); }
    var series = [
      ["tokens", function (s) { var b = budgetOf(s, "token_budget", "max_num_batched_tokens");
        return b && num(s.scheduled_tokens) !== null ? s.scheduled_tokens / b : null; }],
      ["seqs", function (s) { var b = budgetOf(s, "seq_budget", "max_num_seqs");
        return b && num(s.num_seqs) !== null ? s.num_seqs / b : null; }],
      ["kv", function (s) { var u = num(s.blocks_used), tot = (u || 0) + (num(s.blocks_cached) || 0) +
        (num(s.blocks_free) || 0); return u !== null && tot ? u / tot : null; }]
    ];
    series.forEach(function (sr) {
      var pts = [];
      steps.forEach(function (s, i) { var v = sr[1](s); if (v !== null) pts.push(x(i).toFixed(1) + "," + yFrac(v).toFixed(1)); });
      if (pts.length) chart.appendChild(svg("polyline", {points: pts.join(" "), "class": "series series-" + sr[0],
                                                         stroke: COLORS[sr[0]]}));
    });
    var preempted = 0;
    steps.forEach(function (s, i) {
      if (num(s.preemptions)) {
        preempted += s.preemptions;
        var m = svg("g", {"class": "preemption"});
        m.appendChild(svg("line", {x1: x(i), x2: x(i), y1: pad.t, y2: H - pad.b, stroke: COLORS.preempt}));
        m.appendChild(svg("path", {d: "M" + (x(i) - 4) + "," + pad.t + " l8,0 l-4,7 z", fill: COLORS.preempt}));
        titled(m, "step " + s.step + ": " + s.preemptions + " preemption(s)");
        chart.appendChild(m);
      }
    });
    var firstStep = num(steps[0].step), lastStep = num(steps[n - 1].step);
    chart.appendChild(svg("text", {x: x(0), y: H - 4, "class": "tick"}, firstStep === null ? "" : "step " + firstStep));
    chart.appendChild(svg("text", {x: w - pad.r, y: H - 4, "text-anchor": "end", "class": "tick"},
                          lastStep === null ? "" : "step " + lastStep));
    // hover targets: one transparent column per step with its numbers
    steps.forEach(function (s, i) {
      var r = svg("rect", {x: x(i) - step / 2, y: pad.t, width: Math.max(1, step), height: H - pad.t - pad.b,
                           "class": "hover"});
      titled(r, "step " + s.step + "\ntokens " + fmt(num(s.scheduled_tokens)) + " / " + fmt(num(s.token_budget)) +
             " (prefill " + fmt(num(s.prefill_tokens)) + ", decode " + fmt(num(s.decode_tokens)) + ")\nseqs " +
             fmt(num(s.num_seqs)) + " / " + fmt(num(s.seq_budget)) + "\nblocks used " + fmt(num(s.blocks_used)) +
             ", cached " + fmt(num(s.blocks_cached)) + ", free " + fmt(num(s.blocks_free)) + "\nwaiting " +
             fmt(num(s.waiting)) + "\n" + (num(s.duration_s) !== null ? (1000 * s.duration_s).toFixed(1) + " ms" : ""));
      chart.appendChild(r);
    });
    var util = 0, cnt = 0;
    steps.forEach(function (s) { var v = series[0][1](s); if (v !== null) { util += v; cnt++; } });
    var budget = num(cfg.max_num_batched_tokens) !== null ? fmt(cfg.max_num_batched_tokens) + " tok" +
      (num(cfg.max_num_seqs) !== null ? " · " + fmt(cfg.max_num_seqs) + " seqs" : "") : "";
    $("budget-summary").textContent = "— " + (budget ? "budget " + budget + "; " : "") + n + " steps" +
      (cnt ? ", mean token use " + pct(util / cnt) : "");
    chart.dataset.preemptions = String(preempted);

    // prefill vs decode, stacked, against the token budget
    var h2 = 120, pad2 = {l: 40, r: 8, t: 8, b: 12};
    // scaled to the tokens scheduled (the utilisation chart above is against the budget); the budget
    // line is drawn when it falls on the scale
    var yMax = 1, budgetMax = 0;
    steps.forEach(function (s) {
      yMax = Math.max(yMax, (num(s.prefill_tokens) || 0) + (num(s.decode_tokens) || 0), num(s.scheduled_tokens) || 0);
      budgetMax = Math.max(budgetMax, num(s.token_budget) || num(cfg.max_num_batched_tokens) || 0);
    });
    yMax = budgetMax && budgetMax <= 1.5 * yMax ? Math.max(yMax, budgetMax) : yMax * 1.1;
    var tick = niceCeil(yMax / 4), ticks = Math.max(1, Math.ceil(yMax / tick - 1e-9));
    yMax = tick * ticks;
    var step2 = (w2 - pad2.l - pad2.r) / STEPS, x02 = pad2.l + (STEPS - n) * step2;
    var g2 = svg("g");
    tok.appendChild(g2);
    axes(g2, w2, h2, pad2, yMax, function (v) { return fmt(v); }, ticks);
    function y2(v) { return pad2.t + (h2 - pad2.t - pad2.b) * (1 - v / yMax); }
    var bw = Math.max(1, step2 - 1);
    steps.forEach(function (s, i) {
      var pf = num(s.prefill_tokens) || 0, dc = num(s.decode_tokens) || 0, xx = x02 + i * step2;
      if (dc) tok.appendChild(titled(svg("rect", {x: xx, y: y2(dc), width: bw, height: y2(0) - y2(dc),
                                                  fill: COLORS.decode, "class": "bar decode"}),
                                     "step " + s.step + ": " + dc + " decode tokens"));
      if (pf) tok.appendChild(titled(svg("rect", {x: xx, y: y2(dc + pf), width: bw, height: y2(0) - y2(pf),
                                                  fill: COLORS.prefill, "class": "bar prefill"}),
                                     "step " + s.step + ": " + pf + " prefill tokens"));
      if (num(s.preemptions)) tok.appendChild(svg("rect", {x: xx, y: pad2.t, width: bw, height: 3, fill: COLORS.preempt}));
    });
    var pts = [];
    steps.forEach(function (s, i) {
      var b = num(s.token_budget) || num(cfg.max_num_batched_tokens);
      if (b && b <= yMax) pts.push((x02 + i * step2).toFixed(1) + "," + y2(b).toFixed(1), (x02 + (i + 1) * step2).toFixed(1) +
                      "," + y2(b).toFixed(1));
    });
    if (pts.length) tok.appendChild(svg("polyline", {points: pts.join(" "), "class": "budget-line"}));
  }

  // ---- latency waterfall ---------------------------------------------------------------------
  function stagesOf(r, now) {
    var t = obj(r.timings), b = obj(t.ttft_breakdown_ms);
    function at(k) { return num(t[k]) !== null && t[k] > 0 ? t[k] : null; }  // a stamp not taken is 0
    function gap(a, z) { return at(a) !== null && at(z) !== null ? Math.max(0, 1000 * (at(z) - at(a))) : null; }
    var fromTimes = {gateway: gap("gateway_received", "tokenizer_received"),
                     tokenizer: gap("tokenizer_received", "scheduler_received"),
                     queue: gap("scheduler_received", "first_scheduled"), prefill: gap("first_scheduled", "first_token"),
                     network: gap("first_token", "first_token_streamed")};
    var out = [], offset = 0;
    ["gateway", "tokenizer", "queue", "prefill", "network"].forEach(function (k) {
      var ms = num(b[k]) !== null ? Math.max(0, b[k]) : fromTimes[k];
      if (ms === null) return;
      out.push({stage: k, start: offset, ms: ms});
      offset += ms;
    });
    var ttft = num(t.ttft_ms) !== null ? t.ttft_ms : (out.length ? offset : null);
    var end = gap("gateway_received", "finished"), inFlight = false;
    if (end === null) end = gap("gateway_received", "last_token_streamed");
    var decodeStart = ttft !== null ? Math.max(ttft, offset) : offset;
    if (end === null && at("gateway_received") !== null && num(now) !== null && out.length && !r.finish_reason) {
      end = Math.max(0, 1000 * (now - t.gateway_received));  // not finished yet: decoding until now
      inFlight = true;
    }
    if (end !== null && end > decodeStart) out.push({stage: "decode", start: decodeStart, ms: end - decodeStart});
    var chunks = [];  // prefill chunks, when the stats list them: [ms from gateway_received, tokens]
    arr(r.prefill_chunk_list).forEach(function (c) {
      c = obj(c);
      if (at("gateway_received") !== null && num(c.time) !== null && c.time > 0) {
        chunks.push([Math.max(0, 1000 * (c.time - t.gateway_received)), num(c.tokens)]);
      }
    });
    return {segments: out, ttft: ttft, total: Math.max(end !== null ? end : offset, offset), inFlight: inFlight,
            chunks: chunks};
  }
  function niceCeil(v) {  // the least of 1, 2, 2.5, 5 × 10^k (k >= 0) that is >= v
    var p = Math.pow(10, Math.max(0, Math.floor(Math.log10(Math.max(v, 1))))), m = v / p;
    return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 2.5 ? 2.5 : m <= 5 ? 5 : 10) * p;
  }
  function niceStep(range) {
    var raw = range / 6, p = Math.pow(10, Math.floor(Math.log10(raw || 1))), m = raw / p;
    return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 5 ? 5 : 10) * p;
  }
  function renderWaterfall(d) {
    legend($("waterfall-legend"), STAGES.map(function (s) { return [s[0], s[1]]; }));
    var reqs = arr(d.recent_requests).map(obj).filter(function (r) { return r.request_id !== undefined; });
    reqs.sort(function (a, b) {
      return (num(obj(a.timings).gateway_received) || 0) - (num(obj(b.timings).gateway_received) || 0);
    });
    reqs = reqs.slice(-WATERFALL_ROWS);
    var body = $("waterfall-body");
    clear(body);
    if (!reqs.length) {
      body.appendChild(el("p", "empty", "no finished requests yet"));
      $("waterfall-summary").textContent = "";
      return;
    }
    var rows = reqs.map(function (r) { return {r: r, s: stagesOf(r, d.time)}; });
    var maxMs = 1, ttftSum = 0, ttftN = 0;
    rows.forEach(function (row) {
      maxMs = Math.max(maxMs, row.s.total);
      if (row.s.ttft !== null) { ttftSum += row.s.ttft; ttftN++; }
    });
    var rowH = 20, labelW = 230, top = 22, h = top + rows.length * rowH + 4;
    var chart = svg("svg", {"class": "chart waterfall-chart"});
    body.appendChild(chart);
    var w = sizeSvg(chart, h);
    var plotW = w - labelW - 12;
    function x(ms) { return labelW + plotW * ms / maxMs; }
    var tick = niceStep(maxMs);
    for (var v = 0; v <= maxMs + 1e-9; v += tick) {
      chart.appendChild(svg("line", {x1: x(v), x2: x(v), y1: top - 4, y2: h, "class": "gridline"}));
      chart.appendChild(svg("text", {x: x(v), y: 12, "text-anchor": "middle", "class": "tick"},
                            v >= 1000 ? (v / 1000).toFixed(v % 1000 ? 1 : 0) + " s" : fmt(v) + " ms"));
    }
    rows.forEach(function (row, i) {
      var r = row.r, y = top + i * rowH;
      var g = svg("g", {"class": "waterfall-row", "data-request": String(r.request_id)});
      var label = shortId(r.request_id) + "  " + fmt(num(r.prompt_tokens)) + "→" + fmt(num(r.output_tokens)) + " tok";
      g.appendChild(svg("text", {x: 4, y: y + 14, "class": "row-label"}, label));
      var sw = svg("rect", {x: labelW - 10, y: y + 5, width: 6, height: 10, fill: requestColor(r.request_id)});
      g.appendChild(sw);
      row.s.segments.forEach(function (seg) {
        var color = STAGES.filter(function (s) { return s[0] === seg.stage; })[0][1];
        var rect = svg("rect", {x: x(seg.start), y: y + 3, width: Math.max(1, x(seg.start + seg.ms) - x(seg.start)),
                                height: rowH - 6, fill: color, "class": "stage stage-" + seg.stage +
                                (row.s.inFlight && seg.stage === "decode" ? " in-flight" : "")});
        titled(rect, r.request_id + "\n" + seg.stage + ": " + seg.ms.toFixed(1) + " ms (from " +
               seg.start.toFixed(1) + " ms)");
        g.appendChild(rect);
      });
      row.s.chunks.forEach(function (c, k) {
        if (c[0] > maxMs) return;
        g.appendChild(titled(svg("line", {x1: x(c[0]), x2: x(c[0]), y1: y + rowH - 6, y2: y + rowH - 1,
                                          "class": "chunk-mark"}),
                             "prefill chunk " + (k + 1) + (c[1] !== null ? ": " + c[1] + " tokens" : "") + " at " +
                             c[0].toFixed(1) + " ms"));
      });
      if (row.s.ttft !== null) {
        g.appendChild(titled(svg("line", {x1: x(row.s.ttft), x2: x(row.s.ttft), y1: y + 1, y2: y + rowH - 1,
                                          "class": "ttft-mark"}), "TTFT " + row.s.ttft.toFixed(1) + " ms"));
      }
      titled(g, r.request_id + "\nprompt " + fmt(num(r.prompt_tokens)) + " tokens, output " +
             fmt(num(r.output_tokens)) + " tokens" + (num(r.cached_tokens) ? " (" + r.cached_tokens +
             " prompt tokens from the prefix cache)" : "") + (r.finish_reason ? ", finished: " + r.finish_reason : "") +
             (row.s.ttft !== null ? "\nTTFT " + row.s.ttft.toFixed(1) + " ms" : "") + "\ntotal " +
             row.s.total.toFixed(1) + " ms");
      chart.appendChild(g);
    });
    $("waterfall-summary").textContent = "— " + rows.length + " requests" +
      (ttftN ? ", mean TTFT " + (ttftSum / ttftN).toFixed(1) + " ms" : "");
  }

  // ---- polling -------------------------------------------------------------------------------
  function setStatus(ok, text) {
    $("status-dot").className = "dot " + (ok ? "ok" : "bad");
    $("status-text").textContent = text;
  }
  // Engine replicas (docs/scale-out.md): the stats carry `replicas`; the selector picks whose
  // snapshot the panels draw, and its options say each replica's queues and KV usage.
  var replica = "";
  function renderReplicas(d) {
    var list = arr(d.replicas), pick = $("replica");
    $("replica-pick").hidden = list.length === 0;
    if (!list.length) return;
    replica = String(d.replica || replica);
    var sig = list.map(function (r) { return r.id; }).join(",");
    if (pick.dataset.sig !== sig) {
      pick.textContent = "";
      list.forEach(function (r) { var o = el("option"); o.value = r.id; pick.appendChild(o); });
      pick.dataset.sig = sig;
    }
    list.forEach(function (r, i) {
      var q = obj(r.queue_lengths), kv = obj(r.kv);
      pick.options[i].textContent = r.id + (r.ready ? "" : " (down)") + " · " + fmt(num(q.running)) + " running, " +
        fmt(num(q.waiting)) + " waiting, KV " + fmt(100 * (num(kv.usage) || 0), 0) + "%";
    });
    pick.value = replica;
  }
  function render(d) {
    renderReplicas(d);
    liveRequests(d);
    var panels = [renderHeadline, renderKv, renderQueues, renderBudget, renderWaterfall];
    panels.forEach(function (p) {
      try { p(d); } catch (e) { if (window.console) console.error(p.name, e); }  // one bad panel spares the rest
    });
    document.body.dataset.updated = String(num(d.time) || Date.now() / 1000);
  }
  function poll() {
    if (paused) { setTimeout(poll, POLL_MS); return; }
    var headers = {Accept: "application/json"};
    if (key) headers.Authorization = "Bearer " + key;
    var which = replica ? "&replica=" + encodeURIComponent(replica) : "";
    fetch("v1/engine/stats?steps=" + STEPS + which, {headers: headers, cache: "no-store"})
      .then(function (resp) {
        if (!resp.ok) {
          return resp.text().then(function (t) {
            var msg = "HTTP " + resp.status;
            try { msg += ": " + JSON.parse(t).error.message; } catch (e) { /* not an OpenAI error body */ }
            throw new Error(msg);
          });
        }
        return resp.json();
      })
      .then(function (d) {
        render(obj(d));
        var when = num(d.time) ? new Date(d.time * 1000) : new Date();
        setStatus(true, (d.ready === false ? "model loading · " : "live · ") + when.toLocaleTimeString());
      })
      .catch(function (e) { setStatus(false, "stats unavailable: " + e.message); })
      .then(function () { setTimeout(poll, POLL_MS); });
  }
  $("replica").addEventListener("change", function () { replica = this.value; });
  $("pause").addEventListener("click", function () {
    paused = !paused;
    this.textContent = paused ? "Resume" : "Pause";
  });
  poll();
})();
