// The playground: settings built from GET /v1/limits, a multi-turn chat over
// POST /v1/chat/completions (stream + stream_mode "denoise"), one canvas panel per setting.
// Everything from the server or the user is shown with textContent, never as markup.

import { ApiError, apiKey, getJSON, setApiKey, streamJSON } from "./api.js";
import { Run, drawFrame } from "./canvas.js";

const $ = (sel, root = document) => root.querySelector(sel);
const MAX_BACKLOG = 30; // frames: the live view never trails the stream by more than this
// Sampling knobs most runs leave alone: folded under "more settings" to keep the form short.
const RELOAD_MS = 3000;
const SECONDARY = new Set(["top_p", "top_k", "alg_temp", "cfg_scale", "suppress_eos"]);

const state = {
  models: [], // ids from /v1/models
  limits: new Map(), // id -> entry of /v1/limits
  history: [], // [{role, content}] of finished turns
  running: false,
};

// ---- settings forms ------------------------------------------------------------------------

function specsFor(model) {
  const entry = state.limits.get(model) || state.limits.values().next().value;
  return entry ? entry.parameters : {};
}

function fieldFor(name, spec) {
  const label = document.createElement("label");
  label.className = "field";
  label.title = spec.description || "";
  const caption = document.createElement("span");
  caption.textContent = name;
  label.appendChild(caption);
  let input;
  if (spec.enum) {
    input = document.createElement("select");
    for (const value of ["", ...spec.enum]) {
      const option = document.createElement("option");
      option.value = value;
      option.textContent = value === "" ? "default" : value;
      input.appendChild(option);
    }
  } else if (spec.type === "boolean") {
    input = document.createElement("select");
    for (const value of ["", "true", "false"]) {
      const option = document.createElement("option");
      option.value = value;
      option.textContent = value === "" ? "default" : value;
      input.appendChild(option);
    }
  } else {
    input = document.createElement("input");
    input.type = "number";
    input.inputMode = spec.type === "integer" ? "numeric" : "decimal";
    input.step = spec.type === "integer" ? "1" : "any";
    input.placeholder = "default";
  }
  input.dataset.param = name;
  input.dataset.kind = spec.enum ? "enum" : spec.type;
  applyRange(input, spec);
  label.appendChild(input);
  const range = document.createElement("small");
  range.className = "range";
  label.appendChild(range);
  describeRange(range, spec);
  return label;
}

function applyRange(input, spec) {
  if (input.tagName !== "INPUT") return;
  const min = spec.minimum ?? spec.exclusiveMinimum;
  if (min !== undefined) input.min = String(min);
  else input.removeAttribute("min");
  if (spec.maximum !== undefined) input.max = String(spec.maximum);
  else input.removeAttribute("max");
}

function describeRange(el, spec) {
  if (spec.enum || spec.type === "boolean") {
    el.textContent = "";
    return;
  }
  // Bounds past 2^53 (the seed's 2^63 - 1) cannot be shown exactly by a JS number.
  const fmt = (v) => (Math.abs(v) > Number.MAX_SAFE_INTEGER ? `~${v.toExponential(2)}` : String(v));
  const lo = spec.minimum !== undefined ? `[${fmt(spec.minimum)}` : spec.exclusiveMinimum !== undefined ? `(${fmt(spec.exclusiveMinimum)}` : "(-\u221e";
  const hi = spec.maximum !== undefined ? `${fmt(spec.maximum)}]` : spec.exclusiveMaximum !== undefined ? `${fmt(spec.exclusiveMaximum)})` : "\u221e)";
  el.textContent = `${lo}, ${hi}`;
}

function buildForm(fieldset) {
  for (const old of fieldset.querySelectorAll(":scope > label, :scope > details")) old.remove();
  const modelLabel = document.createElement("label");
  modelLabel.className = "field model";
  const caption = document.createElement("span");
  caption.textContent = "model";
  modelLabel.appendChild(caption);
  const select = document.createElement("select");
  select.dataset.param = "model";
  for (const id of state.models) {
    const option = document.createElement("option");
    option.value = id;
    option.textContent = id;
    select.appendChild(option);
  }
  modelLabel.appendChild(select);
  fieldset.appendChild(modelLabel);
  const specs = specsFor(select.value);
  const more = document.createElement("details");
  more.className = "more";
  const summary = document.createElement("summary");
  summary.textContent = "more settings";
  more.appendChild(summary);
  for (const [name, spec] of Object.entries(specs)) {
    (SECONDARY.has(name) ? more : fieldset).appendChild(fieldFor(name, spec));
  }
  if (more.children.length > 1) fieldset.appendChild(more);
  select.addEventListener("change", () => {
    const fresh = specsFor(select.value);
    for (const input of fieldset.querySelectorAll("[data-param]")) {
      const spec = fresh[input.dataset.param];
      if (!spec) continue;
      applyRange(input, spec);
      describeRange(input.parentElement.querySelector(".range"), spec);
    }
  });
}

