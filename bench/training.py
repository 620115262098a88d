"""What a step of the demo model's training costs on this machine, side by side in one run.

    python -m bench.training [--frames 24,100,200] [--repeats 3] [--precisions float32,bfloat16]

Draws needle conversations of each length from the trainer's own data (`run/demo`, encoded by the
first `python -m demo_training.train`), as many as one step of long needles holds, and times a
training step on them (forward and backward through the frozen SmolLM2 into the projector): in
one pass over the whole, and with the real frames detached so that what comes before the first
scene runs once without a graph, each conversation on its own (the trainer's way). Prints a JSON
line per case: tokens, seconds per step (the median of `--repeats`), tokens a second, and the
speed-up of the detached way.
bfloat16 autocast is only worth it where the CPU multiplies bfloat16 itself (AMX or AVX-512
BF16); elsewhere it is emulated, 20 times slower, and skipped unless asked for.
"""

import argparse
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from bench.common import emit, split_list
from demo_training.train import TrainConfig, Trainer, bfloat16_in_hardware, cpu_name, pools
from engine.demo.model import assemble, imagenet_names


def step_s(trainer: Trainer, batch, detach_real: bool) -> float:
    for parameter in trainer.projector.parameters():
        parameter.requires_grad_(True)
    started = time.perf_counter()
    trainer.learn(trainer.train, batch, detach_real=detach_real)
    elapsed = time.perf_counter() - started
    trainer.projector.zero_grad(set_to_none=True)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", default="24,100,200", help="needle lengths in frames")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precisions", help="float32 and/or bfloat16 (default: float32, and bfloat16 where the CPU has it)")
    parser.add_argument("--cache", type=Path, default=Path("run/demo"))
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    precisions = args.precisions.split(",") if args.precisions else ["float32"] + ["bfloat16"] * bfloat16_in_hardware()
    config = TrainConfig()
    model = assemble("cpu")
    train, held_out = pools(config, model.hf.model.vision_tower, args.cache)
    names = imagenet_names()
    emit(event="machine", cpu=cpu_name(), threads=torch.get_num_threads(), bfloat16_in_hardware=bfloat16_in_hardware())
    for precision in precisions:
        trainer = Trainer(model, replace(config, bfloat16=precision == "bfloat16"), train, held_out, names)
        for frames in split_list(args.frames, int):
            rng = np.random.default_rng(frames)
            batch = [trainer.samples.needle(rng, frames) for _ in range(max(1, config.long_batch_frames // frames))]
            tokens = sum(len(trainer.layout.ids(s)[0]) for s in batch)
            step_s(trainer, batch, True)  # warm-up
            whole = statistics.median(step_s(trainer, batch, False) for _ in range(args.repeats))
            detached = statistics.median(step_s(trainer, batch, True) for _ in range(args.repeats))
            emit(precision=precision, frames=frames, conversations=len(batch), tokens=tokens,
                 whole_s=round(whole, 2), detached_s=round(detached, 2), whole_tokens_per_s=round(tokens / whole),
                 detached_tokens_per_s=round(tokens / detached), speedup=round(whole / detached, 2))


if __name__ == "__main__":
    main()
