"""The OpenAI-compatible API with the official `openai` client, against a real gateway, worker
and Redis: completions whole and streamed, sampling, errors in OpenAI's shape, API keys."""

import httpx
import openai
import pytest
from openai import OpenAI

from tests.support import Client, running_stack, sample_video

QUESTION = "What is in the video?"
PROMPT_TOKENS = len(QUESTION) + 13  # the tiny model reads a character a token; "<|im_end|>\n<|im_start|>assistant\n"
MODEL = "tiny-random-llava"
SYSTEM = "Not the session's own opening: it cannot change after the session was made."


def watching(url: str, **headers: str) -> Client:
    """A session that ingested carphone (4 frames at fps 1, the last at ~3 s)."""
    user = Client(url)
    user.http.headers.update(headers)
    assert user.create(fps=1).status_code == 201
    assert user.upload(sample_video("carphone_pristine.mp4").read_bytes()).status_code == 202
    assert user.wait_for_state("ingested")["frames_ingested"] == 4
    return user


def openai_client(url: str, user: Client, **options) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key=user.token, max_retries=0, timeout=60, **options)


@pytest.fixture
def session(stack):
    user = watching(stack.url)
    yield user
    user.delete()
    user.http.close()


def test_a_completion_answers_about_the_sessions_video(stack, session):
    completion = openai_client(stack.url, session).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=6,
        extra_body={"session_id": session.id},
    )
    assert completion.object == "chat.completion" and completion.model == MODEL
    [choice] = completion.choices
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    usage = completion.usage
    assert (usage.prompt_tokens, usage.total_tokens) == (PROMPT_TOKENS, PROMPT_TOKENS + usage.completion_tokens)
    assert 1 <= usage.completion_tokens <= 6
    details = completion.model_extra["streamvqa"]
    assert details["video_time_s"] == pytest.approx(3.0, abs=0.01)
    assert completion.id == f"chatcmpl-{details['answer_id']}"
    # the answer is the session's like any other: looked up by its id, and kept in its conversation
    stored = session.http.get(f"/sessions/{session.id}/answers/{details['answer_id']}", headers=session.auth).json()
    assert (stored["status"], stored["answer"]) == ("done", choice.message.content)


def test_a_streamed_completion_is_chunks_with_a_finish_reason_usage_and_done(stack, session):
    client = openai_client(stack.url, session)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}],
        max_tokens=5, stream=True, stream_options={"include_usage": True}, extra_body={"session_id": session.id},
    ))
    assert {chunk.object for chunk in chunks} == {"chat.completion.chunk"}
    assert len({chunk.id for chunk in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = chunks[-2].choices[0]
    assert finish.finish_reason in ("stop", "length") and all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == PROMPT_TOKENS
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    answer_id = chunks[0].id.removeprefix("chatcmpl-")
    stored = session.http.get(f"/sessions/{session.id}/answers/{answer_id}", headers=session.auth).json()
    assert stored["answer"] == text and stored["tokens"] == chunks[-1].usage.completion_tokens
    # on the wire: Server-Sent Events of `data:` lines, the last `[DONE]`
    body = {"session_id": session.id, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 2, "stream": True}
    raw = httpx.post(f"{stack.url}/v1/chat/completions", json=body, headers=session.auth, timeout=60)
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.rstrip().split("\n\n")[-1] == "data: [DONE]"


def test_temperature_zero_is_the_greedy_answer_and_a_seed_repeats_a_sampled_one(stack):
    first, second = watching(stack.url), watching(stack.url)
    try:
        greedy = first.ask(QUESTION, max_new_tokens=8).json()["answer"]

        def complete(user: Client, **options) -> str:
            completion = openai_client(stack.url, user).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=8,
                extra_body={"session_id": user.id}, **options,
            )
            return completion.choices[0].message.content

        assert complete(second, temperature=0) == greedy
        # the two caches hold the same question and answer now
        sampled = [complete(user, temperature=1.5, top_p=0.95, seed=99) for user in (first, second)]
        assert sampled[0] == sampled[1] != greedy
    finally:
        for user in (first, second):
            user.delete()


def test_a_bad_request_is_400_in_openais_shape(stack, session):
    client = openai_client(stack.url, session)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=5,
            extra_body={"session_id": session.id},
        )
    assert bad.value.status_code == 400
    assert bad.value.body == {
        "message": "temperature: Input should be less than or equal to 2", "type": "invalid_request_error",
        "param": "temperature", "code": "invalid_value",
    }
    with pytest.raises(openai.BadRequestError) as last:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "A car."}],
            extra_body={"session_id": session.id},
        )
    assert (last.value.body["param"], last.value.body["code"]) == ("messages", "invalid_request")
    assert "the last message is the question: its role must be 'user', not 'assistant'" in last.value.body["message"]
    with pytest.raises(openai.BadRequestError) as parts:
        client.chat.completions.create(
            model=MODEL, extra_body={"session_id": session.id},
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}],
        )
    assert (parts.value.body["param"], parts.value.body["code"]) == ("messages.0.content.0.image_url.url", "invalid_media")
    with pytest.raises(openai.BadRequestError) as audio:
        client.chat.completions.create(
            model=MODEL, extra_body={"session_id": session.id},
            messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}],
        )
    assert audio.value.body["param"].startswith("messages.0.content")
    with pytest.raises(openai.BadRequestError) as missing:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}])
    assert missing.value.body["param"] == "session_id"
    assert missing.value.body["message"].startswith("no session to ask: send the video or image in the messages")
    with pytest.raises(openai.BadRequestError) as system:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
            extra_body={"session_id": session.id},
        )
    assert (system.value.body["code"], system.value.body["param"]) == ("system_prompt_mismatch", "messages")
    assert "the session's opening, set when it was made, is the model's default" in system.value.body["message"]


