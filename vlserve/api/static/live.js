// vlserve playground, live mode: frames from a <video> (the webcam or the looping demo clip) go to a video session
// over its WebSocket as JPEG bytes at the session's fps, and the question is asked again every few seconds.
// Loaded after playground.js, whose globals ($, state, authHeaders, errorMessage, ApiError, showError, hideError)
// it uses.
"use strict";

const LIVE_CLIP = "/playground/static/examples/live_demo";
const MAX_FRAME_SIDE = 640;           // frames are scaled down to this longest side before encoding
const JPEG_QUALITY = 0.85;
const MAX_BUFFERED_BYTES = 1 << 20;   // a frame is skipped while the socket still holds this much unsent
const MAX_ANSWERS = 50;               // older answers leave the list
const live = {
  session: null,      // the session object from POST /v1/video/sessions
  socket: null,
  stream: null,       // the webcam's MediaStream
  timers: [],
  canvas: document.createElement("canvas"),
  framesSent: 0,
  framesSeen: 0,      // frames the server has appended (frames.appended)
  questionsSent: 0,
  pending: null,      // {id, entry, text} of the question being answered
  startedAt: 0,
  run: null,          // a token per start; null when stopped
  clip: null,         // live_demo.json: the demo clip's questions and their answers
};

function liveStatus(text) { $("live-status").textContent = text; }

function numberInput(id, fallback) {
  const value = parseFloat($(id).value);
  return Number.isFinite(value) && value > 0 ? value : fallback;
}

// ------------------------------------------------------------------------------------------------ mode
function setMode(mode) {
  const isLive = mode === "live";
  if (!isLive) stopLive();
  $("mode-chat").setAttribute("aria-pressed", String(!isLive));
  $("mode-live").setAttribute("aria-pressed", String(isLive));
  $("conversation").hidden = isLive;
  $("composer").hidden = isLive;
  $("live").hidden = !isLive;
  document.body.dataset.mode = mode;
  hideError();
  if (isLive) { renderLiveChips(); $("live-question").focus(); }
}

document.addEventListener("playground:ready", async () => {
  $("modes").hidden = !state.info.modalities.includes("video");
  if (state.info.demo && !live.clip) {
    try { live.clip = await (await fetch(LIVE_CLIP + ".json")).json(); } catch (_) {}
    renderLiveChips();
  }
});

function renderLiveChips() {
  const useClip = live.clip && $("live-source").value === "demo";
  $("live-chips").replaceChildren(...(useClip ? live.clip.questions : []).map((qa) => {
    const chip = document.createElement("button");
    chip.type = "button";
    chip.textContent = qa.question;
    chip.title = "ask this question";
    chip.addEventListener("click", () => { $("live-question").value = qa.question; $("live-question").focus(); });
    return chip;
  }));
}

// ------------------------------------------------------------------------------------------------ source
async function startSource() {
  const video = $("live-video");
  if ($("live-source").value === "webcam") {
    if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) {
      throw new Error("this browser gives no camera here (a camera needs https or localhost)");
    }
    live.stream = await navigator.mediaDevices.getUserMedia({ video: true, audio: false });
    video.loop = false;
    video.srcObject = live.stream;
  } else {
    video.srcObject = null;
    video.loop = true;
    video.src = LIVE_CLIP + ".webm";
  }
  video.muted = true;
  await video.play();
}

function stopSource() {
  const video = $("live-video");
  video.pause();
  if (live.stream) live.stream.getTracks().forEach((track) => track.stop());
  live.stream = null;
  video.srcObject = null;
  video.removeAttribute("src");
  video.load();
}

// ------------------------------------------------------------------------------------------------ session
async function openSession() {
  const body = { model: $("model").value, fps: numberInput("live-fps", 2) };
  const windowSeconds = parseFloat($("live-window").value);
  if (Number.isFinite(windowSeconds) && windowSeconds > 0) body.max_seconds = windowSeconds;
  const resp = await fetch("/v1/video/sessions", { method: "POST", headers: authHeaders(true),
                                                   body: JSON.stringify(body) });
  if (!resp.ok) throw new ApiError(resp.status, await errorMessage(resp));
  return resp.json();
}

function deleteSession(session) {
  // keepalive: the request still goes out when the page is being left
  fetch("/v1/video/sessions/" + encodeURIComponent(session.id),
        { method: "DELETE", headers: authHeaders(false), keepalive: true }).catch(() => {});
}

