"""The REST API against a real gateway process, a real worker process and a real Redis."""

import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis

from streamvqa.protocol import WorkerInfo
from streamvqa.redis_server import free_port

from tests.support import Client, Stack, metrics_once, sample_video, sse_events


def test_healthz_answers_when_redis_is_reachable(stack):
    reply = httpx.get(f"{stack.url}/healthz")
    assert (reply.status_code, reply.json()) == (200, {"status": "ok"})


def test_create_session_with_defaults_names_the_builtin_random_model(client):
    reply = client.create()
    assert reply.status_code == 201
    body = reply.json()
    assert re.fullmatch(r"[0-9a-f]{64}", body["token"])  # a command line takes it as an option's value
    session = body["session"]
    assert (session["model"], session["policy"], session["fps"]) == ("tiny-random-llava", "infmllm", 1.0)
    # recall is on: what was said just before the budget's span is still found (docs/api.md)
    budget = session["budget_tokens"]
    assert (session["recall"], session["host_budget_tokens"], session["retrieval_tokens"]) == (True, 8 * budget, budget // 2)
    assert session["state"] in ("pending", "ready")
    assert client.wait_for_state("ready")["worker"]


def test_invalid_options_are_refused_with_the_field_named(client):
    reply = client.http.post("/sessions", json={"fps": 9, "surprise": True})
    assert reply.status_code == 422
    body = reply.json()
    assert body["code"] == "invalid_request"
    assert {f["field"] for f in body["fields"]} == {"body.fps", "body.surprise"}


@pytest.mark.parametrize("model", ["llava-hf/llava-1.5-7b-hf", "gpt-9", "../../etc/passwd"])
def test_a_model_no_worker_has_served_is_404_without_retry_after(client, model):
    reply = client.create(model=model)
    assert reply.status_code == 404
    assert "retry-after" not in reply.headers
    assert reply.json()["code"] == "model_not_found"


def test_unknown_session_is_404_missing_token_401_wrong_token_403(stack, client):
    assert client.create().status_code == 201
    other = Client(stack.url)
    assert other.create().status_code == 201

    assert client.http.get("/sessions/0123abcd", headers=client.auth).status_code == 404
    missing = client.http.get(f"/sessions/{client.id}")
    assert (missing.status_code, missing.json()["code"]) == (401, "unauthorized")
    assert missing.headers["www-authenticate"] == "Bearer"
    wrong = client.http.get(f"/sessions/{client.id}", headers={"Authorization": "Bearer not-the-token"})
    assert (wrong.status_code, wrong.json()["code"]) == (403, "forbidden")
    # one session's token opens no other session, on any route
    assert client.http.get(f"/sessions/{other.id}", headers=client.auth).status_code == 403
    assert client.http.post(f"/sessions/{other.id}/ask", json={"question": "hi"}, headers=client.auth).status_code == 403
    assert client.http.post(f"/sessions/{other.id}/upload", content=b"x", headers=client.auth).status_code == 403
    other.http.close()


def test_a_malformed_session_id_is_404(client):
    client.create()
    reply = client.http.get(f"/sessions/{client.id}:lease", headers=client.auth)
    assert (reply.status_code, reply.json()["code"]) == (404, "session_not_found")


def test_delete_forgets_the_session_and_its_worker_lets_it_go_at_once(stack, client):
    client.create()
    client.wait_for_state("ready")
    store = redis.Redis.from_url(stack.redis_url)

    def held() -> bool:
        return any(client.id in WorkerInfo.model_validate_json(w).session_ids for w in store.hvals(f"{stack.prefix}workers"))

    assert held()
    assert client.http.delete(f"/sessions/{client.id}", headers=client.auth).status_code == 204
    assert client.get().status_code == 404
    deadline = time.monotonic() + 3  # its next turn, not its next heartbeat (LEASE_TTL_S / 3 = 5 s)
    while held() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not held()
    store.close()


def test_a_failed_upload_can_be_retried(client):
    client.create()
    no_boundary = client.upload(b"--x\r\n", content_type="multipart/form-data")
    assert (no_boundary.status_code, no_boundary.json()["code"]) == (400, "bad_multipart")
    empty = client.upload(b"")
    assert (empty.status_code, empty.json()["code"]) == (400, "empty_upload")
    # no Content-Length (chunked): the limit is found while streaming, after bytes reached Redis
    too_big = client.upload(iter([b"\0" * (1024 * 1024)] * 5))
    assert (too_big.status_code, too_big.json()["code"]) == (413, "upload_too_large")
    aborted = client.get().json()
    assert (aborted["state"], aborted["media"], aborted["stream_bytes"]) in (("pending", None, 0), ("ready", None, 0))

    video = sample_video("carphone_pristine.mp4").read_bytes()
    assert client.upload(video).status_code == 202
    session = client.wait_for_state("ingested", "error")
    assert (session["state"], session["frames_ingested"]) == ("ingested", 4)
    assert session["stream_bytes"] == len(video)  # counted from 0 again, not after the aborted upload's bytes


def test_a_second_upload_is_409(client):
    client.create()
    assert client.upload(sample_video("carphone_pristine.mp4").read_bytes()).status_code == 202
    second = client.upload(sample_video("bikes.mp4").read_bytes())
    assert (second.status_code, second.json()["code"]) == (409, "media_exists")


def test_an_upload_over_the_limit_is_413(client):
    client.create()
    reply = client.upload(b"\0" * (4 * 1024 * 1024 + 1))  # the stack allows 4 MiB
    assert (reply.status_code, reply.json()["code"]) == (413, "upload_too_large")


def test_an_empty_or_overlong_question_is_422(client):
    client.create()
    assert client.ask("").status_code == 422
    assert client.ask("x" * 4001).status_code == 422
    assert client.ask("ok", max_new_tokens=0).status_code == 422


def test_loose_types_and_a_blank_question_are_422_naming_the_field(client):
    loose = client.http.post("/sessions", json={"pin_turns": True, "budget_tokens": "1024", "recall": 1})
    assert loose.status_code == 422
    assert {f["field"] for f in loose.json()["fields"]} == {"body.pin_turns", "body.budget_tokens", "body.recall"}
    assert client.create().status_code == 201
    for body, field in (
        ({"question": "What?", "stream": "yes"}, "body.stream"),
        ({"question": "What?", "max_new_tokens": 2.0}, "body.max_new_tokens"),
        ({"question": "What?", "temperature": "0.5"}, "body.temperature"),
        ({"question": " \n\t "}, "body.question"),
    ):
        reply = client.http.post(f"/sessions/{client.id}/ask", json=body, headers=client.auth)
        assert reply.status_code == 422, body
        assert [f["field"] for f in reply.json()["fields"]] == [field], body
    blank = client.ask("   ")
    assert blank.json()["message"] == "body.question: Value error, the question has no text: only white space"


def test_a_body_that_is_not_json_is_400_invalid_body(client):
    assert client.create().status_code == 201
    for path, headers in (("/sessions", {}), (f"/sessions/{client.id}/ask", client.auth)):
        for content_type in ("application/json", "text/plain"):
            reply = client.http.post(path, content=b"question: what?", headers={**headers, "Content-Type": content_type})
            assert (reply.status_code, reply.json()) == (
                400, {"code": "invalid_body", "message": "the body is not valid JSON (UTF-8)"}
            ), (path, content_type)
    completion = client.http.post(
        "/v1/chat/completions", content=b"{'messages': []}", headers={**client.auth, "Content-Type": "application/json"}
    )
    assert (completion.status_code, completion.json()) == (400, {"error": {
        "message": "the body is not valid JSON (UTF-8)", "type": "invalid_request_error", "param": None,
        "code": "invalid_body",
    }})


def test_pin_turns_that_cannot_fit_the_budget_are_422_at_creation(client):
    # the tiny model pins 149 tokens of opening and 21 a turn; sinks and recent keep 4 + 128
    reply = client.http.post("/sessions", json={"pin_turns": 64, "budget_tokens": 256})
    assert reply.status_code == 422
    assert [f["field"] for f in reply.json()["fields"]] == ["body.pin_turns"]
    assert reply.json()["fields"][0]["message"] == (
        "tiny-random-llava: pin_turns 64 pins 1493 tokens (149 of the opening, 21 for each turn): beside sinks and "
        "recent (132), budget_tokens 256 leaves room for pin_turns 0 at most"
    )
    one_over = client.http.post("/sessions", json={"pin_turns": 36, "budget_tokens": 1024})
    assert one_over.status_code == 422
    assert "leaves room for pin_turns 35 at most" in one_over.json()["message"]
    assert client.create(pin_turns=35, budget_tokens=1024).status_code == 201
    session = client.wait_for_state("ready", "error")
    assert (session["state"], session["pin_turns"]) == ("ready", 35)  # the worker's engine agrees: it fits


def test_a_session_whose_own_system_prompt_leaves_its_pins_no_room_fails_saying_why(client):
    # the gateway cannot count a system prompt's tokens: the worker finds that 400 more leave no room
    assert client.create(pin_turns=35, budget_tokens=1024, system_prompt="Be brief. " * 40).status_code == 201
    session = client.wait_for_state("error", "ready")
    assert session["state"] == "error"
    assert session["error"].startswith("the session's options do not fit its model: pin_turns (35) pins ")
    assert "fault of the worker" not in session["error"]


def test_the_dashboard_is_served_at_root(stack):
    reply = httpx.get(f"{stack.url}/")
    assert reply.status_code == 200
    assert "<title>streamvqa</title>" in reply.text
    assert httpx.get(f"{stack.url}/app.js").headers["content-type"].startswith("text/javascript")


def test_the_gateway_never_imports_torch():
    code = "import sys, app.main, app.__main__; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_policy_knobs_and_a_system_prompt_are_kept_and_checked(client):
    reply = client.create(policy="infmllm", budget_tokens=512, policy_options={"beta": 2.0, "recent": 64}, system_prompt="Be brief.")
    assert reply.status_code == 201
    session = client.wait_for_state("ready")
    assert (session["policy_options"], session["system_prompt"]) == ({"beta": 2.0, "recent": 64}, "Be brief.")

    wrong_policy = client.http.post("/sessions", json={"policy": "sliding", "policy_options": {"beta": 1}})
    assert wrong_policy.status_code == 422
    assert [f["field"] for f in wrong_policy.json()["fields"]] == ["body.policy_options"]
    assert "no option beta" in wrong_policy.json()["message"]
    too_small = client.http.post("/sessions", json={"budget_tokens": 256, "policy_options": {"recent": 300}})
    assert "must exceed sinks + recent (304)" in too_small.json()["message"]
    bad_knobs = client.http.post("/sessions", json={"policy_options": {"local_sum": 4, "window": 0, "colour": 1}})
    assert {f["field"] for f in bad_knobs.json()["fields"]} == {
        "body.policy_options.local_sum", "body.policy_options.window", "body.policy_options.colour"
    }


def test_the_memory_view_counts_what_the_cache_holds_per_second(client):
    client.create(fps=4, policy="sliding", budget_tokens=256)
    empty = client.http.get(f"/sessions/{client.id}/memory", headers=client.auth).json()
    assert (empty["policy"], empty["budget_tokens"], empty["frames"], empty["spans"]) == ("sliding", 256, 0, [])
    assert client.upload(sample_video("bikes.mp4").read_bytes()).status_code == 202
    session = client.wait_for_state("ingested", timeout_s=120)
    memory = client.http.get(f"/sessions/{client.id}/memory", headers=client.auth).json()
    assert memory["frames"] == session["frames_ingested"] == 40  # bikes.mp4: 10 s at 4 fps
    assert memory["cache_tokens"] == session["cache_tokens"] <= 256 + 2048 + 1024
    assert memory["evictions"] >= 1 and memory["evicted_tokens"] > 0
    assert [(s["start_s"], s["end_s"]) for s in memory["spans"]] == [(t, t + 1) for t in range(10)]
    seen = [s["frame_seen"] for s in memory["spans"]]
    assert len(set(seen)) == 1 and seen[0] > 0  # every second has four frames of the same size
    held = [s["frame_held"] for s in memory["spans"]]
    assert held[-1] == seen[-1] and held[0] < seen[0]  # sliding keeps the newest frame, not the oldest
    assert sum(held) == pytest.approx(memory["frame_tokens"], abs=0.1)


def test_recall_options_are_kept_with_their_defaults_and_checked(client):
    assert client.create(policy="snapkv", budget_tokens=512, recall=True).status_code == 201
    session = client.wait_for_state("ready")
    assert (session["recall"], session["host_budget_tokens"], session["retrieval_tokens"]) == (True, 4096, 256)
    assert session["pin_turns"] == 0
    chosen = client.http.post("/sessions", json={"recall": True, "host_budget_tokens": 1000, "retrieval_tokens": 64})
    assert (chosen.json()["session"]["host_budget_tokens"], chosen.json()["session"]["retrieval_tokens"]) == (1000, 64)
    httpx.delete(f"{client.http.base_url}/sessions/{chosen.json()['session']['id']}", headers={"Authorization": f"Bearer {chosen.json()['token']}"})
    full = client.http.post("/sessions", json={"policy": "full", "recall": True})
    assert full.status_code == 422 and "recall needs a policy that evicts" in full.json()["message"]
    orphan = client.http.post("/sessions", json={"recall": False, "retrieval_tokens": 64})
    assert orphan.status_code == 422 and "retrieval_tokens need recall: true" in orphan.json()["message"]
    tiny = client.http.post("/sessions", json={"recall": True, "host_budget_tokens": 8})
    assert [f["field"] for f in tiny.json()["fields"]] == ["body.host_budget_tokens"]
    assert client.http.post("/sessions", json={"pin_turns": 65}).status_code == 422


def test_with_recall_the_memory_view_shows_device_host_and_dropped_and_answers_recall_the_past(stack, client):
    # bikes.mp4 at 4 fps: 40 frames of 23 tokens; 256 stay on the device, 256 more in the host
    # tier, the rest are dropped (the pages least unlike the others held)
    client.create(fps=4, policy="sliding", budget_tokens=256, recall=True, host_budget_tokens=256, retrieval_tokens=128)
    assert client.upload(sample_video("bikes.mp4").read_bytes()).status_code == 202
    client.wait_for_state("ingested", timeout_s=120)
    memory = client.http.get(f"/sessions/{client.id}/memory", headers=client.auth).json()
    assert (memory["recall"], memory["host_budget_tokens"]) == (True, 256)
    assert 224 < memory["host_tokens"] <= 256 and memory["host_bytes"] > 0
    spans = memory["spans"]
    assert sum(s["frame_host"] + s["text_host"] for s in spans) == pytest.approx(memory["host_tokens"], abs=1)
    states = ["device" if s["frame_held"] else "host" if s["frame_host"] else "dropped" for s in spans]
    assert "dropped" in states and "host" in states and states[-1] == "device"
    assert set(states[states.index("device") :]) == {"device"}  # sliding: the device holds the latest seconds
    reply = client.ask("What was there at the start?", max_new_tokens=4)
    assert reply.status_code == 200
    recalled = reply.json()["recalled_s"]
    assert recalled and set(recalled) <= {i for i, span in enumerate(spans) if span["frame_host"] or span["text_host"]}
    samples = metrics_once(stack.url, "streamvqa_worker_retrieved_tokens_total")
    retrieved = [v for k, v in samples.items() if k.startswith("streamvqa_worker_retrieved_tokens_total")]
    assert retrieved and retrieved[0] >= 64
    pages = [v for k, v in samples.items() if k.startswith("streamvqa_worker_retrieved_pages_total")]
    assert pages and pages[0] >= 2  # 128 tokens from pages of 32
    assert [v for k, v in samples.items() if k.startswith("streamvqa_worker_host_tier_bytes")][0] > 0
    assert [v for k, v in samples.items() if k.startswith("streamvqa_worker_retrieval_seconds_total")][0] > 0


def test_session_events_stream_as_server_sent_events(client):
    client.create(fps=1)
    client.wait_for_state("ready")
    with client.http.stream("GET", f"/sessions/{client.id}/events", headers=client.auth) as events:
        assert events.status_code == 200
        assert client.upload(sample_video("carphone_pristine.mp4").read_bytes()).status_code == 202
        seen = []
        for event in sse_events(events):
            seen.append(event)
            if event["event"] == "state" and event["data"]["state"] == "ingested":
                break
    ingests = [e["data"] for e in seen if e["event"] == "ingest"]
    assert ingests[-1]["frames"] == 4
    assert [t for e in ingests for t in e["times"]] == pytest.approx([0.0, 1.0, 2.0, 3.0], abs=0.01)
    # resuming after the first event replays the rest, in order
    headers = {**client.auth, "Last-Event-ID": seen[0]["id"]}
    with client.http.stream("GET", f"/sessions/{client.id}/events", headers=headers) as resumed:
        replay = []
        for event in sse_events(resumed):
            replay.append(event)
            if len(replay) == len(seen) - 1:
                break
    assert replay == seen[1:]


def test_session_events_end_with_gone_when_the_session_is_deleted(stack, client):
    client.create()
    with client.http.stream("GET", f"/sessions/{client.id}/events", headers=client.auth) as events:
        httpx.delete(f"{stack.url}/sessions/{client.id}", headers=client.auth)
        assert [e["event"] for e in sse_events(events)] == ["gone"]


def test_list_sessions_shows_the_session_whose_token_is_sent_and_no_token(stack):
    users = [Client(stack.url) for _ in range(2)]
    for user in users:
        assert user.create().status_code == 201
    listed = httpx.get(f"{stack.url}/sessions", headers=users[1].auth).json()["sessions"]
    assert [s["id"] for s in listed] == [users[1].id]
    assert all("token" not in s and "token_sha256" not in s for s in listed)
    assert httpx.get(f"{stack.url}/sessions").json()["sessions"] == []  # an address proves nothing (docs/api.md)
    users[1].delete()
    assert httpx.get(f"{stack.url}/sessions", headers=users[1].auth).json()["sessions"] == []
    users[0].delete()


def test_models_lists_what_live_workers_serve_and_the_default(stack):
    models = httpx.get(f"{stack.url}/models").json()
    memory = [{k: m[k] for k in ("dtype", "kv_memory", "host_memory", "warning")} for m in models["models"][0].pop("memory")]
    assert models == {
        "default": "tiny-random-llava",
        "models": [{"name": "tiny-random-llava", "workers": 1, "sessions": pytest.approx(0, abs=64), "max_sessions": 64}],
    }
    assert memory == [{"dtype": "float32", "kv_memory": "auto", "host_memory": "auto", "warning": None}]  # the tests' DTYPE


def test_readyz_needs_a_live_worker_and_metrics_count_the_work(stack, client):
    assert httpx.get(f"{stack.url}/readyz").json() == {"status": "ready", "workers": 1}
    client.create(fps=1)
    assert client.upload(sample_video("carphone_pristine.mp4").read_bytes()).status_code == 202
    client.wait_for_state("ingested")
    assert client.ask("What?", max_new_tokens=2).status_code == 200
    samples = metrics_once(stack.url, "streamvqa_worker_answers_total")
    assert samples['streamvqa_workers{model="tiny-random-llava"}'] == 1
    assert samples['streamvqa_gateway_questions_total{via="rest"}'] >= 1
    assert samples["streamvqa_gateway_ttft_seconds_count"] >= 1
    assert samples['streamvqa_gateway_http_requests_total{method="POST",route="/sessions",status="201"}'] >= 1
    frames = [v for k, v in samples.items() if k.startswith("streamvqa_worker_frames_ingested_total")]
    assert len(frames) == 1 and frames[0] >= 4
    answers = [v for k, v in samples.items() if k.startswith("streamvqa_worker_answers_total")]
    assert answers == [answers[0]] and answers[0] >= 1


def test_a_gateway_without_workers_is_live_but_not_ready(redis_url, tmp_path):
    gateway = Stack(redis_url, f"svqa-test-{uuid.uuid4().hex[:12]}:", tmp_path)
    gateway.start("gateway", "app")
    try:
        gateway.wait_until_serving(workers=0)
        assert httpx.get(f"{gateway.url}/healthz").status_code == 200
        ready = httpx.get(f"{gateway.url}/readyz")
        assert (ready.status_code, ready.json()["code"], ready.headers["retry-after"]) == (503, "no_worker", "5")
        created = httpx.post(f"{gateway.url}/sessions", json={})
        assert (created.status_code, created.json()["code"]) == (503, "no_worker")
    finally:
        gateway.stop()


def test_the_openapi_schema_lists_every_error_status_the_readme_names(stack):
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    named = {int(status) for status in re.findall(r"^\| (\d{3}) \| `", readme, re.M)}
    assert named == {400, 401, 403, 404, 408, 409, 410, 413, 422, 429, 500, 503, 504}
    operations = httpx.get(f"{stack.url}/openapi.json").json()["paths"]
    listed = {int(status) for path in operations.values() for op in path.values() for status in op["responses"]}
    assert named <= listed, named - listed
    ask = operations["/sessions/{session_id}/ask"]["post"]["responses"]
    assert {"409", "504"} <= set(ask) and "no_video" in ask["409"]["description"]
    assert "410" in operations["/sessions/{session_id}/answers/{answer_id}"]["get"]["responses"]
    assert "409" in operations["/sessions/{session_id}/upload"]["post"]["responses"]


def test_redis_down_is_a_503_that_names_no_address_or_error_number(tmp_path):
    closed_port = free_port()
    stack = Stack(f"redis://127.0.0.1:{closed_port}/0", "svqa-test-down:", tmp_path)
    stack.start("gateway", "app")
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                reply = httpx.get(f"{stack.url}/healthz", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, stack.log("gateway")
                time.sleep(0.2)
        assert reply.status_code == 503
        assert reply.json() == {"code": "redis_unreachable", "message": "Redis is unreachable (the gateway's log has the cause)"}
        reply = httpx.get(f"{stack.url}/sessions", timeout=5)
        assert (reply.status_code, reply.json()["message"]) == (503, "Redis is unreachable (the gateway's log has the cause)")
    finally:
        stack.stop()
    assert f"127.0.0.1:{closed_port}" in stack.log("gateway")  # the cause, for whoever runs the gateway
