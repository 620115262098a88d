"""Speed and memory of a 7B video model on one GPU, with random weights: no download.

    python -m bench.gpu [--device cuda] [--shape 7b|tiny|qwen2.5-vl-7b|qwen2.5-vl-tiny] [--budget 4096] [--policy infmllm]
                        [--sessions 1,8,16,32,64] [--minutes 60] [--answer-tokens 32]
                        [--serve-seconds 60] [--ask-every 10]

The model is built from the published configuration of llava-hf/llava-onevision-qwen2-7b-ov-hf
(`--shape 7b`, 8.03e9 parameters):
- language model Qwen2-7B: 28 layers, hidden 3584, 28 query heads, 4 KV heads (head dim 128),
  intermediate 18944, vocabulary 152064, rope_theta 1,000,000, max_position_embeddings 32768,
  rms_norm_eps 1e-6, untied embeddings;
- vision tower SigLIP-so400m-patch14-384: hidden 1152, 16 heads, intermediate 4304, image 384,
  patch 14, no head; 26 layers, as the checkpoint keeps them (SigLIP has 27; the conversion
  drops the last, the original's `mm_vision_select_layer -2`, and reads the last kept one);
- projector: a 2-layer MLP with gelu; vision_feature_layer -1, vision_feature_select_strategy
  "full", image_token_index 151646; a frame is 27x27 patches pooled bilinearly to 14x14, plus
  the learned newline: 197 visual tokens.

Its weights are random, in bfloat16, created directly on the device (8e9 parameters are never
initialised on the CPU), so speed and memory are those of the real checkpoint, and answers are
noise. A random model never ends its turn (its stop ids are cleared, so that every answer is
exactly `--answer-tokens` long). The tokenizer is `engine.tiny.ascii_tokenizer` (its ids lie
within the vocabulary): questions cost one token per character. KV cache: 28 layers x 4 heads
x 128 x 2 (keys, values) x 2 bytes = 57 KiB a token; 235 MB a session at budget 4096.

`--shape qwen2.5-vl-7b` is Qwen/Qwen2.5-VL-7B-Instruct's published configuration instead (8.29e9
parameters): its language model as Qwen2-7B's above but with 3-D rotary positions (sections 16,
24, 24) and a context of 128,000; its vision tower 32 layers of hidden 1280, 16 heads,
intermediate 3420, patches of 14 merged 2x2 by a merger to 3584, windows of 112 pixels with full
attention in layers 7, 15, 23 and 31, temporal patch 2. Its frames are 640x360 and go in pairs
(a pair resized to 644x364: 13 x 23 = 299 visual tokens), so where the measures below say a
frame, this shape takes a pair (1 pair/s is 2 frames/s of video). The same KV bytes a token.
`--shape qwen2.5-vl-tiny` scales it down as `tiny` does.

`--shape tiny` is the same families scaled down (2 layers, hidden 128; vision 2 layers,
112-pixel frames of 17 tokens; budget 512 unless given): the whole script runs on a CPU in a
minute or two, as a smoke test. Its figures say nothing of a GPU.

Every session's cache lives in one KV pool (`engine/kv_pool.py`), as in a worker: allocated at
start with room for the most sessions measured (on a GPU, taken whole then), each session's
pages leased when it opens; the sessions of a step write and attend there together, one call
per layer (`engine/pool_attention.py`).

One JSON line per figure (`measure` names it), after a `setup` line (device, versions,
parameters), and a `summary` line last:
- `memory`: one session streams `--minutes` of video at 1 frame/s (its frames' visual tokens
  computed once and reused); device memory allocated and its peak since the stream began (on a
  CPU, the process's RSS) and the cache's tokens at 1, 5, 15, 30 and 60 minutes, scaled to
  `--minutes`: flat once the cache is at its budget.
- `ingest`: frames/s of `Session.append_frames` in calls of 8 frames (384x384 random RGB, encoded
  by the vision tower), and of one engine step (`engine.step.step`) over N sessions, a frame
  each a step; every session's cache at its budget, after a warm-up.
- `decode`: N sessions with full caches ask at once; answer tokens/s with one batched forward a
  step (`engine.step.step`) against one session at a time (`next` on each answer in
  turn), timed from each answer's first token (the questions' prefill is not), and the ratio.
- `serving`: the worker's loop in process, on this engine, in real time, for `--serve-seconds`:
  each of N sessions gets a frame every second and a question every `--ask-every` seconds
  (sessions staggered), and `worker.scheduler.Scheduler` (batch_sessions 16, step_tokens 4,096)
  fills each step as the worker does: the questions that can start (each with its first token),
  a token of each answer under way and up to 8 waiting frames of sessions in turn within the
  step's token budget, all in one engine step (`steps` counts the steps that held each). Frames wait
  under the worker's live rule (worker/buffers.py: a frame late by more than 3 s is dropped,
  except the newest). Reports time to first token (from the question's arrival) p50 and p99,
  frames dropped and frames late (ingested more than 3 s after they arrived); `served` is true
  when p99 is under 1 s and no frame was dropped or late. A question still waiting at the end
  counts with its wait so far.
The summary names the most sessions served, the decode ratio at each N, the ingest rates and
the memory growth over the stream.
"""

