"""Models and routes under /v1 as OpenAI answers them: an unknown model is 404 `model_not_found`,
`GET /v1/models/{id}`, and a route or method /v1 does not serve is a 404 or 405 in OpenAI's
shape with a client error type; the rest of the API keeps its own shape."""

import time

import httpx
import openai
import pytest
from openai import OpenAI

MODEL = "tiny-random-llava"


@pytest.fixture(scope="module")
def chat(stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.url}/v1", api_key="EMPTY", max_retries=0, timeout=60)


def test_an_unknown_model_is_404_model_not_found(chat):
    with pytest.raises(openai.NotFoundError) as unknown:
        chat.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi?"}])
    assert unknown.value.status_code == 404
    assert unknown.value.body == {
        "message": "the model 'gpt-4o' does not exist: GET /v1/models lists the models served",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found",
    }


def test_a_model_is_retrieved_by_its_id(chat):
    model = chat.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "streamvqa")
    assert 0 <= time.time() - model.created < 600  # the gateway's start (the test's stack began a moment ago), not 0
    assert [listed.created for listed in chat.models.list().data] == [model.created]
    with pytest.raises(openai.NotFoundError) as unknown:
        chat.models.retrieve("Qwen/Qwen2.5-VL-7B-Instruct")  # an id with a slash is one id
    assert unknown.value.body == {
        "message": "the model 'Qwen/Qwen2.5-VL-7B-Instruct' does not exist: GET /v1/models lists the models served",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found",
    }


def test_wrong_routes_and_methods_under_v1_are_404_and_405_in_openais_shape(stack):
    legacy = httpx.post(f"{stack.url}/v1/completions", json={"model": MODEL, "prompt": "Hi"})
    assert legacy.status_code == 404
    assert legacy.json() == {"error": {
        "message": "no route POST /v1/completions; the routes under /v1 are: GET /v1/models, GET /v1/models/{model_id}, "
        "POST /v1/chat/completions",
        "type": "invalid_request_error", "param": None, "code": "unknown_url",
    }}
    assert httpx.get(f"{stack.url}/v1/embeddings").status_code == 404
    wrong = httpx.get(f"{stack.url}/v1/chat/completions")
    assert (wrong.status_code, wrong.headers["allow"]) == (405, "POST")
    assert wrong.json() == {"error": {
        "message": "GET is not allowed on /v1/chat/completions; use POST", "type": "invalid_request_error",
        "param": None, "code": "method_not_allowed",
    }}
    assert httpx.delete(f"{stack.url}/v1/models/{MODEL}").json()["error"]["type"] == "invalid_request_error"
    # the rest of the API keeps its own shape
    elsewhere = httpx.post(f"{stack.url}/nothing/here")
    assert set(elsewhere.json()) == {"code", "message"}
