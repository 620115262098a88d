"""What a watch's check costs (`engine/check.py`), against a frame and an answer token, on one session.

    python -m bench.check [--models tiny-random-llava,streamvqa-demo] [--policy infmllm] [--budget 1024] [--repeats 21]

Per model: a session (`--policy` at `--budget`) streams generated scenes (224 x 224, a figure on a
background, `demo_training/scenes.py`: what the demo model describes) until its cache
holds its budget and evicts at every frame, untimed. Then `--repeats` rounds, each of: one frame
appended (`frame`: the vision encoder, its prompt and the eviction after it), one check against
the cache as it is then (`check`: the yes/no prompt run read only, p(yes) read; the first forward
after an eviction, it also rotates the cache's kept keys at their new positions, which the next
forward would do otherwise), the same check again (`check_again`: those keys rotated already),
the same prompt run into the cache and taken back (`kept_prompt`, `KVCache.rollback`: what the
check would cost without the read-only path, which attends a copy of the cache's keys and
values), and one answer token (`answer_token`: the second token of a short answer, one step of
one token, where the answer has one; the answer is then finished untimed, and stays in the
cache as any answer does). They interleave, so that a busy machine slows them alike.

Prints one line per model and work: its tokens (those of a frame's prompt, a check's prompt, one
answer token), and the median ms over the rounds; then, per model, a check's ms over a frame's
and over an answer token's.
"""

import argparse
import statistics
import time

import numpy as np
import torch

from bench.common import emit
from demo_training import scenes
from engine import Session, SessionConfig, load_model, runner
from engine.check import prompt_text
from engine.step import prompt_of

CONDITION = "a red circle is visible"
QUESTION = "What do you see?"


def measure(model_name: str, policy: str, budget: int, repeats: int) -> None:
    model = load_model(model_name, "cpu")
    session = Session(model, SessionConfig(policy=policy, budget_tokens=budget))
    rng = np.random.default_rng(0)
    clock = 0.0

    def frame() -> float:
        nonlocal clock
        clock += 1.0
        scene = scenes.draw(rng)[0]
        started = time.perf_counter()
        session.append_frames([scene], [clock])
        return time.perf_counter() - started

    while session.stats().tokens_seen < budget + 4 * max(session.frame_tokens, 1):  # full, and evicting
        frame()
    question = session.part(model.tokenize(prompt_text(CONDITION), user=True))
    opening = session.part(model.tokenize(model.chat.user_to_assistant))
    times: dict[str, list[float]] = {"frame": [], "check": [], "check_again": [], "kept_prompt": [], "answer_token": []}
    for _ in range(repeats):
        times["frame"].append(frame())
        for work in ("check", "check_again"):
            started = time.perf_counter()
            session.check(CONDITION)
            times[work].append(time.perf_counter() - started)
        appended, started = session.cache.appended, time.perf_counter()
        runner.run(model, [prompt_of(session, [question, opening])])
        times["kept_prompt"].append(time.perf_counter() - started)
        session.cache.rollback(appended)
        answer = session.ask(QUESTION, max_new_tokens=3)
        if next(answer, None) is not None:  # the question's prompt and the first token
            started = time.perf_counter()
            if next(answer, None) is not None:
                times["answer_token"].append(time.perf_counter() - started)
        "".join(answer)
    check_tokens = question.tokens + opening.tokens
    tokens = {"frame": session.frame_tokens, "answer_token": 1}
    median_ms = {work: round(statistics.median(seconds) * 1000, 2) for work, seconds in times.items() if seconds}
    for work, ms in median_ms.items():
        emit(model=model_name, policy=policy, budget=budget, cache_tokens=session.stats().cache_tokens,
             work=work, tokens=tokens.get(work, check_tokens), ms=ms, repeats=len(times[work]))
    emit(model=model_name, check_over_frame=round(median_ms["check"] / median_ms["frame"], 2),
         check_over_answer_token=round(median_ms["check"] / median_ms["answer_token"], 2))


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--models", default="tiny-random-llava,streamvqa-demo", help="comma-separated models")
    args.add_argument("--policy", default="infmllm")
    args.add_argument("--budget", type=int, default=1024, help="the cache's budget, tokens per layer")
    args.add_argument("--repeats", type=int, default=21, help="rounds of a frame, two checks, the kept prompt and an answer token")
    options = args.parse_args()
    emit(torch_threads=torch.get_num_threads())
    for name in options.models.split(","):
        measure(name, options.policy, options.budget, options.repeats)


if __name__ == "__main__":
    main()
