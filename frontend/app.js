// The dashboard: wires the session, its source, the live view, the memory view and the
// questions together. It talks only to the gateway (api.js); each panel is its own module.

import { createSession, listSamples, liveModels, Session } from "./api.js";
import { Conversation } from "./ask.js";
import { DEMO, demoVideos } from "./demo.js";
import { bytes, clock, count, frameRate, percent, videoTime } from "./format.js";
import { MemoryView } from "./memory.js";
import { CachePlot } from "./plot.js";
import { Stage } from "./preview.js";
import { SessionList } from "./sessions.js";
import { FrameStreamer, openCapture } from "./source.js";
import { Watches } from "./watches.js";

const $ = (selector) => document.querySelector(selector);
const fields = (name) => document.querySelectorAll(`[data-field="${name}"]`);
const STORAGE_KEY = "streamvqa.session";
const POLL_MS = 1000; // the worker rewrites the memory report at most once a second
const HIDDEN_POLL_MS = 5000;
const RECONNECTED_NOTE_MS = 3000;

const POLICIES = {
  infmllm: "Keeps the tokens recent prompts attend to most, with a bias toward recent ones (Inf-MLLM).",
  snapkv: "Keeps what the end of each prompt attends to, pooled (SnapKV).",
  tova: "Keeps what the newest token attends to, the same tokens in every head of a layer (TOVA).",
  knorm: "Keeps the tokens whose keys have the lowest norm, without looking at attention (KNorm).",
  h2o: "Keeps the tokens with the most accumulated attention (H2O): a slow baseline.",
  sliding: "Keeps the first and the latest tokens only (StreamingLLM).",
  full: "Keeps everything: nothing is evicted and memory grows with the video.",
};
// What a user should know about the models built into streamvqa (README, "The default model").
const BUILT_IN_MODELS = {
  "tiny-random-llava": "A tiny test model with random weights: it runs everything, but its answers are random characters.",
  "smollm2-135m-instruct": "A real language model without vision: it answers, but cannot see the frames.",
};
const LIVE_MEDIA = new Set(["frames", "webm", "mp4"]);
// The warnings a session keeps (its record's `warnings`) that the status card shows, by code,
// with their headings; others are a passing note under Source.
const KEPT_WARNINGS = { truncated_media: "Incomplete file" };
const HOST_BUDGET_MULTIPLE = 8; // with recall, the host tier's default size: 8 x the budget (streamvqa/protocol/keys.py)

const ui = {
  connection: $("#connection"),
  error: $("#error"),
  errorText: $("#error-text"),
  createForm: $("#create-form"),
  demo: $("#demo"),
  demoHint: $("#demo-hint"),
  demoControls: $("#demo-controls"),
  model: $("#model"),
  modelHint: $("#model-hint"),
  policy: $("#policy"),
  policyHint: $("#policy-hint"),
  budget: $("#budget"),
  budgetHint: $("#budget-hint"),
  fps: $("#fps"),
  recall: $("#recall"),
  recallHint: $("#recall-hint"),
  hostBudget: $("#host-budget"),
  hostBudgetField: $("#host-budget-field"),
  summary: $("#session-summary"),
  sessionLine: $("#session-line"),
  source: $("#source"),
  tabs: [...document.querySelectorAll("#source [role=tab]")],
  file: $("#file"),
  fileName: $("#file-name"),
  uploadForm: $("#upload-form"),
  uploadButton: $("#upload-form button"),
  uploadLabel: $("#upload-label"),
  uploadPercent: $("#upload-percent"),
  uploadProgress: $("#upload-progress"),
  ingestLabel: $("#ingest-label"),
  ingestPercent: $("#ingest-percent"),
  ingestProgress: $("#ingest-progress"),
  ingestEta: $("#ingest-eta"),
  sourceStatus: $("#source-status"),
  sessionError: $("#session-error"),
  sessionWarnings: $("#session-warnings"),
  cacheMeter: $("#cache-meter"),
  timeline: $("#timeline"),
};

