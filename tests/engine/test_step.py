"""Several sessions in one engine step (`engine/step.py`): the same answers, the same caches, and
each session's failure its own."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from engine import ContextFull, Session, SessionConfig, load_model
from engine.evidence import PROBE, PROBE_ANSWER
from engine.step import Frames, Text, TextScore, step
from demo_training import scenes
from tests.support import answer_together, fault_at_call, needs_demo


SEED = 20240  # held-out scenes (training draws from seeds [0, 1] and [0, 2])


@pytest.fixture(scope="module")
def llava():
    return load_model("tiny-random-llava", "cpu")


def _frames(count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (48, 80, 3), dtype=np.uint8) for _ in range(count)]


def _streamed(model, config: SessionConfig, frames: int, seed: int) -> Session:
    session = Session(model, config)
    session.append_frames(_frames(frames, seed), [float(t) for t in range(frames)])
    return session


def _same_cache(a: Session, b: Session) -> None:
    assert a.cache.tokens == b.cache.tokens
    for layer in range(a.cache.num_layers):
        assert torch.equal(a.cache.order[layer], b.cache.order[layer])
        assert torch.equal(a.cache.kinds[layer], b.cache.kinds[layer])
        assert torch.allclose(a.cache.hf.layers[layer].keys, b.cache.hf.layers[layer].keys, atol=1e-5)
        assert torch.allclose(a.cache.hf.layers[layer].values, b.cache.hf.layers[layer].values, atol=1e-5)
    assert torch.allclose(a.logits, b.logits, atol=1e-4)


def _forward_widths(model, monkeypatch) -> list[int]:
    """The tokens of each forward of the model from now on (until `monkeypatch.undo()`)."""
    widths: list[int] = []
    layer = model.hf.model.language_model.layers[0]
    original = layer.forward

    def counted(hidden, *args, **kwargs):
        widths.append(hidden.shape[1])
        return original(hidden, *args, **kwargs)

    monkeypatch.setattr(layer, "forward", counted)
    return widths


# Budgets small enough that every stream below evicts, streams of different lengths (so caches
# of different lengths pack together), questions of different lengths, one session with recall.
CASES = [
    ("infmllm", {}, 3, "What is it?"),
    ("h2o", {}, 5, "And now, what do you see in the frame?"),
    ("snapkv", {}, 8, "Colour?"),
    ("infmllm", {"recall": True, "retrieval_tokens": 64}, 9, "What came first?"),
]


def test_answers_run_together_are_the_answers_run_alone(llava, monkeypatch):
    def sessions() -> list[Session]:
        return [
            _streamed(llava, SessionConfig(policy=policy, budget_tokens=200, **options), frames, seed)
            for seed, (policy, options, frames, _) in enumerate(CASES)
        ]

    alone = sessions()
    singles = [s.ask(question, max_new_tokens=10) for s, (*_, question) in zip(alone, CASES)]
    expected = ["".join(answer) for answer in singles]
    together = sessions()
    answers = [s.ask(question, max_new_tokens=10) for s, (*_, question) in zip(together, CASES)]
    widths = _forward_widths(llava, monkeypatch)
    assert answer_together(answers) == expected
    monkeypatch.undo()
    assert [a.tokens for a in answers] == [10, 10, 10, 10]
    # the four probes (read only, the evidence's baseline) in one forward, the questions in one,
    # then 9 of a token each, then the four turns closed in one (each a token and its closing)
    probe = sum(len(ids) for ids in (llava.tokenize(PROBE, user=True), llava.tokenize(llava.chat.user_to_assistant), llava.tokenize(PROBE_ANSWER)))
    assert len(widths) == 12 and widths[0] == 4 * probe and widths[2:11] == [4] * 9
    # the same evidence: the same times, weights alike but for the batched products' rounding
    assert [([e.time_s for e in a.evidence], a.recalled_s, a.finish_reason) for a in answers] == [
        ([e.time_s for e in a.evidence], a.recalled_s, a.finish_reason) for a in singles
    ]
    for batched, single in zip(answers, singles):
        assert [e.weight for e in batched.evidence] == pytest.approx([e.weight for e in single.evidence], abs=2e-4)
    for a, b in zip(alone, together):
        _same_cache(a, b)
        assert a.stats().evictions == b.stats().evictions and a.stats().tokens_seen == b.stats().tokens_seen


def test_an_answer_closed_after_a_batched_step_ends_its_turn_once(llava):
    config = SessionConfig(policy="infmllm", budget_tokens=200)
    alone, together = [_streamed(llava, config, 4, seed) for seed in (1, 2)], [_streamed(llava, config, 4, seed) for seed in (1, 2)]
    for session in alone:
        answer = session.ask("Stop early", max_new_tokens=10)
        next(answer), next(answer)  # the question, then one decode step
        answer.close()
    answers = [session.ask("Stop early", max_new_tokens=10) for session in together]
    step(answers), step(answers)  # both questions in one forward, then both tokens
    for answer in answers:
        answer.close()
    for a, b in zip(alone, together):
        _same_cache(a, b)


def test_answers_left_open_close_their_turns_in_the_step_of_their_frames_before_them(llava, monkeypatch):
    sessions = [_streamed(llava, SessionConfig(policy="full"), 2, seed) for seed in (1, 2)]
    answers = [session.ask("Go on", max_new_tokens=10) for session in sessions]
    step(answers), step(answers)  # the questions and first tokens, then a token each: then left open
    held = [session.cache.tokens for session in sessions]
    widths = _forward_widths(llava, monkeypatch)
    assert step([Frames(session, _frames(1, 5), [5.0]) for session in sessions]) == [None, None]
    monkeypatch.undo()
    # one forward closes both turns (the token chosen last, the 8 markers closing it), then one
    # appends both frames (23 tokens each)
    assert widths == [2 * 9, 2 * 23]
    assert [(answer.over, answer.tokens) for answer in answers] == [(True, 2), (True, 2)]
    for session, before in zip(sessions, held):
        assert session.cache.times[0][0, before:].tolist() == [1.0] * 9 + [5.0] * 23  # the closing (at 1.0s) first


def test_frames_appended_together_are_the_frames_appended_alone(llava):
    configs = [SessionConfig(policy="infmllm", budget_tokens=200), SessionConfig(policy="full", frames_per_prompt=2)]
    alone = [_streamed(llava, config, 2 + i, i) for i, config in enumerate(configs)]
    together = [_streamed(llava, config, 2 + i, i) for i, config in enumerate(configs)]
    new = [(_frames(3, 10 + i), [5.0, 6.0, 7.0]) for i in range(len(configs))]
    for session, (frames, times) in zip(alone, new):
        session.append_frames(frames, times)
    assert step([Frames(s, f, t) for s, (f, t) in zip(together, new)]) == [None, None]
    for a, b in zip(alone, together):
        _same_cache(a, b)
        assert b.stats().frames == a.stats().frames and b.stats().video_time_s == 7.0


def test_text_of_several_sessions_runs_in_one_forward_scored_as_alone(llava, monkeypatch):
    """Text is a step's work like frames: three sessions' texts (one empty, one past the room
    its context keeps for questions) in one step; the others in one forward, each scored and
    evicted as alone."""
    configs = [SessionConfig(policy="infmllm", budget_tokens=200), SessionConfig(policy="full"),
               SessionConfig(policy="full", context_tokens=460)]
    alone = [_streamed(llava, config, 2, i) for i, config in enumerate(configs)]
    together = [_streamed(llava, config, 2, i) for i, config in enumerate(configs)]
    texts = ["A transcript of what was said next, in plain words.", "", "A document far longer than what is left. " * 9]
    scores = [alone[0].append_text(texts[0]), alone[1].append_text(texts[1])]
    with pytest.raises(ContextFull):
        alone[2].append_text(texts[2])
    widths = _forward_widths(llava, monkeypatch)
    results = step([Text(s, text) for s, text in zip(together, texts)])
    assert widths == [scores[0].tokens]  # the empty text runs nothing, the refused one is not run
    assert results[0].tokens == scores[0].tokens > 0 and results[0].nll == pytest.approx(scores[0].nll, rel=1e-5)
    assert results[1] == TextScore(0, 0.0) and isinstance(results[2], ContextFull)
    for a, b in zip(alone, together):
        _same_cache(a, b)


def test_a_session_that_cannot_take_its_frames_fails_alone(llava):
    # 149 tokens of opening, 23 a frame: one frame then two more fit in 230, not a third
    small = _streamed(llava, SessionConfig(policy="full", context_tokens=230, question_room_tokens=0), 1, 0)
    backwards = _streamed(llava, SessionConfig(policy="infmllm", budget_tokens=200), 3, 1)  # at 2.0s already
    fine, reference = (_streamed(llava, SessionConfig(policy="infmllm", budget_tokens=200), 2, 2) for _ in range(2))
    frames = _frames(4, 20)
    reference.append_frames(frames, [3.0, 4.0, 5.0, 6.0])
    errors = step(
        [Frames(small, frames, [3.0, 4.0, 5.0, 6.0]), Frames(backwards, frames[:1], [1.0]), Frames(fine, frames, [3.0, 4.0, 5.0, 6.0])]
    )
    assert isinstance(errors[0], ContextFull) and "the frame at 5.0s" in str(errors[0])
    assert isinstance(errors[1], ValueError) and "must not decrease" in str(errors[1])
    assert errors[2] is None
    assert small.stats().frames == 3 and small.cache.tokens == 218  # what fitted went in, nothing past the context
    assert backwards.stats().frames == 3
    _same_cache(fine, reference)


def test_a_failed_batched_forward_leaves_every_session_as_it_was(llava, monkeypatch):
    # the third borrows from its host tier: a failed token keeps what its answer borrowed
    configs = [SessionConfig(policy="infmllm", budget_tokens=200)] * 2
    configs.append(SessionConfig(policy="infmllm", budget_tokens=200, recall=True, retrieval_tokens=64))
    alone = [_streamed(llava, config, 3 + i, i) for i, config in enumerate(configs)]
    expected = ["".join(s.ask("Why?", max_new_tokens=6)) for s in alone]
    together = [_streamed(llava, config, 3 + i, i) for i, config in enumerate(configs)]
    answers = [s.ask("Why?", max_new_tokens=6) for s in together]
    first = step(answers)
    layer = llava.hf.model.language_model.layers[1]
    original = layer.forward

    def broken(hidden, *args, **kwargs):  # a device fault in the middle of a forward of several sessions
        if hidden.shape[1] > 1:
            raise RuntimeError("device fault")
        return original(hidden, *args, **kwargs)

    monkeypatch.setattr(layer, "forward", broken)
    second = step(answers)  # the batched forward fails: each token runs alone instead
    monkeypatch.undo()
    assert not any(isinstance(piece, Exception) for piece in first + second)
    rest = answer_together(answers)
    assert [a + b + c for a, b, c in zip(first, second, rest)] == expected


def test_prompts_longer_than_a_chunk_run_in_chunks_the_same_together_and_alone(llava, monkeypatch):
    # 23 tokens a frame prompt, 7 a chunk: each prompt takes 4 forwards, alone or beside the others
    chunked = {"policy": "infmllm", "budget_tokens": 200, "prefill_chunk_tokens": 7}
    configs = [SessionConfig(**chunked), SessionConfig(**{**chunked, "policy": "full", "frames_per_prompt": 2})]
    new = [(_frames(3, 10 + i), [5.0, 6.0, 7.0]) for i in range(len(configs))]
    alone = [_streamed(llava, config, 2 + i, i) for i, config in enumerate(configs)]
    for session, (frames, times) in zip(alone, new):
        session.append_frames(frames, times)
    together = [_streamed(llava, config, 2 + i, i) for i, config in enumerate(configs)]
    widths = _forward_widths(llava, monkeypatch)
    assert step([Frames(s, f, t) for s, (f, t) in zip(together, new)]) == [None, None]
    monkeypatch.undo()
    # 23 tokens a frame. Round 1: the first's frame (23) beside the second's two (46), 7 of each a
    # forward while both have tokens left; round 2: one frame of each; round 3: the first's last
    assert widths == [14, 14, 14, 9, 7, 7, 4, 14, 14, 14, 4, 7, 7, 7, 2]
    for a, b in zip(alone, together):
        _same_cache(a, b)


def test_question_starts_answer_tokens_and_frames_share_a_step(llava):
    config = SessionConfig(policy="infmllm", budget_tokens=200)

    def sessions() -> list[Session]:
        return [_streamed(llava, config, 3 + i, i) for i in range(3)]

    alone = sessions()
    expected = ["".join(s.ask(q, max_new_tokens=5)) for s, q in zip(alone[:2], ("What is it?", "Where?"))]
    alone[2].append_frames(_frames(2, 30), [9.0, 10.0])
    together = sessions()
    first = together[0].ask("What is it?", max_new_tokens=5)
    head = step([first])  # its question alone; in the next step its token beside a question and frames
    second = together[1].ask("Where?", max_new_tokens=5)
    mixed = step([first, second, Frames(together[2], _frames(2, 30), [9.0, 10.0])])
    assert mixed[2] is None and not any(isinstance(piece, Exception) for piece in head + mixed)
    rest = answer_together([first, second])
    assert [head[0] + mixed[0] + rest[0], mixed[1] + rest[1]] == expected
    for a, b in zip(alone, together):
        _same_cache(a, b)
        assert a.stats().tokens_seen == b.stats().tokens_seen


def test_frames_the_vision_tower_fails_on_fail_alone_and_the_answers_beside_them_go_on(llava, monkeypatch):
    config = SessionConfig(policy="infmllm", budget_tokens=200)
    alone, together = _streamed(llava, config, 3, 0), [_streamed(llava, config, 3 + i, i) for i in range(2)]
    expected = "".join(alone.ask("What is it?", max_new_tokens=5))
    answer = together[0].ask("What is it?", max_new_tokens=5)
    before = together[1].stats()

    def broken(*args, **kwargs):
        raise RuntimeError("vision tower fault")

    monkeypatch.setattr(llava, "encode_frames", broken)
    first, failed = step([answer, Frames(together[1], _frames(1, 50), [9.0])])
    monkeypatch.undo()
    assert isinstance(failed, RuntimeError) and together[1].stats() == before
    assert first + "".join(answer) == expected
    _same_cache(alone, together[0])


def _counts(stats):
    """A session's statistics but its timings and the highest position it reached."""
    return replace(stats, max_position=0, evict_ms=0.0, retrieval_ms=0.0)


