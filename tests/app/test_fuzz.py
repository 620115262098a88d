"""Property-based fuzzing of the gateway, against a real gateway, worker and Redis.

REST: schemathesis generates requests, valid and invalid, for every operation the gateway
publishes in /openapi.json (new routes are picked up as they appear). Two thirds of the
requests on a session name a live session (and a real answer id): as its owner, with its token,
so that they reach past 401, 403 and 404, or as a stranger, with the generated credentials.
The property: no 5xx, except a 503 the README
documents for that request (`no_worker` for a model no worker serves, `no_capacity`); every
error is JSON with a `code` and a `message` (on `/v1/...`, inside OpenAI's `error` object, and
the session is the body's `session_id` there), also inside an event stream; every 2xx JSON body
matches the published schema; nothing hangs.

WebSocket: random first messages on `WS /sessions/{id}/stream`, then, after a valid `start`
(each format, and none), random text and binary messages, `end`, and a question. The property:
the gateway answers with the events and close codes docs/streaming.md documents (never 1011),
answers the question, reports `ingested` or closes, within a timeout, and goes on serving other
sessions.

Examples are bounded and derandomized: the same cases every run.
"""

import json
import time

import hypothesis.strategies as st
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, example, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import response_schema_conformance
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from streamvqa.protocol import CloseCode, frame_message
from tests.media import timed_jpeg
from tests.support import Client, StreamSocket

MODEL = "tiny-random-llava"  # the model the stack's worker serves
REQUEST_TIMEOUT_S = 30  # a request (or an event stream's next line) slower than this is a hang
SETTLE_TIMEOUT_S = 15  # a stream socket must close or report `ingested` this soon after `end`
FORMATS = ("webm", "mp4", "frames")
CLOSE_CODES = {1000, 1009} | {int(code) for code in CloseCode}  # docs/streaming.md; never 1011
EVENT_TYPES = {
    "started", "state", "ingest", "warning", "error", "backpressure",
    "answer_started", "answer_token", "answer_done", "answer_error",
}
ERROR_CODES = {  # of `error` and `answer_error` events; `internal_error` (a gateway bug) is not among them
    "decode_failed", "empty_stream", "bad_frame", "bad_message", "session_error",
    "invalid_request", "too_many_questions", "session_reset", "answer_timeout", "no_video",
}
OVERSIZED = b"\0" * (4 * 1024 * 1024 + 1)  # over WS_MAX_MESSAGE_BYTES: closes with 1009

# No shrinking: against live processes a failing example can cost a whole timeout per try.
REST_EXAMPLES = settings(
    max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None,
    phases=[Phase.explicit, Phase.generate],
)
WS_EXAMPLES = settings(REST_EXAMPLES, max_examples=30)


class Sessions:
    """Live sessions for the fuzzed requests: one shared session with one answered question and
    one watch, and a fresh session for each request that uses a session up (DELETE, upload)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.shared = self.create()
        self.shared.show_frames()
        reply = self.shared.ask("What do you see?", max_new_tokens=2)
        assert reply.status_code == 200, reply.text
        self.answer_id = reply.json()["answer_id"]
        self._watches = {self.shared.id: self.watch(self.shared)}
        self._fresh: list[Client] = []

    @staticmethod
    def watch(user: Client) -> str:
        reply = user.http.post(f"/sessions/{user.id}/watches", json={"condition": "a bike"}, headers=user.auth)
        assert reply.status_code == 201, reply.text
        return reply.json()["id"]

    def watch_of(self, user: Client) -> str:
        """A watch of the user's session (made for a fresh one)."""
        if user.id not in self._watches:
            self._watches[user.id] = self.watch(user)
        return self._watches[user.id]

    def create(self) -> Client:
        user = Client(self.url)
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        while (reply := user.create()).status_code == 429 and time.monotonic() < deadline:
            time.sleep(float(reply.headers.get("Retry-After", "1")))  # the fuzzing used the caller's rate up
        assert reply.status_code == 201, reply.text
        return user

    def for_case(self, case) -> Client:
        if case.method.upper() == "DELETE" or case.path.endswith("/upload"):
            self._fresh.append(self.create())
            return self._fresh[-1]
        return self.shared

    def forget_fresh(self) -> None:
        for user in self._fresh:
            user.delete()
            user.http.close()
        self._fresh.clear()