const state = {
  session: null, // Session
  record: null, // the latest GET /sessions/{id}, with ingest events applied
  events: null, // the session's EventStream
  pollTimer: null,
  capture: null, // {kind, streamer, release} while a camera, the screen or the demo streams
  uploading: false,
  links: { events: "connecting", poll: "ok" }, // the page's two lines to the server
  reconnectedTimer: null,
};

const stage = new Stage({ video: $("#preview"), empty: $("#stage-empty"), badge: $("#stage-badge") });
const memory = new MemoryView({
  timeline: ui.timeline,
  axis: $("#timeline-axis"),
  summary: $("#memory-summary"),
  budgetBar: $("#budget-bar"),
  fields: Object.fromEntries(
    [...document.querySelectorAll("[data-memory]")].map((element) => [element.dataset.memory, element]),
  ),
  recallParts: document.querySelectorAll("#memory [data-recall]"),
  onSeek: (time_s) => stage.seek(time_s),
});
const plot = new CachePlot({
  svg: $("#cache-plot"),
  fields: Object.fromEntries([...document.querySelectorAll("[data-plot]")].map((element) => [element.dataset.plot, element])),
});
const conversation = new Conversation({
  form: $("#ask-form"),
  input: $("#question"),
  history: $("#history"),
  empty: $("#history-empty"),
  order: $("#history-order"),
  onFocus: ({ evidence, recalled, seek_s }) => {
    memory.highlight(evidence, recalled);
    if (seek_s !== null) stage.seek(seek_s);
  },
});
stage.onTime = (time_s) => memory.setPlayhead(time_s);
const watches = new Watches({
  form: $("#watch-form"),
  hint: $("#watch-hint"),
  list: $("#watch-list"),
  marks: $("#watch-marks"),
  toast: { element: $("#watch-toast"), text: $("#watch-toast-text"), show: $("#watch-toast-show"), dismiss: $("#watch-toast-dismiss") },
  onSeek: (time_s) => stage.seek(time_s),
  onError: showError,
});
const owned = new SessionList({
  list: $("#session-list"),
  empty: $("#sessions-empty"),
  note: $("#sessions-note"),
  onEnding: (id) => {
    if (state.session?.id !== id) return;
    stopCapture(false);
    detach();
  },
  onError: showError,
});

// -- messages and the connection ----------------------------------------------------------------

function showError(message) {
  ui.errorText.textContent = message;
  ui.error.hidden = false;
}

function clearError() {
  ui.error.hidden = true;
  ui.errorText.textContent = "";
}

$("#error-dismiss").addEventListener("click", clearError);

function setLink(name, status) {
  const before = connectionState();
  state.links[name] = status;
  const after = connectionState();
  if (before === "reconnecting" && after === "live") {
    clearTimeout(state.reconnectedTimer);
    showConnection("live", "Reconnected");
    state.reconnectedTimer = setTimeout(() => state.session && showConnection(connectionState()), RECONNECTED_NOTE_MS);
  } else {
    showConnection(after);
  }
}

function connectionState() {
  if (!state.session) return "idle";
  const { events, poll } = state.links;
  if (events === "failed") return "failed";
  if (events === "reconnecting" || poll === "failed") return "reconnecting";
  return events === "open" ? "live" : "connecting";
}

function showConnection(status, text) {
  const texts = {
    idle: "No session",
    connecting: "Connecting…",
    live: "Connected",
    reconnecting: "Connection lost — reconnecting…",
    failed: "Disconnected",
  };
  ui.connection.dataset.state = status;
  ui.connection.textContent = text || texts[status];
}

// -- creating a session -------------------------------------------------------------------------

/** Why a session could not be created, for `what` ("create a session", "start the demo"); at the
 *  caller's limit, where to end one. */
function refusal(what, err) {
  if (err.code !== "too_many_sessions") return `Could not ${what}: ${err.message}`;
  owned.refresh();
  return `Could not ${what}: you hold as many sessions as the server allows. End one under “Your sessions”, then try again.`;
}

