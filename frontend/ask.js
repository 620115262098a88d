// Questions and answers: the question box (Enter sends, Shift+Enter breaks the line) and the
// history, newest first. Each answer streams in token by token, then shows the moments of video
// it drew on as chips, and its timing. Each item's `data-state`: waiting, streaming, done, error.

import { milliseconds, percent, videoTime, count } from "./format.js";

export class Conversation {
  /** onEvidence(times, focus_s): an answer's evidence times, and the one the user chose, if any. */
  constructor({ form, input, history, empty, onEvidence }) {
    this.form = form;
    this.input = input;
    this.history = history;
    this.empty = empty;
    this.onEvidence = onEvidence;
    this.session = null;
    this.streams = new Set();
    this.asked = 0;
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.submit();
    });
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
    this.input.disabled = !session;
    this.form.querySelector("button[type=submit]").disabled = !session;
    if (!session) {
      this.history.replaceChildren();
      this.empty.hidden = false;
    }
  }

  async submit() {
    const question = this.input.value.trim();
    if (!question || !this.session) return;
    const session = this.session;
    this.input.value = "";
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
      <p class="meta" hidden></p>`;
    item.querySelector(".question").textContent = question;
    this.history.prepend(item);
    this.empty.hidden = true;
    return item;
  }

  finish(item, done) {
    item.dataset.state = "done";
    const answer = item.querySelector(".answer");
    answer.textContent = done.answer || "(an empty answer)";
    answer.removeAttribute("aria-busy");
    item.querySelector(".note").hidden = true;
    const evidence = [...(done.evidence || [])].sort((a, b) => a.time_s - b.time_s);
    if (evidence.length) {
      const chips = item.querySelector(".chips");
      chips.replaceChildren(...evidence.map((e) => this.chip(e, evidence)));
      item.querySelector(".evidence").hidden = false;
      this.onEvidence(evidence.map((e) => e.time_s), null);
    }
    const meta = item.querySelector(".meta");
    const parts = [`at ${videoTime(done.video_time_s)} of video`, `${count(done.cache_tokens)} tokens in cache`];
    if (done.ttft_ms != null) parts.push(`first token ${milliseconds(done.ttft_ms)}`);
    if (done.total_ms != null) parts.push(`total ${milliseconds(done.total_ms)}`);
    meta.textContent = parts.join(" · ");
    meta.hidden = false;
  }

  chip(evidence, all) {
    const li = document.createElement("li");
    const button = document.createElement("button");
    button.type = "button";
    button.className = "chip";
    button.dataset.time = String(evidence.time_s);
    button.style.setProperty("--weight", Math.min(1, evidence.weight));
    button.textContent = videoTime(evidence.time_s);
    button.title = `${percent(evidence.weight)} of the answer's attention to frames`;
    button.setAttribute("aria-label", `Show ${videoTime(evidence.time_s)} (${percent(evidence.weight)} of the attention)`);
    button.addEventListener("click", () => this.onEvidence(all.map((e) => e.time_s), evidence.time_s));
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
