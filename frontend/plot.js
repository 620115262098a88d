// The cache over video time, drawn as SVG: how many tokens the session's cache held after each
// step (from the session's record, as it is polled and as `ingest` events update it) and how many
// it had seen in all (the memory report's spans, added up, and on to the record's `tokens_seen`,
// which the worker writes with `cache_tokens` while the report comes at most once a second), with
// the budget as a dashed line.
// A bounded cache fills up to its budget and then stays flat while the seen line goes on rising:
// the gap between them is what was evicted. The held line starts when the page first saw the
// session and is kept in the tab's sessionStorage, so that a reload draws the same plot (at most
// MAX_POINTS points a session, for at most MAX_STORED sessions); the seen line always covers the
// whole stream.
//
// The vertical axis is the cache's: it reaches just past what the cache held, and includes the
// budget once the cache holds a quarter of it; a budget or a seen line above that is drawn off the
// scale, said at the top edge, so that a small cache is never a flat line at the bottom.

import { count, tick, tickStep, videoTime } from "./format.js";

const SVG = "http://www.w3.org/2000/svg";
const MAX_POINTS = 1200; // held points kept; past it every other one is dropped
const MAX_STORED = 4; // sessions whose held points the tab keeps (the least recently shown go first)
const STORE_PREFIX = "streamvqa.plot.";
const STORE_INDEX = "streamvqa.plots"; // ids of the sessions stored, most recent last
const BUDGET_IN_VIEW = 4; // the budget is on the scale once the cache holds 1/4 of it
const SEEN_IN_VIEW = 4; // the seen line is on the scale while it is under 4x the cache's scale
const HEADROOM = 1.1;
const HEIGHT_PX = 140;
const PAD = { left: 48, right: 10, top: 10, bottom: 20 }; // px around the plotting area
const MAX_X_TICKS = 6;

/** The smallest of 1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8 times a power of ten that is at least `value`. */
function niceCeil(value) {
  const power = 10 ** Math.floor(Math.log10(Math.max(value, 1)));
  return [1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10].map((m) => Math.round(m * power)).find((v) => v >= value);
}

/** The top of the vertical axis: past the most the cache held, the budget once the cache holds
 *  1/BUDGET_IN_VIEW of it (or where nothing is held yet), the seen line while it is near. */
function axisTop(heldMax, budget, seen) {
  let top = Math.max(heldMax, 1);
  if (budget !== null && (heldMax === 0 || budget <= BUDGET_IN_VIEW * heldMax)) top = Math.max(top, budget);
  if (seen <= SEEN_IN_VIEW * top) top = Math.max(top, seen);
  return niceCeil(HEADROOM * top);
}

/** The held points a tab stored for `id` ([] if none): [[video_time_s, cache_tokens], ...]. */
function loadHeld(id) {
  try {
    const points = JSON.parse(sessionStorage.getItem(STORE_PREFIX + id) || "[]");
    return Array.isArray(points) ? points.slice(-MAX_POINTS) : [];
  } catch {
    return [];
  }
}

/** Keep `points` for `id` (none: forget it), and only the MAX_STORED sessions stored last. */
function storeHeld(id, points) {
  try {
    const stored = JSON.parse(sessionStorage.getItem(STORE_INDEX) || "[]");
    const index = (Array.isArray(stored) ? stored : []).filter((other) => other !== id);
    if (points) index.push(id);
    for (const old of index.splice(0, Math.max(0, index.length - MAX_STORED))) sessionStorage.removeItem(STORE_PREFIX + old);
    sessionStorage.setItem(STORE_INDEX, JSON.stringify(index));
    if (points) sessionStorage.setItem(STORE_PREFIX + id, JSON.stringify(points));
    else sessionStorage.removeItem(STORE_PREFIX + id);
  } catch {
    // storage full or off: the plot goes on, and a reload starts it again
  }
}

function element(name, className) {
  const node = document.createElementNS(SVG, name);
  if (className) node.setAttribute("class", className);
  return node;
}