@pytest.fixture(scope="module")
def sessions(stack):
    found = Sessions(stack.url)
    yield found
    found.forget_fresh()
    found.shared.delete()


# -- REST ------------------------------------------------------------------------------------


def _allowed_503(case) -> set[str]:
    """The 503 codes the README documents for this request."""
    if (case.method.upper(), case.path) != ("POST", "/sessions"):
        return set()
    model = case.body.get("model") if isinstance(case.body, dict) else None
    return {"no_capacity"} | ({"no_worker"} if model not in (None, MODEL) else set())


def _sse_events(response: requests.Response, first_only: bool) -> list[tuple[str, str]]:
    """(event, data) of an event stream, until it ends, a final event (`done`, `error`, `gone`),
    or, with `first_only`, its first frame; AssertionError when it stalls."""
    events, name, data = [], "message", []
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    for line in response.iter_lines(decode_unicode=True):
        assert time.monotonic() < deadline, f"the event stream ran past {REQUEST_TIMEOUT_S} s"
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
        elif not line:
            if data:
                events.append((name, "\n".join(data)))
            if first_only or name in ("done", "error", "gone"):
                break
            name, data = "message", []
    return events


OPENAI_ERROR_TYPES = {
    "invalid_request_error", "authentication_error", "permission_error", "not_found_error", "rate_limit_error", "server_error",
}


def _error_body(text: str, where: str, openai: bool = False) -> dict:
    """The error's `code` and `message` (on `/v1/...`, inside OpenAI's `error` object)."""
    try:
        body = json.loads(text)
    except ValueError:
        raise AssertionError(f"an error that is not JSON: {where}") from None
    assert isinstance(body, dict), where
    if openai:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, where
        body = body["error"]
        assert body["type"] in OPENAI_ERROR_TYPES, where
    assert isinstance(body.get("code"), str) and body["code"], f"an error without a code: {where}"
    assert isinstance(body.get("message"), str), f"an error without a message: {where}"
    return body


# Who a request on a session claims to be: the session's owner (its id and token), a stranger
# (its id, the generated credentials: none or a random token), or as generated (a random id).
IDENTITIES = st.sampled_from(["owner", "stranger", "generated"])
# Upload bodies: the schema has none (the route reads the raw body or a multipart form itself).
UPLOAD_TYPES = st.sampled_from(
    [None, "application/octet-stream", "video/mp4", "multipart/form-data", "multipart/form-data; boundary=x"]
)
UPLOADS = st.tuples(st.binary(max_size=4096), UPLOAD_TYPES)


def test_no_request_gets_a_server_error_and_every_error_is_coded_json(stack, sessions, subtests):
    # One subtest per operation of the live schema. (schemathesis' pytest loader `from_fixture`
    # does not run under pytest 9: it sets `Function._nodeid`, which pytest 9 no longer has.)
    schema = schemathesis.openapi.from_url(f"{stack.url}/openapi.json")
    for operation in (result.ok() for result in schema.get_all_operations()):
        with subtests.test(msg=operation.label):
            statuses: set[int] = set()
            cases = st.one_of(operation.as_strategy(mode) for mode in GenerationMode)

            @REST_EXAMPLES
            @given(case=cases, identity=IDENTITIES, upload=UPLOADS)
            def fuzz(case, identity, upload):
                statuses.add(_request(case, identity, upload, stack.url, sessions))

            fuzz()
            if "{session_id}" in operation.path:  # the fuzzing reached past the session checks
                assert statuses - {401, 403, 404, 429}, statuses