def test_a_prompt_that_fails_midway_through_its_chunks_leaves_the_session_as_it_was(llava, monkeypatch):
    config = SessionConfig(policy="infmllm", budget_tokens=200, prefill_chunk_tokens=7)
    session, reference = _streamed(llava, config, 2, 0), _streamed(llava, config, 2, 0)
    before = session.stats()
    fault_at_call(llava.hf.model.language_model.layers[1], monkeypatch, 3)  # in the third forward of the frame's prompt
    with pytest.raises(RuntimeError, match="device fault"):
        session.append_frames(_frames(1, 40), [3.0])
    monkeypatch.undo()
    # as it was (the highest position reached counts the forwards that ran before the fault)
    assert _counts(session.stats()) == _counts(before)
    assert session.cache.appended == reference.cache.appended
    for new in (session, reference):
        new.append_frames(_frames(1, 40), [3.0])
    _same_cache(session, reference)
    assert _counts(session.stats()) == _counts(reference.stats())


@needs_demo
def test_the_demo_model_answers_the_same_together_and_alone():
    demo = load_model("streamvqa-demo", "cpu")
    questions = ["What colour is the background?", "What shape is it?", "What do you see?"]

    def sessions() -> list[Session]:
        out = []
        for i in range(3):
            session = Session(demo, SessionConfig(policy="infmllm", budget_tokens=256))
            frames = [scenes.draw(np.random.default_rng(SEED + 10 * i + t))[0] for t in range(3)]
            session.append_frames(frames, [0.0, 1.0, 2.0])
            out.append(session)
        return out

    expected = ["".join(s.ask(q, max_new_tokens=16)) for s, q in zip(sessions(), questions)]
    assert all(expected)
    assert answer_together([s.ask(q, max_new_tokens=16) for s, q in zip(sessions(), questions)]) == expected


