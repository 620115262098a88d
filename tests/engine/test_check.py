"""A watch's check (`engine/check.py`): p(yes) of a condition against a session's cache, which is
left exactly as it was; batched in a step with other sessions' work, each as alone."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from engine import POLICIES, Session, SessionConfig, load_model, runner
from engine.check import answer_ids, p_yes, prompt_text
from engine.kv_pool import KVPool
from engine.step import Check, Checked, Frames, prompt_of, step
from demo_training import scenes
from tests.support import fault_at_call, needs_demo

CONDITION = "a red circle is visible"


@pytest.fixture(scope="module")
def llava():
    return load_model("tiny-random-llava", "cpu")


def _frames(count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (48, 80, 3), dtype=np.uint8) for _ in range(count)]


def _streamed(model, config: SessionConfig, frames: int, seed: int, pool: KVPool | None = None) -> Session:
    session = Session(model, config, pool)
    session.append_frames(_frames(frames, seed), [float(t) for t in range(frames)])
    return session


def _cache(session: Session) -> list[list[torch.Tensor]]:
    """What the cache holds, per layer: tokens' kinds, times, stream places, keys and values."""
    cache = session.cache
    return [
        [cache.kinds[layer], cache.times[layer], cache.order[layer], cached.keys.clone(), cached.values.clone()]
        for layer, cached in enumerate(cache.hf.layers)
    ]


def _same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return all(torch.equal(x, y) for layer_a, layer_b in zip(a, b, strict=True) for x, y in zip(layer_a, layer_b, strict=True))


def _state(session: Session) -> tuple:
    """Everything of a session a check must not change."""
    return session.snapshot(), _cache(session), session.memory(), session.stats(), session.cache.appended


def _unchanged(session: Session, before: tuple) -> None:
    snapshot, cache, memory, stats, appended = _state(session)
    assert snapshot == before[0]  # the cache's whole state, its host tier, counters, queries, scores, logits
    assert _same(cache, before[1])
    assert memory == before[2]
    assert stats == before[3]
    assert appended == before[4]