/** `line` set across the plotting area at height `py`. */
function across(line, py, width) {
  for (const [name, value] of [["x1", PAD.left], ["x2", width - PAD.right], ["y1", py], ["y2", py]]) {
    line.setAttribute(name, value.toFixed(1));
  }
  return line;
}

function label(text, px, py, anchor, className) {
  const node = element("text", className);
  node.setAttribute("x", px.toFixed(1));
  node.setAttribute("y", py.toFixed(1));
  node.setAttribute("text-anchor", anchor);
  node.textContent = text;
  return node;
}

export class CachePlot {
  constructor({ svg, fields }) {
    this.svg = svg;
    this.fields = fields; // {held, seen, budget}: the legend's latest values
    this.grid = element("g", "plot-grid");
    this.area = element("path", "plot-held-area");
    this.seenLine = element("polyline", "plot-seen");
    this.heldLine = element("polyline", "plot-held");
    this.budgetLine = element("line", "plot-budget");
    this.labels = element("g", "plot-labels");
    // lines above the scale are cut at its top edge
    const clip = element("clipPath");
    clip.id = "plot-clip";
    this.clipRect = element("rect");
    clip.append(this.clipRect);
    const lines = element("g");
    lines.setAttribute("clip-path", "url(#plot-clip)");
    lines.append(this.area, this.seenLine, this.heldLine, this.budgetLine);
    svg.append(clip, this.grid, lines, this.labels);
    window.addEventListener("resize", () => this.draw());
    this.sessionId = null;
    this.clear();
  }

  /** Show session `id` (null: none), with the held points this tab stored for it. */
  use(id) {
    this.sessionId = id;
    this.clear();
    if (id) this.held = loadHeld(id);
    this.draw();
  }

  /** The session is over: its stored points go too. */
  forget() {
    if (this.sessionId) storeHeld(this.sessionId, null);
    this.use(null);
  }

  clear() {
    this.held = []; // [video_time_s, cache_tokens], in video order
    this.seen = []; // [video_time_s, tokens seen by then], from the latest memory report
    this.seenNow = null; // [video_time_s, tokens_seen] of the latest record: the report may lag it
    this.budget = null; // tokens; null: a cache without a budget (`full`)
    this.draw();
  }

  /** A session record: its budget, and what its cache held at its video time (once it has a
   *  frame). Held points never go back in video time. */
  setRecord(record) {
    this.budget = record.policy === "full" ? null : record.budget_tokens;
    const point = [record.video_time_s, record.cache_tokens];
    const last = this.held[this.held.length - 1];
    const fresh = !last || point[0] > last[0] || (point[0] === last[0] && point[1] !== last[1]);
    if (record.frames_ingested) this.seenNow = [record.video_time_s, record.tokens_seen ?? 0];
    if (record.frames_ingested && fresh) {
      this.held.push(point);
      if (this.held.length > MAX_POINTS) this.held = this.held.filter((_, i) => i % 2 === 0 || i === this.held.length - 1);
      if (this.sessionId) storeHeld(this.sessionId, this.held);
    }
    this.draw();
  }

  /** A memory report: the tokens seen per span of video, added up. A span's tokens count from
   *  its start, so that the line never passes below what the cache held. */
  setReport(report) {
    let total = 0;
    this.seen = report.spans.map((span) => {
      total += span.frame_seen + span.text_seen;
      return [span.start_s, total];
    });
    if (this.seen.length && report.video_time_s > this.seen[this.seen.length - 1][0]) this.seen.push([report.video_time_s, total]);
    this.draw();
  }

  /** The seen line: the report's, then on to what the record says was seen since. */
  seenPoints() {
    const last = this.seen[this.seen.length - 1];
    if (!this.seenNow || (last && this.seenNow[1] <= last[1])) return this.seen;
    return [...this.seen, [Math.max(this.seenNow[0], last ? last[0] : 0), this.seenNow[1]]];
  }

