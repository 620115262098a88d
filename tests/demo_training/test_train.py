"""The demo model's trainer: a schedule stopped and resumed from its saved state, in new trainers as
new processes would be, goes on exactly as one that never stopped (with and without an adapter on
the language model); the tokens before a needle's first scene, run without a graph, give the loss
of one pass over the whole; and an adapter, saved with the projector, loads into the engine's
model as it was trained.

The real SmolLM2 and a fresh projector; images are random features (what they show does not matter
here), so no image is encoded."""

import numpy as np
import pytest
import torch

from tests.support import needs_demo

CONFIG = dict(
    steps=4, warm_steps=3, polish_steps=3, batch=2, eval_every=2, eval_per_task=2, long_frames=(6, 12),
    long_batch_frames=14, mix={"scene": 1.0, "needle": 1.0, "long": 1.0}, polish_mix={"scene": 1.0, "long": 1.0},
    bfloat16=False,
)


@pytest.fixture(scope="module")
def parts():
    from demo_training.data import RealFrame, build_pool
    from engine.demo.model import FEATURE_CHANNELS, assemble

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = assemble("cpu", projector_weights=None)  # a fresh projector, seeded
    noise = torch.Generator().manual_seed(1)
    frames = [RealFrame("clip.mp4", i, i / 25, np.zeros((8, 8, 3), np.uint8)) for i in range(40)]
    pool = build_pool(lambda images: (torch.randn(len(images), 9, FEATURE_CHANNELS, generator=noise),
                                      torch.randn(len(images), 1000, generator=noise)),
                      frames, scene_count=40, crops_per_frame=0, rng=np.random.default_rng(0), plain_per_colour=2)
    return model, pool, {k: v.clone() for k, v in model.hf.model.multi_modal_projector.state_dict().items()}


def trainer_of(parts, adapter_rank: int = 0):
    from demo_training.train import TrainConfig, Trainer

    model, pool, _ = parts
    return Trainer(model, TrainConfig(**CONFIG, adapter_rank=adapter_rank), pool, pool, [f"thing {k}" for k in range(1000)])


@pytest.fixture
def no_adapter(parts):
    """Whatever adapter a test put into the shared model is taken out after it."""
    yield
    from demo_training.adapter import Adapter

    Adapter(parts[0].hf.model.language_model, 1).remove()


@needs_demo
@pytest.mark.parametrize("adapter_rank", [0, 2])
def test_a_schedule_resumed_from_its_saved_state_goes_on_exactly_as_one_that_never_stopped(parts, tmp_path, adapter_rank, no_adapter):
    from demo_training.checkpoint import Checkpoint

    model, _, first = parts
    projector = model.hf.model.multi_modal_projector
    projector.load_state_dict(first)
    torch.manual_seed(5)
    whole = trainer_of(parts, adapter_rank)
    checkpoint = whole.begin("fresh")
    whole.resume(checkpoint)
    uninterrupted = whole.run(checkpoint, save=lambda c: None)
    assert uninterrupted.done and [run["steps"] for run in uninterrupted.runs] == [10]
    weights = {k: v.clone() for k, v in projector.state_dict().items()}
    adapter = whole.adapter.state() if adapter_rank else {}
    assert len(adapter) == (30 * 4 * 2 if adapter_rank else 0)  # a and b of 4 projections in each of SmolLM2's 30 layers
    assert all(v.abs().sum() > 0 for k, v in adapter.items() if k.endswith(".b"))  # zero at first, trained

    # the same schedule in three runs: stopped inside the main stage and inside the polish, each
    # resumed from the file by a new trainer after the projector was reset to other weights
    projector.load_state_dict(first)
    state = tmp_path / "state.pt"
    torch.manual_seed(5)
    trainer = trainer_of(parts, adapter_rank)
    checkpoint = trainer.begin("fresh")
    trainer.resume(checkpoint)
    trainer.run(checkpoint, save=lambda c: c.save(state), max_steps=5)
    for steps in (3, None):
        projector.load_state_dict({k: torch.zeros_like(v) for k, v in first.items()})
        saved = Checkpoint.load(state)
        assert not saved.done and saved.stage == ("main" if steps else "polish")
        trainer = trainer_of(parts, adapter_rank)  # a new adapter, drawn from another seed
        trainer.resume(saved)
        resumed = trainer.run(saved, save=lambda c: c.save(state), max_steps=steps)
    assert resumed.done and [(run["from"], run["steps"]) for run in resumed.runs] == [("warm 0", 5), ("main 2", 3), ("polish 1", 2)]

    losses = [(h["stage"], h["step"], h.get("kind")) for h in resumed.history if "loss" in h]
    assert losses == [(h["stage"], h["step"], h.get("kind")) for h in uninterrupted.history if "loss" in h]
    assert [s for s, _, _ in losses] == ["warm"] * 3 + ["main"] * 4 + ["polish"] * 3
    assert {kind for _, _, kind in losses} == {None, "scene", "needle", "long"}  # every kind drawn, so each path resumed
    again = [h["loss"] for h in resumed.history if "loss" in h]
    assert again == pytest.approx([h["loss"] for h in uninterrupted.history if "loss" in h], abs=1e-6)
    assert [h for h in resumed.history if "held_out" in h] == [h for h in uninterrupted.history if "held_out" in h]
    for name, tensor in projector.state_dict().items():
        torch.testing.assert_close(tensor, weights[name], rtol=0, atol=1e-6)
    for name, tensor in (trainer.adapter.state() if adapter_rank else {}).items():
        torch.testing.assert_close(tensor, adapter[name], rtol=0, atol=1e-6)