function socketURL(session) {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const query = state.key ? "?api_key=" + encodeURIComponent(state.key) : "";
  return `${scheme}//${location.host}/v1/video/sessions/${encodeURIComponent(session.id)}${query}`;
}

function connect(session) {
  return new Promise((resolve, reject) => {
    const socket = new WebSocket(socketURL(session));
    socket.binaryType = "arraybuffer";
    let ready = false;
    socket.addEventListener("message", (e) => {
      if (typeof e.data !== "string") return;
      const msg = JSON.parse(e.data);
      if (!ready && msg.type === "session.ready") { ready = true; resolve(socket); return; }
      if (!ready && msg.type === "error") { reject(new ApiError(msg.error.code, msg.error.message)); return; }
      onMessage(msg);
    });
    socket.addEventListener("close", (e) => {
      if (!ready) { reject(new Error(`the session's socket closed (${e.code}${e.reason ? ": " + e.reason : ""})`)); return; }
      if (live.socket === socket) {  // not closed by stopLive
        stopLive();
        showError(0, `the session ended (${e.code}${e.reason ? ": " + e.reason : ""})`);
      }
    });
  });
}

async function startLive() {
  if (live.run) return;
  if (!$("live-question").value.trim()) { showError(0, "type the question to ask about the video"); return; }
  hideError();
  const run = live.run = {};  // stopLive while this awaits ends the run: each step checks it is still current
  setLiveBusy(true);
  liveStatus("starting\u2026");
  try {
    await startSource();
    const session = await openSession();
    if (live.run !== run) { deleteSession(session); return; }
    live.session = session;
    const socket = await connect(session);
    if (live.run !== run) { socket.close(1000, "the page left live mode"); return; }
    live.socket = socket;
  } catch (e) {
    if (live.run !== run) return;
    stopLive();
    showError(e.status, e.message);
    if (e.status === 401) askKey();
    return;
  }
  live.framesSent = live.framesSeen = 0;
  live.startedAt = performance.now();
  live.timers.push(setInterval(sendFrame, 1000 / numberInput("live-fps", 2)));
  live.timers.push(setInterval(askQuestion, 1000 * numberInput("live-interval", 4)));
  sendFrame();
  liveStatus(`session ${live.session.id}: sending frames`);
}

function stopLive() {
  const wasLive = live.run !== null;
  live.run = null;
  live.timers.forEach(clearInterval);
  live.timers = [];
  if (live.socket) live.socket.close(1000, "the page left live mode");
  if (live.session) deleteSession(live.session);
  if (live.pending) finishEntry(live.pending.entry, "stopped");
  live.socket = live.session = live.pending = null;
  stopSource();
  setLiveBusy(false);
  if (wasLive) liveStatus(`stopped after ${live.framesSent} frames`);
}

function setLiveBusy(busy) {
  $("live-start").hidden = busy;
  $("live-stop").hidden = !busy;
  $("live-source").disabled = busy;
  $("live-fps").disabled = busy;
  $("live-window").disabled = busy;
}

// ------------------------------------------------------------------------------------------------ frames
function sendFrame() {
  const video = $("live-video"), socket = live.socket;
  if (!socket || socket.readyState !== WebSocket.OPEN || video.readyState < 2 || !video.videoWidth) return;
  if (socket.bufferedAmount > MAX_BUFFERED_BYTES) return;  // the network is behind: drop this frame
  const canvas = live.canvas;
  if (!live.framesSent) {  // the size is fixed by the first frame: a session's frames all have one size
    const scale = Math.min(1, MAX_FRAME_SIDE / Math.max(video.videoWidth, video.videoHeight));
    canvas.width = Math.max(2, Math.round(video.videoWidth * scale / 2) * 2);
    canvas.height = Math.max(2, Math.round(video.videoHeight * scale / 2) * 2);
  }
  canvas.getContext("2d").drawImage(video, 0, 0, canvas.width, canvas.height);
  live.framesSent += 1;
  canvas.toBlob(async (blob) => {
    if (!blob) return;
    const bytes = await blob.arrayBuffer();  // (sent as bytes, not a Blob: DevTools then shows each frame)
    if (live.socket === socket && socket.readyState === WebSocket.OPEN) socket.send(bytes);
  }, "image/jpeg", JPEG_QUALITY);
}

