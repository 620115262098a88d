// Live sources: a camera or a screen captured by the browser, sent to the session's stream
// socket as timed JPEG frames (docs/streaming.md, format `frames`), paced at the session's fps.
// A frame is skipped, never queued, while the gateway says `backpressure` or the socket's own
// send buffer is still full; a dropped connection is reopened and the stream goes on.

const MAX_SIDE_PX = 768; // the worker scales frames to this longer side anyway
const JPEG_QUALITY = 0.8;
const MAX_BUFFERED_BYTES = 1024 * 1024; // unsent bytes on the socket past which frames are skipped
const RECONNECT_MS = [1000, 2000, 4000, 8000];
const END_WAIT_MS = 10000; // how long `stop` waits for the last frames to reach the cache
// Close codes after which reconnecting cannot help (docs/streaming.md, "Close codes").
const FINAL_CLOSES = new Set([1007, 1009, 4400, 4401, 4403, 4404, 4409]);

const CLOSE_REASONS = {
  1006: "the connection to the server was lost",
  1011: "the server failed",
  1013: "the server is busy",
  4429: "too many connections or messages",
};

/** A MediaStream from the camera or the screen; rejects with a readable Error. */
export async function openCapture(kind) {
  if (!navigator.mediaDevices) {
    throw new Error("this browser allows camera and screen capture only on https:// or localhost pages");
  }
  try {
    if (kind === "screen") return await navigator.mediaDevices.getDisplayMedia({ video: true, audio: false });
    return await navigator.mediaDevices.getUserMedia({ video: { width: { ideal: 1280 }, height: { ideal: 720 } }, audio: false });
  } catch (err) {
    const what = kind === "screen" ? "screen sharing" : "the camera";
    if (err.name === "NotAllowedError") throw new Error(`${what} was not allowed`);
    if (err.name === "NotFoundError" || err.name === "OverconstrainedError") throw new Error("no camera was found");
    if (err.name === "NotReadableError") throw new Error(`${what} is in use by another program`);
    throw new Error(`${what} could not start (${err.message || err.name})`);
  }
}

/**
 * Streams what `video` shows (a <video> playing a capture) into a session at `fps`.
 * onStatus(state, detail): "connecting", "streaming", "paused" (backpressure), "reconnecting"
 * (detail: why), "ended", "failed" (detail: why). onEvent(event): the socket's `error` and
 * `warning` events. `sent` and `skipped` count frames.
 */
export class FrameStreamer {
  constructor({ url, fps, video, onStatus, onEvent }) {
    this.url = url;
    this.fps = fps;
    this.video = video;
    this.onStatus = onStatus;
    this.onEvent = onEvent;
    this.canvas = document.createElement("canvas");
    this.socket = null;
    this.started = false; // the gateway answered our `start` on this socket
    this.paused = false; // the gateway's `backpressure`
    this.encoding = false;
    this.ending = false;
    this.closing = false;
    this.attempt = 0;
    this.timer = null;
    this.clock = null; // {t0_ms, base_s, next}: the stream's clock, kept across reconnects
    this.sent = 0;
    this.skipped = 0;
    this.endedSignal = null;
  }

  start() {
    this.connect();
  }

  /** End the stream: the last frames reach the cache, then the socket closes. */
  async stop() {
    clearTimeout(this.timer); // no more frames
    this.timer = null;
    if (this.isOpen() && this.started && this.sent > 0) {
      this.ending = true;
      this.socket.send(JSON.stringify({ type: "end" }));
      await new Promise((resolve) => {
        this.endedSignal = resolve;
        setTimeout(resolve, END_WAIT_MS);
      });
    }
    this.close();
    this.onStatus("ended");
  }

  /** Close at once, without waiting for the frames in flight. */
  close() {
    clearTimeout(this.timer);
    this.timer = null;
    this.closing = true;
    if (this.socket) this.socket.close(1000, "the stream is over");
  }

  isOpen() {
    return this.socket !== null && this.socket.readyState === WebSocket.OPEN;
  }

