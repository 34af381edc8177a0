// vlserve playground: a chat over this server's /v1/chat/completions (SSE), media sent inline as data: URLs.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "vlserve-api-key";
const KINDS = { image: "image_url", video: "video_url", audio: "input_audio" };
const GENERIC_QUESTIONS = {  // the demo's question forms, filled in, for media that is not one of the examples
  image: ["Describe the image.", "What shape is in the image?", "How many shapes are there?",
          "What color is the circle?", "Where is the red square?"],
  video: ["Describe the video.", "Which direction does the circle move?", "What color is the moving shape?"],
};
const state = {
  history: [],       // OpenAI messages of the finished turns
  attachments: [],   // {kind, name, url, example}
  info: { models: [], modalities: ["image"], demo: false },
  examples: [],      // entries of examples.json
  controller: null,  // AbortController of the running request
  lastRequest: null,
  key: sessionStorage.getItem(KEY_STORE) || "",
};

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

function authHeaders(json) {
  const h = json ? { "Content-Type": "application/json" } : {};
  if (state.key) h.Authorization = "Bearer " + state.key;
  return h;
}

async function errorMessage(resp) {
  const raw = await resp.text();
  try { return JSON.parse(raw).error.message || raw; } catch (_) { return raw || resp.statusText; }
}

async function getJSON(path) {
  const resp = await fetch(path, { headers: authHeaders(false) });
  if (!resp.ok) throw new ApiError(resp.status, await errorMessage(resp));
  return resp.json();
}

function showError(status, message) {
  const box = $("error");
  box.textContent = (status ? `Error ${status}: ` : "Error: ") + message;
  box.hidden = false;
}

function hideError() { $("error").hidden = true; $("error").textContent = ""; }

function setStatus(text) { $("status").textContent = text; }

// ---------------------------------------------------------------------------------------------- start-up
async function init() {
  try {
    state.info = await getJSON("/v1/playground/info");
    const models = await getJSON("/v1/models");
    $("model").replaceChildren(...models.data.map((m) => new Option(m.id, m.id)));
  } catch (e) {
    if (e.status === 401) { askKey(); return; }
    showError(e.status, e.message);
    return;
  }
  hideError();
  $("key-button").hidden = !state.key;
  const takes = state.info.modalities;
  $("file").accept = takes.map((m) => m + "/*").join(",");
  document.querySelectorAll(".audio-only").forEach((el) => { el.hidden = !takes.includes("audio"); });
  if (state.info.demo) {
    $("demo").hidden = false;
    try { state.examples = await (await fetch("/playground/static/examples/examples.json")).json(); } catch (_) {}
    renderExamples();
  }
  renderChips();
  $("prompt").focus();
  document.dispatchEvent(new Event("playground:ready"));  // live.js waits for the info
}

function askKey() {
  $("key-input").value = state.key;
  $("key-dialog").showModal();
}

$("key-form").addEventListener("submit", () => {
  state.key = $("key-input").value.trim();
  sessionStorage.setItem(KEY_STORE, state.key);
  init();
});
$("key-button").addEventListener("click", askKey);

// ---------------------------------------------------------------------------------------------- media
function readAsDataURL(blob) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(blob);
  });
}

function kindOf(file) {
  const major = (file.type || "").split("/")[0];
  if (major in KINDS) return major;
  const ext = (file.name.split(".").pop() || "").toLowerCase();
  if (["png", "jpg", "jpeg", "gif", "webp", "bmp"].includes(ext)) return "image";
  if (["mp4", "webm", "mov", "mkv", "avi"].includes(ext)) return "video";
  if (["wav", "mp3", "flac", "ogg", "m4a"].includes(ext)) return "audio";
  return null;
}

async function addFiles(files, example = null) {
  for (const file of files) {
    const kind = kindOf(file);
    if (!kind || !state.info.modalities.includes(kind)) {
      showError(0, `${file.name}: this model takes ${state.info.modalities.join(", ") || "text only"}` +
                   (kind ? `, not ${kind}` : " (unrecognised file type)"));
      continue;
    }
    state.attachments.push({ kind, name: file.name, url: await readAsDataURL(file), example });
  }
  renderAttachments();
  renderChips();
}

function mediaElement(att) {
  const el = document.createElement(att.kind === "image" ? "img" : att.kind);
  el.src = att.url;
  el.className = "thumb " + att.kind;
  el.title = att.name;
  if (att.kind === "image") el.alt = att.name;
  else { el.controls = true; el.muted = att.kind === "video"; el.setAttribute("aria-label", att.name); }
  el.addEventListener("error", () => {  // the browser cannot show it (the server may still read it, or say why not)
    const label = document.createElement("span");
    label.className = "thumb unreadable";
    label.textContent = att.name;
    label.title = `${att.name}: this browser cannot show it`;
    el.replaceWith(label);
  });
  return el;
}

