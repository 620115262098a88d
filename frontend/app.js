// The first dashboard: create a session, upload a file, watch ingest, ask questions.
// It speaks only to the gateway's REST API.

const $ = (selector) => document.querySelector(selector);
const POLL_MS = 1000;
let session = JSON.parse(sessionStorage.getItem("streamvqa.session") || "null");
let pollTimer = null;

function show(element, message) {
  element.textContent = message;
  element.hidden = !message;
}

function errorMessage(status, bodyText) {
  try {
    return JSON.parse(bodyText).message || `${status}`;
  } catch {
    return `the server answered ${status}`;
  }
}

async function api(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  if (session) headers.Authorization = `Bearer ${session.token}`;
  const reply = await fetch(path, { ...options, headers });
  const text = await reply.text();
  if (!reply.ok) throw new Error(errorMessage(reply.status, text));
  return text ? JSON.parse(text) : {};
}

function setSession(created) {
  session = created;
  sessionStorage.setItem("streamvqa.session", JSON.stringify(session));
  $("#session-line").textContent = `Session ${session.id}`;
  $("#upload-form button").disabled = false;
  $("#ask-form button").disabled = false;
  show($("#error"), "");
  clearTimeout(pollTimer);
  refresh();
}

// One status request at a time: the next is scheduled when this one ends.
async function refresh() {
  const polled = session;
  try {
    const state = await api(`/sessions/${polled.id}`);
    for (const dd of document.querySelectorAll("#status dd")) {
      const value = state[dd.dataset.field];
      dd.textContent = dd.dataset.field === "video_time_s" ? `${value.toFixed(1)} s` : value;
    }
    show($("#session-error"), state.state === "error" ? `Session error: ${state.error}` : "");
  } catch (err) {
    show($("#session-error"), err.message);
  }
  if (polled === session) pollTimer = setTimeout(refresh, POLL_MS);
}

$("#create-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  try {
    setSession(await api("/sessions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ fps: Number($("#fps").value) }),
    }));
  } catch (err) {
    show($("#error"), err.message);
  }
});

$("#upload-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const file = $("#file").files[0];
  if (!file) return show($("#error"), "Choose a video file first.");
  const button = $("#upload-form button");
  button.disabled = true;
  show($("#error"), "");
  const request = new XMLHttpRequest();
  request.open("POST", `/sessions/${session.id}/upload`);
  request.setRequestHeader("Authorization", `Bearer ${session.token}`);
  request.setRequestHeader("Content-Type", file.type || "application/octet-stream");
  request.upload.onprogress = (e) => {
    if (e.lengthComputable) $("#upload-progress").value = (100 * e.loaded) / e.total;
  };
  request.onload = () => {
    if (request.status >= 400) {
      show($("#error"), `Upload failed: ${errorMessage(request.status, request.responseText)}`);
      button.disabled = false;
    } else {
      $("#upload-progress").value = 100;
    }
  };
  request.onerror = () => {
    show($("#error"), "Upload failed: the connection was lost.");
    button.disabled = false;
  };
  request.send(file);
});

$("#ask-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const question = $("#question").value.trim();
  if (!question) return;
  $("#question").value = "";
  const item = document.createElement("li");
  item.innerHTML = `<p class="question"></p><p class="answer muted">Thinking…</p>`;
  item.querySelector(".question").textContent = question;
  $("#history").prepend(item);
  const line = item.querySelector(".answer");
  try {
    const answer = await api(`/sessions/${session.id}/ask`, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ question }),
    });
    line.classList.remove("muted");
    line.textContent = answer.answer;
    const meta = document.createElement("p");
    meta.className = "meta";
    meta.textContent = `at ${answer.video_time_s.toFixed(1)} s of video · ${answer.cache_tokens} cache tokens · ` +
      `first token ${Math.round(answer.ttft_ms)} ms · total ${Math.round(answer.total_ms)} ms`;
    item.append(meta);
  } catch (err) {
    line.textContent = `Error: ${err.message}`;
  }
});

if (session) setSession(session);
