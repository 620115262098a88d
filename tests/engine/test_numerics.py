"""bfloat16: where it is chosen, and answers within a stated distance of float32's."""

import re

import numpy as np
import pytest
import torch

from engine import Session, SessionConfig, load_model
from engine.numerics import PackedLinear, SharedLinear, cast, choose_dtype, cpu_packs_bfloat16, pack_linears

# Every family the engine runs, tiny models built in code and the two real ones
FAMILIES = [
    "tiny-random-llava", "tiny-random-llava-next-video", "tiny-random-llava-onevision", "tiny-random-qwen2-5-vl",
    "tiny-random-qwen3-vl", "tiny-random-llama", "smollm2-135m-instruct", "streamvqa-demo",
]
# bfloat16 keeps 8 bits of mantissa (a relative step of 0.4%); over a model's layers its logits
# stay within this share of the largest float32 logit (measured: 0.5% to 0.7% on the tiny
# models, 2.5% on SmolLM2-135M and the demo model), and the most likely token is the same
BF16_TOLERANCE = 0.05


def test_a_set_dtype_is_taken_as_it_is_and_a_wrong_one_is_refused():
    assert (choose_dtype("float32", "cpu").dtype, choose_dtype("bfloat16", "cpu").dtype) == (torch.float32, torch.bfloat16)
    assert choose_dtype("bfloat16", "cpu").name == "bfloat16"
    assert choose_dtype("auto", "cuda").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="auto, float32, bfloat16"):
        choose_dtype("float16", "cpu")


def test_auto_is_bfloat16_where_the_cpu_multiplies_it_faster_and_says_why():
    """AMX: bfloat16. AVX-512 BF16 without AMX: bfloat16 only where the timed packed product was no
    slower than float32's at 1 row and at 16 (one session, a full step), with the four times in
    the reason. Neither: float32."""
    chosen = choose_dtype("auto", "cpu")
    if torch.cpu._is_amx_tile_supported():
        assert (chosen.dtype, chosen.reason) == (torch.bfloat16, "a CPU with AMX")
    elif torch.cpu._is_avx512_bf16_supported():
        timed = re.fullmatch(r"a CPU with AVX-512 BF16 and no AMX: through a layer, 1 row (\d+) µs in packed bfloat16 and "
                             r"(\d+) in float32, 16 rows (\d+) µs in packed bfloat16 and (\d+) in float32", chosen.reason)
        assert timed, chosen.reason
        one, sixteen = (int(timed[1]), int(timed[2])), (int(timed[3]), int(timed[4]))
        assert chosen.dtype == (torch.bfloat16 if one[0] <= one[1] and sixteen[0] <= sixteen[1] else torch.float32)
    else:
        assert (chosen.dtype, chosen.reason) == (torch.float32, "a CPU without bfloat16 arithmetic (AMX or AVX-512 BF16)")


