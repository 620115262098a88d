"""The gateway's endpoints as both clients call them, each written once as the `Call` it sends
(what to send, what its reply gives). `Client` and `AsyncClient` add the transport: `send`,
which returns the reply's value on the sync client and is awaited for it on the async one, and
`read`, which iterates (`async for` on the async client) over an event stream."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Unpack

import httpx

from streamvqa.client import wire
from streamvqa.client.models import Answer, Watch
from streamvqa.client.sse import AnswerEvents, SessionEvents
from streamvqa.client.wire import Call, T

Reply = T | Awaitable[T]  # the value on the sync client, to be awaited on the async one


def given(options: dict[str, Any]) -> dict[str, Any]:
    """The options given: each one left at None keeps the gateway's default."""
    return {name: value for name, value in options.items() if value is not None}


class ClientEndpoints:
    """What `Client` and `AsyncClient` ask of the gateway itself; see `streamvqa.client.Client`.
    A subclass names its httpx client and session types and adds `send` and `read`."""

    http_type: type[httpx.Client] | type[httpx.AsyncClient]
    session_type: type[SessionEndpoints]

    def __init__(
        self, base_url: str | None = None, api_key: str | None = None, timeout_s: float = wire.DEFAULT_TIMEOUT_S
    ) -> None:
        self.base_url, self.timeout_s = wire.gateway_url(base_url), timeout_s
        self.http = self.http_type(**wire.http_options(self.base_url, api_key, timeout_s))

    def create_session(self, **options: Any) -> Reply[Any]:
        """A new session. Options (all optional): fps, model, policy, budget_tokens,
        system_prompt, policy_options, recall, host_budget_tokens, retrieval_tokens; see
        `POST /sessions` in docs/api.md."""
        return self.send(Call("POST", "/sessions", self._created, (201,), json=given(options)))

    def session(self, session_id: str, token: str) -> Any:
        """An existing session, from its id and token."""
        return self.session_type(self, session_id, token)

    def sessions(self) -> Reply[list[dict]]:
        """Your sessions' records, failed ones among them, newest first (`GET /sessions`): those of
        your API key; without keys, those of your address where the gateway sets
        ADDRESS_OWNS_SESSIONS, else none (a token opens its own session only: `Session.info()`)."""
        return self.send(Call("GET", "/sessions", lambda reply: reply.json()["sessions"]))

    def end_session(self, session_id: str) -> Reply[None]:
        """End one of your sessions without its token (`DELETE /sessions/{id}` as its owner: your
        API key; without keys, your address where the gateway sets ADDRESS_OWNS_SESSIONS, else
        `401 unauthorized`: end it with its token, `Session.delete()`); a gone one is no error."""
        return self.send(Call("DELETE", f"/sessions/{session_id}", wire.nothing, (204,), gone=wire.ANY_CODE))

    def _created(self, reply: httpx.Response) -> Any:
        body = reply.json()
        return self.session(body["id"], body["token"])