def _request(case, identity: str, upload: tuple[bytes, str | None], url: str, sessions: Sessions) -> int:
    """Send `case` as `identity`, check the property on its reply; the reply's status."""
    if identity != "generated" and "session_id" in case.path_parameters:
        user = sessions.for_case(case)
        case.path_parameters["session_id"] = user.id
        if identity == "owner":
            case.headers = {**(case.headers or {}), **user.auth}
        if "answer_id" in case.path_parameters:
            case.path_parameters["answer_id"] = sessions.answer_id
        if "watch_id" in case.path_parameters:
            case.path_parameters["watch_id"] = sessions.watch_of(user)
    if identity != "generated" and case.path == "/v1/chat/completions" and isinstance(case.body, dict):
        user = sessions.shared  # named in the body: as its owner (its token as the API key) or a stranger
        case.body["session_id"] = user.id
        if identity == "owner":
            case.headers = {**(case.headers or {}), **user.auth}
    kwargs = case.as_transport_kwargs(base_url=url)
    if case.path.endswith("/upload"):  # its own bodies: real video bytes among the random ones
        for generated in ("files", "json", "data"):
            kwargs.pop(generated, None)
        kwargs["data"], content_type = upload
        if content_type:
            kwargs["headers"] = {**kwargs["headers"], "Content-Type": content_type}
    reproduce = case.as_curl_command(base_url=url)
    if case.path.endswith("/upload"):
        reproduce += f"  # with a body of {len(upload[0])} bytes, Content-Type {upload[1]}: {upload[0][:64]!r}"
    try:
        with requests.request(**kwargs, stream=True, timeout=(5, REQUEST_TIMEOUT_S)) as response:
            event_stream = response.headers.get("content-type", "").startswith("text/event-stream")
            events = _sse_events(response, first_only=case.path.endswith("/events")) if event_stream else []
            text = "" if event_stream else response.text
    except requests.Timeout:
        raise AssertionError(f"no answer within {REQUEST_TIMEOUT_S} s\n{reproduce}") from None
    finally:
        sessions.forget_fresh()
    status = response.status_code
    where = f"{case.method.upper()} {case.formatted_path} -> {status} {text[:500]}\n{reproduce}"
    if status == 201 and case.path == "/sessions":  # a fuzzed session: let the worker go
        created = json.loads(text)
        requests.delete(f"{url}/sessions/{created['id']}", headers={"Authorization": f"Bearer {created['token']}"})
    if status >= 400:
        body = _error_body(text, where, openai=case.path.startswith("/v1/"))
        if status >= 500:
            assert status == 503 and body["code"] in _allowed_503(case), f"a server error: {where}"
    elif not event_stream and response.headers.get("content-type", "").startswith("application/json"):
        case.validate_response(response, checks=[response_schema_conformance])
    for name, data in events:
        if name == "error":
            _error_body(data, f"an `error` event in {where}")
    return status


# -- WebSocket -------------------------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
STARTS = st.fixed_dictionaries(
    {"type": st.sampled_from(["start", "end", "START", ""]) | st.text(max_size=8)},
    optional={"format": st.sampled_from([*FORMATS, None]) | st.text(max_size=8) | JSON_VALUES, "extra": JSON_VALUES},
)
FIRST_MESSAGES = st.one_of(st.binary(max_size=64), st.text(max_size=64), JSON_VALUES.map(json.dumps), STARTS.map(json.dumps))
ASKS = st.fixed_dictionaries(
    {"type": st.just("ask")},
    optional={
        "question": st.text(max_size=64) | JSON_VALUES,
        "max_new_tokens": st.integers(-2, 8) | st.sampled_from([1024, 1025]) | JSON_VALUES,
        "ref": st.text(max_size=8) | st.text(min_size=201, max_size=201) | JSON_VALUES,
        "extra": JSON_VALUES,
    },
)
MESSAGES = st.lists(
    st.one_of(
        st.binary(max_size=2048),
        st.builds(frame_message, st.floats(), st.binary(max_size=256)),
        st.builds(lambda t, junk: frame_message(t, b"\xff\xd8\xff" + junk), st.floats(0, 100), st.binary(max_size=256)),
        st.builds(timed_jpeg, st.floats(0, 100)),
        st.text(max_size=64),
        JSON_VALUES.map(json.dumps),
        ASKS.map(json.dumps),
        st.sampled_from([json.dumps({"type": "end"}), json.dumps({"type": "start", "format": "frames"}), OVERSIZED]),
    ),
    max_size=12,
)
PROBE = json.dumps({"type": "ask", "question": "What do you see?", "max_new_tokens": 2, "ref": "probe"})


