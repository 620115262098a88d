"""Questions onto a session's stream; answer events back from the answer's own stream."""

import time
import uuid
from collections.abc import AsyncIterator

from redis.asyncio import Redis

from streamvqa import protocol
from streamvqa.protocol import AnswerEnvelope, DoneEvent, ErrorEvent, Keys, Question, TokenEvent

READ_BLOCK_MS = 1000

# Queues a question unless ARGV[1] already wait. KEYS[1] = the question stream; ARGV[2] = the
# message. Returns 1 when queued.
SUBMIT_LUA = """
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('XADD', KEYS[1], '*', 'm', ARGV[2])
return 1
"""


class QuestionsBacklogFull(Exception):
    pass


class AnswerTimeout(Exception):
    def __init__(self, answer_id: str) -> None:
        super().__init__(answer_id)
        self.answer_id = answer_id


async def submit(redis: Redis, keys: Keys, session_id: str, question: str, max_new_tokens: int) -> str:
    """Queue a question for the session's worker; returns the answer id."""
    answer_id = uuid.uuid4().hex
    message = Question(answer_id=answer_id, question=question, max_new_tokens=max_new_tokens)
    queued = await redis.eval(
        SUBMIT_LUA, 1, keys.questions(session_id), protocol.QUESTIONS_BACKLOG, message.model_dump_json()
    )
    if not queued:
        raise QuestionsBacklogFull()
    return answer_id


async def events(
    redis: Redis, keys: Keys, answer_id: str, timeout_s: float
) -> AsyncIterator[TokenEvent | DoneEvent | ErrorEvent]:
    """The answer's events in order, ending with its done or error event; AnswerTimeout when late."""
    stream = keys.answer(answer_id)
    deadline = time.monotonic() + timeout_s
    last_id = "0-0"
    while True:
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        if remaining_ms <= 0:
            raise AnswerTimeout(answer_id)
        reply = await redis.xread({stream: last_id}, block=min(READ_BLOCK_MS, remaining_ms), count=256)
        for _, entries in reply:
            for entry_id, fields in entries:
                last_id = entry_id
                event = AnswerEnvelope.model_validate_json(fields[b"m"]).event
                yield event
                if event.type != "token":
                    return