@needs_demo
def test_an_adapter_saved_with_the_projector_loads_into_the_engines_model_as_trained(parts, tmp_path, no_adapter):
    """The language model with a trained adapter beside it (as the trainer runs it) and the model the
    engine loads from the saved weights (the adapter merged into SmolLM2) give the same next-token
    distribution; the same weights without their adapter give another."""
    from safetensors.torch import load_file, save_file

    from engine.demo.model import assemble, save_weights

    model, _, first = parts
    model.hf.model.multi_modal_projector.load_state_dict(first)
    trainer = trainer_of(parts, adapter_rank=4)
    noise = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for parameter in trainer.adapter.parameters():  # as if trained (b away from zero), in what fp16 holds
            parameter.copy_((torch.randn(parameter.shape, generator=noise) * 0.2).half())
    ids = torch.tensor([model.tokenize("The stream showed a red circle, then a blue square. What came after the circle?")])
    with torch.no_grad():
        trained = model.hf.model.language_model(input_ids=ids).last_hidden_state
        trained = model.hf.lm_head(trained)[0, -1].log_softmax(dim=-1)
    path = tmp_path / "weights.safetensors"
    save_weights(trainer.projector, path, {"init": "test"}, trainer.adapter.state())
    state = load_file(path)
    assert sum(k.startswith("adapter.") for k in state) == 30 * 4 * 2 and state["adapter.layers.0.self_attn.q_proj.a"].shape == (4, 576)
    save_file({k: v for k, v in state.items() if not k.startswith("adapter.")}, str(tmp_path / "bare.safetensors"))
    loaded = []
    for weights in (path, tmp_path / "bare.safetensors"):
        engine_model = assemble("cpu", projector_weights=weights)
        with torch.no_grad():
            logits = engine_model.hf.lm_head(engine_model.hf.model.language_model(input_ids=ids).last_hidden_state)
        loaded.append(logits[0, -1].log_softmax(dim=-1))
    assert (loaded[0].exp() * (loaded[0] - trained)).sum().abs() < 1e-5
    assert (trained.exp() * (trained - loaded[1])).sum() > 1e-2  # the adapter is what makes the difference
    assert loaded[0].argmax() == trained.argmax()


@needs_demo
def test_a_needles_real_frames_before_its_first_scene_run_without_a_graph_for_the_same_loss(parts):
    """With real frames detached, the positions before the first scene run without a graph; the
    loss is the one pass's, and only the scenes' tokens give the projector a gradient."""
    from demo_training.data import Samples

    model, pool, first = parts
    model.hf.model.multi_modal_projector.load_state_dict(first)
    trainer = trainer_of(parts)
    rng = np.random.default_rng(4)
    batch = [Samples(pool, trainer.names).needle(rng, frames=20) for _ in range(2)]
    first_scene = min(next(i for i, (item, _) in enumerate(s.frames) if pool.scenes[item] is not None) for s in batch)
    assert first_scene >= 2  # so that some real frames come first
    projector = trainer.projector
    losses, grads = [], []
    for detach in (False, True):
        projector.zero_grad(set_to_none=True)
        for parameter in projector.parameters():
            parameter.requires_grad_(True)
        loss, right, count, tokens = trainer.batch_loss(pool, batch, detach_real=detach)
        loss.backward()
        losses.append(loss.item())
        grads.append(projector.linear_1.weight.grad.clone())
        for parameter in projector.parameters():
            parameter.requires_grad_(False)
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert not torch.allclose(grads[0], grads[1])  # the real frames' part of the gradient is gone
    assert grads[1].abs().sum() > 0


@needs_demo
def test_long_needles_grow_from_the_shortest_to_the_longest_over_the_main_stage(parts):
    """long_frames (6, 12) over the first 60% of the stage, each step from the upper half of the
    range so far, as many conversations as 14 frames hold."""
    trainer = trainer_of(parts)
    rng = np.random.default_rng(4)
    for progress, lengths in ((0.0, {6}), (0.3, {6, 7, 8, 9}), (0.6, set(range(6, 13))), (1.0, set(range(6, 13)))):
        drawn = [trainer.draw(trainer.samples, "long", 8, rng, progress) for _ in range(60)]
        assert {len(batch[0].frames) for batch in drawn} == lengths
        assert all(len(batch) == 14 // len(batch[0].frames) and batch[0].task.startswith("long-") for batch in drawn)


def test_weights_trained_from_saved_weights_name_every_schedule_before_them(tmp_path):
    """`lineage` of weights reads their metadata and that of every set they were trained from,
    oldest first; a schedule started from them keeps it in its saved state for the export."""
    import json

    from safetensors.torch import save_file

    from demo_training.checkpoint import Checkpoint
    from demo_training.train import lineage

    first, second = tmp_path / "first.safetensors", tmp_path / "second.safetensors"
    save_file({"w": torch.zeros(2)}, str(first), metadata={"init": "fresh", "train_s": "6957"})
    save_file({"w": torch.ones(2)}, str(second), metadata={
        "init": f"{first} sha256:0123", "train_s": "1127", "earlier": json.dumps(lineage(first))})
    assert lineage(second) == [
        {"init": "fresh", "train_s": "6957", "file": str(first)},
        {"init": f"{first} sha256:0123", "train_s": "1127", "file": str(second)},
    ]
    state = tmp_path / "state.pt"
    Checkpoint({}, "key", f"{second} sha256:4567", "main", 0, {}, earlier=lineage(second)).save(state)
    assert [e["train_s"] for e in Checkpoint.load(state).earlier] == ["6957", "1127"]