function describePolicy() {
  const full = ui.policy.value === "full";
  ui.policyHint.textContent = POLICIES[ui.policy.value];
  ui.budget.disabled = full;
  ui.budgetHint.textContent = full
    ? "The full cache has no budget: it keeps every token."
    : "The cache keeps at most this many tokens per layer (256 – 1,000,000); empty: 8,192, or what the model's context leaves room for.";
  describeRecall();
}

function describeRecall() {
  const full = ui.policy.value === "full";
  if (full !== ui.recall.disabled) ui.recall.checked = !full; // on by default for a policy that evicts
  ui.recall.disabled = full;
  ui.recallHint.textContent = full
    ? "The full cache evicts nothing, so there is nothing to recall."
    : "Keeps what the cache evicts in host memory; questions bring back what they need.";
  ui.hostBudgetField.hidden = full || !ui.recall.checked;
  ui.hostBudget.disabled = ui.hostBudgetField.hidden;
  const budget = Number(ui.budget.value);
  const multiple = `${HOST_BUDGET_MULTIPLE} × budget`;
  ui.hostBudget.placeholder = budget > 0 ? `${count(HOST_BUDGET_MULTIPLE * budget)} (${multiple})` : multiple;
}

function describeModel(workers) {
  const model = ui.model.value;
  const live = workers.find((w) => w.model === model);
  const served = live ? `${live.workers} live worker${live.workers === 1 ? "" : "s"}.` : "";
  ui.modelHint.textContent = model
    ? [BUILT_IN_MODELS[model], served].filter(Boolean).join(" ")
    : "The gateway's default model.";
}

async function loadModels() {
  let workers = [];
  let fallback = "";
  try {
    ({ models: workers, default: fallback } = await liveModels());
  } catch (err) {
    ui.modelHint.textContent = `Could not list the models: ${err.message}`;
    return;
  }
  const options = workers.map(({ model }) => new Option(model, model, false, model === fallback));
  if (workers.length === 0) options.push(new Option(`${fallback} (the gateway's default)`, ""));
  ui.model.replaceChildren(...options);
  ui.model.onchange = () => describeModel(workers);
  if (workers.length === 0) {
    ui.modelHint.textContent = "No worker is running now: a session cannot start until one is.";
  } else {
    describeModel(workers);
  }
}

function sessionOptions() {
  const options = { fps: Number(ui.fps.value), policy: ui.policy.value };
  if (options.policy !== "full" && ui.budget.value) options.budget_tokens = Number(ui.budget.value);
  if (options.policy !== "full") {
    options.recall = ui.recall.checked;
    if (ui.recall.checked && ui.hostBudget.value) options.host_budget_tokens = Number(ui.hostBudget.value);
  }
  if (ui.model.value) options.model = ui.model.value;
  return options;
}

ui.policy.addEventListener("change", describePolicy);
ui.recall.addEventListener("change", describeRecall);
ui.budget.addEventListener("input", describeRecall);

ui.createForm.addEventListener("submit", async (event) => {
  event.preventDefault();
  if (!ui.createForm.reportValidity()) return;
  const button = ui.createForm.querySelector("button[type=submit]");
  button.disabled = true;
  button.textContent = "Creating…";
  clearError();
  try {
    const { session, record } = await createSession(sessionOptions());
    attach(session, record);
  } catch (err) {
    showError(refusal("create a session", err));
  } finally {
    button.disabled = false;
    button.textContent = "Create session";
  }
});

ui.demo.addEventListener("click", async () => {
  ui.demo.disabled = true;
  ui.demo.textContent = "Starting the demo…";
  clearError();
  try {
    const videos = await demoVideos();
    const options = { ...DEMO.options };
    if (ui.model.value) options.model = ui.model.value;
    const { session, record } = await createSession(options);
    attach(session, record);
    startDemo(videos);
  } catch (err) {
    showError(refusal("start the demo", err));
  } finally {
    ui.demo.disabled = false;
    ui.demo.textContent = "Try the demo";
  }
});

