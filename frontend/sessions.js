// "Your sessions": the sessions this browser created (the demo's and failed ones among them),
// each with an End button. How a user frees a place once the gateway's MAX_SESSIONS_PER_KEY is
// reached; failed sessions do not count toward it. A session's token is its only key: the page
// keeps the token of every session it creates (in localStorage, for every tab of this origin),
// lists each with `GET /sessions` and its token, ends it with `DELETE /sessions/{id}` and its
// token, and forgets the token once the gateway lists its session no more. Where the gateway lets
// an address own its sessions (ADDRESS_OWNS_SESSIONS), or with an API key, `GET /sessions`
// without a token lists every session of the caller too, those made through the API among them,
// and those the page has no token for end without one.
// The list is fetched every few seconds and at once after the page creates or ends a session;
// the row of the page's own session follows the state the page knows from its live updates, and a
// session the page ended leaves the list at once (a listing begun before it ended does not bring
// it back).

import { ApiError, endOwnSession, ownSessions } from "./api.js";
import { count, timeOfDay } from "./format.js";

const REFRESH_MS = 5000;
const HIDDEN_REFRESH_MS = 30000;
const TOKENS_KEY = "streamvqa.tokens"; // {id: token} of the sessions this browser created
const MAX_TOKENS = 256; // the oldest are forgotten past this (a caller holds 8 sessions by default)
const EMPTY = "None: a session you create here shows here.";

/** The tokens of the sessions this browser created, in localStorage (where the browser refuses
 *  storage, this page's own copy). */
class Tokens {
  constructor() {
    this.kept = {};
  }

  all() {
    try {
      return JSON.parse(localStorage.getItem(TOKENS_KEY)) || {};
    } catch {
      return { ...this.kept };
    }
  }

  get(id) {
    return this.all()[id];
  }

  add(id, token) {
    this.save({ ...this.all(), [id]: token });
  }

  forget(id) {
    const all = this.all();
    delete all[id];
    this.save(all);
  }

  save(all) {
    this.kept = Object.fromEntries(Object.entries(all).slice(-MAX_TOKENS));
    try {
      localStorage.setItem(TOKENS_KEY, JSON.stringify(this.kept));
    } catch {
      // no storage: this page's copy only
    }
  }
}

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
    this.known = null; // {state, error} of the page's own session, as the page last heard
    this.ended = new Set(); // ids the page ended, left out while a listing still names them
    this.limit = null; // the gateway's MAX_SESSIONS_PER_KEY, once listed
    this.timer = null;
    this.loading = null;
    this.tokens = new Tokens();
    document.addEventListener("visibilitychange", () => !document.hidden && this.refresh());
  }

  /** A session this page created (a Session, with its token): listed, and ended, by its token. */
  remember(session) {
    this.tokens.add(session.id, session.token);
  }

  /** Mark the page's own session (null: none). */
  setCurrent(id) {
    if (id !== this.current) this.known = null;
    this.current = id;
    for (const item of this.list.children) item.dataset.current = String(item.dataset.id === id);
  }

  /** The page's own session's record, as its live updates bring it: its row shows that state. */
  follow(record) {
    if (record.id !== this.current) return;
    this.known = { state: record.state, error: record.error };
    const item = [...this.list.children].find((child) => child.dataset.id === record.id);
    if (item) showState(item, this.known);
  }

  /** A session the page ended (or found gone): its row goes now, and the list is fetched again. */
  drop(id) {
    this.ended.add(id);
    for (const item of [...this.list.children]) if (item.dataset.id === id) item.remove();
    if (!this.list.children.length) this.showEmpty(EMPTY);
    return this.refresh();
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
      const listing = await ownSessions(); // the caller's count; its sessions where it owns them
      const listed = new Set(listing.sessions.map((session) => session.id));
      const unlisted = Object.entries(this.tokens.all()).filter(([id]) => !listed.has(id));
      const found = await Promise.all(unlisted.map(([id, token]) => this.opened(id, token)));
      const sessions = [...listing.sessions, ...found.filter(Boolean)].sort((a, b) => b.created_at - a.created_at);
      this.render({ ...listing, sessions });
    } catch (err) {
      const why = err.status === 401 || err.status === 403
        ? "Listing sessions needs an API key, which this page does not send."
        : `The sessions could not be listed: ${err.message}.`;
      this.showEmpty(why);
    }
  }

  /** The session `token` opens, as `GET /sessions` lists it with that token; null when it opens
   *  none any more (the token is forgotten) or the gateway could not say (it is tried again). */
  async opened(id, token) {
    let sessions;
    try {
      ({ sessions } = await ownSessions(token));
    } catch {
      return null;
    }
    const session = sessions.find((listed) => listed.id === id);
    if (!session) this.tokens.forget(id);
    return session || null;
  }

  render({ sessions, counted, max_sessions }) {
    this.limit = max_sessions;
    const listed = new Set(sessions.map((session) => session.id));
    for (const id of this.ended) if (!listed.has(id)) this.ended.delete(id); // gone from the server too
    const unlisted = counted - sessions.filter((session) => session.state !== "error").length;
    this.note.textContent = `${count(counted)} of ${count(max_sessions)} in use` + (unlisted > 0 ? `, ${count(unlisted)} not listed` : "");
    this.note.title = "Sessions that count toward this address's (or API key's) limit; failed ones do not." + (unlisted > 0
      ? " Those not listed were created from this address with tokens this page does not have (through the API, or in "
        + "another browser): end them with their tokens, or they end by themselves once idle."
      : "");
    sessions = sessions.filter((session) => !this.ended.has(session.id));
    this.list.replaceChildren(...sessions.map((session) => this.item(session)));
    if (sessions.length) this.empty.hidden = true;
    else this.showEmpty(EMPTY, unlisted > 0);
  }

  /** `text` in place of the list; the note goes too, unless `keepNote` (it counts sessions not listed). */
  showEmpty(text, keepNote = false) {
    this.empty.textContent = text;
    this.empty.hidden = false;
    if (!this.list.children.length && !keepNote) this.note.textContent = "";
  }

  item(session) {
    const short = session.id.slice(0, 8);
    const item = document.createElement("li");
    item.className = "owned";
    item.dataset.id = session.id;
    item.dataset.current = String(session.id === this.current);
    const name = document.createElement("span");
    name.className = "owned-id";
    name.textContent = short;
    name.title = session.id;
    const state = document.createElement("span");
    state.className = "owned-state";
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
    showState(item, session.id === this.current && this.known ? this.known : session);
    return item;
  }

  async end(id, button) {
    button.disabled = true;
    button.textContent = "Ending…";
    this.onEnding(id);
    try {
      await endOwnSession(id, this.tokens.get(id));
    } catch (err) {
      if (!(err instanceof ApiError && err.status === 404)) {
        this.onError(`The session could not be ended: ${err.message}.`);
        return this.refresh();
      }
    }
    await this.drop(id);
  }
}

/** A row's state: its text, `data-state`, and why it failed as its title. */
function showState(item, { state, error }) {
  item.dataset.state = state;
  const element = item.querySelector(".owned-state");
  element.textContent = state;
  element.title = error || "";
}