def test_loose_options_are_400_and_max_completion_tokens_counts_over_max_tokens(stack, session):
    def post(**body) -> httpx.Response:
        body = {"session_id": session.id, "messages": [{"role": "user", "content": QUESTION}], **body}
        return httpx.post(f"{stack.url}/v1/chat/completions", json=body, headers=session.auth, timeout=60)

    for body, param in (
        ({"stream": "yes"}, "stream"),
        ({"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
         "stream_options.continuous_usage_stats"),
        ({"stream_options": {"include_usage": "true"}}, "stream_options.include_usage"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": "0.5"}, "temperature"),
        ({"messages": [{"role": "user", "content": "  \n "}]}, "messages"),
    ):
        reply = post(**body)
        assert reply.status_code == 400, body
        assert (reply.json()["error"]["code"], reply.json()["error"]["param"]) == ("invalid_request", param), body
    # given both, max_completion_tokens (OpenAI's newer name) is the one that counts
    over = post(max_tokens=4, max_completion_tokens=5000)
    assert over.status_code == 400
    assert over.json()["error"] == {
        "message": "max_completion_tokens: Input should be less than or equal to 1024", "type": "invalid_request_error",
        "param": "max_completion_tokens", "code": "invalid_value",
    }
    within = post(max_tokens=5000, max_completion_tokens=2)
    assert within.status_code == 200 and within.json()["usage"]["completion_tokens"] <= 2


def test_a_question_over_the_token_limit_is_400_on_v1_as_openai_answers(stack, session):
    reply = httpx.post(
        f"{stack.url}/v1/chat/completions", headers=session.auth, timeout=60,
        json={"session_id": session.id, "messages": [{"role": "user", "content": "x" * 1500}], "max_tokens": 2},
    )
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert (error["code"], error["type"]) == ("question_too_long", "invalid_request_error")
    assert "at most 1024" in error["message"]


def test_a_wrong_token_an_unknown_session_and_no_video_are_openai_errors(stack, session):
    messages = [{"role": "user", "content": QUESTION}]
    stranger = OpenAI(base_url=f"{stack.url}/v1", api_key="not-the-token", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as wrong:
        stranger.chat.completions.create(model=MODEL, messages=messages, extra_body={"session_id": session.id})
    assert wrong.value.status_code == 401
    assert wrong.value.body == {
        "message": "the API key must be the session's token (OpenAI(api_key=token)), or with API_KEYS the key that "
        "owns the session", "type": "authentication_error", "param": None, "code": "invalid_api_key",
    }
    client = openai_client(stack.url, session)
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model=MODEL, messages=messages, extra_body={"session_id": "0" * 32})
    assert (unknown.value.body["code"], unknown.value.body["type"]) == ("session_not_found", "not_found_error")

    empty = Client(stack.url)
    empty.create()
    try:
        with pytest.raises(openai.ConflictError) as conflict:
            openai_client(stack.url, empty).chat.completions.create(
                model=MODEL, messages=messages, stream=True, extra_body={"session_id": empty.id}
            )
        assert conflict.value.body["code"] == "no_video"
    finally:
        empty.delete()


def test_models_lists_the_served_models(stack, session):
    models = openai_client(stack.url, session).models.list()
    assert [model.id for model in models.data] == [MODEL]


def test_with_api_keys_the_key_creates_the_session_and_the_token_opens_it(redis_url, tmp_path):
    with running_stack(redis_url, tmp_path, API_KEYS="key-0123456789abcdef") as keyed:
        assert Client(keyed.url).create().json()["code"] == "api_key_required"
        user = watching(keyed.url, **{"X-API-Key": "key-0123456789abcdef"})
        completion = openai_client(keyed.url, user).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=2,
            extra_body={"session_id": user.id},
        )
        assert completion.usage.completion_tokens <= 2
        # the key may go along too, for the key's rate limit: it changes nothing else
        with_key = openai_client(keyed.url, user, default_headers={"X-API-Key": "key-0123456789abcdef"})
        assert with_key.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=2,
            extra_body={"session_id": user.id},
        ).choices[0].message.role == "assistant"
        user.delete()