/** The demo needs the gateway's sample videos; without them its button says why it is off. */
async function offerDemo() {
  try {
    if ((await listSamples()).length) return;
    ui.demoHint.textContent = "No demo: the server has no sample videos.";
  } catch (err) {
    ui.demoHint.textContent = `No demo: the sample videos could not be listed (${err.message}).`;
  }
  ui.demo.disabled = true;
}

$("#end-session").addEventListener("click", () => {
  const session = state.session;
  if (!session) return;
  stopCapture(false);
  detach();
  owned.drop(session.id);
  session.remove().catch((err) => {
    if (err.status !== 404) showError(`The server could not end the session (${err.message}); it expires once idle.`);
  }).finally(() => owned.refresh());
});

// -- the session's life on this page ------------------------------------------------------------

function attach(session, record, restored = false) {
  state.session = session;
  state.links = { events: "connecting", poll: "ok" };
  sessionStorage.setItem(STORAGE_KEY, JSON.stringify({ id: session.id, token: session.token }));
  owned.remember(session);
  owned.setCurrent(session.id);
  if (!restored) owned.refresh();
  ui.createForm.hidden = true;
  ui.summary.hidden = false;
  ui.sessionLine.textContent = `Session ${session.id.slice(0, 8)}`;
  ui.sessionLine.title = session.id;
  conversation.use(session);
  watches.use(session, record.fps);
  if (restored) {
    conversation.restore(session).catch((err) => {
      if (session === state.session) showError(`The conversation could not be loaded: ${err.message}.`);
    });
  }
  memory.clear();
  plot.use(session.id);
  resetMeters();
  ui.sourceStatus.textContent = "";
  if (restored && record.media) {
    stage.clear(record.media === "upload"
      ? "The page was reloaded, so its copy of the file is gone; the session still holds what the model saw."
      : "The page was reloaded; start the camera or the screen again to go on streaming.");
  } else {
    stage.clear("No video yet: choose a file, your camera or your screen under Source.");
  }
  renderRecord(record);
  showConnection("connecting");
  state.events = session.sessionEvents(onSessionEvent, (status, problem) => {
    if (session !== state.session) return;
    setLink("events", status);
    if (status === "failed") lost(problem);
  });
  poll(session);
}

function detach(message) {
  state.events?.stop();
  clearTimeout(state.pollTimer);
  state.session = null;
  state.record = null;
  sessionStorage.removeItem(STORAGE_KEY);
  owned.setCurrent(null);
  conversation.use(null);
  watches.use(null);
  memory.clear();
  plot.forget();
  stage.clear();
  resetMeters();
  renderRecord(null);
  ui.createForm.hidden = false;
  ui.summary.hidden = true;
  ui.sourceStatus.textContent = "";
  showConnection("idle");
  if (message) showError(message);
}

/** The session cannot be reached any more (deleted, expired, or its token refused). */
function lost(problem) {
  stopCapture(false);
  detach(`This session has ended: ${problem.message}. Create a new one to go on.`);
  owned.refresh();
}

async function poll(session) {
  if (session !== state.session) return;
  try {
    const record = await session.status();
    if (session !== state.session) return;
    renderRecord(keepNewerIngest(record, state.record));
    if (record.media) {
      const report = await session.memory();
      memory.render(report);
      watches.setScale(memory.total_s);
      plot.setReport(report);
    }
    setLink("poll", "ok");
  } catch (err) {
    if (session !== state.session) return;
    if ([401, 403, 404].includes(err.status)) return lost(err);
    setLink("poll", "failed");
  }
  state.pollTimer = setTimeout(() => poll(session), document.hidden ? HIDDEN_POLL_MS : POLL_MS);
}