// {model, params}: only the fields the user filled, typed as the API wants them.
function readSettings(fieldset) {
  const params = {};
  let model = "";
  for (const input of fieldset.querySelectorAll("[data-param]")) {
    const raw = input.value.trim();
    if (input.dataset.param === "model") {
      model = raw;
      continue;
    }
    if (raw === "") continue;
    const kind = input.dataset.kind;
    let value = raw;
    if (kind === "integer") {
      // Past 2^53 a JS number is not exact (seeds go to 2^63 - 1): the digits go as a string,
      // which the API reads as the exact integer. Anything else odd goes as typed, for the
      // API to name the field.
      const n = Number(raw);
      value = Number.isSafeInteger(n) ? n : raw;
    }
    else if (kind === "number") value = Number.isNaN(Number(raw)) ? raw : Number(raw);
    else if (kind === "boolean") value = raw === "true";
    params[input.dataset.param] = value;
  }
  return { model, params };
}

// ---- one answer panel ----------------------------------------------------------------------

class Panel {
  constructor(el) {
    this.el = el;
    this.grid = $(".grid", el);
    this.slider = $(".slider", el);
    this.stepLabel = $(".step-label", el);
    this.answer = $(".answer", el);
    this.error = $(".error", el);
    this.stats = $(".stats", el);
    this.run = null;
    this.shown = -1;
    this.streamDone = false;
    this.slider.addEventListener("input", () => this.show(Number(this.slider.value) - 1, true));
  }

  reset(settings) {
    const p = settings.params;
    this.run = new Run(p.block_length, p.steps || p.max_tokens);
    this.shown = -1;
    this.streamDone = false;
    this.text = "";
    this.answer.textContent = "";
    this.error.textContent = "";
    this.error.hidden = true;
    this.stats.replaceChildren();
    this.grid.replaceChildren();
    this.slider.disabled = true;
    this.slider.max = "1";
    this.slider.value = "1";
    this.stepLabel.textContent = "step 0 / 0";
    $(".panel-model", this.el).textContent = settings.model;
    this.el.dataset.state = "running";
    this.el.dataset.frame = "0";
  }

  show(index, final) {
    if (!this.run || index < 0 || index >= this.run.frames.length) return;
    this.shown = index;
    drawFrame(this.grid, this.run, index, final);
    const frame = this.run.frames[index];
    this.stepLabel.textContent = `step ${frame.step} / ${this.run.last.step}`;
    this.el.dataset.frame = String(index + 1);
  }

  // Live view: one frame per animation frame, skipping ahead when the stream runs far ahead.
  tick(run) {
    if (run !== this.run) return; // a newer answer took over this panel
    const frames = this.run.frames.length;
    const backlog = frames - 1 - this.shown;
    if (backlog > 0) {
      this.show(this.shown + Math.max(1, Math.ceil(backlog / MAX_BACKLOG)), this.streamDone);
    }
    if (this.streamDone && this.shown >= frames - 1) {
      this.finishView();
      return;
    }
    requestAnimationFrame(() => this.tick(run));
  }

  finishView() {
    const frames = this.run.frames.length;
    if (frames > 0) {
      this.show(frames - 1, true);
      this.slider.max = String(frames);
      this.slider.value = String(frames);
      this.slider.disabled = false;
    }
    this.answer.textContent = this.text;
    this.el.dataset.state = this.failed ? "error" : "done";
  }

  async generate(messages, settings, signal) {
    this.reset(settings);
    this.failed = false;
    const body = {
      model: settings.model,
      messages,
      stream: true,
      stream_mode: "denoise",
      stream_options: { include_usage: true },
      ...settings.params,
    };
    const t0 = performance.now();
    let firstText = null;
    let usage = null;
    let finish = null;
    const run = this.run;
    requestAnimationFrame(() => this.tick(run));
    try {
      await streamJSON("../v1/chat/completions", body, (chunk) => {
        if (chunk.usage) usage = chunk.usage;
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) return;
        const content = choice.delta && choice.delta.content;
        if (content) {
          if (firstText === null) firstText = performance.now() - t0;
          this.text += content;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
        if (Array.isArray(choice.canvas)) this.run.add(choice.canvas, choice.steps || 0);
      }, signal);
    } catch (err) {
      this.failed = true;
      this.showError(err);
      throw err;
    } finally {
      this.streamDone = true;
      this.totalMs = performance.now() - t0;
    }
    this.showStats(usage, finish, firstText, this.totalMs);
    return this.text;
  }

  showError(err) {
    this.error.hidden = false;
    if (err instanceof ApiError) {
      const parts = [`${err.status}`];
      if (err.type) parts.push(err.type);
      if (err.code) parts.push(`code ${err.code}`);
      if (err.param) parts.push(`param ${err.param}`);
      this.error.textContent = `${parts.join(" \u00b7 ")}: ${err.message}`;
    } else if (err && err.name === "AbortError") {
      this.error.textContent = "stopped";
    } else {
      this.error.textContent = `network error: ${err && err.message}`;
    }
  }

