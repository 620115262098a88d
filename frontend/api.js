// The gateway's HTTP API, as the page uses it (docs/api.md). Every error becomes an ApiError
// carrying the server's readable message; nothing here touches the DOM.

import { EventStream } from "./sse.js";

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status; // 0: no answer from the server at all
    this.code = code;
  }
}

const LOST = "the connection to the server was lost";

export function errorFromText(status, text) {
  try {
    const body = JSON.parse(text);
    if (body && typeof body.message === "string") return new ApiError(status, body.code || "error", body.message);
  } catch {
    // not JSON: a proxy's page, or nothing at all
  }
  return new ApiError(status, "http_error", `the server answered ${status}`);
}

async function errorFrom(reply) {
  return errorFromText(reply.status, await reply.text().catch(() => ""));
}

async function call(path, { method = "GET", token, json, accept } = {}) {
  const headers = {};
  if (token) headers.Authorization = `Bearer ${token}`;
  if (json !== undefined) headers["Content-Type"] = "application/json";
  if (accept) headers.Accept = accept;
  let reply;
  try {
    reply = await fetch(path, {
      method, headers, cache: "no-store", body: json === undefined ? undefined : JSON.stringify(json),
    });
  } catch {
    throw new ApiError(0, "network", LOST);
  }
  if (!reply.ok) throw await errorFrom(reply);
  return reply;
}

/** `GET /models`: {default: the gateway's default model, models: [{model, workers}] served now}. */
export async function liveModels() {
  const body = await (await call("/models")).json();
  return { default: body.default, models: body.models.map((m) => ({ model: m.name, workers: m.workers })) };
}

/** `GET /samples`: the sample videos the gateway serves, [{name, bytes, url}]. */
export async function listSamples() {
  return (await (await call("/samples")).json()).samples;
}

/** A sample video's bytes (`url` from listSamples). */
export async function fetchSample(url) {
  return (await call(url)).blob();
}

/** `POST /sessions`: {session: a Session, record: the session as created}. */
export async function createSession(options) {
  const created = await (await call("/sessions", { method: "POST", json: options })).json();
  return { session: new Session(created.id, created.token), record: created.session };
}

/** `GET /sessions`: this caller's sessions, newest first, failed ones among them:
 *  {sessions, counted, max_sessions}. With `token`, the one of this address that it opens; without,
 *  every one of this address where the gateway lets an address own its sessions
 *  (ADDRESS_OWNS_SESSIONS), else none. `counted` is the address's, listed or not. */
export async function ownSessions(token) {
  return (await call("/sessions", { token })).json();
}

/** `DELETE /sessions/{id}`: ends it, with its token (or, without, as its owner where the gateway
 *  lets an address own its sessions). */
export async function endOwnSession(id, token) {
  await call(`/sessions/${encodeURIComponent(id)}`, { method: "DELETE", token });
}

/** One session's calls, with its token. */
export class Session {
  constructor(id, token) {
    this.id = id;
    this.token = token;
  }

  get path() {
    return `/sessions/${this.id}`;
  }

  async status() {
    return (await call(this.path, { token: this.token })).json();
  }

  async memory() {
    return (await call(`${this.path}/memory`, { token: this.token })).json();
  }

  /** The conversation the API keeps: {answers: [...]}, the latest `limit` questions, oldest first. */
  async answers(limit = 100) {
    return (await call(`${this.path}/answers?limit=${limit}`, { token: this.token })).json();
  }

  async remove() {
    await call(this.path, { method: "DELETE", token: this.token });
  }

  /** `GET /sessions/{id}/watches`: {watches: [...] oldest first, each with its `fired`, max_watches}. */
  async watches() {
    return (await call(`${this.path}/watches`, { token: this.token })).json();
  }

  /** `POST /sessions/{id}/watches`: the watch as created (422 for a bad field, 429 `too_many_watches`). */
  async watch(condition, every_s, threshold) {
    const json = { condition, every_s, threshold };
    return (await call(`${this.path}/watches`, { method: "POST", token: this.token, json })).json();
  }

  async unwatch(watchId) {
    await call(`${this.path}/watches/${encodeURIComponent(watchId)}`, { method: "DELETE", token: this.token });
  }

  /** Upload a file with XMLHttpRequest (fetch reports no upload progress); onProgress(sent, total).
   *  Resolves with {bytes}; rejects with an ApiError. */
  upload(file, onProgress) {
    return new Promise((resolve, reject) => {
      const request = new XMLHttpRequest();
      request.open("POST", `${this.path}/upload`);
      request.setRequestHeader("Authorization", `Bearer ${this.token}`);
      request.setRequestHeader("Content-Type", file.type || "application/octet-stream");
      request.upload.onprogress = (event) => onProgress(event.loaded, event.lengthComputable ? event.total : file.size);
      request.onload = () => {
        if (request.status >= 200 && request.status < 300) resolve(JSON.parse(request.responseText));
        else reject(errorFromText(request.status, request.responseText));
      };
      request.onerror = () => reject(new ApiError(0, "network", LOST));
      request.send(file);
    });
  }

  /** Queue a question; its answer id. (`wait_s: 0` answers at once with the id, so that the
   *  answer's events can be read, and resumed, at `GET /answers/{id}`.) */
  async ask(question, maxNewTokens = 64) {
    const reply = await call(`${this.path}/ask`, {
      method: "POST", token: this.token, json: { question, max_new_tokens: maxNewTokens, wait_s: 0 },
    });
    const body = await reply.json();
    return { answerId: body.answer_id, done: reply.status === 200 ? body : null };
  }

  /** An answer's events (`token`, then `done` or `error`), resumed after a dropped connection. */
  answerEvents(answerId, onEvent, onStatus) {
    return this.events(`${this.path}/answers/${answerId}`, onEvent, onStatus, (name) => name === "done" || name === "error");
  }

  /** The session's events (`ingest`, `state`, `warning`, `error`, `watch_fired`, `gone`), resumed after a drop. */
  sessionEvents(onEvent, onStatus) {
    return this.events(`${this.path}/events`, onEvent, onStatus, (name) => name === "gone");
  }

  events(url, onEvent, onStatus, isFinal) {
    return new EventStream(url, {
      headers: { Authorization: `Bearer ${this.token}` }, onEvent, onStatus, isFinal, toError: errorFrom,
    });
  }

  /** The address of the session's stream socket (a browser cannot set a header on a WebSocket). */
  streamUrl() {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    return `${scheme}//${location.host}${this.path}/stream?token=${encodeURIComponent(this.token)}`;
  }
}