/** A status fetched while an ingest event came in may be older than what the page shows. */
function keepNewerIngest(record, shown) {
  if (!shown || record.frames_ingested >= shown.frames_ingested) return record;
  const {
    state: current, frames_ingested, video_time_s, ingest_lag_s, frames_dropped, cache_tokens, tokens_seen, ingest_progress,
    ingest_eta_s,
  } = shown;
  return {
    ...record, state: current, frames_ingested, video_time_s, ingest_lag_s, frames_dropped, cache_tokens, tokens_seen,
    ingest_progress, ingest_eta_s,
  };
}

function onSessionEvent(name, data) {
  if (!state.record) return;
  if (name === "ingest") {
    Object.assign(state.record, {
      frames_ingested: data.frames, video_time_s: data.video_time_s, ingest_lag_s: data.lag_s,
      frames_dropped: data.dropped, cache_tokens: data.cache_tokens, tokens_seen: data.tokens_seen,
    });
    if (data.progress !== null && data.progress !== undefined) state.record.ingest_progress = data.progress;
    if (data.eta_s !== null && data.eta_s !== undefined) state.record.ingest_eta_s = data.eta_s;
    if (state.record.state !== "ingested") state.record.state = "ingesting";
    renderRecord(state.record);
  } else if (name === "state") {
    state.record.state = data.state;
    renderRecord(state.record);
  } else if (name === "warning" && KEPT_WARNINGS[data.code]) {
    const warnings = state.record.warnings || [];
    if (!warnings.some((w) => w.code === data.code && w.message === data.message)) {
      state.record.warnings = [...warnings, { code: data.code, message: data.message }];
    }
    renderRecord(state.record);
  } else if (name === "warning") {
    ui.sourceStatus.textContent = `Note: ${data.message}`;
  } else if (name === "error" && data.code !== "session_error") {
    showError(`The video could not be read: ${data.message}`);
  } else if (name === "watch_fired") {
    watches.fired(data);
  } else if (name === "gone") {
    lost({ message: data.message });
  }
}

// -- the live view ------------------------------------------------------------------------------

function setFields(name, text) {
  for (const element of fields(name)) element.textContent = text;
}

function renderRecord(record) {
  state.record = record;
  const r = record || {};
  const live = LIVE_MEDIA.has(r.media);
  const none = !record;
  setFields("state", none ? "–" : r.state);
  for (const element of fields("state")) element.dataset.state = r.state || "";
  setFields("frames_ingested", none ? "–" : count(r.frames_ingested));
  setFields("frames_dropped", live && r.frames_dropped ? `${count(r.frames_dropped)} dropped` : "");
  setFields("video_time_s", none || !r.frames_ingested ? "–" : videoTime(r.video_time_s));
  setFields("media_duration_s", r.media_duration_s ? `of ${videoTime(r.media_duration_s)}` : "");
  setFields("ingest_lag_s", live ? `${r.ingest_lag_s.toFixed(2)} s` : "–");
  for (const element of fields("ingest_lag_s")) {
    element.title = r.media === "upload" ? "A file has no real-time clock: it is ingested as fast as the model goes." : "";
  }
  renderCache(r);
  if (record) plot.setRecord(r);
  if (record) owned.follow(r);
  setFields("model", r.model || "–");
  setFields("policy", r.policy ? `${r.policy}` : "–");
  setFields("budget_tokens", none ? "–" : r.policy === "full" ? "none (full cache)" : `${count(r.budget_tokens)} tokens`);
  setFields("fps", none ? "–" : frameRate(r.fps));
  setFields("recall", none ? "–" : r.recall ? `on · ${count(r.host_budget_tokens)}-token host tier` : "off");
  const full = r.context_full
    ? `The cache reached the model's ${count(r.context_tokens)}-token context: later frames are not taken. Ask about what it holds.`
    : "";
  ui.sessionError.textContent = r.state === "error" ? `Session error: ${r.error}` : full;
  ui.sessionError.hidden = !ui.sessionError.textContent;
  renderWarnings(r.warnings || []);
  renderIngestProgress(r);
  if (r.media === "upload") {
    stage.setIngest(r.frames_ingested ? r.video_time_s : null, r.state === "ingested", r.media_duration_s, r.state === "error");
  }
  ui.timeline.dataset.seekable = String(stage.seekable);
  if (record) conversation.refuse(askRefusal(r));
  if (record) watches.refuse(watchRefusal(r));
  updateSources();
}