  showStats(usage, finish, firstTextMs, totalMs) {
    const frames = this.run.frames.length;
    const last = this.run.last;
    // NFE: the server's count when usage has it, else the forwards the last frame reported.
    const nfe = usage && usage.forwards != null ? usage.forwards : last ? last.step : frames;
    const tokens = usage ? usage.completion_tokens : null;
    const tpf = usage && usage.tokens_per_forward != null
      ? usage.tokens_per_forward
      : tokens != null && nfe ? tokens / nfe : null;
    const rows = [
      ["NFE", String(nfe), usage && usage.forwards != null ? "usage.forwards" : "forwards reported by the last frame"],
      ["tokens / forward", tpf == null ? "\u2013" : tpf.toFixed(2), "completion tokens per forward"],
      ["first stable text", firstTextMs == null ? "\u2013" : `${firstTextMs.toFixed(0)} ms`, "time to the first committed text"],
      ["total", `${totalMs.toFixed(0)} ms`, "time to the end of the stream"],
      ["tokens", tokens == null ? "\u2013" : String(tokens), "completion tokens"],
      ["frames", String(frames), "canvas snapshots received"],
      ["finish", finish || "\u2013", "finish_reason"],
    ];
    const items = [];
    for (const [name, value, help] of rows) {
      const dt = document.createElement("dt");
      dt.textContent = name;
      dt.title = help;
      const dd = document.createElement("dd");
      dd.textContent = value;
      dd.dataset.stat = name;
      items.push(dt, dd);
    }
    this.stats.replaceChildren(...items);
  }
}

// ---- chat ----------------------------------------------------------------------------------

const panels = { a: null, b: null };
let controller = null;

function addMessage(role, content, note) {
  const li = document.createElement("li");
  li.className = `msg ${role}`;
  const who = document.createElement("span");
  who.className = "role";
  who.textContent = note ? `${role} (${note})` : role;
  const text = document.createElement("span");
  text.className = "content";
  text.textContent = content;
  li.append(who, text);
  $("#history").appendChild(li);
  li.scrollIntoView({ block: "nearest" });
  return li;
}

function setRunning(running) {
  state.running = running;
  $("#send").disabled = running;
  $("#stop").disabled = !running;
  document.body.dataset.running = running ? "true" : "false";
}

async function send() {
  const prompt = $("#prompt");
  const text = prompt.value.trim();
  if (!text || state.running || state.models.length === 0) return;
  const compare = $("#compare").checked;
  const messages = [];
  const system = $("#system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...state.history, { role: "user", content: text });
  const userLine = addMessage("user", text);
  prompt.value = "";
  setRunning(true);
  controller = new AbortController();
  const jobs = [panels.a.generate(messages, readSettings($("#settings-a")), controller.signal)];
  if (compare) jobs.push(panels.b.generate(messages, readSettings($("#settings-b")), controller.signal));
  const [a, b] = await Promise.allSettled(jobs);
  setRunning(false);
  if (a.status === "fulfilled") {
    // The conversation goes on with answer A; B is shown for comparison only.
    state.history.push({ role: "user", content: text }, { role: "assistant", content: a.value });
    addMessage("assistant", a.value, compare ? "A" : "");
    if (b && b.status === "fulfilled") addMessage("assistant", b.value, "B, not kept");
  } else {
    userLine.classList.add("failed");
    prompt.value = text;
  }
}

function newChat() {
  if (state.running) return;
  state.history = [];
  $("#history").replaceChildren();
}

// ---- start ---------------------------------------------------------------------------------

function showLoadError(err) {
  const el = $("#load-error");
  if (!err) {
    el.hidden = true;
    el.textContent = "";
    return;
  }
  el.hidden = false;
  const hint = err.status === 401 ? " (enter the API key above)" : "";
  el.textContent = `${err.status || ""} ${err.message}${hint}`.trim();
}

async function loadModels() {
  try {
    const [models, limits] = await Promise.all([getJSON("../v1/models"), getJSON("../v1/limits")]);
    state.models = models.data.map((m) => m.id);
    state.limits = new Map(limits.data.map((entry) => [entry.id, entry]));
    buildForm($("#settings-a"));
    buildForm($("#settings-b"));
    showLoadError(null);
    document.body.dataset.ready = "true";
  } catch (err) {
    showLoadError(err);
    // Triton still starting (503): try again shortly. Other errors wait for the user.
    if (err.status === 503) setTimeout(loadModels, RELOAD_MS);
  }
}

function start() {
  panels.a = new Panel($("#panel-a"));
  panels.b = new Panel($("#panel-b"));
  const key = $("#api-key");
  key.value = apiKey();
  key.addEventListener("change", () => {
    setApiKey(key.value.trim());
    loadModels();
  });
  $("#compare").addEventListener("change", (ev) => {
    $("#settings-b").hidden = !ev.target.checked;
    $("#panel-b").hidden = !ev.target.checked;
    document.body.classList.toggle("comparing", ev.target.checked);
  });
  $("#send").addEventListener("click", send);
  $("#stop").addEventListener("click", () => controller && controller.abort());
  $("#clear").addEventListener("click", newChat);
  $("#prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) {
      ev.preventDefault();
      send();
    }
  });
  setRunning(false);
  loadModels();
}

start();