def test_a_cast_model_keeps_its_rotary_frequencies_in_float32():
    model = load_model("tiny-random-llama", "cpu")
    before = model.rotary.inv_freq.clone()
    cast(model.hf, torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model.hf.lm_head.weight.dtype == torch.bfloat16
    assert model.rotary.inv_freq.dtype == torch.float32 and torch.equal(model.rotary.inv_freq, before)
    assert model.kv_bytes_per_token == 256  # 2 layers x 2 (keys, values) x 2 KV heads x 16 x 2 bytes


def test_a_bfloat16_model_on_a_cpu_runs_its_linear_layers_packed_with_the_same_products():
    """Every linear layer of SmolLM2 (7 a layer for 30 layers, and the head) is packed: a
    layer's query, key and value in one product, its gate and up in another, the other two and
    the head each alone; no plain weight is left beside the packed ones, and each multiplies as
    the plain bfloat16 layer did: rows of one token or many, with or without a bias. A CPU that
    oneDNN packs no bfloat16 weight for (AVX2 alone) keeps every layer plain instead."""
    model = load_model("smollm2-135m-instruct", "cpu", dtype=torch.bfloat16)
    if not cpu_packs_bfloat16():
        linears = [m for m in model.hf.modules() if type(m) is torch.nn.Linear]
        assert len(linears) == 7 * 30 + 1 and {m.weight.dtype for m in linears} == {torch.bfloat16}
        assert not any(isinstance(m, (PackedLinear, SharedLinear)) for m in model.hf.modules())
        return
    shared = [m for m in model.hf.modules() if isinstance(m, SharedLinear)]
    alone = [m for m in model.hf.modules() if isinstance(m, PackedLinear)]
    assert len(shared) == 5 * 30 and len({id(m.shared) for m in shared}) == 2 * 30 and len(alone) == 2 * 30 + 1
    assert not any(isinstance(m, torch.nn.Linear) for m in model.hf.modules())
    assert not any(name.endswith("proj.weight") for name, _ in model.hf.named_parameters())
    torch.manual_seed(0)
    for bias in (False, True):
        plain = [torch.nn.Linear(96, width, bias=bias).to(torch.bfloat16) for width in (40, 24, 24)]
        owner = torch.nn.Module()
        owner.q_proj, owner.k_proj, owner.v_proj = plain
        owner.o_proj = torch.nn.Linear(96, 40, bias=bias).to(torch.bfloat16)
        pack_linears(owner)
        assert [type(owner.get_submodule(n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")] == [SharedLinear] * 3 + [PackedLinear]
        for rows in ((1, 96), (3, 96), (2, 5, 96)):
            x, other = torch.randn(rows, dtype=torch.bfloat16), torch.randn(rows, dtype=torch.bfloat16)
            # in any order, and a sibling called with another input between (or twice with one)
            for name, given in (("v_proj", x), ("q_proj", x), ("q_proj", x), ("k_proj", other), ("k_proj", x), ("v_proj", x)):
                layer = plain[("q_proj", "k_proj", "v_proj").index(name)]
                expected = torch.nn.functional.linear(given.float(), layer.weight.detach().float(),
                                                      None if layer.bias is None else layer.bias.detach().float())
                got = owner.get_submodule(name)(given).detach()  # the bias is a parameter: the engine runs under inference_mode
                assert got.shape == (*rows[:-1], layer.out_features) and got.dtype == torch.bfloat16
                assert float((got.float() - expected).abs().max()) <= 0.01 * float(expected.abs().max())


def _logits(model) -> torch.Tensor:
    session = Session(model, SessionConfig(policy="full"))
    if model.sees_frames:
        rng = np.random.default_rng(1)
        session.append_frames([rng.integers(0, 256, (48, 80, 3), dtype=np.uint8) for _ in range(4)], [0.0, 0.5, 1.0, 1.5])
    session.append_text("Then a note arrives, in plain words.")
    return session.logits.float()


@pytest.mark.parametrize("name", FAMILIES)
def test_bfloat16_logits_are_within_the_tolerance_of_float32(name):
    reference = _logits(load_model(name, "cpu"))
    half = _logits(load_model(name, "cpu", dtype=torch.bfloat16))
    assert float((half - reference).abs().max()) <= BF16_TOLERANCE * float(reference.abs().max())
    assert int(half.argmax()) == int(reference.argmax())


@pytest.mark.parametrize(("taken", "restored"), [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_a_snapshot_restores_into_a_worker_of_the_other_dtype(taken, restored):
    """A session moves between workers set to different DTYPEs: its keys, values and host
    tier are converted to the new worker's, and it answers as a session of that dtype would."""
    config = SessionConfig(budget_tokens=300, recall=True, host_budget_tokens=640)
    source = Session(load_model("tiny-random-llava", "cpu", dtype=taken), config)
    rng = np.random.default_rng(0)
    source.append_frames([rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(12)], [float(i) for i in range(12)])
    assert source.stats().evictions > 0 and source.host_pages  # something evicted into the host tier
    target = load_model("tiny-random-llava", "cpu", dtype=restored)
    moved = Session.restore(target, source.snapshot())
    assert {layer.keys.dtype for layer in moved.cache.hf.layers} == {restored}
    assert moved.cache.host.keys.dtype == torch.bfloat16  # either way: a float32 model's host pages keep bfloat16
    for session in (source, moved):  # the same text read over each cache: the same next token, the logits close
        session.append_text("Then a note arrives, in plain words.")
    assert float((moved.logits.float() - source.logits.float()).abs().max()) <= BF16_TOLERANCE * float(source.logits.abs().max())
    assert int(moved.logits.argmax()) == int(source.logits.argmax())
    assert len("".join(moved.ask("What is it?", max_new_tokens=6))) > 0