/** Why the session cannot be asked about now, or null: the model answers only about video it saw. */
function askRefusal(r) {
  if (r.state === "error") return "The session failed: it takes no questions. Start a new session.";
  if (!r.frames_ingested) return "No video yet: upload a file or start the camera, then ask.";
  return null;
}

/** Why no watch can be added now, or null: a watch is checked only on video that comes after it. */
function watchRefusal(r) {
  if (r.state === "error") return "The session failed: it has no video to watch.";
  if (r.media === "upload" && r.state === "ingested") {
    return "The file is all in: a watch added now would have no video left to check. Add watches before uploading.";
  }
  return null;
}

/** The session's lasting warnings, each under its heading (context_full has its own line above). */
function renderWarnings(warnings) {
  const shown = warnings.filter((w) => KEPT_WARNINGS[w.code]);
  ui.sessionWarnings.replaceChildren(...shown.map((w) => {
    const line = document.createElement("p");
    line.dataset.code = w.code;
    line.textContent = `${KEPT_WARNINGS[w.code]}: ${w.message}.`;
    return line;
  }));
  ui.sessionWarnings.hidden = shown.length === 0;
}

function renderCache(r) {
  const tokens = r.cache_tokens ?? 0;
  const bounded = r.policy && r.policy !== "full";
  setFields("cache_tokens", !r.policy ? "–" : bounded ? `${count(tokens)} / ${count(r.budget_tokens)}` : `${count(tokens)} tokens`);
  ui.cacheMeter.hidden = !bounded;
  ui.cacheMeter.value = bounded ? Math.min(1, tokens / r.budget_tokens) : 0;
  ui.cacheMeter.title = bounded ? `${percent(tokens / r.budget_tokens)} of the budget` : "";
}

/** An upload's ingest: the share of its video in the cache, and the time left at the rate the
 *  worker measured (the record's `ingest_progress` and `ingest_eta_s`). */
function renderIngestProgress(r) {
  if (r.media !== "upload") return;
  const done = r.state === "ingested";
  const fraction = done ? 1 : r.ingest_progress ?? 0;
  ui.ingestProgress.value = 100 * fraction;
  ui.ingestPercent.textContent = r.frames_ingested || done ? percent(fraction) : "–";
  ui.ingestLabel.textContent = done
    ? `Ingested · ${count(r.frames_ingested)} frames`
    : r.frames_ingested ? `Ingesting · ${videoTime(r.video_time_s)}` : "Ingest";
  ui.ingestEta.textContent = ingestEta(r);
}

function ingestEta(r) {
  if (r.state !== "ingesting" || !r.upload_ended) return "";
  if (!r.frames_ingested) return "Starting…";
  if (r.ingest_eta_s === null || r.ingest_eta_s === undefined) return "Estimating the time left…";
  return `About ${clock(Math.max(1, r.ingest_eta_s))} left`;
}

function resetMeters() {
  ui.uploadProgress.value = 0;
  ui.uploadPercent.textContent = "0%";
  ui.uploadLabel.textContent = "Upload";
  ui.ingestProgress.value = 0;
  ui.ingestPercent.textContent = "–";
  ui.ingestLabel.textContent = "Ingest";
  ui.ingestEta.textContent = "";
}

// -- sources ------------------------------------------------------------------------------------

