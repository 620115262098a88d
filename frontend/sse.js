// Server-Sent Events over fetch(). A browser's EventSource cannot send the session's bearer
// header, so the page reads the event streams itself: `readEvents` parses one response body,
// and `EventStream` keeps a stream open, resuming after the last event id when it drops.

const DEFAULT_RETRY_MS = 2000;
const MAX_RETRY_MS = 15000;

/** Calls onEvent({id, event, data}) for each event of a text/event-stream body, and
 *  onRetry(ms) for each `retry:` field; returns when the body ends. */
export async function readEvents(body, onEvent, onRetry = () => {}) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let event = { id: undefined, event: "", data: [] };
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      const lines = buffer.split(/\r\n|\n|\r(?!$)/);
      buffer = lines.pop();
      for (const line of lines) {
        if (line === "") {
          if (event.data.length) onEvent({ id: event.id, event: event.event || "message", data: event.data.join("\n") });
          event = { id: undefined, event: "", data: [] };
          continue;
        }
        if (line.startsWith(":")) continue; // a comment: the server's keepalive
        const colon = line.indexOf(":");
        const name = colon < 0 ? line : line.slice(0, colon);
        const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (name === "data") event.data.push(value);
        else if (name === "event") event.event = value;
        else if (name === "id") event.id = value;
        else if (name === "retry" && /^\d+$/.test(value)) onRetry(Number(value));
      }
    }
  } finally {
    reader.releaseLock();
  }
}

/** Statuses worth trying again: the server is busy, restarting, or rate-limiting us. */
function retryable(status) {
  return status === 429 || status >= 500;
}

/**
 * One event stream, kept open until a final event (isFinal) or stop(). Reconnects with
 * Last-Event-ID after a dropped connection or a 429/5xx, waiting the server's `retry` time,
 * doubled after each failure in a row. `onStatus(state, detail)` reports "open",
 * "reconnecting" (detail: the error, if any) and "failed" (detail: the error from `toError`).
 */
export class EventStream {
  constructor(url, { headers = {}, onEvent, onStatus = () => {}, isFinal = () => false, toError }) {
    this.url = url;
    this.headers = headers;
    this.onEvent = onEvent;
    this.onStatus = onStatus;
    this.isFinal = isFinal;
    this.toError = toError;
    this.lastEventId = null;
    this.retryMs = DEFAULT_RETRY_MS;
    this.abort = new AbortController();
    this.finished = this.run();
  }

  stop() {
    this.abort.abort();
  }

  get stopped() {
    return this.abort.signal.aborted;
  }

  async run() {
    let failures = 0;
    while (!this.stopped) {
      let problem = null;
      try {
        const headers = { ...this.headers, Accept: "text/event-stream" };
        if (this.lastEventId) headers["Last-Event-ID"] = this.lastEventId;
        const reply = await fetch(this.url, { headers, cache: "no-store", signal: this.abort.signal });
        if (!reply.ok) {
          problem = await this.toError(reply);
          if (!retryable(reply.status)) {
            this.onStatus("failed", problem);
            return;
          }
        } else {
          this.onStatus("open");
          failures = 0;
          await readEvents(reply.body, (event) => this.dispatch(event), (ms) => (this.retryMs = ms));
        }
      } catch (err) {
        problem = err; // the connection dropped, or stop() aborted it
      }
      if (this.stopped) return;
      failures += 1;
      this.onStatus("reconnecting", problem);
      await this.pause(Math.min(this.retryMs * 2 ** (failures - 1), MAX_RETRY_MS));
    }
  }

  dispatch(event) {
    if (this.stopped) return;
    if (event.id) this.lastEventId = event.id;
    let data;
    try {
      data = JSON.parse(event.data);
    } catch {
      return; // every event of this API carries JSON; anything else is not ours
    }
    this.onEvent(event.event, data);
    if (this.isFinal(event.event)) this.stop();
  }

  pause(ms) {
    return new Promise((resolve) => {
      const timer = setTimeout(resolve, ms);
      this.abort.signal.addEventListener("abort", () => { clearTimeout(timer); resolve(); }, { once: true });
    });
  }
}
