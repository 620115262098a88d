// The memory view: what the bounded cache still holds of the whole stream so far
// (`GET /sessions/{id}/memory`). One column per span of video (at most 600): the frame lane
// fills by the share of the span's frame tokens still held, the text lane by the share of its
// prompt, question and answer tokens. Each column says how much is held in `data-held`:
// `all`, `part`, `none` (evicted) or `empty` (no frame tokens came from it).
// With recall, what the cache evicts may sit in the host tier: each lane stacks a host fill on
// its device fill, and the column's frames are in one place in `data-state`: `device`, `host`,
// `dropped` (neither), `part` (split between them) or `empty`. An answer's recalled seconds
// are marked `data-recalled`, its evidence `data-evidence`.

import { bytes, count, percent, tick, tickStep } from "./format.js";

const HELD_EPSILON = 0.05; // tokens: `frame_held` is a mean over layers and heads
const MAX_TICKS = 6;

/** How much of what was seen is held: all, part, none, or empty when nothing was seen. */
export function heldClass(seen, held) {
  if (seen <= 0) return "empty";
  if (held >= seen - HELD_EPSILON) return "all";
  if (held <= HELD_EPSILON) return "none";
  return "part";
}

/** Where what was seen is: all on the device, all in the host tier, all dropped, split (part),
 *  or empty when nothing was seen. */
export function placeClass(seen, held, host) {
  if (seen <= 0) return "empty";
  const dropped = seen - held - host;
  const places = [["device", held], ["host", host], ["dropped", dropped]].filter(([, n]) => n > HELD_EPSILON);
  return places.length === 1 ? places[0][0] : "part";
}

export class MemoryView {
  constructor({ timeline, axis, summary, budgetBar, fields, recallParts, onSeek }) {
    // timeline: the grid of span columns; its parent holds the playhead over it
    this.timeline = timeline;
    this.axis = axis;
    this.summary = summary;
    this.budgetBar = budgetBar;
    this.fields = fields; // {name: element} for frame_tokens, text_tokens, evictions, evicted_tokens, host_*
    this.recallParts = recallParts; // elements shown only with recall (data-recall="with") or only without
    this.onSeek = onSeek;
    this.summaryText = summary.textContent;
    this.total_s = 0;
    this.evidence = [];
    this.recalled = [];
    this.updatedAt = null;
    this.playhead = document.createElement("div");
    this.playhead.className = "playhead";
    this.playhead.hidden = true;
    timeline.parentElement.append(this.playhead);
    timeline.addEventListener("click", (event) => this.clicked(event));
  }

  clear() {
    this.timeline.replaceChildren();
    this.axis.replaceChildren();
    this.timeline.setAttribute("aria-label", "No video yet");
    this.budgetBar.setAttribute("aria-label", "No cache yet");
    this.budgetBar.style.setProperty("--frames-share", 0);
    this.budgetBar.style.setProperty("--text-share", 0);
    for (const element of Object.values(this.fields)) element.textContent = "–";
    this.summary.textContent = this.summaryText;
    this.total_s = 0;
    this.evidence = [];
    this.recalled = [];
    this.updatedAt = null;
    this.playhead.hidden = true;
    this.showRecall(false);
  }

  /** Draw a memory report; a report already drawn is skipped. */
  render(report) {
    if (report.updated_at === this.updatedAt) return;
    this.updatedAt = report.updated_at;
    this.showRecall(report.recall);
    this.renderBudget(report);
    this.renderTimeline(report.spans, report.recall);
    this.renderSummary(report);
  }

  showRecall(recall) {
    for (const element of this.recallParts) element.hidden = (element.dataset.recall === "with") !== Boolean(recall);
  }

  renderBudget(report) {
    const { frame_tokens: frames, text_tokens: text, cache_tokens: held } = report;
    const capacity = report.budget_tokens ?? Math.max(held, 1); // `full` has no budget: scale to what it holds
    const frameShare = Math.min(1, frames / capacity);
    this.budgetBar.style.setProperty("--frames-share", frameShare);
    this.budgetBar.style.setProperty("--text-share", Math.min(1 - frameShare, text / capacity));
    const of = report.budget_tokens === null ? "no budget" : `of a ${count(report.budget_tokens)}-token budget`;
    this.budgetBar.setAttribute(
      "aria-label", `${count(held)} tokens held ${of}: ${count(frames)} from frames, ${count(text)} from text`,
    );
    this.fields.frame_tokens.textContent = count(frames);
    this.fields.text_tokens.textContent = count(text);
    this.fields.evictions.textContent = count(report.evictions);
    this.fields.evicted_tokens.textContent = count(report.evicted_tokens);
    this.fields.host_tokens.textContent = report.recall ? `${count(report.host_tokens)} / ${count(report.host_budget_tokens)}` : "–";
    this.fields.host_bytes.textContent = report.recall ? bytes(report.host_bytes) : "";
  }

  renderTimeline(spans, recall) {
    const timeline = this.timeline;
    while (timeline.children.length > spans.length) timeline.lastElementChild.remove();
    while (timeline.children.length < spans.length) timeline.append(newColumn());
    timeline.style.setProperty("--columns", Math.max(spans.length, 1));
    timeline.dataset.dense = String(spans.length > 120);
    spans.forEach((span, index) => {
      const column = timeline.children[index];
      const frameHost = span.frame_host ?? 0;
      const textHost = span.text_host ?? 0;
      column.dataset.held = heldClass(span.frame_seen, span.frame_held);
      column.dataset.text = heldClass(span.text_seen, span.text_held);
      column.dataset.state = placeClass(span.frame_seen, span.frame_held, frameHost);
      column.dataset.start = span.start_s;
      column.dataset.end = span.end_s;
      column.style.setProperty("--held", share(span.frame_held, span.frame_seen));
      column.style.setProperty("--in-host", share(frameHost, span.frame_seen));
      column.style.setProperty("--text-held", share(span.text_held, span.text_seen));
      column.style.setProperty("--text-in-host", share(textHost, span.text_seen));
      const describe = recall ? describePlaces : describeHeld;
      column.title = `${tick(span.start_s)} – ${tick(span.end_s)}\n`
        + `frames: ${describe(span.frame_seen, span.frame_held, frameHost)}\n`
        + `text: ${describe(span.text_seen, span.text_held, textHost)}`;
    });
    this.total_s = spans.length ? spans[spans.length - 1].end_s : 0;
    this.renderAxis();
    this.markFocus();
  }

