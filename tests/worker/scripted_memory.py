"""`python -m tests.worker.scripted_memory`: a worker (as `python -m worker`) whose look at its
memory reads the file named by SCRIPTED_MEMORY ("<total bytes> <free bytes> <held bytes>") at
each look: the memory that others hold and then free, which a test cannot take from a shared
machine. Everything else is the real worker."""

import functools
import os
from pathlib import Path

import torch

from worker import __main__ as entry
from worker import capacity, loop


def read(device: torch.device) -> capacity.Reading:
    total, free, held = (int(n) for n in Path(os.environ["SCRIPTED_MEMORY"]).read_text().split())
    return capacity.Reading(total, free, held)


if __name__ == "__main__":
    loop.Capacity = functools.partial(capacity.Capacity, read=read)
    entry.main()