# -- state made in a batched step, changed in a lone one (and back) ------------------------------
#
# A session's counters of tokens per second of video grow at 64, 128, ... seconds; a session
# restored from a snapshot holds them at the size it was saved with. Whatever a batched step
# creates, the session's next step alone must be able to change, and the other way round.


def _inference_tensors(session: Session) -> list[str]:
    """Where a tensor the session keeps across steps is an inference-mode tensor."""
    found, seen = [], set()

    def walk(value, where: str) -> None:
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            if value.is_inference():
                found.append(where)
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{where}[{key!r}]")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, f"{where}[{i}]")
        elif hasattr(value, "__dict__") and type(value).__module__.startswith("engine"):
            for key, item in vars(value).items():
                walk(item, f"{where}.{key}")

    walk(session, "session")
    return found


def _long_streams(llava, count: int, **options) -> list[Session]:
    """Sessions whose frames reach past 64 s of video only in steps run together."""
    sessions = [Session(llava, SessionConfig(budget_tokens=200, **options)) for _ in range(count)]
    for second in range(0, 72, 8):
        frames = [_frames(2, second + i) for i in range(count)]
        times = [float(second), second + 4.0]
        assert step([Frames(s, f, times) for s, f in zip(sessions, frames)]) == [None] * count
    return sessions


