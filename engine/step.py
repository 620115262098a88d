"""One engine step: the work of one session or many, run through the one runner.

Work comes in four kinds, of distinct sessions of one model:
- an `Answer` to advance by one piece: its question's prompt when it has not begun (then its
  first token is chosen; where it wants evidence, after its probe, run read only the round
  before: `engine/evidence.py`), else the token it chose last (then the next is chosen);
- `Frames` to append: encoded together (one vision call per pooling), then cut into the
  session's frame prompts (`frames_per_prompt` frames each);
- a `Check` to score: its condition's yes/no prompt, run read only (`engine/check.py`); where its
  p(yes) reaches `evidence_at`, a probe runs read only the round after, and the times the check
  attended to beyond it are its evidence;
- `Text` to append: the user turn's text, scored against what the model predicted, or a
  session's opening (its system prompt).
The turn of an answer left open in the session of frames or text (`SessionState.open_answer`)
is closed first, in a run ahead of the rest.

A step runs in rounds, each one run of the runner (`engine/runner.py`, one forward per chunk)
over the next prompt of every item that has one left; a last round closes the turns of the
answers that said all. After its prompt, each session applies what ran and evicts, exactly as
alone. One session alone is a step of one: `engine/session.py` calls `step` for everything, and
this is the only caller of the runner.

Results, one per item in order: an answer's piece (a str; None once it is over), a check's
`Checked`, text's `TextScore` (None for an opening), None for frames, or the exception where
the item failed: frames a session cannot take (`ValueError`, `ContextFull`; the frames before
them stay appended), a check of a session that is answering (`ValueError`), or a failed
forward. A failed forward leaves every session of it as it was; an answer's token or a check in
it then runs alone, so that a fault of one session does not end another's answer.
"""

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum, auto
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from engine import layout, runner
from engine.check import answer_ids, p_yes, prompt_text
from engine.evidence import PROBE, PROBE_ANSWER, Contrast, Evidence, Observed, frame_attention
from engine.loan import begin_retrieval, give_back

if TYPE_CHECKING:
    from engine.answer import Answer
    from engine.session_state import Part, SessionState

log = logging.getLogger(__name__)
MAX_RECALLED_SECONDS = 64  # whole seconds an answer lists as borrowed from the host tier


class Checked(NamedTuple):
    """A check's outcome."""

    p_yes: float  # in [0, 1]
    evidence: list[Evidence]  # where p_yes reached the check's `evidence_at`: the times it attended to beyond a probe


@dataclass(frozen=True)
class TextScore:
    tokens: int
    nll: float  # summed negative log-likelihood (nats) of the tokens given everything before


Result = str | Checked | TextScore | None | Exception


@dataclass(frozen=True)
class Frames:
    """RGB uint8 frames (H, W, 3) for a session, taken at non-decreasing video times."""

    session: "SessionState"
    frames: Sequence[np.ndarray]
    times_s: Sequence[float]
    flush: bool = False  # encode the frames held back for their group too (`Session.frame_groups`)


@dataclass(frozen=True)
class Check:
    """A yes/no condition about a session's video so far, scored against its cache as it is
    (`engine/check.py`): its result is p(yes); nothing of it stays in the cache. It sees the
    frames in the cache, not those held back for their group (`Session.frame_groups`)."""

    session: "SessionState"
    condition: str
    evidence_at: float | None = None  # at or above this p(yes), its evidence too (a watch that fires: its threshold)


@dataclass(frozen=True)
class Text:
    """Text for a session's cache: the user turn's (a transcript, a document), scored against
    what the model predicted; or, `opening`, the conversation's opening (`Session.__init__`)."""

    session: "SessionState"
    text: str
    opening: bool = False


class Does(Enum):
    """What a prompt is for, and so what the step does before it runs and once it ran."""

    QUESTION = auto()  # an answer's question: then `question_ran`
    TOKEN = auto()  # the token an answer chose last: then `fed` the logits after it
    CLOSING = auto()  # the markers closing an answer's turn: then `closed`
    FRAMES = auto()  # a frame prompt: room made before it, `appended_frames` after
    TEXT = auto()  # text or an opening: evicted after it (text scored: its `TextScore`)
    PROBE = auto()  # read only, before an answer's question: `probed`, its evidence's baseline
    CHECK = auto()  # read only: p(yes), and where it reaches `evidence_at` a check's probe next
    CHECK_PROBE = auto()  # read only, after a firing check: its evidence


