// The stage: the <video> that shows what the model watches. A live capture plays as it comes;
// a file plays from a local copy, kept in step with ingest: it never runs ahead of the last
// frame the model has taken in, and waits there until the model catches up.

import { videoTime } from "./format.js";

export class Stage {
  constructor({ video, empty, badge }) {
    this.video = video;
    this.empty = empty;
    this.badge = badge;
    this.emptyText = empty.textContent;
    this.kind = null; // "file", "camera", "screen", "demo" or null
    this.nextClip = null; // the demo's: plays its next clip, or ends it
    this.objectUrl = null;
    this.head_s = null; // the last frame the model has ingested (file), null before the first
    this.ingested = false; // the whole file is in
    this.fps = 1;
    this.waiting = false; // paused at the limit, to go on when the model catches up
    this.started = false; // played along once already
    this.onTime = () => {};
    video.addEventListener("timeupdate", () => this.keepInStep());
    video.addEventListener("seeking", () => this.keepInStep());
    video.addEventListener("error", () => {
      if (this.kind === "file") this.say("This browser cannot preview this file; the model still receives it.");
      if (this.kind === "demo") this.nextClip(); // a clip this browser cannot play: the next one
    });
    video.addEventListener("ended", () => this.kind === "demo" && this.nextClip());
  }

  get seekable() {
    return this.kind === "file" && this.video.readyState >= 1;
  }

  showLive(stream, kind) {
    this.reset();
    this.kind = kind;
    this.video.controls = false;
    this.video.srcObject = stream;
    this.video.play().catch(() => {});
    this.say(null);
    this.setBadge(`● Live · ${kind}`, "live");
  }

  /** The demo: the video files at `urls` played one after another, `rounds` times over, as a live
   *  source (what the stage shows is what is streamed); onEnd() once the last one has played. */
  showSamples(urls, rounds, onEnd) {
    this.reset();
    this.kind = "demo";
    this.video.controls = false;
    const clips = Array.from({ length: rounds }, () => urls).flat();
    let next = 0;
    this.nextClip = () => {
      if (next === clips.length) return onEnd();
      this.video.src = clips[next];
      next += 1;
      this.setBadge(`● Live · demo · clip ${next} of ${clips.length}`, "live");
      this.video.play().catch(() => {}); // muted, so the browser allows it
    };
    this.say(null);
    this.nextClip();
  }

  showFile(file, fps) {
    this.reset();
    this.kind = "file";
    this.fps = fps;
    this.objectUrl = URL.createObjectURL(file);
    this.video.src = this.objectUrl;
    this.video.controls = true;
    this.say(null);
    this.setBadge("Waiting for the model", "waiting");
  }

  /** No preview, with a reason (a restored session's file is not on this page any more). */
  clear(message = this.emptyText) {
    this.reset();
    this.say(message);
  }

  reset() {
    const video = this.video;
    video.pause();
    video.srcObject = null;
    video.removeAttribute("src");
    video.load();
    if (this.objectUrl) URL.revokeObjectURL(this.objectUrl);
    this.objectUrl = null;
    this.kind = null;
    this.nextClip = null;
    this.head_s = null;
    this.ingested = false;
    this.waiting = false;
    this.started = false;
    this.setBadge(null);
  }

  /** The model has ingested the file up to `head_s` (`done`: all of it; `failed`: it could not read it). */
  setIngest(head_s, done, duration_s, failed = false) {
    if (this.kind !== "file") return;
    if (failed) return this.setBadge("The model could not read this video", "error");
    this.head_s = head_s;
    this.ingested = done;
    if (done) this.setBadge(`Model has seen all ${videoTime(duration_s ?? head_s)}`, "done");
    else if (head_s !== null) this.setBadge(`Model has seen ${videoTime(head_s)}`, "ingesting");
    if (this.waiting && (done || this.video.currentTime <= this.limit())) {
      this.waiting = false;
      this.video.play().catch(() => {});
    } else if (!this.waiting && this.video.paused && this.video.currentTime === 0 && head_s !== null && !this.started) {
      this.started = true; // play along from the first ingested frame; muted, so the browser allows it
      this.video.play().catch(() => {});
    }
  }

  /** How far the preview may play: one frame interval past the last ingested frame (0 before it). */
  limit() {
    return this.head_s === null ? 0 : this.head_s + 1 / this.fps;
  }

  keepInStep() {
    if (this.kind === "file") this.onTime(this.video.currentTime);
    if (this.kind !== "file" || this.ingested) return;
    if (this.video.currentTime > this.limit() + 0.05) {
      this.waiting = !this.video.paused || this.waiting;
      this.video.pause();
      this.video.currentTime = this.limit();
    }
  }

  /** Show the moment `time_s` of the file (an evidence chip); true when the stage could. */
  seek(time_s) {
    if (!this.seekable) return false;
    this.waiting = false;
    this.video.pause();
    this.video.currentTime = Math.min(time_s, this.video.duration || time_s);
    this.video.scrollIntoView({ block: "nearest", behavior: "smooth" });
    return true;
  }

  say(message) {
    this.empty.textContent = message || "";
    this.empty.hidden = !message;
    this.video.hidden = Boolean(message);
  }

  setBadge(text, tone) {
    this.badge.textContent = text || "";
    this.badge.hidden = !text;
    this.badge.dataset.tone = tone || "";
  }
}
