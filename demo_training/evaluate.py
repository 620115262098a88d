"""Scoring the demo model through the engine, as a user would ask it: one session per question.

Held-out scenes come from their own seed (training uses others); an answer is right when the
first colour, shape, digit or letter it names is the expected one. A real frame is named right
when the answer contains the name of the encoder's own top ImageNet class for that frame.
"""

import re
from collections.abc import Sequence

import numpy as np
import torch

from demo_training import scenes
from demo_training.data import DESCRIBE, condition_for, misses
from engine.demo.model import EfficientNetTower, pooled_features
from engine.model import Model
from engine import Session, SessionConfig

QUESTIONS = {
    "colour": "What colour is the {thing}?",
    "shape": "What shape is it?",
    "digit": "What digit is shown?",
}
KIND_OF = {"colour": None, "shape": "shape", "digit": "digit"}
CHOICES = {
    "colour": list(scenes.COLOURS),
    "shape": list(scenes.SHAPES),
    "digit": list(scenes.DIGITS),
}


def ask(model: Model, frames: Sequence[np.ndarray], times_s: Sequence[float], question: str, max_new_tokens: int = 16) -> str:
    session = Session(model, SessionConfig(policy="full"))
    session.append_frames(list(frames), list(times_s))
    return "".join(session.ask(question, max_new_tokens=max_new_tokens))


def first_named(answer: str, choices: Sequence[str]) -> str | None:
    """The choice the answer names first (whole words; "grey" is gray; plurals count). A digit
    counts only as a number of its own: the 0 of "188.0s", "0:42" or "10" names no digit."""
    text = answer.lower().replace("grey", "gray")
    found = []
    for choice in choices:
        if choice.isdigit():
            pattern = rf"(?<![\w.:,]){choice}(?![\w:]|[.,]\d)"
        else:
            pattern = rf"(?<![\w]){re.escape(choice.lower())}(e?s)?(?![\w])"
        match = re.search(pattern, text)
        if match:
            found.append((match.start(), choice))
    return min(found)[1] if found else None


def scene_accuracy(model: Model, task: str, count: int, seed: int) -> tuple[float, list[tuple[str, str, str]]]:
    """Accuracy on `count` held-out single scenes for `task` (colour, shape or digit), and the
    (question, expected, answer) of each."""
    rng = np.random.default_rng(seed)
    results = []
    for _ in range(count):
        image, scene = scenes.draw(rng, KIND_OF[task] or scenes.KINDS[rng.integers(len(scenes.KINDS))])
        thing = {"shape": "shape", "count": "shapes", "digit": "digit", "letter": "letter"}[scene.kind]
        question = QUESTIONS[task].format(thing=thing)
        if scene.kind == "count":
            question = question.replace(" is ", " are ")
        expected = {"colour": scene.colour, "shape": scene.shape, "digit": scene.symbol}[task]
        answer = ask(model, [image], [0.0], question)
        results.append((question, expected, answer))
    right = sum(first_named(answer, CHOICES[task]) == expected for _, expected, answer in results)
    return right / count, results


@torch.inference_mode()
def naming_accuracy(model: Model, frames: Sequence[np.ndarray], names: Sequence[str]) -> tuple[float, list[tuple[str, str]]]:
    """How often "What do you see?" about one real frame names the encoder's top ImageNet class."""
    tower: EfficientNetTower = model.hf.model.vision_tower
    _, logits = pooled_features(tower, list(frames))
    results = []
    for frame, cls in zip(frames, logits.argmax(dim=-1).tolist(), strict=True):
        answer = ask(model, [frame], [0.0], DESCRIBE[0])
        results.append((names[cls], answer))
    right = sum(name.lower() in answer.lower() for name, answer in results)
    return right / len(frames), results


def check_accuracy(model: Model, count: int, seed: int) -> tuple[float, list[tuple[str, bool, float]]]:
    """How often a watch's check (`Session.check`, engine/check.py) is on the right side of 0.5,
    over `count` held-out streams of three scenes one a second, half of whose last scene makes
    the condition true and half not (a near miss half of those: the shape in another colour,
    another shape in the colour, another digit or letter); and the (condition, truth, p(yes)) of each."""
    rng = np.random.default_rng(seed)
    results = []
    for k in range(count):
        image, target = scenes.draw(rng)
        while target.kind == "plain":
            image, target = scenes.draw(rng)
        condition = condition_for(target, rng)
        true = k % 2 == 0
        near = not true and rng.random() < 0.5 and target.kind != "count"
        while not true:
            image, scene = scenes.draw(rng, target.kind if near else None)
            if scene.kind != "plain" and misses(scene, target, condition, near):
                break
        before = [scenes.draw(rng)[0] for _ in range(2)]
        session = Session(model, SessionConfig(policy="full"))
        session.append_frames([*before, image], [0.0, 1.0, 2.0])
        results.append((condition[0], true, session.check(condition[0])))
    right = sum((p > 0.5) == truth for _, truth, p in results)
    return right / count, results
