"""The trainer's whole state between runs, so that a schedule of hours goes on across runs of a few
minutes to two hours, on different machines, and a run that resumes goes on exactly as one that
never stopped: the projector (and the language model's adapter), the optimizer, where the stage
stands, and every random state.

Small enough to commit (`demo_training/state.pt`, about 13 MB: the projector in float32 and AdamW's
two moments of it). Saved by writing a new file and renaming it over the old, so that a run killed
while saving leaves the last whole state.
"""

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

STAGES = ("warm", "main", "polish", "done")


@dataclass
class Checkpoint:
    config: dict  # the TrainConfig the schedule runs, as a dict (resuming runs the same schedule)
    data: str  # the key of the encoded images it draws from (train.pools)
    init: str  # where its first weights came from: "fresh", or the weights' file and sha256
    stage: str  # one of STAGES: the stage under way
    step: int  # steps done in that stage
    projector: dict[str, torch.Tensor]  # float32, reading standardised inputs (exported folded)
    optimizer: dict | None = None  # the stage's AdamW state; None before its first step
    rng: dict | None = None  # the stage's numpy bit generator (its draw of conversations)
    torch_rng: torch.Tensor = field(default_factory=torch.get_rng_state)
    history: list[dict] = field(default_factory=list)  # a line per step (loss, tokens) and per held-out check
    runs: list[dict] = field(default_factory=list)  # a line per run: the machine, its precision, steps, seconds
    earlier: list[dict] = field(default_factory=list)  # the init weights' lineage (train.lineage), oldest first
    adapter: dict[str, torch.Tensor] = field(default_factory=dict)  # the language model's adapter (adapter.Adapter.state), if it has one

    @property
    def done(self) -> bool:
        return self.stage == "done"

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        torch.save(asdict(self), partial)
        os.replace(partial, path)

    @classmethod
    def load(cls, path: Path) -> "Checkpoint":
        state = torch.load(path, weights_only=True)
        if state.get("stage") not in STAGES:
            raise ValueError(f"{path} is not a training state (stage {state.get('stage')!r})")
        return cls(**state)
