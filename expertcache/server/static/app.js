// expertcache browser UI: a streaming chat over /v1/chat/completions and a live view of the
// expert cache from /stats. Plain JS, no dependencies; every request carries the API key when set.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { history: [], busy: false, abort: null, stats: null, draws: 0, modelName: null };
window.expertcacheUI = state;  // read by tests and handy in the console

function key() { return $("api-key").value.trim(); }
function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  if (key()) h["Authorization"] = "Bearer " + key();
  return h;
}
$("api-key").value = sessionStorage.getItem("expertcache-api-key") || "";
$("api-key").addEventListener("change", () => { sessionStorage.setItem("expertcache-api-key", key()); refreshModel(); });

function fmtBytes(n) {
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + u[i];
}
function pct(x) { return (100 * x).toFixed(1) + "%"; }

async function errorText(resp) {
  let msg = resp.status + " " + resp.statusText;
  try { const body = await resp.json(); msg = (body.error && body.error.message) || body.detail || msg; } catch (e) { /* not JSON */ }
  if (resp.status === 401) msg += " (enter the server's API key under Settings)";
  return msg;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

async function refreshModel() {
  try {
    const h = await fetch("health");
    const body = await h.json().catch(() => ({}));
    const st = $("status");
    st.textContent = h.ok ? "ready" : (body.status || "not ready") + (body.progress != null ? " " + pct(body.progress) : "");
    st.className = "pill " + (h.ok ? "ok" : body.status === "error" ? "bad" : "");
    const r = await fetch("v1/models", { headers: headers(false) });
    if (!r.ok) { $("model").textContent = await errorText(r); return; }
    const m = (await r.json()).data[0];
    state.modelName = m.id;
    $("model").textContent = m.id + (m.max_model_len ? " · context " + m.max_model_len : "");
  } catch (e) { $("model").textContent = "server unreachable"; }
}

async function send(text) {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...state.history, { role: "user", content: text });
  const body = {
    model: state.modelName || undefined, messages, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value),
  };
  addMessage("user", text);
  const out = addMessage("assistant", "");
  out.classList.add("streaming");
  state.busy = true; $("send").disabled = true; $("stop").disabled = false;
  state.abort = new AbortController();
  const t0 = performance.now();
  let first = null, chunks = 0, usage = null, reply = "";
  try {
    const resp = await fetch("v1/chat/completions", { method: "POST", headers: headers(true), body: JSON.stringify(body), signal: state.abort.signal });
    if (!resp.ok) throw new Error(await errorText(resp));
    const reader = resp.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut); buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const obj = JSON.parse(data);
          if (obj.error) throw new Error(obj.error.message);
          if (obj.usage) usage = obj.usage;
          for (const ch of obj.choices || []) {
            const delta = (ch.delta && ch.delta.content) || "";
            if (delta) {
              if (first === null) first = performance.now();
              chunks++; reply += delta; out.textContent = reply;
              $("messages").scrollTop = $("messages").scrollHeight;
            }
          }
        }
      }
    }
    state.history.push({ role: "user", content: text }, { role: "assistant", content: reply });
    state.lastChunks = chunks;
    const n = usage ? usage.completion_tokens : chunks;
    const secs = (performance.now() - (first || t0)) / 1000;
    $("speed").textContent = n + " tokens · " + (n > 1 && secs > 0 ? ((n - 1) / secs).toFixed(1) : "–") + " tok/s · first token " +
      (first ? ((first - t0) / 1000).toFixed(2) + " s" : "–");
  } catch (e) {
    if (e.name !== "AbortError") { out.remove(); addMessage("error", String(e.message || e)); }
  } finally {
    out.classList.remove("streaming");
    out.dataset.done = "1";
    state.busy = false; $("send").disabled = false; $("stop").disabled = true;
    pollStats();
  }
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.busy) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => state.abort && state.abort.abort());
$("clear").addEventListener("click", () => { state.history = []; $("messages").textContent = ""; $("speed").textContent = ""; });

// ---- the cache view ----------------------------------------------------------------------------

function renderTiers(es) {
  const rows = [];
  const t = es.per_tier || {};
  if (t.device) rows.push(["device", t.device.slots_per_layer, t.device.hits, t.device.misses]);
  if (t.host) rows.push(["host RAM", t.host.slots_per_layer == null ? "all" : t.host.slots_per_layer, t.host.hits, t.host.misses]);
  $("tiers").tBodies[0].innerHTML = rows.map(([name, slots, h, m]) =>
    `<tr><td>${name}</td><td>${slots}</td><td>${h + m ? pct(h / (h + m)) : "–"}</td><td>${h}</td><td>${m}</td></tr>`).join("");
}