/** Enable what the session's media allows: one file, or live frames (camera and screen both). */
function updateSources() {
  const r = state.record;
  const media = r?.media ?? null;
  const capturing = state.capture !== null;
  const busy = !r || r.state === "error" || state.uploading;
  ui.source.dataset.enabled = String(Boolean(r));
  ui.file.disabled = busy || capturing || media !== null;
  ui.uploadButton.disabled = ui.file.disabled || !ui.file.files.length;
  for (const button of document.querySelectorAll("#source [data-action=start]")) {
    button.disabled = busy || capturing || (media !== null && media !== "frames");
  }
  for (const button of document.querySelectorAll("#source [data-action=stop]")) {
    button.disabled = !capturing || state.capture.kind !== button.dataset.kind;
  }
  ui.demoControls.hidden = state.capture?.kind !== "demo";
  if (r && media === "upload" && !state.uploading && !ui.sourceStatus.textContent) {
    ui.sourceStatus.textContent = "This session has its video. Create a new session for another one.";
  } else if (r && media === "frames" && !capturing && !ui.sourceStatus.textContent) {
    ui.sourceStatus.textContent = "This session takes live frames; start the camera or the screen to go on.";
  }
}

function selectTab(tab) {
  for (const other of ui.tabs) {
    const selected = other === tab;
    other.setAttribute("aria-selected", String(selected));
    other.tabIndex = selected ? 0 : -1;
    $(`#${other.getAttribute("aria-controls")}`).hidden = !selected;
  }
}

for (const tab of ui.tabs) {
  tab.addEventListener("click", () => selectTab(tab));
  tab.addEventListener("keydown", (event) => {
    const step = { ArrowRight: 1, ArrowLeft: -1 }[event.key];
    if (!step) return;
    const next = ui.tabs[(ui.tabs.indexOf(tab) + step + ui.tabs.length) % ui.tabs.length];
    selectTab(next);
    next.focus();
  });
}

function describeFile() {
  const file = ui.file.files[0];
  ui.fileName.textContent = file ? `${file.name} · ${bytes(file.size)}` : "or drop it here · MP4, WebM, MOV…";
  ui.fileName.closest(".dropzone").dataset.chosen = String(Boolean(file));
  updateSources();
}

ui.file.addEventListener("change", describeFile);
const dropzone = $(".dropzone");
dropzone.addEventListener("dragover", (event) => {
  if (ui.file.disabled) return;
  event.preventDefault();
  dropzone.dataset.over = "true";
});
dropzone.addEventListener("dragleave", () => delete dropzone.dataset.over);
dropzone.addEventListener("drop", (event) => {
  event.preventDefault();
  delete dropzone.dataset.over;
  if (ui.file.disabled || !event.dataTransfer.files.length) return;
  ui.file.files = event.dataTransfer.files;
  describeFile();
});

function showUploadProgress(sent, total) {
  const fraction = total ? sent / total : 0;
  ui.uploadProgress.value = 100 * fraction;
  ui.uploadPercent.textContent = percent(fraction);
  ui.uploadLabel.textContent = `Uploading · ${bytes(sent)} of ${bytes(total)}`;
}

ui.uploadForm.addEventListener("submit", async (event) => {
  event.preventDefault();
  const session = state.session;
  const file = ui.file.files[0];
  if (!session) return;
  if (!file) return showError("Choose a video file first.");
  clearError();
  ui.sourceStatus.textContent = "";
  state.uploading = true;
  updateSources();
  stage.showFile(file, state.record.fps);
  state.record.media = "upload"; // as the server will say; the events may come before the next poll
  showUploadProgress(0, file.size);
  try {
    await session.upload(file, showUploadProgress);
    if (session !== state.session) return;
    ui.uploadProgress.value = 100;
    ui.uploadPercent.textContent = "100%";
    ui.uploadLabel.textContent = `Uploaded · ${bytes(file.size)}`;
  } catch (err) {
    if (session !== state.session) return;
    const size = err.code === "upload_too_large" ? ` (this file is ${bytes(file.size)})` : "";
    showError(`Upload failed: ${err.message}${size}`);
    state.record.media = null;
    stage.clear();
    resetMeters();
  } finally {
    state.uploading = false;
    updateSources();
  }
});

