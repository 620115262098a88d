"""Qwen2.5-VL and Qwen3-VL: frames in pairs as Qwen's processor makes them, 3-D positions (and
Qwen3-VL's deep-stack features) as transformers' own forward places them, and a bounded cache that
re-encodes them after eviction."""

import json

import numpy as np
import pytest
import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize

from engine import Session, SessionConfig, load_model
from engine.layout import FIELDS, GRID_COLUMN, GRID_ROW, GROUP, compact, of_parts, pack, unpack
from engine.model import load_pretrained
from engine.kv_pool import KVPool
from engine.qwen_vision import QwenVision
from engine import tiny
from tests.support import answer_together, fault_at_call

TIMES = [0.0, 0.5, 1.0, 1.5, 2.0]
FAMILIES = ["tiny-random-qwen2-5-vl", "tiny-random-qwen3-vl"]
# Each family's text around a pair of frames, as its own processor writes it
AROUND = {
    "tiny-random-qwen2-5-vl": lambda times: (f"[{times[0]:.1f}s]<|vision_start|>", "<|vision_end|>\n"),
    "tiny-random-qwen3-vl": lambda times: (f"<{sum(times) / 2:.1f} seconds><|vision_start|>", "<|vision_end|>"),
}
# The pixels a frame may take (min, max), a patch's side, mean and std of each tiny model
PIXELS = {
    "tiny-random-qwen2-5-vl": (56 * 56, 112 * 112, 14, (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
    "tiny-random-qwen3-vl": (64 * 64, 128 * 128, 16, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
}


@pytest.fixture(scope="module", params=FAMILIES)
def qwen(request):
    return load_model(request.param, "cpu")


def _frames(count: int, seed: int = 0, shape=(90, 160, 3)) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(count)]


def test_qwen_frames_are_the_qwen_processors_patches_and_visual_tokens(qwen):
    frame = _frames(1)[0]
    low, high, patch, mean, std = PIXELS[qwen.name]
    processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": low, "longest_edge": high}, patch_size=patch, image_mean=mean, image_std=std
    )
    expected = processor(images=[frame], return_tensors="pt")  # an image: one frame, twice over time
    patches, grid = qwen.vision.patches([frame, frame])
    assert grid.tolist() == expected["image_grid_thw"].tolist() == [[1, 6, 10]]  # 84x140 or 96x160 pixels
    assert torch.allclose(patches, expected["pixel_values"], atol=1e-6)
    tokens, deepstack = qwen.split_visual(qwen.encode_frames([frame, frame]))
    assert tokens.shape == (1, 15, 64) and qwen.frame_grid(frame.shape) == (3, 5)
    with torch.inference_mode():
        features = qwen.hf.model.get_image_features(expected["pixel_values"], expected["image_grid_thw"])
    assert torch.allclose(tokens[0], features.pooler_output[0], atol=1e-5)
    if qwen.name == "tiny-random-qwen3-vl":  # two deep-stack layers, each (15, 64)
        assert deepstack.shape == (1, 15, 128)
        assert torch.allclose(deepstack[0], torch.cat([f[0] for f in features.deepstack_features], dim=-1), atol=1e-5)
    else:
        assert deepstack is None
    # Qwen2.5-VL-7B's own bounds for video frames: a 1280x720 frame is 1008x560 pixels, 36x20 merged patches
    assert smart_resize(720, 1280, 28, 128 * 28 * 28, 768 * 28 * 28) == (560, 1008)
    assert QwenVision().grid((720, 1280, 3)) == (20, 36)


def test_qwen_layout_of_a_prompt_and_after_eviction():
    layout = of_parts([(2, None), (6, (2, 3)), (1, None)])  # text, a group of 2 rows x 3 columns, text
    assert layout.tolist() == [
        [0, 0, 0], [1, 0, 0],
        [2, 0, 0], [2, 0, 1], [2, 0, 2], [2, 1, 0], [2, 1, 1], [2, 1, 2],
        [5, 0, 0],
    ]
    # kept: a text token; three tokens of a group, at (row, column) (0, 2), (1, 0), (3, 4) of its
    # grid; text; two of another group, at (2, 1) and (2, 3)
    group = torch.tensor([[0, 1, 1, 1, 5, 9, 9]])
    row = torch.tensor([[0, 0, 1, 3, 0, 2, 2]])
    column = torch.tensor([[0, 2, 0, 4, 0, 1, 3]])
    s, rows, columns = compact(group, row, column).tolist()
    assert s == [[0, 1, 1, 1, 4, 5, 5]]  # the first group keeps 3 rows and 3 columns: it spans 3
    assert rows == [[0, 0, 1, 2, 0, 0, 0]] and columns == [[0, 1, 0, 2, 0, 0, 1]]  # their order, not their gaps


def _reference(qwen, session: Session, frames, times, question: str | None = None):
    """The same stream as the session's, as transformers' own inputs: ids, video patches, grids
    and token types, each pair of frames a video of one temporal group."""
    config = qwen.hf.config
    ids = qwen.tokenize(qwen.chat.open(session.config.system_prompt))
    types, patches, grids = [0] * len(ids), [], []
    for first in range(0, len(frames), 2):
        pair = frames[first : first + 2]
        pair = pair + pair[-1:] * (2 - len(pair))
        pixels, grid = qwen.vision.patches(pair)
        tokens = int(grid[0].prod()) // 4
        pair_times = times[first : first + 2] + times[first : first + 2][-1:] * (2 - len(times[first : first + 2]))
        opening, closing = (qwen.tokenize(text) for text in AROUND[qwen.name](pair_times))
        ids += opening + [config.video_token_id] * tokens + closing
        types += [0] * len(opening) + [2] * tokens + [0] * len(closing)
        patches.append(pixels)
        grids.append(grid)
    if question is not None:
        asked = qwen.tokenize(question) + qwen.tokenize(qwen.chat.user_to_assistant)
        ids, types = ids + asked, types + [0] * len(asked)
    return {
        "input_ids": torch.tensor([ids]),
        "pixel_values_videos": torch.cat(patches),
        "video_grid_thw": torch.cat(grids),
        "mm_token_type_ids": torch.tensor([types]),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
    }


# Tokens after two pairs (149 of the opening; a pair 24 with Qwen2.5-VL's markers, 30 with
# Qwen3-VL's), and where the next goes: Qwen2.5-VL's second pair's 3x5 tokens at time 170, heights
# 170-172, widths 170-174, its closing markers at 175 and 176; Qwen3-VL's at 183, its marker at 188
AFTER_TWO_PAIRS = {"tiny-random-qwen2-5-vl": (197, 177), "tiny-random-qwen3-vl": (209, 189)}


def test_qwen_session_without_eviction_is_transformers_forward_and_generate(qwen):
    frames = _frames(5)
    session = Session(qwen, SessionConfig(policy="full"))
    session.append_frames(frames, TIMES)
    assert session.stats().frames == 4  # two pairs; the fifth frame waits for its partner
    inputs = _reference(qwen, session, frames[:4], TIMES[:4])
    tokens, next_position = AFTER_TWO_PAIRS[qwen.name]
    assert session.cache.tokens == inputs["input_ids"].shape[1] == tokens
    with torch.inference_mode():
        expected = qwen.hf(**inputs).logits[0, -1]
    assert torch.allclose(session.logits, expected, atol=1e-5)
    assert session.cache.next_position() == next_position and session.cache.max_position == next_position - 1

    question = "What is it?"
    answer = "".join(session.ask(question, max_new_tokens=6))  # the question sees the fifth frame, paired with itself
    inputs = _reference(qwen, session, frames, TIMES, question)
    qwen.hf.model.rope_deltas = None
    with torch.inference_mode():
        generated = qwen.hf.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert answer == qwen.tokenizer.decode(generated[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert session.stats().frames == 5 and session.stats().video_time_s == 2.0


@pytest.mark.parametrize("policy", ["sliding", "h2o", "snapkv", "tova", "knorm", "infmllm"])
def test_qwen_every_policy_stays_within_its_budget_with_positions_bounded(qwen, policy):
    session = Session(qwen, SessionConfig(policy=policy, budget_tokens=160))
    frames = _frames(40, seed=3)
    for first in range(0, 40, 4):
        session.append_frames(frames[first : first + 4], [float(t) for t in range(first, first + 4)])
        assert session.cache.tokens <= 160
    # 20 pairs of 15 visual tokens and 13 of markers, 560 tokens streamed: a cache that kept
    # every position would place the next token past 400; this one stays within what it holds
    assert session.cache.next_position() <= 160 and session.cache.max_position < 200
    assert session.stats().evictions >= 10
    answer = session.ask("What moved?", max_new_tokens=5)
    assert len("".join(answer)) > 0 and answer.tokens == 5
    assert session.cache.max_position < 200


def test_qwen_a_lone_frame_waits_for_its_pair_unless_a_question_comes(qwen):
    session = Session(qwen, SessionConfig(policy="infmllm", budget_tokens=160))
    frames = _frames(4, seed=5)
    session.append_frames(frames[:1], [0.0])
    assert session.stats().frames == 0 and session.memory().frame_tokens == 0  # nothing seen yet
    session.append_frames(frames[1:3], [1.0, 2.0])
    assert session.stats().frames == 2 and session.stats().video_time_s == 1.0
    "".join(session.ask("Now?", max_new_tokens=3))
    assert session.stats().frames == 3 and session.stats().video_time_s == 2.0
    assert 2.0 in session.cache.times[0][0].tolist()
    session.append_frames(frames[3:], [3.0])  # a new pair begins
    assert session.stats().frames == 3
    with pytest.raises(ValueError, match="must not decrease"):
        session.append_frames(frames[:1], [2.5])  # before the frame waiting


def test_qwen_snapshot_restores_the_layout_and_the_frame_waiting(qwen):
    config = SessionConfig(policy="infmllm", budget_tokens=160, peak_tokens=320)
    first = Session(qwen, config)
    first.append_frames(_frames(9, seed=7), [float(t) for t in range(9)])
    restored = Session.restore(qwen, first.snapshot())
    for layer in range(qwen.num_layers):
        assert torch.equal(first.cache.hf.layers[layer].layout.rows, restored.cache.hf.layers[layer].layout.rows)
    # taken over by another worker: restored into its KV pool
    pool = KVPool(qwen.num_layers, qwen.kv_heads, qwen.head_dim, 320 // 16, 16, qwen.dtype, qwen.device)
    taken = Session.restore(qwen, first.snapshot(), pool)
    assert pool.free_pages == 0 and taken.cache.lease is not None
    answers = []
    for session in (first, restored, taken):
        session.append_frames(_frames(3, seed=8), [9.0, 10.0, 11.0])
        answers.append("".join(session.ask("What came last?", max_new_tokens=6)))
        assert session.stats().frames == 12
    assert answers[0] == answers[1] == answers[2]


def test_qwen_answers_together_are_the_answers_alone(qwen):
    cases = [("infmllm", 7, "What is it?"), ("snapkv", 12, "Colour?"), ("full", 3, "And now, what do you see?")]

    def streamed() -> list[Session]:
        sessions = []
        for seed, (policy, count, _) in enumerate(cases):
            session = Session(qwen, SessionConfig(policy=policy, budget_tokens=160))
            session.append_frames(_frames(count, seed), [float(t) for t in range(count)])
            sessions.append(session)
        return sessions

    alone = ["".join(s.ask(q, max_new_tokens=6)) for s, (*_, q) in zip(streamed(), cases)]
    answers = [s.ask(q, max_new_tokens=6) for s, (*_, q) in zip(streamed(), cases)]
    assert answer_together(answers) == alone


def test_qwen_a_pair_that_fails_midway_through_its_chunks_leaves_the_session_as_it_was(qwen, monkeypatch):
    config = SessionConfig(policy="infmllm", budget_tokens=160, prefill_chunk_tokens=7)  # a pair's group split over chunks
    session, reference = Session(qwen, config), Session(qwen, config)
    for each in (session, reference):
        each.append_frames(_frames(8, seed=9), [float(t) for t in range(8)])
    fault_at_call(qwen.hf.model.language_model.layers[1], monkeypatch, 3)  # in the third forward of the pair's prompt
    with pytest.raises(RuntimeError, match="device fault"):
        session.append_frames(_frames(2, seed=10), [8.0, 9.0])
    monkeypatch.undo()
    for layer_index in range(qwen.num_layers):
        assert torch.equal(session.cache.hf.layers[layer_index].layout.rows, reference.cache.hf.layers[layer_index].layout.rows)
    for each in (session, reference):
        each.append_frames(_frames(2, seed=10), [8.0, 9.0])
    assert session.cache.next_position() == reference.cache.next_position()
    assert torch.allclose(session.logits, reference.logits, atol=1e-5)
    assert "".join(session.ask("Which?", max_new_tokens=4)) == "".join(reference.ask("Which?", max_new_tokens=4))


def test_qwen_a_host_tier_keeps_each_tokens_place_on_its_frame():
    rows = torch.zeros(FIELDS, 2, 3, dtype=torch.long)
    rows[GROUP] = torch.tensor([[100, 100, 7], [40, 40, 40]])
    rows[GRID_ROW] = torch.tensor([[0, 1, 0], [2, 2, 3]])
    rows[GRID_COLUMN] = torch.tensor([[4, 0, 0], [1, 2, 0]])
    order = torch.tensor([[104, 105, 7], [49, 50, 52]])
    back = unpack(pack(rows, order), order)
    assert torch.equal(back[GROUP:], rows[GROUP:]) and not back[:GROUP].any()  # positions are made again


def _turned_by_the_model(model, cached, head: int) -> torch.Tensor:
    """(n, head_dim) a layer's stored keys of one KV head turned in float32 by the model's own
    rotary embedding at their 3-D positions, as its forward turns a key."""
    keys, positions = cached.keys[0, head].float(), cached.layout.positions()[head]  # (n, head_dim), (n, 3)
    cos, sin = model.rotary(keys, positions.T[:, None, :])  # (1, n, head_dim)
    half = keys.shape[-1] // 2
    return keys * cos[0] + torch.cat([-keys[:, half:], keys[:, :half]], dim=-1) * sin[0]


def _recalling(qwen, **options) -> Session:
    config = SessionConfig(policy="infmllm", budget_tokens=160, recall=True, retrieval_tokens=64, host_budget_tokens=1024, **options)
    session = Session(qwen, config)
    session.append_frames(_frames(30, seed=11), [float(t) for t in range(30)])
    return session


def test_qwen_recall_borrows_evicted_frames_at_positions_before_the_question(qwen):
    session = _recalling(qwen)
    assert session.stats().host_tokens > 300  # most of 15 pairs of 28 tokens left the device
    answer = session.ask("What was at the start?", max_new_tokens=4)
    next(answer)  # the question ran: it borrowed, then it was placed after what it borrowed
    question = len(qwen.tokenize("What was at the start?")) + len(qwen.tokenize(qwen.chat.user_to_assistant))
    for cached in session.cache.hf.layers:
        positions = cached.layout.positions()[..., 0]  # (kv_heads, n) time, the least of the three
        assert cached.layout.tokens == cached.keys.shape[2] == 160 + 64 + question
        assert positions[:, : 160 + 64].amax() < positions[:, 160 + 64 :].amin()
    assert all(int(borrowed.sum()) == 2 * 64 for borrowed in session.cache.loan.borrowed.values())  # 64 in each of 2 KV heads
    # What the attention reads, borrowed keys among them: the stored keys turned by the model's own
    # rotary embedding at their 3-D positions, as its forward turns a key
    for cached in session.cache.hf.layers:
        for head in range(qwen.kv_heads):
            assert torch.allclose(cached.rotated()[0, head], _turned_by_the_model(qwen, cached, head), atol=1e-5)
    assert session.cache.loan.retrieved_tokens == 64
    "".join(answer)
    assert answer.recalled_s and all(0 <= t < 30 for t in answer.recalled_s)  # seconds of frames it borrowed
    for cached in session.cache.hf.layers:  # given back, and down to the budget again
        assert cached.layout.tokens == cached.keys.shape[2] == session.cache.tokens == 160
    assert session.cache.max_position < 160 + 64 + question + 4 + 8  # and 8 of the turn's closing markers
    session.append_frames(_frames(4, seed=12), [30.0, 31.0, 32.0, 33.0])
    assert session.cache.tokens == 160 and session.cache.next_position() <= 160


def test_qwen_recall_restores_from_a_snapshot_with_its_pages_apart(qwen):
    session = _recalling(qwen)
    pages = session.changed_host_pages()
    restored = Session.restore(qwen, session.snapshot(host_pages=False), read_page=pages.__getitem__)
    answers = ["".join(s.ask("What was at the start?", max_new_tokens=6)) for s in (session, restored)]
    assert answers[0] == answers[1]
    tiers = session.cache.host, restored.cache.host
    assert tiers[0].pages == tiers[1].pages and tiers[0].grids is not None
    assert all(torch.equal(tiers[0].page_state(n)["grids"], tiers[1].page_state(n)["grids"]) for n in tiers[0].pages)


def test_qwen_recall_answers_together_as_alone(qwen):
    def sessions() -> list[Session]:
        recall = _recalling(qwen)
        plain = Session(qwen, SessionConfig(policy="snapkv", budget_tokens=160))
        plain.append_frames(_frames(9, seed=13), [float(t) for t in range(9)])
        return [recall, plain]

    questions = ["What was at the start?", "Colour?"]
    alone = ["".join(s.ask(q, max_new_tokens=6)) for s, q in zip(sessions(), questions)]
    answers = [s.ask(q, max_new_tokens=6) for s, q in zip(sessions(), questions)]
    assert answer_together(answers) == alone


def test_qwen_loads_from_a_local_folder_like_a_hub_checkpoint(qwen, tmp_path):
    hf, tokenizer = {"tiny-random-qwen2-5-vl": tiny.tiny_qwen2_5_vl, "tiny-random-qwen3-vl": tiny.tiny_qwen3_vl}[qwen.name](seed=0)
    hf.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    low, high, *_ = PIXELS[qwen.name]
    shares = 2 if qwen.name == "tiny-random-qwen3-vl" else 1  # Qwen3-VL's bounds are a clip's: here a pair's
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"size": {"shortest_edge": low * shares, "longest_edge": high * shares}}))
    loaded = load_pretrained(str(tmp_path), "cpu")
    assert loaded.vision == qwen.vision and loaded.position_axes == 3
    frames = _frames(2)
    assert torch.allclose(loaded.encode_frames(frames), qwen.encode_frames(frames), atol=1e-6)
    session = Session(loaded, SessionConfig(policy="infmllm", budget_tokens=160))
    session.append_frames(frames, [0.0, 1.0])
    assert session.stats().frames == 2


def test_qwen_sessions_in_one_kv_pool_attend_together_and_answer_as_alone(qwen):
    """Sessions leasing from one KV pool write and attend there together, one call per layer
    (engine/pool_attention.py), their tokens at their 3-D positions: the answers of sessions
    with caches of their own."""
    cases = [("infmllm", 7, "What is it?"), ("snapkv", 12, "Colour?"), ("sliding", 4, "Now?")]
    config = lambda policy: SessionConfig(policy=policy, budget_tokens=160, peak_tokens=320)  # noqa: E731
    pool = KVPool(qwen.num_layers, qwen.kv_heads, qwen.head_dim, 3 * 320 // 16, 16, qwen.dtype, qwen.device)
    pooled, alone = [], []
    for seed, (policy, count, _) in enumerate(cases):
        for sessions, where in ((pooled, pool), (alone, None)):
            session = Session(qwen, config(policy), where)
            session.append_frames(_frames(count, seed), [float(t) for t in range(count)])
            sessions.append(session)
    expected = ["".join(s.ask(q, max_new_tokens=6)) for s, (*_, q) in zip(alone, cases)]
    answers = [s.ask(q, max_new_tokens=6) for s, (*_, q) in zip(pooled, cases)]
    assert all(s.cache.in_pool(1) for s in pooled)
    assert answer_together(answers) == expected
    for a, b in zip(pooled, alone):
        for layer in range(qwen.num_layers):
            assert torch.equal(a.cache.hf.layers[layer].layout.rows, b.cache.hf.layers[layer].layout.rows)


def test_qwen_in_bfloat16_keys_are_one_rotation_from_what_the_model_computed_after_many_evictions(qwen):
    """However many evictions re-encode a key's position, what the attention reads is the stored
    key rotated once, by the model's own rotary embedding at its 3-D position: bfloat16's
    rounding of that one rotation, not one per move (docs/engine.md, "Precision")."""
    model = load_model(qwen.name, "cpu")
    model.hf.to(torch.bfloat16)
    session = Session(model, SessionConfig(policy="infmllm", budget_tokens=160))
    for first in range(0, 80, 8):
        session.append_frames(_frames(8, seed=first), [float(t) for t in range(first, first + 8)])
    assert session.stats().evictions >= 30
    for cached in session.cache.hf.layers:
        for head in range(model.kv_heads):
            turned = _turned_by_the_model(model, cached, head)
            error = (cached.rotated()[0, head].float() - turned).norm() / turned.norm()
            assert error < 0.01  # one bfloat16 rounding (2^-8 a value) of each rotated key