def test_frames_run_together_then_alone(llava):
    first, second = _long_streams(llava, 2)
    assert first.stats().video_time_s == 68.0
    assert _inference_tensors(first) == []
    first.append_frames(_frames(1, 99), [70.0])  # alone, after the counters grew in a batched step
    assert first.stats().frames == 19
    answer = second.ask("What is it?", max_new_tokens=4)  # the other one asks alone
    list(answer)
    assert answer.tokens == 4
    assert [s.start_s for s in first.memory().spans][-1] == 70


def test_a_question_run_together_then_alone(llava):
    def streams() -> list[Session]:
        made = [_streamed(llava, SessionConfig(budget_tokens=200, recall=True, retrieval_tokens=32), 4, seed) for seed in (1, 2)]
        for session, second in zip(made, (100.0, 130.0)):  # the next question's time is past 64 s
            session.append_frames(_frames(1, 7), [second])
        return made

    alone = ["".join(s.ask("What came first?", max_new_tokens=3)) for s in streams()]
    sessions = streams()
    answers = [s.ask("What came first?", max_new_tokens=3) for s in sessions]
    assert answer_together(answers) == alone  # together, each answers as it does alone
    assert [a.tokens for a in answers] == [3, 3]
    assert _inference_tensors(sessions[0]) == []
    sessions[0].append_frames(_frames(1, 8), [131.0])  # alone
    assert len(list(sessions[0].ask("And then?", max_new_tokens=3))) == 3
    assert sessions[0].stats().frames == 6


def test_restored_then_together_then_alone(llava):
    saved = _long_streams(llava, 2, recall=True)
    restored = [Session.restore(llava, s.snapshot()) for s in saved]
    times = [140.0]  # past what the restored counters hold
    assert step([Frames(s, _frames(1, i), times) for i, s in enumerate(restored)]) == [None, None]
    answers = [s.ask("What is it?", max_new_tokens=2) for s in restored]
    answer_together(answers)
    assert all(_inference_tensors(s) == [] for s in restored)
    restored[1].append_frames(_frames(1, 5), [141.0])  # alone
    assert len(list(restored[1].ask("Now?", max_new_tokens=2))) == 2
    assert restored[1].memory().spans[-1].end_s == 142