READ_ONLY = (Does.PROBE, Does.CHECK, Does.CHECK_PROBE)
RETRIED_ALONE = (Does.TOKEN, Does.CLOSING, Does.CHECK, Does.CHECK_PROBE)  # after a failed forward of several


@dataclass
class _Job:
    """One prompt of one item: its parts, what it is for, and what the step needs of it after."""

    item: int  # the item's index in the step's work
    session: "SessionState"
    parts: list["Part"]
    does: Does
    times: list[float] | None = None  # FRAMES: the real frames' times
    targets: list[int] | None = None  # TEXT, scored: its token ids
    observed: Observed | None = None  # read only: what it paid the frames (a probe's; a check's that wants evidence)
    contrast: Contrast | None = None  # CHECK_PROBE: the check's own attention
    p_yes: float = 0.0  # CHECK_PROBE: the check's


Work = "Answer | Frames | Check | Text"


def step(work: Sequence[Work]) -> list[Result]:
    """Run the work of one step; one result per item (see the module's docstring)."""
    results: list[Result] = [None] * len(work)
    _close_left_open(work, results)
    answers = [(i, item) for i, item in enumerate(work) if not isinstance(item, (Frames, Check, Text))]
    plan = {i: jobs for i, answer in answers if (jobs := _answer_jobs(i, answer))}  # per item, the prompts it still runs, in order
    for i, item in enumerate(work):
        try:
            if isinstance(item, Check):
                plan[i] = [_check_job(i, item)]
            elif isinstance(item, Text) and results[i] is None:
                job = _text_job(i, item)
                if job is None:
                    results[i] = TextScore(0, 0.0)  # no tokens: nothing runs
                else:
                    plan[i] = [job]
        except Exception as err:
            results[i] = err
    _plan_frames([(i, item) for i, item in enumerate(work) if isinstance(item, Frames) and results[i] is None], plan, results)
    while plan:
        round_ = []
        for i in list(plan):
            job = plan[i].pop(0)
            if not plan[i]:
                del plan[i]
            try:
                if job.does is Does.FRAMES:
                    job.session.make_frame_room(job.parts, job.times)
            except Exception as err:
                results[i] = err
                plan.pop(i, None)
                continue
            round_.append(job)
        _apply(round_, work, results, plan)
    closing = []  # the turns of the answers that said all, closed in one more round
    for i, answer in answers:
        if results[i] is None:
            try:
                results[i] = answer.advance()
                if results[i] is None and not answer.over:
                    closing.append(_closing_job(i, answer))
            except Exception as err:
                results[i] = err
    _apply([job for job in closing if job is not None], work, results, {})
    for item in work:  # an answer over (ended, or its question failed) is no longer its session's open one
        if item.session.open_answer is not None and item.session.open_answer.over:
            item.session.open_answer = None
    return results


def _close_left_open(work: Sequence[Work], results: list[Result]) -> None:
    """Close first, in a run of their own, the turns of answers left open in the sessions of frames or text (failing those where it fails)."""
    left = {i: item.session.open_answer for i, item in enumerate(work)
            if isinstance(item, (Frames, Text)) and item.session.open_answer is not None}
    _apply([_closing_job(i, answer) for i, answer in left.items() if answer.stop()], left, results, {})


def _apply(jobs: list[_Job], work: Sequence[Work] | dict[int, Work], results: list[Result], plan: dict[int, list[_Job]]) -> None:
    """Run the jobs as one run of the runner, then apply what each ran; a job that failed fails
    its item (and its further prompts)."""
    for job, ran in zip(jobs, _run(jobs), strict=True):
        try:
            if isinstance(ran, Exception):
                raise ran
            _applied(job, ran, work[job.item], results, plan)
        except Exception as err:
            results[job.item] = err
            plan.pop(job.item, None)
            if job.does in (Does.QUESTION, Does.PROBE):  # an answer's question that did not run
                work[job.item].failed()


