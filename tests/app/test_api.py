"""The REST API against a real gateway process, a real worker process and a real Redis."""

import subprocess
import sys

import httpx

from tests.support import Client, sample_video


def test_healthz_answers_when_redis_is_reachable(stack):
    reply = httpx.get(f"{stack.url}/healthz")
    assert (reply.status_code, reply.json()) == (200, {"status": "ok"})


def test_create_session_with_defaults_names_the_builtin_random_model(client):
    reply = client.create()
    assert reply.status_code == 201
    body = reply.json()
    assert len(body["token"]) >= 40
    session = body["session"]
    assert (session["model"], session["policy"], session["fps"]) == ("tiny-random-llava", "infmllm", 1.0)
    assert session["state"] in ("pending", "ready")
    assert client.wait_for_state("ready")["worker"]


def test_invalid_options_are_refused_with_the_field_named(client):
    reply = client.http.post("/sessions", json={"fps": 9, "surprise": True})
    assert reply.status_code == 422
    body = reply.json()
    assert body["code"] == "invalid_request"
    assert {f["field"] for f in body["fields"]} == {"body.fps", "body.surprise"}


def test_a_model_no_worker_serves_is_503_with_retry_after(client):
    reply = client.create(model="llava-hf/llava-1.5-7b-hf")
    assert reply.status_code == 503
    assert reply.headers["retry-after"] == "5"
    assert reply.json()["code"] == "no_worker"


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


def test_delete_forgets_the_session(client):
    client.create()
    assert client.http.delete(f"/sessions/{client.id}", headers=client.auth).status_code == 204
    assert client.get().status_code == 404


def test_a_failed_upload_can_be_retried(client):
    client.create()
    no_boundary = client.upload(b"--x\r\n", content_type="multipart/form-data")
    assert (no_boundary.status_code, no_boundary.json()["code"]) == (400, "bad_multipart")
    empty = client.upload(b"")
    assert (empty.status_code, empty.json()["code"]) == (400, "empty_upload")
    # no Content-Length (chunked): the limit is found while streaming, after bytes reached Redis
    too_big = client.upload(iter([b"\0" * (1024 * 1024)] * 5))
    assert (too_big.status_code, too_big.json()["code"]) == (413, "upload_too_large")
    assert client.get().json()["state"] in ("pending", "ready")

    assert client.upload(sample_video("carphone_pristine.mp4").read_bytes()).status_code == 202
    session = client.wait_for_state("ingested", "error")
    assert (session["state"], session["frames_ingested"]) == ("ingested", 4)


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


def test_the_dashboard_is_served_at_root(stack):
    reply = httpx.get(f"{stack.url}/")
    assert reply.status_code == 200
    assert "<title>streamvqa</title>" in reply.text
    assert httpx.get(f"{stack.url}/app.js").headers["content-type"].startswith("text/javascript")


def test_the_gateway_never_imports_torch():
    code = "import sys, app.main, app.__main__; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