function renderTotals(snap, es) {
  const c = snap.engine_counters || {};
  const items = [];
  if (es.per_tier) {
    items.push(["bytes moved", fmtBytes(es.bytes_moved || 0)]);
    items.push(["read from disk", fmtBytes((es.per_tier.disk || {}).bytes_read || 0)]);
    if (es.prefetch) items.push(["prefetch useful", es.prefetch.issued ? es.prefetch.useful + " of " + es.prefetch.issued : "–"]);
    items.push(["misses computed on CPU", pct(es.cpu_computed_share || 0)]);
  }
  items.push(["decode speed", c.decode_seconds ? (c.generated_tokens / c.decode_seconds).toFixed(1) + " tok/s" : "–"]);
  items.push(["prefill speed", c.prefill_seconds ? (c.prompt_tokens / c.prefill_seconds).toFixed(1) + " tok/s" : "–"]);
  items.push(["tokens generated", c.generated_tokens || 0]);
  if (snap.kv_cache_usage != null) items.push(["KV cache in use", pct(snap.kv_cache_usage)]);
  items.push(["requests running / waiting", (snap.running || 0) + " / " + (snap.waiting || 0)]);
  $("totals").innerHTML = items.map(([k, v]) => `<dt>${k}</dt><dd>${v}</dd>`).join("");
}

const TIER_COLOR = { 2: getComputedStyle(document.documentElement).getPropertyValue("--dev").trim() || "#e0542c",
                     1: getComputedStyle(document.documentElement).getPropertyValue("--host").trim() || "#2a9d8f" };

function renderHeatmap(es) {
  const cv = $("heatmap");
  const uses = es.use_counts || [];
  const res = es.residency || [];
  const L = uses.length, E = L ? uses[0].length : 0;
  const ctx = cv.getContext("2d");
  if (!L || !E) { ctx.clearRect(0, 0, cv.width, cv.height); return; }
  const cell = Math.max(4, Math.floor(Math.min(640 / E, 360 / L)));
  cv.width = cell * E; cv.height = cell * L;
  let max = 0, total = 0;
  for (const row of uses) for (const v of row) { max = Math.max(max, v); total += v; }
  const lmax = Math.log1p(max || 1);
  // host outlines only when the host tier is partial (when it holds every expert they say nothing)
  const partialHost = res.some((row) => row.some((r) => r === 0));
  for (let l = 0; l < L; l++) {
    for (let e = 0; e < E; e++) {
      const shade = Math.log1p(uses[l][e]) / lmax;  // 0..1
      const g = Math.round(250 - 200 * shade);
      ctx.fillStyle = `rgb(${g},${g},${Math.min(255, g + 25)})`;
      ctx.fillRect(e * cell, l * cell, cell, cell);
      const r = res[l] ? res[l][e] : 0;
      if (r && (r === 2 || partialHost) && cell >= 6) {
        ctx.strokeStyle = TIER_COLOR[r];
        ctx.lineWidth = Math.max(1, Math.floor(cell / 6));
        ctx.strokeRect(e * cell + ctx.lineWidth / 2, l * cell + ctx.lineWidth / 2, cell - ctx.lineWidth, cell - ctx.lineWidth);
      }
    }
  }
  state.draws++;
  cv.dataset.totalUses = String(total);
  cv.dataset.draws = String(state.draws);
  cv.title = `${L} MoE layers (rows) × ${E} experts (columns); ${total} routed token-expert pairs so far`;
}

function renderEP(es) {
  const ep = es.expert_parallel;
  if (!ep) { $("ep").innerHTML = ""; return; }
  const loads = ep.pairs_per_rank_last_step || [];
  const max = Math.max(1, ...loads);
  $("ep").innerHTML = `<h3>Expert parallel: ${ep.world_size} ranks <small>(balance max/mean ${Number(ep.balance_mean).toFixed(2)}, ` +
    `${ep.rearrangements} rearrangements)</small></h3><table><tr><th>rank</th><th>pairs last step</th><th></th></tr>` +
    loads.map((n, r) => `<tr><td>${r}</td><td>${n}</td><td style="text-align:left"><span style="display:inline-block;height:.7em;background:var(--accent);width:${(100 * n / max).toFixed(0)}px"></span></td></tr>`).join("") +
    "</table>";
}

async function pollStats() {
  try {
    const r = await fetch("stats", { headers: headers(false) });
    if (!r.ok) { $("cache-note").textContent = "/stats: " + await errorText(r); return; }
    const snap = await r.json();
    state.stats = snap;
    const es = snap.expert_stats || {};
    renderTiers(es); renderTotals(snap.engine || {}, es); renderHeatmap(es); renderEP(es);
    $("cache-note").textContent = es.per_tier ? "" : (snap.status === "ok"
      ? "Every expert is resident (no cache budget given): start the server with e.g. --device-memory 25% to watch the cache work."
      : "The model is " + snap.status + ".");
  } catch (e) { $("cache-note").textContent = "stats unavailable: " + e; }
}

refreshModel();
pollStats();
setInterval(() => { pollStats(); if ($("status").textContent !== "ready") refreshModel(); }, 1000);