// ------------------------------------------------------------------------------------------------ questions
function askQuestion() {
  const socket = live.socket, question = $("live-question").value.trim();
  if (!socket || socket.readyState !== WebSocket.OPEN || !question || !live.framesSeen) return;
  if (live.pending) { liveStatus("the last answer is still coming: this turn is skipped"); return; }
  live.questionsSent += 1;
  const id = "q" + live.questionsSent;
  const message = { type: "question", question_id: id, question };
  const maxTokens = parseInt($("max-tokens").value, 10);
  const temperature = parseFloat($("temperature").value);
  if (!Number.isNaN(maxTokens)) message.max_tokens = maxTokens;
  if (!Number.isNaN(temperature)) message.temperature = temperature;
  live.pending = { id, text: question, entry: answerEntry(id, question) };
  socket.send(JSON.stringify(message));
}

function answerEntry(id, question) {
  const entry = document.createElement("li");
  entry.className = "live-answer";
  entry.dataset.questionId = id;
  entry.dataset.state = "streaming";
  const seconds = ((performance.now() - live.startedAt) / 1000).toFixed(1);
  const head = document.createElement("div");
  head.className = "when";
  head.textContent = `${new Date().toLocaleTimeString()} \u00b7 +${seconds} s \u00b7 ${question}`;
  const text = document.createElement("div");
  text.className = "text";
  entry.append(head, text);
  $("live-answers").prepend(entry);  // newest first
  while ($("live-answers").children.length > MAX_ANSWERS) $("live-answers").lastElementChild.remove();
  return entry;
}

function finishEntry(entry, figures, expected = null, text = null) {
  entry.dataset.state = figures === "stopped" ? "stopped" : "done";
  if (text !== null) entry.querySelector(".text").textContent = text;
  const line = document.createElement("div");
  line.className = "figures";
  line.textContent = figures;
  entry.append(line);
  if (expected !== null) {
    const check = document.createElement("div");
    check.className = "expected";
    check.textContent = (expected === text ? "\u2713 matches" : "\u2717 differs from") + ` the clip's answer: ${expected}`;
    entry.append(check);
  }
}

function answerFigures(msg) {
  const parts = [];
  if (msg.ttft_ms !== undefined && msg.ttft_ms !== null) parts.push(`TTFT ${Math.round(msg.ttft_ms)} ms`);
  if (msg.frames !== undefined) parts.push(`${msg.frames} frames`);
  const usage = msg.usage || {};
  if (usage.completion_tokens !== undefined) parts.push(`${usage.completion_tokens} tokens`);
  if (usage.prompt_tokens !== undefined) {
    const cached = (usage.prompt_tokens_details || {}).cached_tokens;
    parts.push(`prompt ${usage.prompt_tokens} tokens` + (cached !== undefined ? `, ${cached} cached` : ""));
  }
  return parts.join(" \u00b7 ");
}

function clipAnswer(question) {
  if (!live.clip || $("live-source").value !== "demo") return null;
  const qa = live.clip.questions.find((q) => q.question === question);
  return qa ? qa.answer : null;
}

function onMessage(msg) {
  const pending = live.pending;
  const mine = pending && msg.question_id === pending.id;
  if (msg.type === "frames.appended") {
    live.framesSeen = msg.frames;
    liveStatus(`session ${live.session.id}: ${live.framesSent} frames sent, ` +
               `${msg.frames} appended, ${msg.window_frames} in the window`);
  } else if (msg.type === "answer.delta" && mine) {
    pending.entry.querySelector(".text").textContent += msg.delta;
  } else if (msg.type === "answer.done" && mine) {
    live.pending = null;
    hideError();  // an earlier question's error is history now
    finishEntry(pending.entry, answerFigures(msg), clipAnswer(pending.text), msg.text);
  } else if (msg.type === "session.closed") {  // idle expiry, or a DELETE from elsewhere
    stopLive();
    showError(0, `the video session closed (${msg.reason || "closed"})`);
  } else if (msg.type === "error") {
    const error = msg.error || {};
    showError(typeof error.code === "number" ? error.code : 0, error.message || JSON.stringify(msg));
    if (mine) {  // the question's own error: no answer will come
      live.pending = null;
      pending.entry.dataset.state = "error";
      pending.entry.querySelector(".text").textContent = error.message || "";
    }
  }
}

// ------------------------------------------------------------------------------------------------ wiring
$("mode-chat").addEventListener("click", () => setMode("chat"));
$("mode-live").addEventListener("click", () => setMode("live"));
$("live-form").addEventListener("submit", (e) => { e.preventDefault(); startLive(); });
$("live-stop").addEventListener("click", stopLive);
$("live-source").addEventListener("change", renderLiveChips);
window.addEventListener("pagehide", () => { if (live.session) deleteSession(live.session); });
