"""A session never runs past its model's context: a real gateway and worker whose context is
lowered to 700 tokens (MAX_CONTEXT_TOKENS), the tiny LLaVA model (23 tokens a frame)."""

from collections.abc import Iterator

import pytest

from tests.support import Client, Stack, running_stack, sample_video, sse_events

CONTEXT_TOKENS = 700


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(redis_url, tmp_path_factory.mktemp("context"), MAX_CONTEXT_TOKENS=str(CONTEXT_TOKENS)) as stack:
        yield stack


def test_a_bounded_cache_that_cannot_fit_the_context_is_refused_with_the_limit(stack):
    user = Client(stack.url)
    reply = user.create(budget_tokens=4096)
    assert reply.status_code == 422
    assert reply.json()["fields"] == [
        {
            "field": "body.budget_tokens",
            "message": "tiny-random-llava: budget_tokens 4096 does not fit the model's 700-token context beside a "
            "2048-token prompt and a 1024-token answer and what a question retrieves: at most 0",
        }
    ]
    reply = user.create()  # no budget: none fits beside a prompt and an answer
    assert reply.status_code == 422 and "use policy 'full'" in reply.json()["message"]


def test_a_full_session_stops_taking_frames_at_the_context_and_still_answers(stack):
    user = Client(stack.url)
    assert user.create(policy="full", fps=4).status_code == 201
    assert user.wait_for_state("ready")["context_tokens"] == CONTEXT_TOKENS
    with user.http.stream("GET", f"/sessions/{user.id}/events", headers=user.auth) as events:
        assert user.upload(sample_video("bikes.mp4").read_bytes()).status_code == 202  # 40 frames at 4 fps
        seen = []
        for event in sse_events(events):
            seen.append(event)
            if event["event"] == "state" and event["data"]["state"] == "ingested":
                break
    # 149 tokens of opening and 12 frames of 23: a 13th would cut into the 256 kept for questions
    session = user.get().json()
    assert (session["frames_ingested"], session["cache_tokens"], session["context_full"]) == (12, 425, True)
    warnings = [e["data"] for e in seen if e["event"] == "warning"]
    assert warnings == [
        {
            "type": "warning",
            "code": "context_full",
            "message": "the frame at 3.0s needs 23 more tokens, but the cache holds 425 of the model's 700-token "
            "context (256 of it kept for questions): later frames are not taken; ask about what it holds, or use a "
            "policy that evicts",
        }
    ]
    assert session["warnings"] == [{"code": "context_full", "message": warnings[0]["message"]}]  # kept in the session
    assert [t for e in seen if e["event"] == "ingest" for t in e["data"]["times"]][-1] == pytest.approx(2.75, abs=0.02)

    answer = user.ask("what?", max_new_tokens=8)
    assert answer.status_code == 200 and answer.json()["tokens"] == 8
    # 425 + 5 + its turn's 21 + 8 answer tokens: 459 held; 241 left, so a 300-character question does not fit
    refused = user.ask("x" * 300)
    assert refused.status_code == 409 and refused.json() == {
        "code": "context_full",
        "message": "the question needs 322 more tokens, but the cache holds 459 of the model's 700-token context: "
        "ask a shorter question, or start a session with a policy that evicts",
    }
    user.delete()


# 149 tokens of opening and 2 frames of 23: 195 held; the question takes 19 and its turn 21, so an
# answer could take 465: it leaves half (232, less than the 256 kept for questions) and takes 233
HELD_TOKENS, LONG_ANSWER_TOKENS = 195, 233
LONG_TURN_TOKENS = 19 + 13 + LONG_ANSWER_TOKENS + 8


def test_a_long_answer_leaves_the_room_for_questions_and_the_session_says_it_is_full(stack):
    user = Client(stack.url)
    assert user.create(policy="full").status_code == 201
    assert user.show_frames(2)["frames_ingested"] == 2
    held = user.get().json()["cache_tokens"]
    assert held == HELD_TOKENS
    long = user.ask("Tell me everything.", max_new_tokens=1000)
    assert long.status_code == 200
    assert (long.json()["tokens"], long.json()["finish_reason"]) == (LONG_ANSWER_TOKENS, "length")
    session = user.get().json()
    assert (session["cache_tokens"], session["context_full"]) == (held + LONG_TURN_TOKENS, True)
    assert [w["code"] for w in session["warnings"]] == ["context_full"]
    assert session["warnings"][0]["message"].startswith(f"the cache holds {held + LONG_TURN_TOKENS} of the model's 700-token")
    for _ in range(3):  # the room kept takes later questions
        later = user.ask("And then?", max_new_tokens=8)
        assert later.status_code == 200 and later.json()["tokens"] == 8
    user.delete()
