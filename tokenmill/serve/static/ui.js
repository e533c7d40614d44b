// tokenmill web UI: a streaming chat over /v1/chat/completions and a live dashboard fed by /stats.
"use strict";

const $ = (id) => document.getElementById(id);
const conversation = [];     // the messages so far: {role, content}
let controller = null;       // AbortController of the answer being streamed
let modelName = null;

// ---- tabs -------------------------------------------------------------------------------------
for (const tab of document.querySelectorAll(".tab")) {
  tab.addEventListener("click", () => {
    document.querySelectorAll(".tab").forEach((t) => t.classList.toggle("active", t === tab));
    document.querySelectorAll(".panel").forEach((p) => p.classList.toggle("active", p.id === tab.dataset.panel));
    if (tab.dataset.panel === "dashboard-panel") refreshDashboard();
  });
}

// ---- chat -------------------------------------------------------------------------------------
function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

function number(id) {
  const v = $(id).value.trim();
  return v === "" ? null : Number(v);
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...conversation);
  const body = {
    messages, stream: true, stream_options: { include_usage: true },
    max_completion_tokens: number("max_tokens"), temperature: number("temperature"), top_p: number("top_p"),
    top_k: number("top_k"), min_p: number("min_p"), repetition_penalty: number("repetition_penalty"),
    presence_penalty: number("presence_penalty"), frequency_penalty: number("frequency_penalty"),
    ignore_eos: $("ignore_eos").checked,
  };
  if (modelName) body.model = modelName;
  const seed = number("seed");
  if (seed !== null) body.seed = seed;
  const stops = $("stop_strings").value.split("\n").filter((s) => s !== "");
  if (stops.length) body.stop = stops;
  for (const k of Object.keys(body)) if (body[k] === null) delete body[k];
  return body;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

// Yields the JSON payload of each `data:` event of a server-sent event stream, until [DONE].
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function send(text) {
  conversation.push({ role: "user", content: text });
  addMessage("user", text);
  const bubble = addMessage("assistant", "");
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  $("status").textContent = "waiting for the first token…";
  const start = performance.now();
  let first = null;
  let answer = "";
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody()), signal: controller.signal,
    });
    if (!response.ok) {
      const err = await response.json().catch(() => ({ error: { message: response.statusText } }));
      throw new Error(`${response.status}: ${err.error.message}`);
    }
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      const delta = chunk.choices.length ? chunk.choices[0].delta.content : null;
      if (delta) {
        if (first === null) first = performance.now();
        answer += delta;
        bubble.textContent = answer;
        $("messages").scrollTop = $("messages").scrollHeight;
      }
      if (chunk.usage) {
        const secs = (performance.now() - start) / 1000;
        const ttft = first === null ? "-" : Math.round(first - start) + " ms";
        $("status").textContent = `${chunk.usage.completion_tokens} tokens in ${secs.toFixed(2)} s · ` +
          `TTFT ${ttft} · prompt ${chunk.usage.prompt_tokens} tokens`;
      }
    }
    conversation.push({ role: "assistant", content: answer });
  } catch (e) {
    if (e.name === "AbortError") {
      $("status").textContent = "stopped";
      if (answer) conversation.push({ role: "assistant", content: answer });
    } else {
      bubble.remove();
      conversation.pop();
      addMessage("error", e.message);
      $("status").textContent = "";
    }
  } finally {
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

$("chat-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) {
    ev.preventDefault();
    $("chat-form").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => {
  conversation.length = 0;
  $("messages").textContent = "";
  $("status").textContent = "";
});

// ---- dashboard --------------------------------------------------------------------------------
const COLORS = ["#2a6fdb", "#d9822b"];

// A line chart of up to two series, one point a second; null values leave gaps, lone points show as dots.
function chart(canvas, series, { max: fixedMax = null, integer = false } = {}) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, left = 40, top = 8, bottom = 18;
  ctx.clearRect(0, 0, w, h);
  const values = series.flat().filter((v) => v !== null);
  const peak = Math.max(0, ...values);
  const max = fixedMax || (integer ? 4 * Math.max(1, Math.ceil(peak * 1.1 / 4)) : Math.max(1e-9, peak * 1.1) || 1);
  const y = (v) => top + (h - top - bottom) * (1 - v / max);
  const n = Math.max(1, ...series.map((s) => s.length));
  const x = (i) => left + (w - left) * (n === 1 ? 1 : i / (n - 1));
  ctx.strokeStyle = "#dcdcd8";
  ctx.fillStyle = "#6b6b70";
  ctx.font = "11px system-ui";
  for (let i = 0; i <= 4; i++) {
    const v = max * i / 4;
    ctx.beginPath(); ctx.moveTo(left, y(v)); ctx.lineTo(w, y(v)); ctx.stroke();
    ctx.fillText(integer || max >= 10 ? Math.round(v).toString() : v.toFixed(2), 0, y(v) + 4);
  }
  ctx.fillText(`-${n - 1} s`, left, h - 4);
  ctx.fillText("now", w - 24, h - 4);
  series.forEach((s, k) => {
    ctx.strokeStyle = ctx.fillStyle = COLORS[k];
    ctx.lineWidth = 2;
    ctx.beginPath();
    s.forEach((v, i) => {
      if (v === null) return;
      if (i > 0 && s[i - 1] !== null) ctx.lineTo(x(i), y(v)); else ctx.moveTo(x(i), y(v));
    });
    ctx.stroke();
    s.forEach((v, i) => {
      const lone = v !== null && (i === 0 || s[i - 1] === null) && (i === s.length - 1 || s[i + 1] === null);
      if (lone) { ctx.beginPath(); ctx.arc(x(i), y(v), 2.5, 0, 2 * Math.PI); ctx.fill(); }
    });
  });
}

async function refreshDashboard() {
  if (!$("dashboard-panel").classList.contains("active")) return;
  let data;
  try {
    data = await (await fetch("/stats")).json();
  } catch (e) {
    return;
  }
  const s = data.stats, pts = data.points;
  $("t-running").textContent = s.num_running;
  $("t-waiting").textContent = s.num_waiting;
  $("t-kv").textContent = (100 * s.kv_cache_usage).toFixed(1) + " %";
  $("t-kv-tokens").textContent = s.kv_cache_used_tokens;
  $("t-rate").textContent = pts.length ? pts[pts.length - 1].generation_tokens_per_s.toFixed(1) : "-";
  $("t-preempt").textContent = s.num_preemptions;
  const col = (k, scale = 1) => pts.map((p) => (p[k] === null ? null : p[k] * scale));
  chart($("c-kv"), [col("kv_cache_usage", 100)], { max: 100 });
  chart($("c-requests"), [col("running"), col("waiting")], { integer: true });
  chart($("c-batch"), [col("decode_batch"), col("prefill_batch")], { integer: true });
  chart($("c-latency"), [col("ttft_s", 1000), col("tpot_s", 1000)]);
}

async function init() {
  try {
    const models = await (await fetch("/v1/models", { headers: headers() })).json();
    modelName = models.data[0].id;
    $("model-name").textContent = modelName;
  } catch (e) {
    $("model-name").textContent = "";
  }
  setInterval(refreshDashboard, 1000);
}
init();