for (const button of document.querySelectorAll("#source [data-action=start]")) {
  button.addEventListener("click", () => startCapture(button.dataset.kind));
}
for (const button of document.querySelectorAll("#source [data-action=stop]")) {
  button.addEventListener("click", () => stopCapture());
}

async function startCapture(kind) {
  const session = state.session;
  if (!session || state.capture) return;
  clearError();
  ui.sourceStatus.textContent = kind === "camera" ? "Asking for the camera…" : "Choose what to share…";
  let stream;
  try {
    stream = await openCapture(kind);
  } catch (err) {
    ui.sourceStatus.textContent = "";
    return showError(`Could not start the ${kind}: ${err.message}.`);
  }
  if (session !== state.session) return stream.getTracks().forEach((track) => track.stop());
  stream.getVideoTracks()[0]?.addEventListener("ended", () => stopCapture()); // "Stop sharing" in the browser
  stage.showLive(stream, kind);
  streamStage(kind, () => stream.getTracks().forEach((track) => track.stop()));
}

/** The demo: the sample videos play on the stage, streamed as a camera would be, and the
 *  stream ends after the last one. */
function startDemo(videos) {
  if (!state.session || state.capture) return;
  stage.showSamples(videos, DEMO.rounds, () => stopCapture());
  streamStage("demo", () => {});
}

/** Stream what the stage shows to the session's socket as frames, at the session's fps;
 *  release() lets the source go when the stream stops. */
function streamStage(kind, release) {
  const streamer = new FrameStreamer({
    url: state.session.streamUrl(), fps: state.record.fps, video: $("#preview"),
    onStatus: (status, detail) => captureStatus(kind, status, detail),
    onEvent: (event) => (ui.sourceStatus.textContent = `Note: ${event.message}`),
  });
  state.capture = { kind, streamer, release };
  streamer.start();
  updateSources();
}

function captureStatus(kind, status, detail) {
  const capture = state.capture;
  if (!capture || capture.kind !== kind) return;
  const { streamer } = capture;
  const sent = `${count(streamer.sent)} frame${streamer.sent === 1 ? "" : "s"} sent`;
  const skipped = streamer.skipped ? ` · ${count(streamer.skipped)} skipped` : "";
  const texts = {
    connecting: "Connecting…",
    streaming: `Streaming at ${frameRate(streamer.fps)} · ${sent}${skipped}`,
    paused: `The model is behind: frames are skipped until it catches up · ${sent}${skipped}`,
    reconnecting: `Reconnecting (${detail})… · ${sent}`,
  };
  if (status === "failed") {
    stopCapture();
    showError(`The ${kind} stream stopped: ${detail}.`);
    return;
  }
  if (texts[status]) ui.sourceStatus.textContent = texts[status];
}

/** Stop the camera or the screen; `drain`: end the stream and wait for its last frames to
 *  reach the cache, else close at once (the session is over). */
async function stopCapture(drain = true) {
  const capture = state.capture;
  if (!capture) return;
  state.capture = null;
  capture.release();
  if (!drain) return capture.streamer.close();
  const off = capture.kind === "demo" ? "The demo is over" : `The ${capture.kind} is off`;
  stage.clear(`${off}. The session keeps what the model saw: ask away.`);
  updateSources();
  ui.sourceStatus.textContent = "Ending the stream…";
  await capture.streamer.stop();
  if (!state.capture) ui.sourceStatus.textContent = `Stream ended · ${count(capture.streamer.sent)} frames sent.`;
}

// -- start --------------------------------------------------------------------------------------

async function restore() {
  const saved = JSON.parse(sessionStorage.getItem(STORAGE_KEY) || "null");
  if (!saved) return;
  const session = new Session(saved.id, saved.token);
  try {
    attach(session, await session.status(), true);
  } catch (err) {
    sessionStorage.removeItem(STORAGE_KEY);
    if (err.status === 0) showError(`Could not reach the server: ${err.message}.`);
  }
}

describePolicy();
renderRecord(null);
selectTab(ui.tabs[0]);
loadModels();
offerDemo();
restore().finally(() => owned.refresh());
