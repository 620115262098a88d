"""bench.gpu builds the published shape of LLaVA-OneVision-Qwen2-7B (on the meta device: no
weights allocated), and its tiny shape streams and answers on the CPU."""

import numpy as np
import torch

from bench.gpu import build_model, next_times
from engine import Session, SessionConfig


def test_7b_is_the_published_shape():
    model = build_model("7b", "meta")
    text = model.hf.config.get_text_config()
    assert sum(p.numel() for p in model.hf.parameters()) == 8_030_348_832  # the Hub's "8.03B params"
    assert model.dtype == torch.bfloat16
    assert (model.num_layers, text.num_attention_heads, model.kv_heads, model.head_dim) == (28, 28, 4, 128)
    assert (text.hidden_size, text.intermediate_size, text.vocab_size) == (3584, 18944, 152064)
    assert model.kv_bytes_per_token == 57_344  # 28 layers x 4 heads x 128 x (keys, values) x 2 bytes
    assert model.context_tokens == 32768
    vision = model.hf.config.vision_config
    assert (vision.num_hidden_layers, vision.hidden_size, vision.image_size, vision.patch_size) == (26, 1152, 384, 14)


def test_tiny_answers_run_to_their_length():
    model = build_model("tiny", "cpu")
    session = Session(model, SessionConfig(budget_tokens=256))
    frames = [np.zeros((112, 112, 3), np.uint8)] * 20
    session.append_frames(frames, next_times(session, len(frames)))
    assert session.stats().cache_tokens == 256
    assert model.encode_frames(frames[:1]).shape == (1, 17, 128)  # 8x8 patches pooled to 4x4, and a newline
    answer = session.ask("What happened?", max_new_tokens=5)
    list(answer)
    assert (answer.tokens, answer.finish_reason) == (5, "length")


def test_qwen2_5_vl_7b_is_the_published_shape():
    model = build_model("qwen2.5-vl-7b", "meta")
    text = model.hf.config.get_text_config()
    assert sum(p.numel() for p in model.hf.parameters()) == 8_292_166_656  # the Hub's "8.29B params"
    assert (model.num_layers, text.num_attention_heads, model.kv_heads, model.head_dim) == (28, 28, 4, 128)
    assert (text.hidden_size, text.intermediate_size, text.vocab_size) == (3584, 18944, 152064)
    assert model.kv_bytes_per_token == 57_344 and model.context_tokens == 128_000 and model.position_axes == 3
    vision = model.hf.config.vision_config
    assert (vision.depth, vision.hidden_size, vision.patch_size, vision.window_size) == (32, 1280, 14, 112)
    assert model.frame_grid((360, 640, 3)) == (13, 23)  # a pair of 640x360 frames: 299 visual tokens


def test_qwen2_5_vl_tiny_streams_pairs_and_answers_to_its_length():
    model = build_model("qwen2.5-vl-tiny", "cpu")
    session = Session(model, SessionConfig(budget_tokens=256))
    frames = [np.zeros((360, 640, 3), np.uint8)] * 20
    session.append_frames(frames, next_times(session, len(frames)))
    assert session.stats().cache_tokens == 256 and session.stats().frames == 20
    assert model.encode_frames(frames[:2]).shape == (1, 299, 128)
    answer = session.ask("What happened?", max_new_tokens=5)
    list(answer)
    assert (answer.tokens, answer.finish_reason) == (5, "length")
