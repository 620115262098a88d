"""One worker, several sessions asking at once: their answer tokens run in one forward, and each
answer is what the same question gets alone."""

from concurrent.futures import ThreadPoolExecutor

from tests.support import Client, metrics_once

QUESTION = "What is in the frame?"
TOKENS = 32  # the tiny random model never stops early
AT_ONCE = 4


def test_questions_asked_at_once_are_answered_together_and_as_alone(stack):
    users = [Client(stack.url) for _ in range(AT_ONCE + 1)]
    try:
        for user in users:
            assert user.create().status_code == 201
            user.wait_for_state("ready")
            user.show_frames()  # the same frame in every session
        alone = users[0].ask(QUESTION, max_new_tokens=TOKENS).json()
        assert alone["tokens"] == TOKENS
        with ThreadPoolExecutor(AT_ONCE) as pool:
            replies = list(pool.map(lambda user: user.ask(QUESTION, max_new_tokens=TOKENS), users[1:]))
        assert [reply.status_code for reply in replies] == [200] * AT_ONCE
        assert [reply.json()["answer"] for reply in replies] == [alone["answer"]] * AT_ONCE
        # the answers overlapped: steps ran more than one session each, on average
        samples = metrics_once(stack.url, "streamvqa_worker_answers_total", at_least=AT_ONCE + 1)
        steps = sum(v for k, v in samples.items() if k.startswith("streamvqa_worker_steps_total"))
        ran = sum(v for k, v in samples.items() if k.startswith("streamvqa_worker_step_sessions_total"))
        assert ran >= steps + TOKENS, (ran, steps)
    finally:
        for user in users:
            user.delete()