  draw() {
    const width = Math.max(this.svg.clientWidth, 200);
    this.svg.setAttribute("viewBox", `0 0 ${width} ${HEIGHT_PX}`);
    this.svg.dataset.points = String(this.held.length);
    const seen = this.seenPoints();
    const last = this.held[this.held.length - 1];
    const seenLast = seen[seen.length - 1];
    const seenTotal = seenLast ? seenLast[1] : 0;
    const drawn = Boolean(last || seenLast);
    const bounded = drawn && this.budget !== null;
    const tMax = Math.max(last ? last[0] : 0, seenLast ? seenLast[0] : 0, 1);
    const heldMax = Math.max(0, ...this.held.map(([, tokens]) => tokens));
    const yMax = axisTop(heldMax, this.budget, seenTotal);
    this.svg.dataset.yMax = String(yMax);
    const x = (t) => PAD.left + ((width - PAD.left - PAD.right) * t) / tMax;
    const y = (tokens) => PAD.top + (HEIGHT_PX - PAD.top - PAD.bottom) * (1 - tokens / yMax);
    const xy = ([t, tokens]) => `${x(t).toFixed(1)},${y(tokens).toFixed(1)}`;

    this.heldLine.setAttribute("points", this.held.map(xy).join(" "));
    this.seenLine.setAttribute("points", seen.map(xy).join(" "));
    this.area.setAttribute("d", this.held.length > 1
      ? `M${xy([this.held[0][0], 0])} ${this.held.map((point) => `L${xy(point)}`).join(" ")} L${xy([last[0], 0])} Z`
      : "");
    this.budgetLine.toggleAttribute("hidden", !bounded);
    if (bounded) across(this.budgetLine, y(this.budget), width);
    for (const [name, value] of [["x", 0], ["y", PAD.top - 2], ["width", width], ["height", HEIGHT_PX - PAD.top + 2]]) {
      this.clipRect.setAttribute(name, value);
    }

    const grid = [];
    const labels = [];
    if (drawn) {
      grid.push(...[0, yMax].map((tokens) => across(element("line"), y(tokens), width)));
      labels.push(label(count(yMax), PAD.left - 6, y(yMax) + 4, "end"), label("0", PAD.left - 6, y(0) + 4, "end"));
      if (bounded && this.budget > 0.1 * yMax && this.budget < 0.85 * yMax) { // clear of the other two
        labels.push(label(count(this.budget), PAD.left - 6, y(this.budget) + 4, "end", "plot-budget-label"));
      }
      const above = [];
      if (bounded && this.budget > yMax) above.push(`budget ${count(this.budget)}`);
      if (seenTotal > yMax) above.push(`seen ${count(seenTotal)}`);
      if (above.length) labels.push(label(`↑ ${above.join(" · ")} (above the scale)`, PAD.left + 6, PAD.top + 11, "start", "plot-above"));
      const step = tickStep(tMax, MAX_X_TICKS);
      for (let t = 0; t <= tMax + 1e-9; t += step) {
        const anchor = t === 0 ? "start" : x(t) > width - PAD.right - 16 ? "end" : "middle";
        labels.push(label(tick(t), x(t), HEIGHT_PX - 5, anchor));
      }
    }
    this.grid.replaceChildren(...grid);
    this.labels.replaceChildren(...labels);

    this.svg.setAttribute("aria-label", this.describe(last, seenTotal));
    this.fields.held.textContent = last ? count(last[1]) : "–";
    this.fields.seen.textContent = seenLast ? count(seenTotal) : "–";
    this.fields.budget.textContent = !drawn ? "–" : bounded ? count(this.budget) : "none";
  }

  describe(last, seenTotal) {
    if (!last) return "No cache yet";
    const of = this.budget === null ? "with no budget" : `of a ${count(this.budget)}-token budget`;
    return `Cache over video time: ${count(last[1])} tokens held ${of} at ${videoTime(last[0])}; `
      + `${count(seenTotal)} tokens seen so far`;
  }
}