class SessionEndpoints:
    """What `Session` and `AsyncSession` ask of the gateway; see `streamvqa.client.Session`."""

    def __init__(self, client: Any, session_id: str, token: str) -> None:
        self.client, self.id, self.token = client, session_id, token
        self._path = f"/sessions/{session_id}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r})"

    def info(self) -> Reply[dict]:
        """The session record: state, error, frames_ingested, video_time_s, cache_tokens, ..."""
        return self._send("GET", "")

    def upload(self, source: wire.UploadSource, progress: wire.UploadProgress | None = None) -> Reply[int]:
        """Send a video file (a path or a binary file object) in chunks; the bytes the gateway took.
        `progress` gets (bytes sent, total bytes or None when unknown) after each chunk."""
        return self._send("POST", "/upload", lambda reply: reply.json()["bytes"], (202,), upload=(source, progress))

    def ask(self, question: str, max_new_tokens: int = 64, **sampling: Unpack[wire.SamplingOptions]) -> Reply[Answer]:
        """Ask about what the session has seen so far; waits for the whole answer. Greedy unless
        `sampling` says otherwise: `temperature`, `top_p`, `top_k`, `seed`, `stop`."""
        body = {"question": question, "max_new_tokens": max_new_tokens, **given(sampling)}
        return self._send("POST", "/ask", lambda reply: Answer.from_json(reply.json(), question), json=body)

    def ask_stream(
        self, question: str, max_new_tokens: int = 64, **sampling: Unpack[wire.SamplingOptions]
    ) -> AnswerStream:
        """Ask, and iterate over the answer's text as it is generated (`async for` on the async
        client); then `.answer` is the Answer. `sampling` as for `ask`."""
        body = {"question": question, "max_new_tokens": max_new_tokens, **given(sampling), "stream": True}
        return AnswerStream(self, question, self._call("POST", "/ask", json=body))

    def memory(self) -> Reply[dict]:
        """The cache: policy, budget_tokens, cache_tokens, evictions, the host tier (recall), and
        spans of video time with the tokens seen, held and in the host tier for each
        (`GET /sessions/{id}/memory`)."""
        return self._send("GET", "/memory")

    def watch(self, condition: str, every_s: float | None = None, threshold: float | None = None) -> Reply[Watch]:
        """Watch the video for a yes/no condition: from the session's video time now on, every
        `every_s` seconds of video (default 2) its worker scores p(yes), and the watch fires when
        it reaches `threshold` (default 0.5), once per episode (docs/api.md, "Watches"). Its
        firings come from `firings()`, and stay in the watch's `fired`."""
        body = {"condition": condition, **given({"every_s": every_s, "threshold": threshold})}
        return self._send("POST", "/watches", lambda reply: Watch.model_validate(reply.json()), (201,), json=body)

    def watches(self) -> Reply[list[Watch]]:
        """The session's watches, oldest first, each with its firings and its last check."""
        return self._send("GET", "/watches", lambda reply: [Watch.model_validate(w) for w in reply.json()["watches"]])

    def unwatch(self, watch_id: str) -> Reply[None]:
        """Stop a watch and forget its firings (their events stay); a gone watch is no error."""
        return self._send("DELETE", f"/watches/{watch_id}", wire.nothing, (204,), gone="watch_not_found")

    def events(self, since: str | None = "0") -> Any:
        """The session's events as they come (`GET /sessions/{id}/events`: `ingest`, `state`,
        `warning`, `error`, `watch_fired`), each a dict with its `type`: from the first it keeps
        (`since="0"`, the last 1000) or only new ones (None). Ends when the session is deleted or
        expires; leave the loop to stop sooner. `async for` on the async client."""
        params = {"since": since} if since else {}
        return self.client.read(self._call("GET", "/events", params=params), SessionEvents())

    def delete(self) -> Reply[None]:
        """Forget the session (its worker frees its memory); deleting a gone session is no error."""
        return self._send("DELETE", "", wire.nothing, (204,), gone=wire.ANY_CODE)

    def _call(self, method: str, path: str, *reply: Any, **fields: Any) -> Call:
        """A call on this session: its path under the session's, with its token; `reply`: the
        Call's result and expected statuses, when not a JSON body with 200."""
        return Call(method, self._path + path, *reply, token=self.token, **fields)

    def _send(self, method: str, path: str, *reply: Any, **fields: Any) -> Reply[Any]:
        return self.client.send(self._call(method, path, *reply, **fields))


class AnswerStream:
    """An answer as it is generated: iterate for its text, piece by piece (`async for` on the
    async client's); once the iteration is over, `answer` holds the whole Answer. A gateway that
    does not stream answers gives the whole text as one piece."""

    def __init__(self, session: SessionEndpoints, question: str, call: Call) -> None:
        self.session, self.question, self.call = session, question, call
        self._events: AnswerEvents | None = None

    @property
    def answer(self) -> Answer | None:
        return self._events.answer if self._events else None

    def __iter__(self) -> Any:
        return self._pieces()

    def __aiter__(self) -> Any:
        return self._pieces()

    def _pieces(self) -> Any:
        self._events = AnswerEvents(self.question)
        return self.session.client.read(self.call, self._events)
