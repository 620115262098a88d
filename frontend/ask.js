// Questions and answers: the question box (Enter sends, Shift+Enter breaks the line) and the
// history, newest first (the page says so), shown again after a reload from what the API keeps. Each answer streams in token by token, then shows the moments of video
// it drew on as chips, the seconds it recalled from the host tier (with recall), and its timing.
// Each item's `data-state`: waiting, streaming, done, error.

import { clock, milliseconds, percent, videoTime, count } from "./format.js";

/** Whole seconds as runs of consecutive ones: [4, 5, 6, 9] -> [[4, 7], [9, 10]], each [start, end). */
export function secondRanges(seconds) {
  const ranges = [];
  for (const s of [...new Set(seconds)].sort((a, b) => a - b)) {
    const last = ranges[ranges.length - 1];
    if (last && last[1] === s) last[1] = s + 1;
    else ranges.push([s, s + 1]);
  }
  return ranges;
}

export class Conversation {
  /** onFocus({evidence, recalled, seek_s}): an answer was finished or chosen: the evidence times
   *  to mark (all of them, or the one chosen), the seconds it recalled, and where to seek (or null). */
  constructor({ form, input, history, empty, order, onFocus }) {
    this.form = form;
    this.input = input;
    this.history = history;
    this.empty = empty;
    this.order = order;
    this.onFocus = onFocus;
    this.hint = form.querySelector(".hint");
    this.hintText = this.hint.textContent; // shown while questions may be asked
    this.button = form.querySelector("button[type=submit]");
    this.refused = false;
    this.session = null;
    this.streams = new Set();
    this.asked = 0;
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.submit();
    });
    input.addEventListener("input", () => this.enable());
    input.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        form.requestSubmit();
      }
    });
  }

  /** Ask in this session from now on (null: no session, the box is disabled). */
  use(session) {
    for (const stream of this.streams) stream.stop();
    this.streams.clear();
    this.session = session;
    this.refuse(session ? null : "Create a session to ask.");
    if (!session) {
      this.history.replaceChildren();
      this.empty.hidden = false;
      this.order.hidden = true;
    }
  }

  /** Show the session's conversation as the API keeps it (after a reload): each question with its
   *  answer, its error, or its tokens followed while it is still being answered. */
  async restore(session) {
    const { answers } = await session.answers();
    if (session !== this.session) return;
    for (const asked of answers) { // oldest first: each goes on top of the one before
      const item = this.addItem(asked.question);
      if (asked.status === "done") this.finish(item, asked.result);
      else if (asked.status === "error") this.fail(item, asked.message);
      else this.follow(session, item, asked.answer_id);
    }
  }

  /** Why a question cannot be asked now (shown under the box, which is disabled), or null. */
  refuse(reason) {
    this.hint.textContent = reason || this.hintText;
    this.hint.dataset.refused = String(Boolean(reason));
    this.refused = Boolean(reason);
    this.input.disabled = this.refused;
    this.enable();
  }

  /** Ask is enabled for a question with text in it (not only white space), when one may be asked. */
  enable() {
    this.button.disabled = this.refused || !this.input.value.trim();
  }

  async submit() {
    const question = this.input.value.trim();
    if (!question || !this.session) return;
    const session = this.session;
    this.input.value = "";
    this.enable();
    const item = this.addItem(question);
    try {
      const { answerId, done } = await session.ask(question);
      if (session !== this.session) return;
      if (done) return this.finish(item, done);
      this.follow(session, item, answerId);
    } catch (err) {
      this.fail(item, err.message);
    }
  }

  follow(session, item, answerId) {
    const answer = item.querySelector(".answer");
    let tokens = 0;
    const stream = session.answerEvents(answerId, (name, data) => {
      if (name === "token") {
        if (tokens === 0) answer.textContent = "";
        tokens += 1;
        answer.append(data.text); // one text node per token: the answer grows as it comes
        item.dataset.state = "streaming";
        item.dataset.tokens = String(tokens);
      } else if (name === "done") {
        this.finish(item, data);
      } else if (name === "error") {
        this.fail(item, data.message);
      }
    }, (state, problem) => {
      const note = item.querySelector(".note");
      if (state === "reconnecting") {
        note.textContent = "Connection lost; resuming the answer…";
        note.hidden = false;
      } else if (state === "open") {
        note.hidden = true;
      } else if (state === "failed") {
        this.fail(item, problem.message);
      }
    });
    this.streams.add(stream);
    stream.finished.then(() => this.streams.delete(stream));
  }

  addItem(question) {
    this.asked += 1;
    const item = document.createElement("li");
    item.className = "qa";
    item.dataset.state = "waiting";
    item.innerHTML = `
      <p class="question"></p>
      <p class="answer" aria-busy="true"><span class="thinking">Thinking…</span></p>
      <p class="note" hidden></p>
      <div class="evidence" hidden><span class="evidence-label">Evidence</span><ul class="chips"></ul></div>
      <div class="recalled" hidden><span class="evidence-label">Recalled from host</span><ul class="chips"></ul></div>
      <p class="meta" hidden></p>`;
    item.querySelector(".question").textContent = question;
    this.history.prepend(item);
    this.empty.hidden = true;
    this.order.hidden = false;
    return item;
  }

  finish(item, done) {
    item.dataset.state = "done";
    const answer = item.querySelector(".answer");
    answer.textContent = done.answer || "(an empty answer)";
    answer.removeAttribute("aria-busy");
    item.querySelector(".note").hidden = true;
    const evidence = [...(done.evidence || [])].sort((a, b) => a.time_s - b.time_s);
    const times = evidence.map((e) => e.time_s);
    const recalled = done.recalled_s || [];
    if (evidence.length) {
      item.querySelector(".evidence .chips").replaceChildren(...evidence.map((e) => this.chip(e, times, recalled)));
      item.querySelector(".evidence").hidden = false;
    }
    if (recalled.length) {
      const ranges = secondRanges(recalled);
      item.querySelector(".recalled .chips").replaceChildren(...ranges.map((r) => this.recalledChip(r, times, recalled)));
      item.querySelector(".recalled").hidden = false;
    }
    if (evidence.length || recalled.length) this.onFocus({ evidence: times, recalled, seek_s: null });
    const meta = item.querySelector(".meta");
    const parts = [`at ${videoTime(done.video_time_s)} of video`, `${count(done.cache_tokens)} tokens in cache`];
    if (done.ttft_ms != null) parts.push(`first token ${milliseconds(done.ttft_ms)}`);
    if (done.total_ms != null) parts.push(`total ${milliseconds(done.total_ms)}`);
    meta.textContent = parts.join(" · ");
    meta.hidden = false;
  }

  chip(evidence, times, recalled) {
    const li = document.createElement("li");
    const button = document.createElement("button");
    button.type = "button";
    button.className = "chip";
    button.dataset.time = String(evidence.time_s);
    button.style.setProperty("--weight", Math.min(1, evidence.weight));
    const time = document.createElement("span");
    time.textContent = videoTime(evidence.time_s);
    const weight = document.createElement("span");
    weight.className = "chip-weight";
    weight.textContent = percent(evidence.weight);
    button.append(time, " ", weight);
    button.title = `${percent(evidence.weight)} of the answer's attention to frames`;
    button.setAttribute("aria-label", `Show ${videoTime(evidence.time_s)} (${percent(evidence.weight)} of the attention)`);
    button.addEventListener("click", () => this.onFocus({ evidence: [evidence.time_s], recalled, seek_s: evidence.time_s }));
    li.append(button);
    return li;
  }

  /** A run of recalled seconds [start, end): shows them in the memory view and seeks to its start. */
  recalledChip([start, end], times, recalled) {
    const li = document.createElement("li");
    const button = document.createElement("button");
    button.type = "button";
    button.className = "chip chip-recalled";
    button.dataset.start = String(start);
    button.dataset.end = String(end);
    button.textContent = `${clock(start)}–${clock(end)}`;
    const seconds = end - start === 1 ? "1 second" : `${end - start} seconds`;
    button.title = `The answer brought ${seconds} of video back from the host tier`;
    button.setAttribute("aria-label", `Show ${clock(start)} to ${clock(end)}, recalled from the host tier (${seconds})`);
    button.addEventListener("click", () => this.onFocus({ evidence: times, recalled, seek_s: start }));
    li.append(button);
    return li;
  }

  fail(item, message) {
    item.dataset.state = "error";
    const answer = item.querySelector(".answer");
    answer.removeAttribute("aria-busy");
    answer.textContent = `Error: ${message}`;
    item.querySelector(".note").hidden = true;
  }
}