  renderSummary(report) {
    if (report.recall) return this.renderRecallSummary(report);
    const seconds = { all: 0, part: 0, none: 0 };
    for (const span of report.spans) {
      const held = heldClass(span.frame_seen, span.frame_held);
      if (held in seconds) seconds[held] += span.end_s - span.start_s;
    }
    const total = seconds.all + seconds.part + seconds.none;
    const label = total === 0
      ? "No frames in the cache yet"
      : `Of ${total} s of video with frames: ${seconds.all} s held in full, ${seconds.part} s partly evicted, ${seconds.none} s evicted`;
    this.timeline.setAttribute("aria-label", label);
    if (total === 0) {
      this.summary.textContent = this.summaryText;
    } else if (report.budget_tokens === null) {
      this.summary.textContent = `Full cache: all ${count(report.cache_tokens)} tokens kept; memory grows with the video.`;
    } else {
      const share = percent(report.cache_tokens / report.budget_tokens);
      this.summary.textContent = `${count(report.cache_tokens)} of ${count(report.budget_tokens)} tokens (${share}) · `
        + `${seconds.none} s evicted, ${seconds.part} s partly, ${seconds.all} s held`;
    }
  }

  /** With recall: seconds of video by where their frames are, and the host tier's use. */
  renderRecallSummary(report) {
    const seconds = { device: 0, host: 0, dropped: 0, part: 0 };
    for (const span of report.spans) {
      const place = placeClass(span.frame_seen, span.frame_held, span.frame_host);
      if (place in seconds) seconds[place] += span.end_s - span.start_s;
    }
    const total = seconds.device + seconds.host + seconds.dropped + seconds.part;
    const places = `${seconds.device} s on the device, ${seconds.host} s in the host tier, `
      + `${seconds.dropped} s dropped, ${seconds.part} s split`;
    this.timeline.setAttribute("aria-label", total === 0
      ? "No frames in the cache yet"
      : `Of ${total} s of video with frames: ${places}`);
    if (total === 0) {
      this.summary.textContent = this.summaryText;
      return;
    }
    const share = percent(report.cache_tokens / report.budget_tokens);
    this.summary.textContent = `${count(report.cache_tokens)} of ${count(report.budget_tokens)} tokens (${share}) · `
      + `host tier ${count(report.host_tokens)} of ${count(report.host_budget_tokens)} tokens, ${bytes(report.host_bytes)} · `
      + places;
  }

  renderAxis() {
    const total = this.total_s;
    const step = tickStep(total, MAX_TICKS);
    const ticks = [];
    for (let t = 0; t <= total + 1e-9; t += step) {
      const label = document.createElement("span");
      label.textContent = tick(t);
      label.style.left = `${(100 * t) / Math.max(total, 1)}%`;
      ticks.push(label);
    }
    this.axis.replaceChildren(...ticks);
  }

  /** Mark the spans that an answer drew on (its evidence times, in seconds) and those it brought
   *  back from the host tier (its recalled whole seconds). */
  highlight(times, recalled = []) {
    this.evidence = times;
    this.recalled = recalled;
    this.markFocus();
  }

  markFocus() {
    for (const column of this.timeline.querySelectorAll(".span")) {
      const start = Number(column.dataset.start);
      const end = Number(column.dataset.end);
      const within = (t) => t >= start && t < end;
      column.toggleAttribute("data-evidence", this.evidence.some(within));
      column.toggleAttribute("data-recalled", this.recalled.some(within));
    }
  }

  /** A vertical line at `time_s` (the file preview's position), or none. */
  setPlayhead(time_s) {
    const shown = time_s !== null && this.total_s > 0;
    this.playhead.hidden = !shown;
    if (shown) this.playhead.style.left = `${Math.min(100, (100 * time_s) / this.total_s)}%`;
  }

  clicked(event) {
    if (this.total_s <= 0) return;
    const box = this.timeline.getBoundingClientRect();
    const fraction = Math.min(1, Math.max(0, (event.clientX - box.left) / box.width));
    this.onSeek(fraction * this.total_s);
  }
}

function newColumn() {
  const column = document.createElement("div");
  column.className = "span";
  for (const name of ["frames", "text"]) {
    const lane = document.createElement("i");
    lane.className = `lane lane-${name}`;
    const host = document.createElement("b");
    host.className = "lane-host"; // stacked on the device fill (the lane's ::after)
    lane.append(host);
    column.append(lane);
  }
  return column;
}

function share(part, whole) {
  return whole > 0 ? Math.min(1, part / whole) : 0;
}

function describeHeld(seen, held) {
  if (seen <= 0) return "none (a gap: nothing came into the cache)";
  return `${count(held)} of ${count(seen)} tokens held (${percent(held / seen)})`;
}

function describePlaces(seen, held, host) {
  if (seen <= 0) return "none (a gap: nothing came into the cache)";
  const dropped = Math.max(0, seen - held - host);
  return `${count(seen)} tokens: ${count(held)} on the device, ${count(host)} in the host tier, ${count(dropped)} dropped`;
}
