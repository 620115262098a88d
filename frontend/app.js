// The first dashboard: create a session, upload a file, watch ingest, ask questions.
// It speaks only to the gateway's REST API.

const $ = (selector) => document.querySelector(selector);
const POLL_MS = 1000;
let session = JSON.parse(sessionStorage.getItem("streamvqa.session") || "null");
let pollTimer = null;

function showError(message) {
  const box = $("#error");
  box.textContent = message;
  box.hidden = !message;
}

async function api(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  if (session) headers.Authorization = `Bearer ${session.token}`;
  const reply = await fetch(path, { ...options, headers });
  const body = await reply.json().catch(() => ({}));
  if (!reply.ok) throw new Error(body.message || `${reply.status} ${reply.statusText}`);
  return body;
}

function setSession(created) {
  session = created;
  sessionStorage.setItem("streamvqa.session", JSON.stringify(session));
  $("#session-line").textContent = `Session ${session.id}`;
  $("#upload-form button").disabled = false;
  $("#ask-form button").disabled = false;
  clearInterval(pollTimer);
  pollTimer = setInterval(refresh, POLL_MS);
  refresh();
}

async function refresh() {
  try {
    const state = await api(`/sessions/${session.id}`);
    for (const dd of document.querySelectorAll("#status dd")) {
      const value = state[dd.dataset.field];
      dd.textContent = dd.dataset.field === "video_time_s" ? `${value.toFixed(1)} s` : value;
    }
    showError(state.state === "error" ? `Session error: ${state.error}` : "");
  } catch (err) {
    showError(err.message);
  }
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
    showError(err.message);
  }
});

$("#upload-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const file = $("#file").files[0];
  if (!file) return showError("Choose a video file first.");
  const request = new XMLHttpRequest();
  request.open("POST", `/sessions/${session.id}/upload`);
  request.setRequestHeader("Authorization", `Bearer ${session.token}`);
  request.setRequestHeader("Content-Type", file.type || "application/octet-stream");
  request.upload.onprogress = (e) => { if (e.lengthComputable) $("#upload-progress").value = (100 * e.loaded) / e.total; };
  request.onload = () => {
    if (request.status >= 400) {
      const body = JSON.parse(request.responseText || "{}");
      showError(body.message || `Upload failed: ${request.status}`);
    } else {
      $("#upload-progress").value = 100;
    }
  };
  request.onerror = () => showError("Upload failed: the connection was lost.");
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
  try {
    const answer = await api(`/sessions/${session.id}/ask`, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ question }),
    });
    const line = item.querySelector(".answer");
    line.classList.remove("muted");
    line.textContent = answer.answer;
    const meta = document.createElement("p");
    meta.className = "meta";
    meta.textContent = `at ${answer.video_time_s.toFixed(1)} s of video · ${answer.cache_tokens} cache tokens · first token ${Math.round(answer.ttft_ms)} ms · total ${Math.round(answer.total_ms)} ms`;
    item.append(meta);
  } catch (err) {
    item.querySelector(".answer").textContent = `Error: ${err.message}`;
  }
});

if (session) setSession(session);
