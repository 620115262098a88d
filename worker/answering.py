"""A worker's answers: a question's start (refused, or its prefill and first token), one token
per step after it, the answer's events published once each, and the questions a dead worker
left behind.

An answer's events go to its own stream by a script that adds each at its index once, so a
step retried after Redis failed, or a worker that takes a session over, never sends one twice.
The same script finds an answer whose client left (its cancel mark, set by the gateway): the
answer stops at that token, its turn still closed in the cache, and ends with a `done` event whose
`finish_reason` is `cancelled`; a question cancelled before it began is not begun.
"""

import logging
import time

from redis.asyncio import Redis

from engine import Answer, ContextFull, Model, Result, Sampling
from streamvqa import protocol
from streamvqa.protocol import AnswerEnvelope, DoneEvent, ErrorEvent, Keys, Question, TokenEvent, scripts
from worker.answer_run import AnswerRun
from worker.capacity import Counters
from worker.decode import INTERNAL
from worker.hosted import Hosted
from worker.records import RecordWriter, progress
from worker.scheduler import entry_time
from worker.threads import Threads

log = logging.getLogger(__name__)

GONE, PUBLISHED, CANCELLED = 0, 1, 2  # what publishing an answer event found (PUBLISH_ANSWER_LUA)


def engine_sampling(options: protocol.Sampling) -> Sampling:
    """A question's sampling options as the engine takes them."""
    return Sampling(**{**options.model_dump(), "stop": tuple(options.stop)})


class Starts:
    """Questions a step starts: asked on the engine's thread (`work`), then published."""

    def __init__(self, answering: "Answering", starting: list[tuple[str, Hosted, bytes, Question, str]]) -> None:
        self.answering = answering
        self.starting = starting
        self.befores = [hosted.engine.stats() for _, hosted, *_ in starting]
        self.begun: list[tuple[int, AnswerRun | Exception | None]] = []  # per question: its tokens, and its run or why not

    def work(self) -> list[Answer]:
        """On the engine's thread: each question asked (refused when too long); their answers."""
        for (_, hosted, entry_id, question, stream), before in zip(self.starting, self.befores, strict=True):
            tokens = len(self.answering.model.tokenize(question.question, user=True))
            if tokens > protocol.MAX_QUESTION_TOKENS:
                self.begun.append((tokens, None))
                continue
            try:
                pieces = hosted.engine.ask(question.question, question.max_new_tokens, engine_sampling(question.sampling))
            except Exception as err:
                self.begun.append((tokens, err))
                continue
            self.begun.append((tokens, AnswerRun(entry_id, question, stream, pieces, before)))
        return [run.pieces for _, run in self.begun if isinstance(run, AnswerRun)]

    async def publish(self, results: list[Result] | Exception) -> None:
        """Each question started, or refused (too long, past the context, a failure)."""
        if isinstance(results, Exception):  # the step failed as a whole
            begun = [(tokens, results, None) for tokens, _ in self.begun]
            begun += [(0, results, None)] * (len(self.starting) - len(begun))
        else:
            firsts = iter(results)
            begun = [(tokens, run, next(firsts) if isinstance(run, AnswerRun) else None) for tokens, run in self.begun]
        answering, counters = self.answering, self.answering.counters
        for (session_id, hosted, entry_id, _, stream), (tokens, run, piece) in zip(self.starting, begun, strict=True):
            error = run if isinstance(run, Exception) else piece if isinstance(piece, Exception) else None
            if isinstance(error, ContextFull):
                message = f"{error}: ask a shorter question, or start a session with a policy that evicts"
                await answering._refuse(session_id, entry_id, stream, ErrorEvent(code="context_full", message=message))
            elif error is not None:
                log.error("session %s: answering failed", session_id, exc_info=error)
                await answering._refuse(session_id, entry_id, stream, ErrorEvent(code="internal_error", message=f"answering failed {INTERNAL}"))
            elif run is None:
                message = f"the question is {tokens} tokens long; at most {protocol.MAX_QUESTION_TOKENS} are taken"
                await answering._refuse(session_id, entry_id, stream, ErrorEvent(code="question_too_long", message=message))
            else:
                hosted.answer = run
                counters.prompt_tokens += run.pieces.prompt_tokens
                if run.question.asked_at is not None:
                    counters.queue_time_s.observe(max(0.0, run.started_unix - run.question.asked_at))
                await answering._send(session_id, hosted, piece)


class Tokens:
    """Answers a step advances by a token each."""

    def __init__(self, answering: "Answering", stepping: list[tuple[str, Hosted]]) -> None:
        self.answering = answering
        self.stepping = stepping

    def work(self) -> list[Answer]:
        return [hosted.answer.pieces for _, hosted in self.stepping]

    async def publish(self, results: list[Result] | Exception) -> None:
        pieces = [results] * len(self.stepping) if isinstance(results, Exception) else results
        for (session_id, hosted), piece in zip(self.stepping, pieces, strict=True):
            if isinstance(piece, Exception):
                log.error("session %s: answering failed", session_id, exc_info=piece)
                await self.answering.cancel(session_id, hosted, ErrorEvent(code="internal_error", message=f"answering failed {INTERNAL}"))
            else:
                await self.answering._send(session_id, hosted, piece)


