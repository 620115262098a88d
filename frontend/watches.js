// Watches: standing yes/no conditions that the session's worker checks every few seconds of video,
// firing when one becomes true (docs/api.md, "Watches"). The form beside the question box adds one
// and the list shows each with its firings and removes it. Each firing is a mark on the memory
// view's timeline (a click shows that moment in the preview), a line on the page and, where the
// user allowed it, a browser notification. Firings come live as the session's `watch_fired`
// events and from `GET /watches` after a reload; a watch's firing at the same second is kept once.

import { percent, videoTime } from "./format.js";

const DEFAULT_EVERY_S = 2;
const MAX_FIRINGS_KEPT = 100; // a watch's latest firings, as the server keeps them
const TIME_EPSILON_S = 1e-3;

export class Watches {
  /** form: its #watch-condition, #watch-every and #watch-threshold inputs; hint: the line under
   *  it; list: the watches; marks: the layer over the memory timeline; toast: {element, text, show, dismiss};
   *  onSeek(time_s): show that moment of the video; onError(message): an API error to show. */
  constructor({ form, hint, list, marks, toast, onSeek, onError }) {
    this.form = form;
    this.condition = form.querySelector("#watch-condition");
    this.every = form.querySelector("#watch-every");
    this.threshold = form.querySelector("#watch-threshold");
    this.button = form.querySelector("button[type=submit]");
    this.hint = hint;
    this.hintText = hint.textContent; // shown while watches may be added
    this.refused = false;
    this.list = list;
    this.marks = marks;
    this.toast = toast;
    this.onSeek = onSeek;
    this.onError = onError;
    this.session = null;
    this.watches = new Map(); // id -> the watch as the API gives it; `fired` oldest first
    this.total_s = 0; // the timeline's length
    this.toastTime_s = null; // where the toast's Show button seeks
    this.adding = false;
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.add();
    });
    this.condition.addEventListener("input", () => this.enable());
    toast.show.addEventListener("click", () => this.onSeek(this.toastTime_s));
    toast.dismiss.addEventListener("click", () => (toast.element.hidden = true));
  }

  /** Watch this session from now on (null: none, the form is disabled); `fps`: its sampling rate,
   *  whose frame interval is the shortest time between checks. */
  use(session, fps = 1) {
    this.session = session;
    this.watches = new Map();
    this.total_s = 0;
    this.toast.element.hidden = true;
    const interval_s = 1 / fps;
    this.every.min = String(interval_s);
    this.every.value = String(Math.ceil(100 * Math.max(DEFAULT_EVERY_S, interval_s)) / 100);
    this.render();
    if (session) this.load(session);
  }

  /** The session's watches as the API keeps them, with the firings this page already has. */
  async load(session) {
    let watches;
    try {
      ({ watches } = await session.watches());
    } catch (err) {
      if (session === this.session && ![401, 403, 404].includes(err.status)) {
        this.onError(`The watches could not be loaded: ${err.message}.`);
      }
      return;
    }
    if (session !== this.session) return;
    this.watches = new Map(watches.map((watch) => {
      const known = this.watches.get(watch.id);
      return [watch.id, known ? { ...watch, fired: merged(known.fired, watch.fired) } : watch];
    }));
    this.render();
  }

  /** A `watch_fired` event: {watch_id, time_s, probability, evidence}. */
  async fired({ watch_id, time_s, probability, evidence }) {
    const session = this.session;
    if (!session) return;
    if (!this.watches.has(watch_id)) await this.load(session); // one added elsewhere, through the API
    const watch = this.watches.get(watch_id);
    if (!watch || session !== this.session) return;
    const firing = { time_s, probability, evidence: evidence || [] };
    watch.fired = merged(watch.fired, [firing]);
    this.render();
    this.announce(watch, firing);
  }

  /** Why a watch cannot be added now (shown under the form, which is disabled), or null. */
  refuse(reason) {
    this.hint.textContent = reason || this.hintText;
    this.hint.dataset.refused = String(Boolean(reason));
    this.refused = Boolean(reason);
    this.enable();
  }

  /** The timeline is `total_s` seconds of video long. */
  setScale(total_s) {
    if (total_s === this.total_s) return;
    this.total_s = total_s;
    this.renderMarks();
  }

  async add() {
    const condition = this.condition.value.trim();
    const session = this.session;
    if (!condition || !session || this.adding) return;
    if (this.watches.size === 0) askToNotify(); // in the click's own turn, as browsers require
    this.adding = true;
    this.enable();
    try {
      const watch = await session.watch(condition, Number(this.every.value), Number(this.threshold.value));
      if (session !== this.session) return;
      this.watches.set(watch.id, watch);
      this.condition.value = "";
      this.render();
    } catch (err) {
      if (session === this.session) this.onError(`Could not add the watch: ${err.message}`);
    } finally {
      this.adding = false;
      this.enable();
    }
  }

  async remove(watch) {
    const session = this.session;
    try {
      await session.unwatch(watch.id);
    } catch (err) {
      if (err.status !== 404) return this.onError(`Could not remove the watch: ${err.message}`);
    }
    if (session !== this.session) return;
    this.watches.delete(watch.id);
    this.render();
  }

  /** A firing on the page, and as a notification where the user allowed them. */
  announce(watch, firing) {
    const text = `“${watch.condition}” at ${videoTime(firing.time_s)} of video${seenAt(firing.evidence)}`;
    this.toast.text.textContent = `Watch fired: ${text}`;
    this.toastTime_s = firing.time_s;
    this.toast.element.hidden = false;
    if (!("Notification" in window) || Notification.permission !== "granted") return;
    try {
      const notification = new Notification("Watch fired", { body: text, tag: `${watch.id}@${firing.time_s}` });
      notification.onclick = () => {
        window.focus();
        this.onSeek(firing.time_s);
        notification.close();
      };
    } catch {
      // a browser that notifies only through a service worker: the page's line says it
    }
  }

  enable() {
    const off = !this.session || this.refused;
    this.condition.disabled = off;
    this.every.disabled = off;
    this.threshold.disabled = off;
    this.button.disabled = off || this.adding || !this.condition.value.trim();
  }

  render() {
    this.renderList();
    this.renderMarks();
    this.enable();
  }

  renderList() {
    this.list.replaceChildren(...[...this.watches.values()].map((watch) => {
      const item = document.createElement("li");
      item.className = "watch";
      item.dataset.watch = watch.id;
      item.dataset.fired = String(watch.fired.length);
      const condition = document.createElement("p");
      condition.className = "watch-condition";
      condition.textContent = watch.condition;
      const meta = document.createElement("p");
      meta.className = "watch-meta";
      meta.textContent = `every ${watch.every_s} s · p(yes) ≥ ${watch.threshold} · ${firings(watch.fired)}`;
      const remove = document.createElement("button");
      remove.type = "button";
      remove.className = "secondary small";
      remove.textContent = "Remove";
      remove.setAttribute("aria-label", `Remove the watch “${watch.condition}”`);
      remove.addEventListener("click", () => this.remove(watch));
      item.append(condition, remove, meta);
      return item;
    }));
  }

  /** One mark a firing, at its second on the timeline (none before the timeline has a length). */
  renderMarks() {
    const marks = [];
    for (const watch of this.total_s > 0 ? this.watches.values() : []) {
      for (const firing of watch.fired) {
        const mark = document.createElement("button");
        mark.type = "button";
        mark.className = "watch-mark";
        mark.dataset.watch = watch.id;
        mark.dataset.time = String(firing.time_s);
        mark.style.left = `${Math.min(100, (100 * firing.time_s) / this.total_s)}%`;
        mark.title = `“${watch.condition}” at ${videoTime(firing.time_s)} (p(yes) ${percent(firing.probability)})${seenAt(firing.evidence)}`;
        mark.setAttribute("aria-label", `Show ${videoTime(firing.time_s)}, where “${watch.condition}” fired`);
        mark.addEventListener("click", () => this.onSeek(firing.time_s));
        marks.push(mark);
      }
    }
    this.marks.replaceChildren(...marks);
  }
}

/** Firings a and b together, once each, oldest first, the latest MAX_FIRINGS_KEPT. */
function merged(a, b) {
  const all = [...a];
  for (const firing of b) {
    if (!all.some((f) => Math.abs(f.time_s - firing.time_s) < TIME_EPSILON_S)) all.push(firing);
  }
  return all.sort((x, y) => x.time_s - y.time_s).slice(-MAX_FIRINGS_KEPT);
}

/** The seconds a firing's check attended to beyond a question about nothing (its evidence), in time order. */
function seenAt(evidence) {
  if (!evidence || !evidence.length) return "";
  return ` · seen at ${[...evidence].sort((a, b) => a.time_s - b.time_s).map((e) => videoTime(e.time_s)).join(", ")}`;
}

function firings(fired) {
  if (!fired.length) return "not fired yet";
  const last = `last at ${videoTime(fired[fired.length - 1].time_s)}`;
  return `${fired.length} firing${fired.length === 1 ? "" : "s"}, ${last}`;
}

/** Ask once whether the page may notify; a browser without notifications, or a refusal, is fine. */
function askToNotify() {
  if (!("Notification" in window) || Notification.permission !== "default") return;
  Promise.resolve(Notification.requestPermission()).catch(() => {});
}