function renderAttachments() {
  $("attachments").replaceChildren(...state.attachments.map((att, i) => {
    const box = document.createElement("div");
    box.className = "attachment";
    const remove = document.createElement("button");
    remove.type = "button";
    remove.textContent = "\u00d7";
    remove.setAttribute("aria-label", "remove " + att.name);
    remove.addEventListener("click", () => { state.attachments.splice(i, 1); renderAttachments(); renderChips(); });
    box.append(mediaElement(att), remove);
    return box;
  }));
}

function renderExamples() {
  $("examples").replaceChildren(...state.examples.map((ex) => {
    const button = document.createElement("button");
    button.type = "button";
    button.title = `attach ${ex.file} (${ex.questions.find((q) => q.form.startsWith("describe")).answer})`;
    button.setAttribute("aria-label", "attach example " + ex.file);
    const src = "/playground/static/examples/" + ex.file;
    const preview = document.createElement(ex.kind === "image" ? "img" : "video");
    preview.src = src;
    if (ex.kind === "image") preview.alt = ex.file; else { preview.muted = true; preview.loop = true; preview.autoplay = true; }
    button.append(preview);
    button.addEventListener("click", async () => {
      const blob = await (await fetch(src)).blob();
      await addFiles([new File([blob], ex.file, { type: ex.mime })], ex);
      $("prompt").focus();
    });
    return button;
  }));
}

function renderChips() {
  if (!state.info.demo) return;
  const example = state.attachments.length === 1 ? state.attachments[0].example : null;
  const kind = state.attachments.length ? state.attachments[0].kind : "image";
  const questions = example ? example.questions.map((q) => q.question) : (GENERIC_QUESTIONS[kind] || []);
  $("chips").replaceChildren(...questions.map((q) => {
    const chip = document.createElement("button");
    chip.type = "button";
    chip.textContent = q;
    chip.title = "put this question in the box (Enter sends it)";
    chip.addEventListener("click", () => { $("prompt").value = q; $("prompt").focus(); });
    return chip;
  }));
}

// ---------------------------------------------------------------------------------------------- requests
function userMessage(text, attachments) {
  if (!attachments.length) return { role: "user", content: text };
  const parts = attachments.map((att) => att.kind === "audio"
    ? { type: "input_audio", input_audio: { data: att.url.split(",", 2)[1], format: att.name.split(".").pop() } }
    : { type: KINDS[att.kind], [KINDS[att.kind]]: { url: att.url } });
  if (text) parts.push({ type: "text", text });
  return { role: "user", content: parts };
}

function buildRequest(messages) {
  const request = { model: $("model").value, messages, stream: true, stream_options: { include_usage: true } };
  const temperature = parseFloat($("temperature").value);
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (!Number.isNaN(temperature)) request.temperature = temperature;
  if (!Number.isNaN(maxTokens)) request.max_tokens = maxTokens;
  return request;
}

async function* sseEvents(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
      if (data.length) yield data.join("\n");
    }
  }
}

function renderTurn(role, text, attachments = []) {
  const turn = document.createElement("div");
  turn.className = "turn " + role;
  if (attachments.length) {
    const media = document.createElement("div");
    media.className = "media";
    media.append(...attachments.map(mediaElement));
    turn.append(media);
  }
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  turn.append(body);
  $("empty-hint").hidden = true;
  $("conversation").append(turn);
  turn.scrollIntoView({ block: "end" });
  return turn;
}

function figuresText(t0, tFirst, tEnd, usage) {
  const parts = [];
  if (tFirst !== null) parts.push(`TTFT ${Math.round(tFirst - t0)} ms`);
  if (usage) {
    const n = usage.completion_tokens;
    parts.push(`${n} token${n === 1 ? "" : "s"}`);
    if (n > 1 && tEnd > tFirst) parts.push(`${((n - 1) / ((tEnd - tFirst) / 1000)).toFixed(1)} tokens/s`);
    const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
    parts.push(`prompt ${usage.prompt_tokens} tokens, ${cached} cached`);
  }
  return parts.join(" \u00b7 ");
}

function expectedAnswer(text, attachments) {
  const example = attachments.length === 1 ? attachments[0].example : null;
  const qa = example && example.questions.find((q) => q.question === text.trim());
  return qa ? qa.answer : null;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").hidden = !busy;
  setStatus(busy ? "answering\u2026" : "");
}