import argparse
import contextlib
import gc
import importlib.metadata
import math
import platform
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import (
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    PretrainedConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Config,
    SiglipVisionConfig,
)

from bench.common import emit, rss_bytes
from engine import POLICIES, Answer, Session, SessionConfig, runner
from engine.kv_pool import KVPool
from engine.step import Frames, prompt_of
from engine.step import step as engine_step
from engine.model import FAMILIES, Model, Vision, chat_format
from engine.qwen_vision import QwenVision
from engine.tiny import VISION_END, VISION_START, ascii_tokenizer
from streamvqa.protocol import POOL_PAGE_TOKENS, peak_cache_tokens
from worker.scheduler import DEFAULT_STEP_TOKENS, Scheduler

QWEN2_7B = dict(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    max_position_embeddings=32768,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=151643,
    eos_token_id=151645,
)
SIGLIP_SO400M = dict(  # as llava-onevision-qwen2-7b-ov-hf keeps it: 26 of SigLIP's 27 layers
    hidden_size=1152,
    intermediate_size=4304,
    num_hidden_layers=26,
    num_attention_heads=16,
    image_size=384,
    patch_size=14,
    vision_use_head=False,
)


QWEN25_VL_7B_TEXT = {  # Qwen/Qwen2.5-VL-7B-Instruct's language model
    **QWEN2_7B,
    "max_position_embeddings": 128000,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [16, 24, 24]},
}
QWEN25_VL_VISION = dict(  # and its vision tower
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    out_hidden_size=3584,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
    tokens_per_second=2,
    hidden_act="silu",
)
QWEN_FRAME = (360, 640)  # (height, width) of the Qwen shapes' frames


@dataclass(frozen=True)
class Shape:
    text: dict  # Qwen2Config fields (Qwen2.5-VL's text config's)
    vision: dict  # SiglipVisionConfig fields (Qwen2.5-VL's vision config's)
    budget_tokens: int  # the default --budget
    family: str = "llava_onevision"  # or "qwen2_5_vl"


@dataclass(frozen=True)
class Visual:
    """One frame's visual tokens (1, tokens, hidden) (a pair's, for Qwen), reused at every time,
    and for Qwen their grid (rows, columns)."""

    tokens: torch.Tensor
    grid: tuple[int, int] | None = None