  connect() {
    if (this.attempt === 0) this.onStatus("connecting");
    const socket = new WebSocket(this.url);
    this.socket = socket;
    socket.onopen = () => socket.send(JSON.stringify({ type: "start", format: "frames" }));
    socket.onmessage = (message) => {
      if (typeof message.data === "string") this.receive(JSON.parse(message.data));
    };
    socket.onclose = (close) => this.closed(socket, close);
  }

  receive(event) {
    if (event.type === "started") {
      this.started = true;
      this.attempt = 0;
      if (this.clock === null) {
        // A session that already has frames goes on after them, on its sampling grid.
        const base_s = event.frames > 0 ? (Math.floor(event.video_time_s * this.fps) + 1) / this.fps : 0;
        this.clock = { t0_ms: performance.now(), base_s, next: 0 };
        this.tick();
      }
      this.onStatus("streaming");
    } else if (event.type === "backpressure") {
      this.paused = event.paused;
      this.onStatus(event.paused ? "paused" : "streaming");
    } else if (event.type === "state" && event.state === "ingested" && this.endedSignal) {
      this.endedSignal();
    } else if (event.type === "error" || event.type === "warning") {
      this.onEvent(event);
    }
  }

  closed(socket, close) {
    if (socket !== this.socket) return;
    this.socket = null;
    this.started = false;
    this.paused = false;
    if (this.closing) return;
    const reason = close.reason || CLOSE_REASONS[close.code] || `the socket closed (${close.code})`;
    if (FINAL_CLOSES.has(close.code) || this.ending) {
      clearTimeout(this.timer);
      this.timer = null;
      if (this.endedSignal) this.endedSignal();
      this.closing = true;
      this.onStatus("failed", reason);
      return;
    }
    const wait_ms = RECONNECT_MS[Math.min(this.attempt, RECONNECT_MS.length - 1)];
    this.attempt += 1;
    this.onStatus("reconnecting", reason);
    setTimeout(() => {
      if (!this.closing) this.connect();
    }, wait_ms);
  }

  /** One frame slot of the clock: capture now, or skip; then wait for the next slot. A slot
   *  missed entirely (a slow tab) is skipped, so frames never bunch up. */
  tick() {
    const clock = this.clock;
    const elapsed_s = (performance.now() - clock.t0_ms) / 1000;
    const slot = clock.next;
    if (this.ready()) {
      // Never earlier than the slot's grid point, so that the worker's sampler keeps every frame.
      this.capture(clock.base_s + Math.max(elapsed_s, slot / this.fps));
    } else if (this.video.readyState >= 2) {
      this.skipped += 1;
    }
    clock.next = Math.max(slot + 1, Math.floor(elapsed_s * this.fps) + 1);
    const due_ms = clock.t0_ms + (clock.next * 1000) / this.fps;
    this.timer = setTimeout(() => this.tick(), Math.max(0, due_ms - performance.now()));
  }

  ready() {
    return this.isOpen() && this.started && !this.paused && !this.ending && !this.encoding
      && this.socket.bufferedAmount < MAX_BUFFERED_BYTES && this.video.readyState >= 2 && this.video.videoWidth > 0;
  }

  async capture(time_s) {
    this.encoding = true;
    try {
      const { videoWidth: width, videoHeight: height } = this.video;
      const scale = Math.min(1, MAX_SIDE_PX / Math.max(width, height));
      this.canvas.width = Math.max(2, Math.round(width * scale));
      this.canvas.height = Math.max(2, Math.round(height * scale));
      this.canvas.getContext("2d").drawImage(this.video, 0, 0, this.canvas.width, this.canvas.height);
      const jpeg = await new Promise((resolve) => this.canvas.toBlob(resolve, "image/jpeg", JPEG_QUALITY));
      if (!jpeg || !this.isOpen() || !this.started || this.ending) {
        this.skipped += 1;
        return;
      }
      const header = new ArrayBuffer(8);
      new DataView(header).setFloat64(0, time_s, true);
      this.socket.send(new Blob([header, jpeg]));
      this.sent += 1;
      this.onStatus("streaming");
    } finally {
      this.encoding = false;
    }
  }
}