async function send() {
  const text = $("prompt").value.trim();
  if (state.controller || (!text && !state.attachments.length)) return;
  hideError();
  const attachments = state.attachments;
  const message = userMessage(text, attachments);
  const request = buildRequest([...state.history, message]);
  state.lastRequest = request;
  const userTurn = renderTurn("user", text, attachments);
  const answer = renderTurn("assistant", "");
  answer.dataset.state = "streaming";
  const answerText = answer.querySelector(".text");
  state.attachments = [];
  $("prompt").value = "";
  renderAttachments();
  state.controller = new AbortController();
  setBusy(true);
  const t0 = performance.now();
  let tFirst = null, usage = null, output = "";
  try {
    const resp = await fetch("/v1/chat/completions", { method: "POST", headers: authHeaders(true),
                                                       body: JSON.stringify(request), signal: state.controller.signal });
    if (!resp.ok) throw new ApiError(resp.status, await errorMessage(resp));
    for await (const data of sseEvents(resp.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ApiError(chunk.error.code, chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const delta = choice.delta && choice.delta.content;
        if (!delta) continue;
        if (tFirst === null) tFirst = performance.now();
        output += delta;
        answerText.textContent = output;
      }
    }
    finishAnswer(answer, message, output, figuresText(t0, tFirst, performance.now(), usage),
                 expectedAnswer(text, attachments));
  } catch (e) {
    if (e.name === "AbortError") {
      finishAnswer(answer, message, output, "stopped", null);
    } else {  // the turn did not happen: put the question and media back for another try
      userTurn.remove();
      answer.remove();
      state.attachments = attachments.concat(state.attachments);
      $("prompt").value = $("prompt").value || text;
      renderAttachments();
      showError(e.status, e.message);
      if (e.status === 401) askKey();
    }
  } finally {
    state.controller = null;
    setBusy(false);
    renderChips();
  }
}

function finishAnswer(answer, message, output, figures, expected) {
  if (!answer.isConnected) return;  // "New chat" cleared the conversation while this answer streamed
  state.history.push(message, { role: "assistant", content: output });
  answer.dataset.state = "done";
  const line = document.createElement("div");
  line.className = "figures";
  line.textContent = figures;
  answer.append(line);
  if (expected !== null) {
    const check = document.createElement("div");
    check.className = "expected";
    check.textContent = (expected === output ? "\u2713 matches" : "\u2717 differs from") + ` the world's answer: ${expected}`;
    answer.append(check);
  }
}

// ---------------------------------------------------------------------------------------------- copy as code
function currentRequest() {
  const text = $("prompt").value.trim();
  if (text || state.attachments.length) return buildRequest([...state.history, userMessage(text, state.attachments)]);
  return state.lastRequest;
}

function requestAsCode(lang, request) {
  const base = location.origin;
  const body = JSON.stringify(request, null, 2).replace(/'/g, "\\u0027");  // still JSON; safe in '...' quoting
  if (lang === "curl") {
    const auth = state.key ? ` -H "Authorization: Bearer $VLSERVE_API_KEY"` : "";
    return `curl -sN ${base}/v1/chat/completions -H 'Content-Type: application/json'${auth} -d @- <<'JSON'\n` +
           `${body}\nJSON\n`;
  }
  return ["import json", "import os", "", "from openai import OpenAI", "",
          `client = OpenAI(base_url="${base}/v1", api_key=os.environ.get("VLSERVE_API_KEY", "EMPTY"))`,
          `request = json.loads(r'''${body}''')`,
          "for chunk in client.chat.completions.create(**request):",
          "    if chunk.choices and chunk.choices[0].delta.content:",
          "        print(chunk.choices[0].delta.content, end=\"\", flush=True)",
          "    if chunk.usage:",
          "        print(\"\\n\", chunk.usage)", ""].join("\n");
}

async function copyCode(lang) {
  const request = currentRequest();
  if (!request) { setStatus("nothing to copy yet: type a question or add media"); return; }
  const code = requestAsCode(lang, request);
  $("copy-title").textContent = lang === "curl" ? "The request as curl" : "The request in Python (openai client)";
  $("copy-text").value = code;
  $("copy-dialog").showModal();
  await writeClipboard(code);
}

async function writeClipboard(code) {
  try { await navigator.clipboard.writeText(code); setStatus("copied to the clipboard"); }
  catch (_) { $("copy-text").select(); setStatus("select the text and copy it (the clipboard is not available)"); }
}

// ---------------------------------------------------------------------------------------------- wiring
$("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
});
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape" && state.controller) state.controller.abort();
});
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("add-media").addEventListener("click", () => $("file").click());
$("file").addEventListener("change", async (e) => { await addFiles([...e.target.files]); e.target.value = ""; });
$("prompt").addEventListener("paste", (e) => {
  const files = [...(e.clipboardData ? e.clipboardData.files : [])];
  if (files.length) { e.preventDefault(); addFiles(files); }
});
document.addEventListener("dragover", (e) => { e.preventDefault(); document.body.classList.add("drop-target"); });
document.addEventListener("dragleave", (e) => {
  if (!e.relatedTarget) document.body.classList.remove("drop-target");
});
document.addEventListener("drop", (e) => {
  e.preventDefault();
  document.body.classList.remove("drop-target");
  if (e.dataTransfer && e.dataTransfer.files.length) addFiles([...e.dataTransfer.files]);
});
$("new-chat").addEventListener("click", () => {
  if (state.controller) state.controller.abort();
  state.history = [];
  state.lastRequest = null;
  document.querySelectorAll("#conversation .turn").forEach((t) => t.remove());
  $("empty-hint").hidden = false;
  hideError();
  $("prompt").focus();
});
$("copy-curl").addEventListener("click", () => copyCode("curl"));
$("copy-python").addEventListener("click", () => copyCode("python"));
$("copy-again").addEventListener("click", () => writeClipboard($("copy-text").value));

init();