SHAPES = {
    "7b": Shape(QWEN2_7B, SIGLIP_SO400M, 4096),
    "tiny": Shape(
        {**QWEN2_7B, "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2},
        {**SIGLIP_SO400M, "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
         "image_size": 112},
        512,
    ),
    "qwen2.5-vl-7b": Shape(QWEN25_VL_7B_TEXT, QWEN25_VL_VISION, 4096, "qwen2_5_vl"),
    "qwen2.5-vl-tiny": Shape(
        {**QWEN25_VL_7B_TEXT, "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [4, 6, 6]}},
        {**QWEN25_VL_VISION, "depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "out_hidden_size": 128,
         "fullatt_block_indexes": [1]},
        512,
        "qwen2_5_vl",
    ),
}
SIGLIP_MEAN = SIGLIP_STD = (0.5, 0.5, 0.5)
QUESTION = "What happened in the last ten seconds?"
BATCH_SESSIONS = 16  # the worker's default BATCH_SESSIONS
FRAMES_PER_STEP = 8  # the worker's default FRAMES_PER_STEP
MAX_LAG_S = 3.0  # the worker's LIVE_MAX_LAG_S: a frame later than this is dropped (the newest kept)
TTFT_TARGET_S = 1.0
MEMORY_MINUTES = (1, 5, 15, 30, 60)  # of an hour; scaled to --minutes


def model_config(shape: str) -> PretrainedConfig:
    sizes = SHAPES[shape]
    if sizes.family == "qwen2_5_vl":
        return Qwen2_5_VLConfig(
            text_config=sizes.text, vision_config=sizes.vision, image_token_id=151655, video_token_id=151656,
            vision_start_token_id=151652, vision_end_token_id=151653, tie_word_embeddings=False,
        )
    return LlavaOnevisionConfig(
        text_config=Qwen2Config(**sizes.text),
        vision_config=SiglipVisionConfig(**sizes.vision),
        image_token_index=151646,
        video_token_index=151647,
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
    )


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def build_model(shape: str, device: str) -> Model:
    """The shape with random bfloat16 weights, created on `device`, wrapped as the engine's model."""
    config = model_config(shape)
    qwen = SHAPES[shape].family == "qwen2_5_vl"
    torch.manual_seed(0)
    with torch.device(device), default_dtype(torch.bfloat16):
        hf = (Qwen2_5_VLForConditionalGeneration if qwen else LlavaOnevisionForConditionalGeneration)(config).eval()
    if qwen:
        tokenizer = ascii_tokenizer((VISION_START, VISION_END))
        vision = QwenVision.of(config, {})  # Qwen2.5-VL's video defaults: a frame of 128 to 768 merged patches' pixels
        name = f"{shape}-random"
    else:
        tokenizer = ascii_tokenizer()
        vision = Vision.of(FAMILIES["llava_onevision"], config, SIGLIP_MEAN, SIGLIP_STD)
        name = f"llava-onevision-qwen2-{shape}-random"
    model = Model(name, hf, tokenizer, chat_format(tokenizer, None), vision, device)
    if qwen:  # the published ids of its vision markers lie outside the ASCII tokenizer: the tokenizer's own
        model.frame_markers = (VISION_START, VISION_END)
    model.stop_ids = frozenset()  # random weights: every answer runs to its max_new_tokens
    return model


class Clock:
    """Wall-clock seconds, read after the device has finished its queued work."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def next_times(session: Session, count: int) -> list[float]:
    """`count` video times after the session's last frame, a second apart."""
    start = session.stats().video_time_s + 1.0
    return [start + k for k in range(count)]


def stream_visual(session: Session, visual: Visual, times_s: Sequence[float]) -> None:
    """What `append_frames` does after encoding, for one frame's (a pair's) visual tokens reused
    at every time: the stream's cost without the vision tower's."""
    for t in times_s:
        for parts, times in session.frame_prompts(visual.tokens, [t], visual.grid):
            session.make_frame_room(parts, times)
            session.ran(parts, runner.run(session.model, [prompt_of(session, parts)])[0].logits)
            session.appended_frames(times)


def make_pool(model: Model, config: SessionConfig, sessions: int) -> KVPool:
    """A worker's KV pool with room for `sessions` caches of `config`'s peak, allocated at once."""
    pages = sessions * -(-config.peak_tokens // POOL_PAGE_TOKENS)
    return KVPool(model.num_layers, model.kv_heads, model.head_dim, pages, POOL_PAGE_TOKENS, model.dtype, model.device)


def filled_session(model: Model, config: SessionConfig, visual: Visual, pool: KVPool | None = None) -> Session:
    """A session whose cache is at its budget, as in a long stream."""
    session = Session(model, config, pool)
    while session.stats().cache_tokens < config.budget_tokens:
        stream_visual(session, visual, next_times(session, 1))
    return session


# -- measures ------------------------------------------------------------------------------------


def measure_memory(model: Model, config: SessionConfig, visual: Visual, minutes: float, clock: Clock, pool: KVPool) -> dict:
    """One session in the pool streams `minutes` of video at 1 frame/s; memory at checkpoints."""
    cuda = model.device.type == "cuda"
    total_s = round(minutes * 60)
    marks = {max(1, round(m * minutes)) for m in MEMORY_MINUTES}  # m minutes of an hour, in seconds of `minutes`
    session = Session(model, config, pool)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started, lines = clock(), []
    for second in range(1, total_s + 1):
        stream_visual(session, visual, [float(second)])
        if second in marks:
            stats = session.stats()
            line = {"measure": "memory", "video_s": second, "cache_tokens": stats.cache_tokens,
                    "cache_bytes": stats.cache_bytes, "tokens_seen": stats.tokens_seen}
            if cuda:
                line |= {"allocated_bytes": torch.cuda.memory_allocated(), "peak_bytes": torch.cuda.max_memory_allocated()}
            else:
                line["rss_bytes"] = rss_bytes()
            line["frames_per_s"] = round(second / (clock() - started), 2)
            emit(**line)
            lines.append(line)
    key = "allocated_bytes" if cuda else "rss_bytes"
    full = [line for line in lines if line["cache_tokens"] >= config.budget_tokens] or lines[-1:]
    return {"memory_growth_bytes": full[-1][key] - full[0][key], "memory_growth_from_s": full[0]["video_s"],
            "memory_growth_to_s": full[-1]["video_s"], "cache_tokens": full[-1]["cache_tokens"]}


def measure_ingest(sessions: list[Session], counts: list[int], frames: list[np.ndarray], clock: Clock) -> dict:
    """Frames/s of append_frames (8 a call) on one session, and of one engine step over N."""
    one = sessions[0]
    batch = frames[:8]
    for _ in range(2):  # warm-up
        one.append_frames(batch, next_times(one, len(batch)))
    calls = 4
    started = clock()
    for _ in range(calls):
        one.append_frames(batch, next_times(one, len(batch)))
    rate = calls * len(batch) / (clock() - started)
    emit(measure="ingest", mode="append_frames", sessions=1, frames_per_call=len(batch), frames=calls * len(batch),
         frames_per_s=round(rate, 2))
    rates = {"one_session_8_per_call": round(rate, 2)}
    for count in counts:
        group = sessions[:count]

        def together() -> None:
            work = [(s, [frames[i % len(frames)]], next_times(s, 1)) for i, s in enumerate(group)]
            errors = [e for e in engine_step([Frames(*w) for w in work]) if e is not None]
            if errors:
                raise errors[0]

        together()  # warm-up
        started = clock()
        for _ in range(calls):
            together()
        rate = calls * count / (clock() - started)
        emit(measure="ingest", mode="step", sessions=count, frames_per_call=count,
             frames=calls * count, frames_per_s=round(rate, 2))
        rates[f"together_{count}"] = round(rate, 2)
    return rates


def _begun(sessions: Sequence[Session], answer_tokens: int) -> list[Answer]:
    """Each session asks; its question is run and its first token chosen."""
    answers = [session.ask(QUESTION, max_new_tokens=answer_tokens) for session in sessions]
    for answer in answers:
        next(answer)
    return answers


def decode_rates(sessions: list[Session], answer_tokens: int, clock: Clock) -> tuple[float, float]:
    """Answer tokens/s of the sessions answering at once: batched, then one at a time."""
    answers = _begun(sessions, answer_tokens)
    started = clock()
    while True:
        pieces = engine_step(answers)
        failed = [p for p in pieces if isinstance(p, Exception)]
        if failed:
            raise failed[0]
        if all(p is None for p in pieces):
            break
    batched = sum(a.tokens - 1 for a in answers) / (clock() - started)
    answers = _begun(sessions, answer_tokens)
    started = clock()
    live = answers
    while live:
        live = [answer for answer in live if next(answer, None) is not None]
    return batched, sum(a.tokens - 1 for a in answers) / (clock() - started)


def measure_decode(sessions: list[Session], answer_tokens: int, clock: Clock) -> float:
    """Batched over sequential answer tokens/s of N sessions."""
    batched, sequential = decode_rates(sessions, answer_tokens, clock)
    ratio = batched / sequential
    emit(measure="decode", sessions=len(sessions), answer_tokens=answer_tokens,
         batched_tokens_per_s=round(batched, 1), sequential_tokens_per_s=round(sequential, 1), ratio=round(ratio, 2))
    return ratio


@dataclass
class _Stream:
    """One session's arrivals in the serving simulation, as the scheduler's `Work`. Times are
    seconds since the simulation began."""

    session: Session
    frame_at_s: float  # the next frame's arrival
    question_at_s: float  # the next question's arrival
    ask_every_s: float
    video_base_s: float  # video time at the simulation's start
    frames: deque[float] = field(default_factory=deque)  # arrivals of frames waiting
    questions: deque[float] = field(default_factory=deque)  # arrivals of questions not started
    answer: Answer | None = None
    arrived: int = 0
    ingested: int = 0
    dropped: int = 0
    late: int = 0
    asked: int = 0

    def arrive(self, now_s: float) -> None:
        while self.frame_at_s <= now_s:
            self.frames.append(self.frame_at_s)
            self.frame_at_s += 1.0
            self.arrived += 1
        while self.question_at_s <= now_s:
            self.questions.append(self.question_at_s)
            self.question_at_s += self.ask_every_s
            self.asked += 1
        # the worker's live rule: frames late by more than MAX_LAG_S are dropped, except the newest
        while len(self.frames) > 1 and now_s - self.frames[0] > MAX_LAG_S:
            self.frames.popleft()
            self.dropped += 1

    @property
    def next_arrival_s(self) -> float:
        return min(self.frame_at_s, self.question_at_s)

    @property
    def next_question_at(self) -> tuple[int, int] | None:
        if self.questions and self.answer is None:
            return round(self.questions[0] * 1000), 0
        return None

    @property
    def answering(self) -> bool:
        return self.answer is not None

    @property
    def ingest_ready(self) -> bool:
        return bool(self.frames)

    @property
    def frame_tokens(self) -> int:
        return self.session.frame_tokens

    def take_frames(self, now_s: float) -> list[float]:
        """Up to FRAMES_PER_STEP waiting frames' video times; counts the late ones."""
        taken = [self.frames.popleft() for _ in range(min(FRAMES_PER_STEP, len(self.frames)))]
        self.ingested += len(taken)
        self.late += sum(now_s - arrival > MAX_LAG_S for arrival in taken)
        return [self.video_base_s + arrival for arrival in taken]


def measure_serving(sessions: list[Session], frames: list[np.ndarray], seconds: float, ask_every_s: float,
                    answer_tokens: int, clock: Clock) -> bool:
    """The worker's loop over N sessions at 1 frame/s for `seconds`; True when they were served."""
    count = len(sessions)
    streams = {
        str(i): _Stream(session, i / count, 1.0 + ask_every_s * i / count, ask_every_s, next_times(session, 1)[0])
        for i, session in enumerate(sessions)
    }
    scheduler = Scheduler(BATCH_SESSIONS, DEFAULT_STEP_TOKENS, FRAMES_PER_STEP)
    ttft_s: list[float] = []
    steps = {"start": 0, "answer": 0, "ingest": 0}  # steps that held each kind of work
    origin = clock()
    while (now := clock() - origin) < seconds:
        for stream in streams.values():
            stream.arrive(now)
        step = scheduler.next_step(streams)
        if step is None:
            wake = min(stream.next_arrival_s for stream in streams.values())
            time.sleep(max(0.0, min(wake, seconds) - (clock() - origin)))
            continue
        for kind, ids in (("start", step.starts), ("answer", step.answers), ("ingest", step.frames)):
            steps[kind] += bool(ids)
        starting = [streams[i] for i in step.starts]
        arrivals = [stream.questions.popleft() for stream in starting]
        for stream in starting:
            stream.answer = stream.session.ask(QUESTION, max_new_tokens=answer_tokens)
        answering = starting + [streams[i] for i in step.answers]
        ingesting, now = [streams[i] for i in step.frames], clock() - origin
        work = []
        for stream in ingesting:
            times = stream.take_frames(now)
            work.append(Frames(stream.session, [frames[int(t) % len(frames)] for t in times], times))
        results = engine_step([stream.answer for stream in answering] + work)
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:
            raise failed[0]
        ttft_s += [clock() - origin - arrival for arrival in arrivals]
        for stream, piece in zip(answering, results, strict=False):
            if piece is None:
                stream.answer = None
    end = clock() - origin
    started = len(ttft_s)
    for stream in streams.values():
        ttft_s += [end - arrival for arrival in stream.questions]  # still waiting: a lower bound
        stream.late += sum(end - arrival > MAX_LAG_S for arrival in stream.frames)
        if stream.answer is not None:
            stream.answer.close()
            stream.answer = None
    p50, p99 = _percentile(ttft_s, 50), _percentile(ttft_s, 99)
    dropped = sum(s.dropped for s in streams.values())
    late = sum(s.late for s in streams.values())
    served = bool(ttft_s) and p99 < TTFT_TARGET_S and dropped == 0 and late == 0
    emit(measure="serving", sessions=count, seconds=round(end, 1), questions=sum(s.asked for s in streams.values()),
         started=started, ttft_p50_s=_round(p50), ttft_p99_s=_round(p99),
         frames=sum(s.arrived for s in streams.values()), frames_ingested=sum(s.ingested for s in streams.values()),
         frames_dropped=dropped, frames_late=late, steps=steps, served=served)
    return served


def _percentile(values: list[float], q: float) -> float | None:
    """Nearest rank: the smallest value at or above q% of them (p99 of fewer than 100 is the max)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


# -- the run -------------------------------------------------------------------------------------


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    args.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    args.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    args.add_argument("--budget", type=int, default=None, help="cache tokens per layer (7b shapes: 4096, tiny: 512)")
    args.add_argument("--policy", default="infmllm", choices=sorted(POLICIES))
    args.add_argument("--sessions", default="1,8,16,32,64", help="comma-separated session counts")
    args.add_argument("--minutes", type=float, default=60.0, help="video streamed by the memory measure")
    args.add_argument("--answer-tokens", type=int, default=32)
    args.add_argument("--serve-seconds", type=float, default=60.0, help="wall-clock seconds per serving run")
    args.add_argument("--ask-every", type=float, default=10.0, help="seconds between a session's questions")
    opts = args.parse_args()
    counts = sorted({int(c) for c in opts.sessions.split(",") if c})
    if not counts or counts[0] < 1:
        sys.exit(f"--sessions must be positive counts, got {opts.sessions!r}")
    if opts.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA device here; for a smoke test on the CPU: --device cpu --shape tiny")
    budget = opts.budget or SHAPES[opts.shape].budget_tokens
    # the peak a worker reserves for such a session: its buffers grow no larger
    config = SessionConfig(policy=opts.policy, budget_tokens=budget, peak_tokens=peak_cache_tokens(budget))

    with torch.inference_mode():
        model = build_model(opts.shape, opts.device)
        clock = Clock(model.device)
        frame_shape = QWEN_FRAME if isinstance(model.vision, QwenVision) else (model.vision.image_size,) * 2
        rng = np.random.default_rng(0)
        frames = [rng.integers(0, 256, (*frame_shape, 3), dtype=np.uint8) for _ in range(8)]
        # (1, tokens_per_frame, hidden), reused by every stream
        visual = Visual(model.encode_frames(frames[: model.frames_per_group]), model.frame_grid(frames[0].shape))
        emit(measure="setup", device=_device_name(model.device), torch=torch.__version__,
             transformers=importlib.metadata.version("transformers"), shape=opts.shape,
             parameters=sum(p.numel() for p in model.hf.parameters()),
             weights_bytes=sum(p.numel() * p.element_size() for p in model.hf.parameters()),
             kv_bytes_per_token=model.kv_bytes_per_token, tokens_per_frame=visual.tokens.shape[1], policy=opts.policy,
             budget=budget, cache_bytes_at_budget=budget * model.kv_bytes_per_token)

        pool = make_pool(model, config, counts[-1])  # as a worker holds its sessions' caches
        memory = measure_memory(model, config, visual, opts.minutes, clock, pool)
        gc.collect()  # the memory measure's session, whose pages go back
        sessions = [filled_session(model, config, visual, pool) for _ in range(counts[-1])]
        ingest = measure_ingest(sessions, counts, frames, clock)
        decode_rates(sessions[:2], 4, clock)  # warm-up
        ratios = {count: round(measure_decode(sessions[:count], opts.answer_tokens, clock), 2) for count in counts}
        served = [count for count in counts if measure_serving(
            sessions[:count], frames, opts.serve_seconds, opts.ask_every, opts.answer_tokens, clock)]
        emit(measure="summary", device=_device_name(model.device), shape=opts.shape, budget=budget, policy=opts.policy,
             sessions_served_at_1fps=max(served, default=0), decode_batched_over_sequential=ratios,
             ingest_frames_per_s=ingest, **memory)


if __name__ == "__main__":
    main()
