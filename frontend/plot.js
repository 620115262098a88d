// The cache over video time, drawn as SVG: how many tokens the session's cache held after each
// step (from the session's record, as it is polled and as `ingest` events update it) and how many
// it had seen in all (the memory report's spans, added up), with the budget as a dashed line.
// A bounded cache fills up to its budget and then stays flat while the seen line goes on rising:
// the gap between them is what was evicted. The held line starts when the page first saw the
// session (a reload starts it again); the seen line always covers the whole stream.

import { count, tick, tickStep, videoTime } from "./format.js";

const SVG = "http://www.w3.org/2000/svg";
const MAX_POINTS = 1200; // held points kept; past it every other one is dropped
const HEIGHT_PX = 140;
const PAD = { left: 48, right: 10, top: 10, bottom: 20 }; // px around the plotting area
const MAX_X_TICKS = 6;

/** The smallest of 1, 2, 2.5, 5 times a power of ten that is at least `value`. */
function niceCeil(value) {
  const power = 10 ** Math.floor(Math.log10(Math.max(value, 1)));
  return [1, 2, 2.5, 5, 10].map((m) => m * power).find((v) => v >= value);
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
    svg.append(this.grid, this.area, this.seenLine, this.heldLine, this.budgetLine, this.labels);
    window.addEventListener("resize", () => this.draw());
    this.clear();
  }

  clear() {
    this.held = []; // [video_time_s, cache_tokens], in video order
    this.seen = []; // [video_time_s, tokens seen by then], from the latest memory report
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
    if (record.frames_ingested && fresh) {
      this.held.push(point);
      if (this.held.length > MAX_POINTS) this.held = this.held.filter((_, i) => i % 2 === 0 || i === this.held.length - 1);
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

  draw() {
    const width = Math.max(this.svg.clientWidth, 200);
    this.svg.setAttribute("viewBox", `0 0 ${width} ${HEIGHT_PX}`);
    this.svg.dataset.points = String(this.held.length);
    const last = this.held[this.held.length - 1];
    const seenLast = this.seen[this.seen.length - 1];
    const seenTotal = seenLast ? seenLast[1] : 0;
    const drawn = Boolean(last || seenLast);
    const bounded = drawn && this.budget !== null;
    const tMax = Math.max(last ? last[0] : 0, seenLast ? seenLast[0] : 0, 1);
    const yMax = niceCeil(Math.max(seenTotal, ...this.held.map(([, tokens]) => tokens), this.budget ?? 0, 1));
    const x = (t) => PAD.left + ((width - PAD.left - PAD.right) * t) / tMax;
    const y = (tokens) => PAD.top + (HEIGHT_PX - PAD.top - PAD.bottom) * (1 - tokens / yMax);
    const xy = ([t, tokens]) => `${x(t).toFixed(1)},${y(tokens).toFixed(1)}`;

    this.heldLine.setAttribute("points", this.held.map(xy).join(" "));
    this.seenLine.setAttribute("points", this.seen.map(xy).join(" "));
    this.area.setAttribute("d", this.held.length > 1
      ? `M${xy([this.held[0][0], 0])} ${this.held.map((point) => `L${xy(point)}`).join(" ")} L${xy([last[0], 0])} Z`
      : "");
    this.budgetLine.toggleAttribute("hidden", !bounded);
    if (bounded) across(this.budgetLine, y(this.budget), width);

    const grid = [];
    const labels = [];
    if (drawn) {
      grid.push(...[0, yMax].map((tokens) => across(element("line"), y(tokens), width)));
      labels.push(label(count(yMax), PAD.left - 6, y(yMax) + 4, "end"), label("0", PAD.left - 6, y(0) + 4, "end"));
      if (bounded && this.budget > 0.1 * yMax && this.budget < 0.85 * yMax) { // clear of the other two
        labels.push(label(count(this.budget), PAD.left - 6, y(this.budget) + 4, "end", "plot-budget-label"));
      }
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
