// "Your sessions": every session this caller created (`GET /sessions`: from this address, or
// with the gateway's API key), the demo's and failed ones among them, each with an End button
// (`DELETE /sessions/{id}` as their owner: no token needed). How a user frees a place once the
// gateway's MAX_SESSIONS_PER_KEY is reached; failed sessions do not count toward it.

import { ApiError, endOwnSession, ownSessions } from "./api.js";
import { count, timeOfDay } from "./format.js";

const REFRESH_MS = 5000;
const HIDDEN_REFRESH_MS = 30000;

export class SessionList {
  /** onEnding(id): a session is about to be ended from the list (the page lets go of it first
   *  when it is its own); onError(message): an end that failed. */
  constructor({ list, empty, note, onEnding, onError }) {
    this.list = list;
    this.empty = empty;
    this.note = note;
    this.onEnding = onEnding;
    this.onError = onError;
    this.current = null; // the id of the page's own session
    this.limit = null; // the gateway's MAX_SESSIONS_PER_KEY, once listed
    this.timer = null;
    this.loading = null;
    document.addEventListener("visibilitychange", () => !document.hidden && this.refresh());
  }

  /** Mark the page's own session (null: none). */
  setCurrent(id) {
    this.current = id;
    for (const item of this.list.children) item.dataset.current = String(item.dataset.id === id);
  }

  /** List the sessions again now (after the listing under way, if any), then every few seconds. */
  refresh() {
    clearTimeout(this.timer);
    const loading = (this.loading || Promise.resolve()).then(() => this.load());
    this.loading = loading;
    loading.finally(() => {
      if (this.loading !== loading) return;
      this.loading = null;
      this.timer = setTimeout(() => this.refresh(), document.hidden ? HIDDEN_REFRESH_MS : REFRESH_MS);
    });
    return loading;
  }

  async load() {
    try {
      this.render(await ownSessions());
    } catch (err) {
      const why = err.status === 401 || err.status === 403
        ? "Listing sessions needs an API key, which this page does not send."
        : `The sessions could not be listed: ${err.message}.`;
      this.showEmpty(why);
    }
  }

  render({ sessions, counted, max_sessions }) {
    this.limit = max_sessions;
    this.note.textContent = `${count(counted)} of ${count(max_sessions)} in use`;
    this.note.title = "Sessions that count toward this address's (or API key's) limit; failed ones do not.";
    this.list.replaceChildren(...sessions.map((session) => this.item(session)));
    if (sessions.length) this.empty.hidden = true;
    else this.showEmpty("None: a session you create, here or through the API, shows here.");
  }

  showEmpty(text) {
    this.empty.textContent = text;
    this.empty.hidden = false;
    if (!this.list.children.length) this.note.textContent = "";
  }

  item(session) {
    const short = session.id.slice(0, 8);
    const item = document.createElement("li");
    item.className = "owned";
    item.dataset.id = session.id;
    item.dataset.state = session.state;
    item.dataset.current = String(session.id === this.current);
    const name = document.createElement("span");
    name.className = "owned-id";
    name.textContent = short;
    name.title = session.id;
    const state = document.createElement("span");
    state.className = "owned-state";
    state.textContent = session.state;
    if (session.error) state.title = session.error;
    const meta = document.createElement("span");
    meta.className = "owned-meta";
    meta.textContent = [session.model, `created ${timeOfDay(session.created_at)}`, session.id === this.current ? "this page" : null]
      .filter(Boolean).join(" · ");
    const end = document.createElement("button");
    end.type = "button";
    end.className = "secondary small";
    end.textContent = "End";
    end.setAttribute("aria-label", `End session ${short}`);
    end.addEventListener("click", () => this.end(session.id, end));
    item.append(name, state, end, meta);
    return item;
  }

  async end(id, button) {
    button.disabled = true;
    button.textContent = "Ending…";
    this.onEnding(id);
    try {
      await endOwnSession(id);
    } catch (err) {
      if (!(err instanceof ApiError && err.status === 404)) this.onError(`The session could not be ended: ${err.message}.`);
    }
    await this.refresh();
  }
}