def _pool(model, sessions: int = 1) -> KVPool:
    """A worker's KV pool, for `sessions` sessions of a peak of 1,024 tokens."""
    return KVPool(model.num_layers, model.kv_heads, model.head_dim, sessions * 1024 // 16, 16, model.dtype, model.device)


# Budgets small enough that each stream evicts; every policy that evicts with recall (a host tier with pages)
CASES = [(policy, {} if policy == "full" else {"recall": True, "retrieval_tokens": 64}) for policy in POLICIES]


@pytest.mark.parametrize("policy, options", CASES, ids=POLICIES)
@pytest.mark.parametrize("pooled", [False, True], ids=["own buffers", "in a pool"])
def test_a_check_leaves_the_session_as_it_was(llava, policy, options, pooled):
    config = SessionConfig(policy=policy, budget_tokens=200, peak_tokens=1024 if pooled else None, **options)
    session = _streamed(llava, config, 8, 0, _pool(llava) if pooled else None)
    reference = _streamed(llava, config, 8, 0, _pool(llava) if pooled else None)
    if options.get("recall"):
        assert session.stats().host_tokens > 0
    before = _state(session)
    scores = [session.check(CONDITION), session.check("the screen is blue"), session.check(CONDITION)]
    _unchanged(session, before)
    assert all(0.0 <= p <= 1.0 for p in scores)
    assert scores[0] == scores[2]  # the same cache, the same condition: the same p(yes)

    # what comes next is what it would have been without the checks: frames (their positions,
    # eviction, host tier) and a greedy answer (recall borrows from the host tier)
    for s in (session, reference):
        s.append_frames(_frames(3, 1), [8.0, 9.0, 10.0])
    assert _same(_cache(session), _cache(reference))
    assert session.stats().max_position == reference.stats().max_position
    assert "".join(session.ask("What came first?", max_new_tokens=12)) == "".join(reference.ask("What came first?", max_new_tokens=12))
    assert _same(_cache(session), _cache(reference))
    assert session.check(CONDITION) == reference.check(CONDITION)


@pytest.mark.parametrize("name", ["tiny-random-llava", "tiny-random-qwen2-5-vl"])
def test_a_check_reads_what_its_prompt_run_into_the_cache_would(name):
    """The read-only forward attends what a kept one does: the same logits as the check's prompt
    run into a copy of the session (with 3-D positions too)."""
    model = load_model(name, "cpu")
    session = _streamed(model, SessionConfig(policy="infmllm", budget_tokens=200), 6, 2)
    copy = Session.restore(model, session.snapshot())
    question = session.part(model.tokenize(prompt_text(CONDITION), user=True))
    opening = session.part(model.tokenize(model.chat.user_to_assistant))
    read = runner.run(model, [replace(prompt_of(session, [question, opening]), keep=False)])[0].logits
    kept = runner.run(model, [prompt_of(copy, [question, opening])])[0].logits
    assert torch.allclose(read, kept, atol=1e-5)
    assert session.check(CONDITION) == pytest.approx(p_yes(kept, answer_ids(model.tokenizer)), abs=1e-6)
    assert copy.cache.tokens == session.cache.tokens + question.tokens + opening.tokens


@pytest.mark.parametrize("pooled", [False, True], ids=["own buffers", "in a pool"])
def test_checks_in_one_step_are_each_as_alone(llava, pooled):
    """Checks of three sessions (caches of different lengths, one with recall) in one step with
    another session's frames and another's answer (in a pool: those two written and attended
    there, the checks beside): each p(yes) is its check's alone, the frames and the answer what
    they are without the checks."""
    pool = _pool(llava, 10) if pooled else None
    peak = 1024 if pooled else None
    configs = [
        SessionConfig(policy="infmllm", budget_tokens=200, peak_tokens=peak),
        SessionConfig(policy="full", peak_tokens=peak),
        SessionConfig(policy="infmllm", budget_tokens=200, recall=True, peak_tokens=peak),
    ]
    conditions = [CONDITION, "someone waves", "the light is on?"]

    def sessions() -> list[Session]:
        return [_streamed(llava, config, frames, seed, pool) for seed, (config, frames) in enumerate(zip(configs, (3, 5, 9)))]

    alone = [s.check(c) for s, c in zip(sessions(), conditions)]
    watched = sessions()
    before = [_state(s) for s in watched]
    framed, framed_alone = _streamed(llava, configs[0], 4, 7, pool), _streamed(llava, configs[0], 4, 7, pool)
    asked, asked_alone = _streamed(llava, configs[0], 4, 8, pool), _streamed(llava, configs[0], 4, 8, pool)
    answer = asked.ask("What is it?", max_new_tokens=8)

    results = step([*(Check(s, c) for s, c in zip(watched, conditions)), Frames(framed, _frames(2, 9), [4.0, 5.0]), answer])
    assert [r.p_yes for r in results[:3]] == pytest.approx(alone, abs=1e-5)
    assert [r.evidence for r in results[:3]] == [[], [], []]  # none asked for
    assert results[3] is None
    for session, state in zip(watched, before):
        _unchanged(session, state)
    framed_alone.append_frames(_frames(2, 9), [4.0, 5.0])
    assert _same(_cache(framed), _cache(framed_alone))
    assert results[4] + "".join(answer) == "".join(asked_alone.ask("What is it?", max_new_tokens=8))


def test_p_yes_is_a_probability_read_from_the_yes_and_no_tokens(llava):
    ids = answer_ids(llava.tokenizer)  # a character-level vocabulary: the first letters ("y", "Y"; "n", "N")
    assert sorted(llava.tokenizer.convert_ids_to_tokens(list(ids.yes))) == ["Y", "y"]
    assert sorted(llava.tokenizer.convert_ids_to_tokens(list(ids.no))) == ["N", "n"]
    assert answer_ids(llava.tokenizer) is ids  # found once per tokenizer
    logits = torch.full((llava.hf.config.get_text_config().vocab_size,), -5.0)
    logits[list(ids.yes)] = torch.tensor([1.0, 1.0])  # e + e against e^-5 + e^-5: yes nearly sure
    assert p_yes(logits, ids) == pytest.approx(1 / (1 + np.exp(-6)))
    logits[list(ids.no)] = 1.0
    assert p_yes(logits, ids) == pytest.approx(0.5)
    assert prompt_text(" a dog runs? ") == "Is this true of the video now: a dog runs? Answer yes or no."
    with pytest.raises(ValueError, match="needs a condition"):
        prompt_text(" ?")


def test_a_check_waits_for_an_answer_under_way(llava):
    session = _streamed(llava, SessionConfig(policy="infmllm", budget_tokens=200), 3, 0)
    answer = session.ask("What is it?", max_new_tokens=4)
    next(answer)
    before = _cache(session)
    with pytest.raises(ValueError, match="answering"):
        session.check(CONDITION)
    assert _same(_cache(session), before)
    "".join(answer)
    assert 0.0 <= session.check(CONDITION) <= 1.0


def test_a_failed_forward_leaves_every_session_of_it_as_it_was(llava, monkeypatch):
    """A forward of a check and frames fails: the check runs again alone and leaves its session as
    it was; the frames fail, and their session holds what it held."""
    config = SessionConfig(policy="h2o", budget_tokens=200)
    watched, framed = _streamed(llava, config, 4, 0), _streamed(llava, config, 4, 1)
    alone = watched.check(CONDITION)
    before, framed_before = _state(watched), _state(framed)
    fault_at_call(llava.hf.model.language_model.layers[1], monkeypatch, 1)
    results = step([Check(watched, CONDITION), Frames(framed, _frames(1, 2), [4.0])])
    monkeypatch.undo()
    assert results[0].p_yes == pytest.approx(alone, abs=1e-6)
    assert isinstance(results[1], RuntimeError)
    _unchanged(watched, before)
    assert _same(_cache(framed), framed_before[1])


@needs_demo
def test_the_demo_model_checks_a_scene_and_leaves_it_as_it_was():
    """On a real vocabulary the whole words are read (SmolLM2: YES is two tokens, NO one). The
    demo model was trained to describe scenes, not to judge statements: on its scenes p(yes) is
    near 1 for the right figure and for wrong ones alike (docs/engine.md), so only its range is
    asserted here, not its direction."""
    demo = load_model("streamvqa-demo", "cpu")
    ids = answer_ids(demo.tokenizer)
    assert sorted(demo.tokenizer.convert_ids_to_tokens(list(ids.yes))) == ["Yes", "yes", "ĠYes", "Ġyes"]
    assert sorted(demo.tokenizer.convert_ids_to_tokens(list(ids.no))) == ["NO", "No", "no", "ĠNO", "ĠNo", "Ġno"]
    session = Session(demo, SessionConfig(policy="infmllm", budget_tokens=160, recall=True))
    red_circle = scenes.draw(np.random.default_rng(382), "shape")[0]  # on a blue background
    session.append_frames([red_circle] * 12, [float(t) for t in range(12)])
    assert session.stats().host_tokens > 0
    before = _state(session)
    scores = [session.check("a red circle is visible"), session.check("a green triangle is visible")]
    _unchanged(session, before)
    assert all(0.0 <= p <= 1.0 for p in scores)


def test_a_check_that_reaches_its_evidence_at_reads_the_times_it_attended_to_beyond_a_probe(llava):
    """A watch that fires asks its check for evidence (its threshold as `evidence_at`): a probe
    runs read only after it, and the times the check's queries paid more than the probe's are
    its evidence; a check under `evidence_at` runs no probe. Either way the session is as it
    was, and its p(yes) is the plain check's."""
    session = _streamed(llava, SessionConfig(policy="infmllm", budget_tokens=200), 6, 3)
    before = _state(session)
    alone = session.check(CONDITION)
    widths = []
    original = llava.hf.model.language_model.layers[0].forward

    def counted(hidden, *args, **kwargs):
        widths.append(hidden.shape[1])
        return original(hidden, *args, **kwargs)

    llava.hf.model.language_model.layers[0].forward = counted
    try:
        (fired,) = step([Check(session, CONDITION, evidence_at=0.0)])
        runs_fired, widths[:] = len(widths), []
        (silent,) = step([Check(session, CONDITION, evidence_at=1.0)])
        runs_silent = len(widths)
    finally:
        del llava.hf.model.language_model.layers[0].forward
    assert (runs_fired, runs_silent) == (2, 1)  # the check, then the probe; the check alone
    assert isinstance(fired, Checked) and fired.p_yes == pytest.approx(alone, abs=1e-6)
    assert 1 <= len(fired.evidence) <= 3 and {e.time_s for e in fired.evidence} <= {0.0, 1.0, 2.0, 3.0, 4.0, 5.0}
    assert all(0 < e.weight <= 1 for e in fired.evidence)
    assert silent == Checked(fired.p_yes, [])
    _unchanged(session, before)
