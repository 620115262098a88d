"""GET /metrics as an operator of vLLM reads it, after users asked questions: tokens prefilled and
generated, queue time, time per output token, sessions per engine step; and each answer counted
once by the gateway that took its question, however it is delivered or resumed. The module has
a gateway and a worker of its own, so every counter starts at zero."""

from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.support import Client, metrics_once, sample_video, sse_events

QUESTION = "What is in the video?"
PROMPT_TOKENS = len(QUESTION) + 13  # the tiny model reads a character a token, and closes the turn in 13
LONG_QUESTION = "Describe every frame of the video in detail."  # 44 characters
TOKENS = 32  # the tiny random model never stops early


def value(samples: dict[str, float], name: str, *labels: str) -> float:
    """The sum of `name`'s samples whose labels include each of `labels` (e.g. 'le="1.0"')."""
    return sum(v for k, v in samples.items() if k.split("{")[0] == name and all(label in k for label in labels))


def completion(url: str, user: Client, question: str, max_tokens: int) -> dict:
    reply = httpx.post(
        f"{url}/v1/chat/completions", headers=user.auth, timeout=60,
        json={"session_id": user.id, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens},
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_tokens_queue_time_and_answers_move_as_users_asked(stack, client):
    assert client.create(fps=1).status_code == 201
    assert client.upload(sample_video("carphone_pristine.mp4").read_bytes()).status_code == 202
    assert client.wait_for_state("ingested")["frames_ingested"] == 4
    first = completion(stack.url, client, QUESTION, 6)
    second = completion(stack.url, client, LONG_QUESTION, 4)
    assert (first["usage"]["prompt_tokens"], first["usage"]["completion_tokens"]) == (34, 6)
    assert (second["usage"]["prompt_tokens"], second["usage"]["completion_tokens"]) == (57, 4)
    # a third question streamed as Server-Sent Events, then its events read again from the start
    with client.http.stream("POST", f"/sessions/{client.id}/ask", headers=client.auth,
                            json={"question": QUESTION, "max_new_tokens": 1, "stream": True}) as streamed:
        events = list(sse_events(streamed))
    started, done = events[0]["data"], events[-1]["data"]
    assert (events[-1]["event"], done["tokens"]) == ("done", 1)
    headers = {**client.auth, "Accept": "text/event-stream"}
    with client.http.stream("GET", started["location"], headers=headers) as resumed:
        assert [e["event"] for e in sse_events(resumed)] == ["token", "done"]

    samples = metrics_once(stack.url, "streamvqa_worker_answers_total", at_least=3)
    # the worker's counters: what the answers say they took
    assert value(samples, "streamvqa_worker_prompt_tokens_total") == 34 + 57 + 34
    assert value(samples, "streamvqa_worker_generation_tokens_total") == 6 + 4 + 1
    assert value(samples, "streamvqa_worker_queue_time_seconds_count") == 3
    ttft_s = (first["streamvqa"]["ttft_ms"] + second["streamvqa"]["ttft_ms"] + done["ttft_ms"]) / 1000
    assert 0 <= value(samples, "streamvqa_worker_queue_time_seconds_sum") <= ttft_s + 0.01  # each waited less than its first token
    assert value(samples, "streamvqa_worker_time_per_output_token_seconds_count") == 2  # the answers of 6 and 4 tokens
    # one session: every step ran it alone
    steps = value(samples, "streamvqa_worker_steps_total")
    assert steps >= 1 + 6 + 4 + 1  # the frames (one step or more), and a step per answer token
    assert value(samples, "streamvqa_worker_step_batch_sessions_count") == steps
    assert value(samples, "streamvqa_worker_step_batch_sessions_bucket", 'le="1.0"') == steps
    assert value(samples, "streamvqa_worker_step_batch_sessions_sum") == value(samples, "streamvqa_worker_step_sessions_total")
    # the KV pool, allocated once at start: the session's cache leases pages of it, as GET /models says
    [memory] = httpx.get(f"{stack.url}/models", headers=client.auth).json()["models"][0]["memory"]  # its own pages
    pages, free = value(samples, "streamvqa_worker_kv_pool_pages"), value(samples, "streamvqa_worker_kv_pool_free_pages")
    assert pages == memory["pool_pages"] > 0
    assert list(memory["pool_session_pages"]) == [client.id]
    assert free == pages - memory["pool_session_pages"][client.id] < pages
    assert value(samples, "streamvqa_worker_kv_pool_bytes") == memory["pool_bytes"] > 0
    # and its host pool beside it, for host tiers: this session recalls (the default), and its tier leases a run of it
    host_pages = value(samples, "streamvqa_worker_host_pool_pages")
    assert host_pages == memory["host_pool_pages"] > 0
    assert list(memory["host_pool_session_pages"]) == [client.id]
    leased = memory["host_pool_session_pages"][client.id]
    assert value(samples, "streamvqa_worker_host_pool_free_pages") == host_pages - leased < host_pages
    assert value(samples, "streamvqa_worker_host_pool_bytes") == memory["host_pool_bytes"] > 0
    # the gateway's: three questions, three answers (the one read twice is counted once)
    assert value(samples, "streamvqa_gateway_questions_total", 'via="openai"') == 2
    assert value(samples, "streamvqa_gateway_questions_total", 'via="sse"') == 1
    assert value(samples, "streamvqa_gateway_answers_total", 'outcome="done"') == 3
    assert value(samples, "streamvqa_gateway_ttft_seconds_count") == 3


def test_sessions_asking_at_once_share_engine_steps(stack):
    users = [Client(stack.url) for _ in range(3)]
    try:
        for user in users:
            assert user.create().status_code == 201
            user.wait_for_state("ready")
            user.show_frames()
        before = metrics_once(stack.url, "streamvqa_worker_steps_total")
        with ThreadPoolExecutor(len(users)) as pool:
            replies = list(pool.map(lambda user: user.ask(QUESTION, max_new_tokens=TOKENS), users))
        assert [reply.json()["tokens"] for reply in replies] == [TOKENS] * 3
        answered = value(before, "streamvqa_worker_answers_total") + 3
        samples = metrics_once(stack.url, "streamvqa_worker_answers_total", at_least=answered)
        steps = value(samples, "streamvqa_worker_step_batch_sessions_count")
        alone = value(samples, "streamvqa_worker_step_batch_sessions_bucket", 'le="1.0"')
        assert steps == value(samples, "streamvqa_worker_steps_total")
        assert steps - alone >= TOKENS // 2  # most of the answers' tokens came in steps of two or three sessions
        assert value(samples, "streamvqa_worker_step_batch_sessions_bucket", 'le="4.0"') == steps  # never more than three
        assert value(samples, "streamvqa_worker_generation_tokens_total") - value(before, "streamvqa_worker_generation_tokens_total") == 3 * TOKENS
    finally:
        for user in users:
            user.delete()
