// The deepbatch dashboard: polls the server's own JSON once a second and draws it with uPlot.
// No data is fetched from anywhere but the server that served this page.
"use strict";
(() => {
  const KEY_STORAGE = "deepbatch.apiKey";
  const POLL_MS = 1000;
  const TIMEOUT_MS = 3000; // a poll that hangs (server stopped mid-reply) counts as failed
  const HISTORY = 300; // samples kept per series: five minutes at one a second
  const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd"];

  const $ = (id) => document.getElementById(id);

  class AuthError extends Error {}
  class HTTPError extends Error {
    constructor(status) { super(`HTTP ${status}`); this.status = status; }
  }

  function storedKey() {
    try { return localStorage.getItem(KEY_STORAGE) || ""; } catch (e) { return ""; }
  }

  async function getJSON(path) {
    const abort = new AbortController();
    const timer = setTimeout(() => abort.abort(), TIMEOUT_MS);
    const headers = {};
    const key = storedKey();
    if (key) headers.Authorization = "Bearer " + key;
    try {
      const r = await fetch(path, { headers, signal: abort.signal, cache: "no-store" });
      if (r.status === 401) throw new AuthError("API key needed");
      if (!r.ok) throw new HTTPError(r.status);
      return await r.json();
    } finally {
      clearTimeout(timer);
    }
  }

  // -- history and charts ---------------------------------------------------------------------

  const history = {
    t: [], running: [], waiting: [], kvUsage: [], kvTokens: [], kvFrag: [], genTps: [], promptTps: [],
    ttft50: [], ttft99: [], tpot50: [], tpot99: [], ctlSeqs: [], ctlTokens: [],
  };

  function record(sample) {
    for (const k of Object.keys(history)) {
      const v = sample[k];
      history[k].push(v === undefined || v === null || !Number.isFinite(v) ? null : v);
      if (history[k].length > HISTORY) history[k].shift();
    }
  }

  // [history key, label, scale]; a second scale gets its own axis on the right.
  const CHARTS = [
    { id: "c-requests", series: [["running", "running"], ["waiting", "waiting"]] },
    { id: "c-kv", series: [["kvUsage", "blocks used"], ["kvTokens", "token usage"], ["kvFrag", "fragmentation"]] },
    { id: "c-throughput", series: [["genTps", "generation"], ["promptTps", "prompt"]] },
    { id: "c-ttft", series: [["ttft50", "p50"], ["ttft99", "p99"]] },
    { id: "c-tpot", series: [["tpot50", "p50"], ["tpot99", "p99"]] },
    { id: "c-controller", series: [["ctlSeqs", "max_num_seqs", "y"], ["ctlTokens", "max_num_batched_tokens", "tokens"]] },
  ];
  const charts = [];

  function chartWidth(el) {
    return Math.max(el.clientWidth || el.parentElement.clientWidth || 0, 300);
  }

  function makeChart(spec) {
    const el = $(spec.id);
    const scales = [...new Set(spec.series.map((s) => s[2] || "y"))];
    const opts = {
      width: chartWidth(el),
      height: 180,
      scales: { x: { time: true } },
      series: [{}, ...spec.series.map((s, i) => ({
        label: s[1], scale: s[2] || "y", stroke: COLORS[i % COLORS.length], width: 2, spanGaps: false,
      }))],
      axes: [{}, ...scales.map((scale, i) => ({ scale, side: i === 0 ? 3 : 1, grid: { show: i === 0 } }))],
      legend: { live: false },
      cursor: { drag: { x: false, y: false } },
    };
    const chart = new uPlot(opts, [[], ...spec.series.map(() => [])], el);
    charts.push({ spec, el, chart });
  }

  function drawCharts() {
    for (const { spec, el, chart } of charts) {
      const columns = spec.series.map((s) => history[s[0]]);
      chart.setData([history.t.slice(), ...columns.map((c) => c.slice())]);
      // What the chart holds, for anyone reading the DOM: samples with any value, and per series.
      const perSeries = {};
      spec.series.forEach((s, i) => { perSeries[s[1]] = columns[i].filter((v) => v !== null).length; });
      el.dataset.points = history.t.filter((_, j) => columns.some((c) => c[j] !== null)).length;
      el.dataset.series = JSON.stringify(perSeries);
    }
  }

  function resizeCharts() {
    for (const { el, chart } of charts) chart.setSize({ width: chartWidth(el), height: 180 });
  }

  // -- tiles and tables -----------------------------------------------------------------------

  const fmt = (v, digits = 0) => (v === null || v === undefined || !Number.isFinite(v) ? "-" : v.toFixed(digits));
  const pct = (v) => (v === null || v === undefined ? null : 100 * v);

  function setText(id, text) { $(id).textContent = text; }

  function cells(row, values, tag = "td") {
    for (const v of values) {
      const c = document.createElement(tag);
      c.textContent = v; // never innerHTML: tenant names are chosen by clients
      row.appendChild(c);
    }
  }

  function drawTiles(stats, ds, sample) {
    setText("t-running", fmt(stats.num_requests_running));
    setText("t-waiting", fmt(stats.num_requests_waiting));
    setText("t-swapped", fmt(stats.num_requests_swapped));
    setText("t-kv-usage", fmt(sample.kvUsage, 1) + " %");
    setText("t-kv-tokens", fmt(sample.kvTokens, 1) + " %");
    setText("t-kv-frag", fmt(sample.kvFrag, 1) + " %");
    setText("t-gen-tps", fmt(sample.genTps, 1));
    setText("t-gen-total", fmt(ds.num_generation_tokens));
    $("t-gen-total").dataset.value = ds.num_generation_tokens;
    setText("t-ttft", `${fmt(ds.ttft_ms.p50, 1)} / ${fmt(ds.ttft_ms.p99, 1)}`);
    setText("t-tpot", `${fmt(ds.tpot_ms.p50, 1)} / ${fmt(ds.tpot_ms.p99, 1)}`);
    setText("t-preempt", fmt(stats.num_preemptions.total));
    // Speculative decoding, where it is on: tokens a drafting request gains per step, and the
    // share of draft tokens accepted.
    const spec = stats.spec_decode;
    $("tile-spec").hidden = !spec;
    if (spec) setText("t-spec", `${fmt(spec.mean_acceptance_length, 2)} / ${fmt(pct(spec.acceptance_rate), 0)} %`);
  }

  function drawTenants(ds) {
    const table = $("tenants");
    const body = table.tBodies[0];
    body.replaceChildren();
    for (const t of ds.tenants) {
      const row = document.createElement("tr");
      row.dataset.tenant = t.tenant;
      row.dataset.share = t.share;
      cells(row, [t.tenant, String(t.generation_tokens)]);
      const share = document.createElement("td");
      const bar = document.createElement("span");
      bar.className = "bar";
      bar.style.width = `${(100 * t.share).toFixed(1)}%`;
      const label = document.createElement("span");
      label.textContent = `${(100 * t.share).toFixed(1)} %`;
      share.append(bar, label);
      row.appendChild(share);
      body.appendChild(row);
    }
    table.dataset.rows = ds.tenants.length;
    $("tenants-empty").hidden = ds.tenants.length > 0;
    setText("tenant-window", `(generated tokens, last ${fmt(ds.window_s)} s)`);
  }

  let shownSetting = null; // the setting the frontier table was last scrolled to

  function drawController(state, report) {
    const section = $("controller");
    section.dataset.state = state;
    const on = report !== null;
    $("ctl-body").hidden = !on;
    setText("ctl-state", {
      on: "on", off: "off (start the server with --slo-ttft-ms and/or --slo-tpot-ms)",
      draining: "on (server draining: last report)",
    }[state] || "");
    if (!on) return;
    const ms = (v) => fmt(v, 1);
    // A frontier latency is null where the model predicts no bound (the queue grows without end).
    const unbounded = (v) => (v === null ? "\u221e" : ms(v));
    const s = report.settings;
    const o = report.observed;
    const w = report.workload;
    const rows = [
      ["targets p99 TTFT / TPOT (ms)", `${ms(report.targets.ttft_p99_ms)} / ${ms(report.targets.tpot_p99_ms)}`],
      ["max_num_seqs", `${s.max_num_seqs} (limit ${report.limits.max_num_seqs})`],
      ["max_num_batched_tokens", `${s.max_num_batched_tokens} (limit ${report.limits.max_num_batched_tokens})`],
      ["prefill chunk tokens", String(s.prefill_chunk_tokens)],
      ["observed p99 TTFT / TPOT (ms)",
        `${ms(o.ttft_p99_ms)} / ${ms(o.tpot_p99_ms)} (${o.ttft_samples} / ${o.tpot_samples} samples)`],
      ["arrival rate (req/s)", w ? fmt(w.arrival_rate_rps, 2) : "-"],
      ["changes / steps", `${report.num_changes} / ${report.num_steps}`],
      ["last decision", report.last_decision],
    ];
    const sbody = $("ctl-settings").tBodies[0];
    sbody.replaceChildren();
    for (const r of rows) {
      const row = document.createElement("tr");
      cells(row, [r[0]], "th");
      cells(row, [r[1]]);
      sbody.appendChild(row);
    }
    const points = [...report.frontier].sort((a, b) =>
      a.max_num_seqs - b.max_num_seqs || a.max_num_batched_tokens - b.max_num_batched_tokens);
    const fbody = $("frontier").tBodies[0];
    fbody.replaceChildren();
    let currentRow = null;
    for (const p of points) {
      const row = document.createElement("tr");
      const current = p.max_num_seqs === s.max_num_seqs && p.max_num_batched_tokens === s.max_num_batched_tokens;
      if (current) {
        row.className = "current";
        currentRow = row;
      }
      row.dataset.current = current ? "1" : "0";
      cells(row, [String(p.max_num_seqs), String(p.max_num_batched_tokens), fmt(p.capacity_rps, 2),
        fmt(p.throughput_rps, 2), unbounded(p.ttft_p99_ms), unbounded(p.tpot_p99_ms),
        p.meets ? "yes" : p.meets_tpot ? "TPOT only" : p.meets_ttft ? "TTFT only" : "no"]);
      fbody.appendChild(row);
    }
    $("frontier").dataset.rows = points.length;
    const meets = points.filter((p) => p.meets).length;
    setText("frontier-summary", points.length
      ? `${points.length} settings, ${meets} predicted to meet both targets`
      : "no frontier yet: " + report.last_decision);
    const setting = `${s.max_num_seqs}/${s.max_num_batched_tokens}`;
    if (currentRow && setting !== shownSetting) {
      // Bring the current setting into view when it changes, without moving the page.
      const box = currentRow.closest(".scroll");
      box.scrollTop = currentRow.offsetTop - box.clientHeight / 2;
    }
    shownSetting = currentRow ? setting : null;
  }

  // -- status ---------------------------------------------------------------------------------

  const status = $("status");
  let restarts = 0;

  function setStatus(state, text) {
    status.dataset.state = state;
    status.textContent = text;
  }

  // -- polling --------------------------------------------------------------------------------

  let previous = null; // the last good /dashboard/stats, for rates
  let lastController = null;
  let timer = null;
  let needKey = false;

  async function controllerReport(ds) {
    if (!ds.controller) return ["off", null];
    try {
      return ["on", await getJSON("/v1/controller")];
    } catch (e) {
      if (e instanceof HTTPError && e.status === 503) return ["draining", lastController];
      if (e instanceof HTTPError && e.status === 404) return ["off", null];
      throw e;
    }
  }

  function rate(ds, key) {
    // Counters restart from zero with the server: no rate across a restart.
    if (!previous || previous.server_id !== ds.server_id || !(ds.time > previous.time)) return null;
    return (ds[key] - previous[key]) / (ds.time - previous.time);
  }

  async function health() {
    // 503 is an answer here (draining, or the engine dead), not a failed poll.
    const r = await fetch("/health", { cache: "no-store", signal: AbortSignal.timeout(TIMEOUT_MS) });
    return r.json();
  }

  async function poll() {
    const [stats, ds, up] = await Promise.all([getJSON("/stats"), getJSON("/dashboard/stats"), health()]);
    const [ctlState, report] = await controllerReport(ds);
    if (previous && previous.server_id !== ds.server_id) {
      restarts += 1;
      status.dataset.restarts = restarts;
    }
    status.dataset.serverId = ds.server_id;
    const kv = stats.kv_cache;
    const sample = {
      t: Date.now() / 1000,
      running: stats.num_requests_running,
      waiting: stats.num_requests_waiting,
      kvUsage: pct(kv ? kv.usage : stats.kv_cache_usage),
      kvTokens: pct(kv ? kv.token_usage : null),
      kvFrag: pct(kv ? kv.internal_fragmentation : null),
      genTps: rate(ds, "num_generation_tokens"),
      promptTps: rate(ds, "num_prompt_tokens"),
      ttft50: ds.ttft_ms.p50, ttft99: ds.ttft_ms.p99,
      tpot50: ds.tpot_ms.p50, tpot99: ds.tpot_ms.p99,
      ctlSeqs: report ? report.settings.max_num_seqs : null,
      ctlTokens: report ? report.settings.max_num_batched_tokens : null,
    };
    previous = ds;
    lastController = report;
    record(sample);
    drawTiles(stats, ds, sample);
    drawTenants(ds);
    drawController(ctlState, report);
    drawCharts();
    setText("model", ds.model || "");
    if (up.status === "ok") setStatus("live", "live");
    else setStatus(up.status, up.status === "dead" ? `engine dead: ${up.error}` : up.status);
    setText("updated", "updated " + new Date().toLocaleTimeString());
  }

  function askForKey() {
    needKey = true;
    setStatus("key", "API key needed");
    $("key-form").hidden = false;
    $("key-input").focus();
  }

  async function tick() {
    timer = null;
    const started = performance.now();
    try {
      await poll();
    } catch (e) {
      if (e instanceof AuthError) {
        askForKey(); // polling waits for a key: the same request would only fail again
        return;
      }
      // The server is down or restarting: a gap in the charts, and keep trying.
      record({ t: Date.now() / 1000 });
      drawCharts();
      const why = e instanceof HTTPError ? e.message : ["AbortError", "TimeoutError"].includes(e.name) ? "timed out" : "unreachable";
      setStatus("reconnecting", `reconnecting (${why})`);
    }
    if (!needKey) timer = setTimeout(tick, Math.max(0, POLL_MS - (performance.now() - started)));
  }

  function restart() {
    if (timer !== null) clearTimeout(timer);
    needKey = false;
    tick();
  }

  // -- start ----------------------------------------------------------------------------------

  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const key = $("key-input").value.trim();
    try {
      if (key) localStorage.setItem(KEY_STORAGE, key);
      else localStorage.removeItem(KEY_STORAGE);
    } catch (e) { /* storage disabled: the key is lost on reload */ }
    $("key-input").value = "";
    $("key-form").hidden = true;
    $("change-key").hidden = false;
    restart();
  });
  $("key-clear").addEventListener("click", () => {
    try { localStorage.removeItem(KEY_STORAGE); } catch (e) { /* nothing stored */ }
    $("key-input").value = "";
  });
  $("change-key").addEventListener("click", () => {
    $("key-form").hidden = !$("key-form").hidden;
  });
  $("change-key").hidden = !storedKey();

  for (const spec of CHARTS) makeChart(spec);
  window.addEventListener("resize", resizeCharts);
  // The controller's chart is laid out while hidden; size it once it shows.
  new ResizeObserver(resizeCharts).observe($("ctl-body"));
  window.deepbatchDashboard = { history, charts };
  tick();
})();