def _applied(job: _Job, ran: runner.Ran, item: Work, results: list[Result], plan: dict[int, list[_Job]]) -> None:
    """What follows a job's run: a read-only prompt's outcome is read; else its session takes
    what ran, then evicts (each its own) and its item moves on."""
    session = job.session
    if job.does is Does.PROBE:
        item.probed(job.parts[-1].tokens, job.observed.read())
    elif job.does is Does.CHECK:
        results[job.item] = checked = Checked(p_yes(ran.logits, answer_ids(session.model.tokenizer)), [])
        if item.evidence_at is not None and checked.p_yes >= item.evidence_at:  # its evidence: against a probe, next round
            contrast = Contrast()
            contrast.add(job.observed.read())  # the check's own attention
            plan[job.item] = [_Job(job.item, session, probe_parts(session), Does.CHECK_PROBE, observed=Observed(),
                                   contrast=contrast, p_yes=checked.p_yes)]
    elif job.does is Does.CHECK_PROBE:
        job.contrast.probe(job.observed.read(), job.parts[-1].tokens)
        results[job.item] = Checked(job.p_yes, job.contrast.top(session.config.evidence_top_k))
    else:
        session.ran(job.parts, ran.logits)
        if job.does in (Does.QUESTION, Does.TOKEN, Does.CLOSING):
            _answer_ran(job, item)
        elif job.does is Does.FRAMES:
            session.appended_frames(job.times)
        else:  # TEXT
            session.cache.evict()
            if job.targets is not None:
                results[job.item] = TextScore(len(job.targets), ran.nll)


def _answer_ran(job: _Job, answer: "Answer") -> None:
    """An answer's prompt ran: it takes the logits and what its queries paid the frames, then the
    cache evicts as the policy says (once its turn closed, after giving back what it borrowed)."""
    session, cache = job.session, job.session.cache
    if job.does is Does.QUESTION:
        answer.question_ran(frame_attention(cache, answer.prompt_tokens), session.logits)
        if session.policy.evict_on_question:
            cache.evict()
    elif job.does is Does.TOKEN:
        answer.fed(session.logits)
        if session.policy.evicts_every_decode_step:  # h2o
            answer.weighed(frame_attention(cache, answer.unweighed))
            cache.evict()
    else:  # CLOSING
        answer.weighed(frame_attention(cache, answer.unweighed + sum(part.tokens for part in job.parts)))
        give_back(cache)
        cache.evict()
        recalled = sorted(cache.loan.recalled_seconds)[:MAX_RECALLED_SECONDS] if answer.borrowed else []
        answer.closed(answer.contrast.top(session.config.evidence_top_k), recalled)


def _closing_job(item: int, answer: "Answer") -> _Job | None:
    """The prompt that closes the turn of an answer that said all, the markers closing it
    pinned; None (and it is over) when its question never ran."""
    if (closing := answer.closing()) is None:
        answer.stop()
        return None
    (unfed, markers), session = closing, answer.session
    session.pin_turn(session.cache.appended + len(unfed), markers.tokens, new_turn=False)
    return _Job(item, session, [session.part(unfed), markers], Does.CLOSING)


def _answer_jobs(item: int, answer: "Answer") -> list[_Job]:
    """The prompts that advance an answer: its probe (where it wants evidence and the context has
    room) and its question's, places reserved for what it borrows and its markers pinned; or its
    last token; none if none."""
    session = answer.session
    question = answer.begin()
    if question is not None:
        words, markers = question
        answer.borrowed = begin_retrieval(session.cache, session.config.borrowed_tokens, words.tokens)
        session.pin_turn(session.cache.appended + words.tokens, markers.tokens, new_turn=True)
        asked = _Job(item, session, question, Does.QUESTION)
        if session.config.evidence_top_k == 0:
            return [asked]
        probe = probe_parts(session)
        if sum(part.tokens for part in probe) > session.context_tokens - session.cache.tokens:
            return [asked]
        return [_Job(item, session, probe, Does.PROBE, observed=Observed()), asked]
    token = answer.unfed()
    return [] if token is None else [_Job(item, session, [session.part(token)], Does.TOKEN)]


def _check_job(item: int, check: Check) -> _Job:
    """A check's prompt, to run read only (with a firing check's probe planned after it, whose
    attention is the baseline of the check's evidence). Refused (raises) while its session
    answers, or past its context."""
    session = check.session
    parts = _read_only_parts(session, prompt_text(check.condition))
    session.make_check_room(sum(part.tokens for part in parts))
    return _Job(item, session, parts, Does.CHECK, observed=None if check.evidence_at is None else Observed())