class Answering:
    def __init__(
        self, redis: Redis, keys: Keys, model: Model, threads: Threads, records: RecordWriter, counters: Counters
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.model = model
        self.threads = threads
        self.records = records
        self.counters = counters
        self._publish = redis.register_script(scripts.PUBLISH_ANSWER_LUA)

    async def starts(self, work: list[tuple[str, Hosted]]) -> "Starts | None":
        """The questions a step starts, the first waiting in each session (None when every one
        was refused or needs no answer): asked on the engine's thread, their prefills and first
        tokens run in the step."""
        starting: list[tuple[str, Hosted, bytes, Question, str]] = []
        for session_id, hosted in work:
            question = await self._take_question(session_id, hosted)
            if question is not None:
                starting.append((session_id, hosted, *question))
        return Starts(self, starting) if starting else None

    async def queue(self, session_id: str, hosted: Hosted, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        """A question read joins its session's queue. One asked on a stream socket after media
        waits for that media, unless the media entry is gone already (in the cache of the worker
        that held the session before: it is acknowledged only once a snapshot holds it)."""
        hosted.questions.append((entry_id, fields))
        try:
            after = Question.model_validate_json(fields[b"m"]).after_media
        except (KeyError, TypeError, ValueError):
            return  # dropped when its turn comes
        if after is None:
            return
        if entry_time(after) > hosted.media_read and not await self.redis.xrange(self.keys.media(session_id), after, after, 1):
            return
        hosted.wait_for_media(entry_id, after)

    async def _take_question(self, session_id: str, hosted: Hosted) -> tuple[bytes, Question, str] | None:
        """The session's next question, to be started: (entry id, question, answer stream); None
        when it was refused or needs no answer (each such is acknowledged)."""
        entry_id, fields = hosted.questions.popleft()
        hosted.waits.pop(entry_id, None)
        questions = self.keys.questions(session_id)
        try:
            question = Question.model_validate_json(fields[b"m"])
        except (KeyError, TypeError, ValueError):
            log.warning("session %s: dropped a malformed (or deleted) question", session_id)
            await self.records.consume(questions, entry_id)
            return None
        stream = self.keys.answer(session_id, question.answer_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xlen(stream)
            pipe.exists(self.keys.cancel(session_id, question.answer_id))
            events, cancelled = await pipe.execute()
        if events:  # the same question twice (a retried submit): answered once
            log.warning("session %s: answer %s already has events; not answering again", session_id, question.answer_id)
            await self.records.consume(questions, entry_id)
            return None
        if cancelled:  # its client left before it began
            stats = hosted.engine.stats()
            done = DoneEvent(
                answer="", tokens=0, finish_reason="cancelled", video_time_s=stats.video_time_s,
                cache_tokens=stats.cache_tokens, worker_ms=0.0,
            )
            await self._refuse(session_id, entry_id, stream, done)
            return None
        if hosted.failed:
            await self._refuse(session_id, entry_id, stream, ErrorEvent(code="session_error", message=hosted.error))
            return None
        if hosted.engine.stats().frames == 0 and not hosted.engine.frames_waiting and self.model.sees_frames:
            message = "the session has no video yet: upload a file or stream to it, then ask"
            await self._refuse(session_id, entry_id, stream, ErrorEvent(code="no_video", message=message))
            return None
        return entry_id, question, stream

    async def tokens(self, work: list[tuple[str, Hosted]]) -> "Tokens | None":
        """The answers under way that a step advances by a token (an answer with events Redis
        did not take before sends those instead, and takes no token this step)."""
        stepping = [(session_id, hosted) for session_id, hosted in work if not hosted.answer.outbox]
        for session_id, hosted in work:
            if hosted.answer.outbox:
                await self._send(session_id, hosted, "")
        return Tokens(self, stepping) if stepping else None

    async def cancel(self, session_id: str, hosted: Hosted, error: ErrorEvent | None = None) -> None:
        """Stop an answer under way (its turn still ends in the cache), with `error` as its last event."""
        run, hosted.answer = hosted.answer, None
        hosted.changed = True
        await self.threads.engine(run.pieces.close)
        self.counters.generation_tokens += run.pieces.tokens
        if error is not None:
            await self._publish_event(session_id, run.stream, error, run.published)
        await self.records.consume(self.keys.questions(session_id), run.entry_id)

    async def drop(self, hosted: Hosted) -> None:
        """Forget the answer under way, publishing nothing (the session left this worker)."""
        if hosted.answer is not None:
            await self.threads.engine(hosted.answer.pieces.close)
            hosted.answer = None

    async def reclaim(self, session_id: str, hosted: Hosted, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        """A question a dead worker had read: answered already (acknowledged), begun (ended with
        `session_reset`), or not begun (queued to be answered)."""
        questions = self.keys.questions(session_id)
        try:
            question = Question.model_validate_json(fields[b"m"])
        except (KeyError, ValueError):
            await self.records.consume(questions, entry_id)
            return
        stream = self.keys.answer(session_id, question.answer_id)
        events = await self.redis.xrange(stream)
        kinds = {AnswerEnvelope.model_validate_json(f[b"m"]).event.type for _, f in events}
        if kinds & {"done", "error"}:
            await self.records.consume(questions, entry_id)  # answered before the worker died
        elif kinds:
            message = "the worker answering this question stopped part-way; ask again"
            await self._publish_event(session_id, stream, ErrorEvent(code="session_reset", message=message), len(events))
            await self.records.consume(questions, entry_id)
        else:
            await self.queue(session_id, hosted, entry_id, fields)

    async def _send(self, session_id: str, hosted: Hosted, piece: str | None) -> None:
        """Send a generated piece (None: the answer is over). A session found gone, or an answer
        found cancelled, stops here."""
        run = hosted.answer
        run.add(piece or "")
        cancel = self.keys.cancel(session_id, run.question.answer_id)
        while run.outbox:
            published = await self._publish_event(session_id, run.stream, run.outbox[0], run.published, cancel)
            if published == GONE:
                await self.cancel(session_id, hosted)  # deleted: nobody will read on
                hosted.lost = True
                return
            if published == CANCELLED:
                await self._finish(session_id, hosted, cancelled=True)
                return
            run.outbox.pop(0)
            run.published += 1
        if piece is None:
            await self._finish(session_id, hosted)

    async def _finish(self, session_id: str, hosted: Hosted, cancelled: bool = False) -> None:
        """The answer's final event; a `cancelled` answer's engine answer is closed first (its
        turn ends in the cache), and the pieces not sent are left out of its text."""
        run = hosted.answer
        if cancelled:
            await self.threads.engine(run.pieces.close)
            del run.text[len(run.text) - len(run.outbox) :]
            run.outbox.clear()
        # the session's record before the final event, so that a client told the answer is done reads
        # the cache after it (both idempotent, should the event fail and all this run again)
        await self.records.set(session_id, **progress(hosted.engine))
        if hosted.engine.context_full and not hosted.record.context_full:  # answers filled a cache that does not evict
            why = (
                f"the cache holds {hosted.engine.stats().cache_tokens} of the model's {hosted.engine.context_tokens}-token "
                "context after an answer, the rest kept for questions"
            )
            await self.records.context_full(session_id, hosted, why)
        if not await self._publish_event(session_id, run.stream, run.done(hosted.engine, cancelled), run.published):  # Redis failing: tried again
            hosted.lost = True  # deleted meanwhile
        hosted.answer = None
        hosted.changed = True
        stats, counters = hosted.engine.stats(), self.counters
        counters.answers += 1
        counters.generation_tokens += run.pieces.tokens
        if run.pieces.tokens > 1 and run.first_token_at is not None and not cancelled:
            counters.time_per_output_token_s.observe(max(0.0, time.time() - run.first_token_at) / (run.pieces.tokens - 1))
        counters.evictions += stats.evictions - run.before.evictions
        counters.retrieved_tokens += stats.retrieved_tokens - run.before.retrieved_tokens
        counters.retrieved_pages += stats.retrieved_pages - run.before.retrieved_pages
        counters.retrieval_ms += stats.retrieval_ms - run.before.retrieval_ms
        hosted.host_bytes = stats.host_bytes
        await self.records.consume(self.keys.questions(session_id), run.entry_id)
        await self.records.report_memory(session_id, hosted, force=True)

    async def _refuse(self, session_id: str, entry_id: bytes, stream: str, final: ErrorEvent | DoneEvent) -> None:
        """Answer a question that is not begun with its one final event."""
        await self._publish_event(session_id, stream, final, 0)
        await self.records.consume(self.keys.questions(session_id), entry_id)

    async def _publish_event(
        self, session_id: str, stream: str, event: TokenEvent | DoneEvent | ErrorEvent, index: int, cancel: str | None = None
    ) -> int:
        """Add an answer's `index`-th event (from 0): PUBLISHED, GONE when the session is gone,
        CANCELLED (nothing added) when the answer's `cancel` mark is set."""
        document = AnswerEnvelope(event=event).model_dump_json()
        keys = [self.keys.session(session_id), stream, *([cancel] if cancel else [])]
        args = [document, protocol.ANSWER_MAXLEN, protocol.ANSWER_TTL_S, index]
        return int(await self._publish(keys=keys, args=args))