def _is_start(message: bytes | str) -> bool:
    """Whether `message` is a valid first message (docs/streaming.md), by hand."""
    try:
        parsed = json.loads(message) if isinstance(message, str) else None
    except ValueError:
        return False
    return (
        isinstance(parsed, dict) and parsed.get("type") == "start"
        and set(parsed) <= {"type", "format"} and parsed.get("format") in (*FORMATS, None)
    )


def _check_event(event: dict) -> None:
    assert event.get("type") in EVENT_TYPES, f"an undocumented event {event}"
    if event["type"] in ("error", "answer_error"):
        assert event.get("code") in ERROR_CODES and isinstance(event.get("message"), str), event


def _healthy(url: str) -> None:
    reply = requests.get(f"{url}/healthz", timeout=REQUEST_TIMEOUT_S)
    assert reply.status_code == 200, reply.text


@WS_EXAMPLES
@given(first=FIRST_MESSAGES)
def test_any_first_message_gets_started_or_4400(stack, first):
    user = Client(stack.url)
    user.create()
    url = f"ws://127.0.0.1:{stack.port}/sessions/{user.id}/stream"
    try:
        with ws_connect(url, additional_headers=user.auth, open_timeout=10, max_size=None) as socket:
            socket.send(first)
            try:
                event, code = json.loads(socket.recv(timeout=REQUEST_TIMEOUT_S)), None
            except ConnectionClosed as closed:
                event, code = None, closed.rcvd.code if closed.rcvd else None
        if _is_start(first):
            assert event is not None and event["type"] == "started", (first, event, code)
        else:
            assert code == CloseCode.BAD_REQUEST, (first, event, code)
    finally:
        user.delete()
        user.http.close()
    _healthy(stack.url)


@pytest.mark.parametrize("media_format", [*FORMATS, None])
@settings(WS_EXAMPLES, max_examples=12)
@given(messages=MESSAGES)
@example(messages=[OVERSIZED])
@example(messages=[timed_jpeg(0.0), json.dumps({"type": "ask", "question": "?"}), timed_jpeg(1.0)])
def test_any_messages_after_start_get_documented_events_and_close_codes(stack, media_format, messages):
    """After the messages: `end` (a media socket), then a question; the socket must answer it
    and, with media, report `ingested`, or close with a documented code, within the timeout."""
    user = Client(stack.url)
    user.create()
    try:
        socket = StreamSocket(user, media_format)
        assert socket.started["type"] == "started", socket.started
        sent = [m for m in messages if socket.send(m)]
        if media_format:
            socket.end()
        socket.send(PROBE)
        ingested, answered = media_format is None, False
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while not (ingested and answered):
            try:
                event = socket.next_event(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                events = [e for e in socket.events if e["type"] != "answer_token"]
                raise AssertionError(
                    f"within {SETTLE_TIMEOUT_S} s of `end` the socket neither closed nor answered and reported "
                    f"`ingested`; sent {messages!r:.1500}; got {events}; session {user.get().json()}"
                ) from None
            if event is None:
                break
            _check_event(event)
            ingested = ingested or (event["type"], event.get("state")) == ("state", "ingested")
            answered = answered or (event.get("ref") == "probe" and event["type"] in ("answer_done", "answer_error"))
        socket.close()
        if socket.close_code is not None:
            assert socket.close_code in CLOSE_CODES, (socket.close_code, socket.close_reason, socket.events[-5:])
        if OVERSIZED in sent and socket.close_code is not None:
            assert socket.close_code in (1009, CloseCode.BAD_REQUEST, CloseCode.UNDECODABLE), socket.close_code
    finally:
        user.delete()
        user.http.close()
    _healthy(stack.url)


def test_the_gateway_still_serves_streams_and_questions_after_the_fuzz(stack):
    _healthy(stack.url)
    user = Client(stack.url)
    assert user.create().status_code == 201
    socket = StreamSocket(user, "frames")
    for second in range(3):
        socket.send(timed_jpeg(float(second), second))
    socket.end()
    assert socket.wait_for(lambda e: (e["type"], e.get("state")) == ("state", "ingested")) is not None, socket.events
    assert socket.frame_times() == [0.0, 1.0, 2.0]
    socket.close()
    reply = user.ask("What do you see?", max_new_tokens=4)
    assert reply.status_code == 200 and reply.json()["tokens"] >= 1, reply.text
    user.delete()