def _text_job(item: int, text: Text) -> _Job | None:
    """Text's prompt (scored, unless it is the opening), evicted after; None for no tokens.
    Refused (raises) past the room the session keeps for questions."""
    session = text.session
    if text.opening:
        return _Job(item, session, [session.opening(text.text)], Does.TEXT)
    ids = session.user_text(text.text)
    return _Job(item, session, [session.part(ids)], Does.TEXT, targets=ids) if ids else None


def _read_only_parts(session: "SessionState", text: str) -> list["Part"]:
    """A question (user text) and the markers that close the user's turn and open the
    assistant's: a check's or a probe's prompt."""
    model = session.model
    return [session.part(model.tokenize(text, user=True)), session.part(model.tokenize(model.chat.user_to_assistant))]


def probe_parts(session: "SessionState") -> list["Part"]:
    """The probe (engine/evidence.py): its question's prompt, then the first words of an answer."""
    return [*_read_only_parts(session, PROBE), session.part(session.model.tokenize(PROBE_ANSWER))]


def _plan_frames(work: list[tuple[int, Frames]], plan: dict[int, list[_Job]], results: list[Result]) -> None:
    """Check each session's frames, encode them (together, per pooling and grid), and plan their
    prompts."""
    by_kind: dict[tuple, list[tuple[int, "SessionState", list[np.ndarray], list[float]]]] = {}
    for i, item in work:
        try:
            session = item.session
            if session.check_frames(item.frames, item.times_s, item.flush):
                frames, times, real = session.frame_groups(item.frames, item.times_s, item.flush)
                if frames:
                    kind = (session.config.pool, session.model.frame_grid(frames[0].shape))
                    by_kind.setdefault(kind, []).append((i, session, frames, times[:real]))
        except Exception as err:
            results[i] = err
    for (pool, grid), items in by_kind.items():
        model = items[0][1].model
        try:
            visual = model.encode_frames([frame for _, _, frames, _ in items for frame in frames], pool)  # (N, tokens, hidden)
        except Exception as err:  # the vision tower failed: these frames fail, the step goes on
            for i, *_ in items:
                results[i] = err
            continue
        offset = 0
        for i, session, frames, times_s in items:
            count = len(frames) // model.frames_per_group
            plan[i] = [_Job(i, session, parts, Does.FRAMES, times=times)
                       for parts, times in session.frame_prompts(visual[offset : offset + count], times_s, grid)]
            offset += count


def prompt_of(session: "SessionState", parts: list["Part"], targets: torch.Tensor | None = None) -> runner.Prompt:
    """Parts as the runner's prompt after the session's cache (scored against `targets`)."""
    deepstack = [part.deepstack[0] for part in parts if part.deepstack is not None]
    return runner.Prompt(
        session.cache,
        torch.cat([part.embeds for part in parts], dim=1),
        torch.cat([torch.full((part.tokens,), part.kind, dtype=torch.int8) for part in parts]),
        torch.cat([torch.full((part.tokens,), part.time_s) for part in parts]),
        session.config.prefill_chunk_tokens,
        targets,
        session.logits if targets is not None else None,
        layout.of_parts([(part.tokens, part.grid) for part in parts]) if session.cache.positions_3d else None,
        torch.cat(deepstack) if deepstack else None,
    )


def _prompt(job: _Job) -> runner.Prompt:
    prompt = prompt_of(job.session, job.parts, None if job.targets is None else torch.tensor(job.targets))
    return replace(prompt, keep=False, observed=job.observed) if job.does in READ_ONLY else prompt


def _run(jobs: list[_Job]) -> list[runner.Ran | Exception]:
    """One run of the runner over the jobs' prompts; if it fails, each job's error, or (an
    answer's token) what it gives run alone."""
    if not jobs:
        return []
    prompts = [_prompt(job) for job in jobs]
    model = jobs[0].session.model
    try:
        return runner.run(model, prompts)
    except Exception as err:  # every session is as it was
        if len(jobs) == 1:
            return [err]
        log.exception("a forward of %d sessions failed; their answers' tokens run alone", len(jobs))
        failed = err
    outcomes: list[runner.Ran | Exception] = []
    for job, prompt in zip(jobs, prompts, strict=True):
        if job.does not in RETRIED_ALONE:
            outcomes.append(failed)
            continue
        try:
            outcomes.append(runner.run(model, [prompt])[0])
        except Exception as err:
            outcomes.append(err)
    return outcomes
