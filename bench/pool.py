"""Memory, time and snapshots of caches in a worker's KV pool: sessions in turn, `full` over a
long stream, and the bytes a recall session's snapshots write.

    python -m bench.pool turns [--model smollm2-135m-instruct] [--sessions 16] [--budgets 512] [--tokens 4000]
    python -m bench.pool stream [--model streamvqa-demo] [--frames 444] [--policies full,infmllm]
    python -m bench.pool snapshots [--model smollm2-135m-instruct] [--budgets 512] [--tokens 2000] [--intervals 5]
    python -m bench.pool decode [--model smollm2-135m-instruct] [--counts 1,8,32] [--budgets 512] [--tokens 200]
                                [--dtypes float32,bfloat16]
    python -m bench.pool worker [--model streamvqa-demo] [--sessions 3] [--minutes 4] [--budgets 1024]
    python -m bench.pool linears [--model smollm2-135m-instruct] [--counts 1,8,32]

`turns`: sessions one after another on one model, each with recall (a host tier of 16x the
budget), streaming --tokens of random text in pieces of 600 characters, asked one question, then
ended; once with their caches in a KV pool and their host tiers in a host pool (as a worker runs
them) and once with buffers and tiers of their own, each in a process of its own. Prints, per mode, the resident memory after each session, and
the ratio of the last session's to the second's (`creep`: 1.0 is none).

`stream`: frames (224 x 224, random: the time does not depend on what they show) appended one at
a time at 2 frames/s; prints ms per frame of the first 50 and the last 50, and their ratio. For
`full` the cache grows by a frame's tokens at every frame, so only the attention should grow.

`snapshots`: an `infmllm` session with recall (a host tier of 16x the budget) streams random text
until its tier is full, then --intervals times --tokens more, snapshotted after each: the bytes a
worker writes with the host pages apart (the snapshot without them, and each page that changed)
and with the whole tier, each over the bytes of the tokens streamed in the interval (their keys
and values in every layer).

`decode`: the most of --counts sessions (`infmllm`, in one KV pool as a worker holds them, leased
in turn) each stream --tokens of random text and are asked a question; then, for each count,
that many answer at once, one engine step a token of each: the median ms of a step, tokens/s,
and tokens/s over one session's (the batch's gain, in one run); with --dtypes, each count in
each dtype, and `over_first` over the first dtype's one session.

`linears`: every linear layer of the model's decoder in float32, and in bfloat16 laid out for
oneDNN (engine/numerics.py), once each (`separate`) and with a layer's query, key and value in
one product and its gate and up in another (`fused`, as the engine loads it), or plain
(`bfloat16 plain`) on a CPU that oneDNN packs no bfloat16 weight for, run over --counts rows at
a time: the median ms of one pass over all of them.

`worker`: a worker's resident memory through the whole service (gateway, worker, Redis, as
`make run` starts them with the default settings): --sessions sessions with recall (the default
options, or a budget of --budgets) each upload the same --minutes video (320 x 240, 10 fps,
MPEG-4) at once, wait until it is ingested, are asked one question and are ended. Prints the
worker's resident memory when ready, its peak while the sessions live (sampled every 20 ms,
and the kernel's high-water mark since ready where it can be reset) and once the worker
holds no session, each in MiB, with the peak and the end over ready, and how much of the end
is files mapped (`after_file_mib`: mostly the model's weights, read in as they are first used).
"""

import copy
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import av
import httpx
import numpy as np
import torch

from bench.common import emit, parser, random_text, rss_bytes, split_list, status_bytes
from bench.stack import serving
from engine import Session, SessionConfig, load_model
from engine.host_pool import HostPool
from engine.kv_pool import KVPool
from engine.numerics import DTYPES, PackedLinear, cpu_packs_bfloat16, pack_linears
from engine.step import step
from streamvqa.client import Client
from streamvqa.protocol import POOL_PAGE_TOKENS, peak_cache_tokens

EDGE_FRAMES = 50
VIDEO_SIZE, VIDEO_FPS = (320, 240), 10  # `worker`'s video
SAMPLE_S = 0.02  # `worker`: how often the worker's resident memory is read


def turns(model_name: str, sessions: int, budget: int, tokens: int, pooled: bool) -> None:
    model = load_model(model_name, "cpu")
    config = SessionConfig(policy="infmllm", budget_tokens=budget, recall=True, peak_tokens=budget + budget // 2 + 3072)
    pool = None
    if pooled:  # room for one session at a time, its cache and its host tier, as a worker sized for it
        shape = (model.num_layers, model.kv_heads, model.head_dim)
        host = HostPool(*shape, config.host_tokens // config.page_tokens, config.page_tokens, model.dtype, model.device)
        pool = KVPool(*shape, -(-config.peak_tokens // POOL_PAGE_TOKENS), POOL_PAGE_TOKENS, model.dtype, model.device, host)
    rng = np.random.default_rng(0)
    after = []
    for turn in range(sessions):
        session = Session(model, config, pool)
        streamed = 0
        while streamed < tokens:
            streamed += session.append_text(random_text(600, rng)).tokens
        "".join(session.ask("What was said first?", max_new_tokens=8))
        session.release()
        del session
        after.append(rss_bytes())
        emit(mode="pool" if pooled else "own", session=turn + 1, rss_mib=round(after[-1] / 2**20, 1))
    emit(mode="pool" if pooled else "own", sessions=sessions, rss_after_second_mib=round(after[1] / 2**20, 1),
         rss_after_last_mib=round(after[-1] / 2**20, 1), creep=round(after[-1] / after[1], 3))


def stream(model_name: str, frames: int, policy: str) -> None:
    model = load_model(model_name, "cpu")
    session = Session(model, SessionConfig(policy=policy, budget_tokens=1024))
    picture = np.random.default_rng(0).integers(0, 256, (224, 224, 3), dtype=np.uint8)
    taken = []
    for i in range(frames):
        started = time.perf_counter()
        session.append_frames([picture], [i * 0.5])
        taken.append(time.perf_counter() - started)
    first, last = (1000 * float(np.mean(part)) for part in (taken[:EDGE_FRAMES], taken[-EDGE_FRAMES:]))
    emit(policy=policy, frames=frames, cache_tokens=session.stats().cache_tokens, threads=torch.get_num_threads(),
         first_ms_per_frame=round(first, 1), last_ms_per_frame=round(last, 1), last_over_first=round(last / first, 2))


def snapshots(model_name: str, budget: int, tokens: int, intervals: int) -> None:
    model = load_model(model_name, "cpu")
    session = Session(model, SessionConfig(policy="infmllm", budget_tokens=budget, recall=True))
    rng = np.random.default_rng(0)
    host = session.cache.host

    def stream(count: int) -> int:
        streamed = 0
        while streamed < count:
            streamed += session.append_text(random_text(600, rng)).tokens
        return streamed

    while not host.dropped_pages:  # until the tier is full and lets pages go
        stream(budget)
    session.snapshot(host_pages=False), session.changed_host_pages()  # the first: every page
    for interval in range(intervals):
        streamed = stream(tokens)
        apart = len(session.snapshot(host_pages=False)) + sum(len(page) for page in session.changed_host_pages().values())
        whole = len(session.snapshot())
        token_bytes = streamed * model.kv_bytes_per_token
        emit(interval=interval + 1, tokens_streamed=streamed, host_tokens=session.stats().host_tokens,
             streamed_mib=round(token_bytes / 2**20, 1), apart_mib=round(apart / 2**20, 1), whole_mib=round(whole / 2**20, 1),
             apart_over_streamed=round(apart / token_bytes, 2), whole_over_streamed=round(whole / token_bytes, 2))


def decode(model_name: str, counts: list[int], budget: int, tokens: int, dtypes: list[torch.dtype], answer_tokens: int = 16) -> None:
    """Each count for each dtype in turn, on one model loaded in each: `over_first` is over the
    first dtype's first count (float32's one session, by default), so that the dtypes compare in
    one run."""
    first = None
    for dtype in dtypes:
        first = decode_in(model_name, counts, budget, tokens, dtype, answer_tokens, first)


def decode_in(model_name: str, counts: list[int], budget: int, tokens: int, dtype: torch.dtype, answer_tokens: int,
              first: float | None) -> float:
    model = load_model(model_name, "cpu", dtype=dtype)
    config = SessionConfig(policy="infmllm", budget_tokens=budget, peak_tokens=peak_cache_tokens(budget))
    pages = max(counts) * -(-config.peak_tokens // POOL_PAGE_TOKENS)
    pool = KVPool(model.num_layers, model.kv_heads, model.head_dim, pages, POOL_PAGE_TOKENS, model.dtype, model.device)
    rng = np.random.default_rng(0)
    sessions = []
    for _ in range(max(counts)):
        session = Session(model, config, pool)
        streamed = 0
        while streamed < tokens:
            streamed += session.append_text(random_text(600, rng)).tokens
        sessions.append(session)
    one = None
    for count in counts:
        answers = [session.ask("What was said first?", max_new_tokens=answer_tokens + 2) for session in sessions[:count]]
        step(answers)  # the questions, and the first tokens
        step(answers)  # a first step of tokens, not timed
        times = []
        for _ in range(answer_tokens):
            started = time.perf_counter()
            step(answers)
            times.append(time.perf_counter() - started)
        for answer in answers:  # to the end of their turns
            for _ in answer:
                pass
        step_ms = float(np.median(times)) * 1000
        rate = count / step_ms * 1000
        one, first = one or rate, first or rate
        emit(mode="decode", dtype=str(dtype).removeprefix("torch."), sessions=count, step_ms=round(step_ms, 1),
             tokens_per_s=round(rate, 1), over_one_session=round(rate / one, 2), over_first=round(rate / first, 2),
             threads=torch.get_num_threads())
    for session in sessions:
        session.release()
    return first


def linears(model_name: str, counts: list[int]) -> None:
    """The model's linear layers of one decode step: in float32; in bfloat16 packed one by one
    (`separate`) and siblings in one product (`fused`) where the CPU packs bfloat16 weights, plain
    (`bfloat16 plain`) where it does not (AVX2 alone)."""
    layers = load_model(model_name, "cpu").hf.get_decoder().layers

    def made(dtype: torch.dtype, pack: str | None = None) -> tuple[torch.dtype, list[torch.nn.Module]]:
        modules = [copy.deepcopy(module).to(dtype) for layer in layers for module in (layer.self_attn, layer.mlp)]
        for module in modules:
            if pack == "fused":
                pack_linears(module)
            elif pack == "separate":
                for name, child in list(module.named_children()):
                    if isinstance(child, torch.nn.Linear):
                        setattr(module, name, PackedLinear.of(child))
        return dtype, modules

    ways = {"float32": made(torch.float32)}
    if cpu_packs_bfloat16():
        ways |= {"separate": made(torch.bfloat16, "separate"), "fused": made(torch.bfloat16, "fused")}
    else:
        ways["bfloat16 plain"] = made(torch.bfloat16)
    mlp = layers[0].mlp
    for rows in counts:
        for way, (dtype, modules) in ways.items():
            x = torch.randn(1, rows, mlp.gate_proj.in_features, dtype=dtype)
            wide = torch.randn(1, rows, mlp.down_proj.in_features, dtype=dtype)

            def run() -> None:
                for module in modules:
                    if hasattr(module, "q_proj"):
                        module.q_proj(x), module.k_proj(x), module.v_proj(x), module.o_proj(x)
                    else:
                        module.gate_proj(x), module.up_proj(x), module.down_proj(wide)

            with torch.inference_mode():
                run()
                times = []
                for _ in range(20):
                    started = time.perf_counter()
                    run()
                    times.append(time.perf_counter() - started)
            emit(mode="linears", way=way, rows=rows, ms=round(float(np.median(times)) * 1000, 2), threads=torch.get_num_threads())


def write_video(path: Path, seconds: float) -> Path:
    """A video of `seconds`: a colour and a bar that move with each frame, MPEG-4 at VIDEO_FPS."""
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=VIDEO_FPS)
        stream.width, stream.height, stream.pix_fmt = *VIDEO_SIZE, "yuv420p"
        for index in range(int(seconds * VIDEO_FPS)):
            image = np.zeros((VIDEO_SIZE[1], VIDEO_SIZE[0], 3), np.uint8)
            image[:] = ((index * 3) % 256, (index * 7) % 256, 128)
            bar = (index * 5) % (VIDEO_SIZE[0] - 20)
            image[:, bar : bar + 20] = 255
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            frame.pts = index
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return path


class Resident:
    """A process's resident memory (Linux: /proc/<pid>/status), now and its peak since `start`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.clear_refs = Path(f"/proc/{pid}/clear_refs")
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def field(self, name: str) -> int:
        return status_bytes(self.pid, name, default=0)

    def now(self) -> int:
        return self.field("VmRSS")

    def start(self) -> None:
        """Sample from now on; the kernel's high-water mark starts again from now where it may."""
        try:
            self.clear_refs.write_text("5")
        except OSError:
            pass
        self.peak_bytes = self.now()
        self._thread.start()

    def stop(self) -> int:
        """The peak since `start`: the highest sample, or the kernel's mark if higher."""
        self._stop.set()
        self._thread.join()
        return max(self.peak_bytes, self.field("VmHWM"))

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.peak_bytes = max(self.peak_bytes, self.now())


def worker_memory(model: str, sessions: int, minutes: float, budget: int | None) -> None:
    mib = lambda n: round(n / 2**20, 1)  # noqa: E731
    options = {"recall": True} | ({"budget_tokens": budget} if budget else {})
    with tempfile.TemporaryDirectory(prefix="streamvqa-pool-") as folder:
        video = write_video(Path(folder) / "video.mp4", minutes * 60)
        with serving("pool", model) as stack, Client(stack.base) as client:
            resident = Resident(stack.worker.pid)
            ready = resident.now()
            resident.start()

            def one(_: int) -> float:
                with client.create_session(**options) as session:  # ended as the block ends
                    session.upload(video)
                    record = session.wait_until_ingested(timeout_s=1800)
                    session.ask("What changes in the video?", max_new_tokens=16)
                    return float(record["video_time_s"])

            with ThreadPoolExecutor(sessions) as pool:
                video_s = list(pool.map(one, range(sessions)))
            deadline = time.monotonic() + 60
            while any(m["sessions"] for m in httpx.get(f"{stack.base}/models").json()["models"]):
                if time.monotonic() > deadline:
                    raise RuntimeError("the worker still holds sessions a minute after they ended")
                time.sleep(0.5)
            time.sleep(2)  # a heartbeat or two: what the worker frees as its sessions go
            peak = resident.stop()
            after, after_file = resident.now(), resident.field("RssFile")
    emit(mode="worker", model=model, sessions=sessions, video_s=max(video_s), budget=budget or "default",
         rss_ready_mib=mib(ready), rss_peak_mib=mib(peak), rss_after_mib=mib(after),
         peak_over_ready_mib=mib(peak - ready), after_over_ready_mib=mib(after - ready),
         after_file_mib=mib(after_file))


def main() -> None:
    args = parser(__doc__, policies="full,infmllm", budgets="")
    args.add_argument("what", choices=["turns", "stream", "snapshots", "decode", "worker", "linears"])
    args.add_argument("--counts", default="1,8,32", help="decode: comma-separated session counts, the first the baseline")
    args.add_argument("--dtypes", default="float32", help="decode: comma-separated float32, bfloat16 (engine/numerics.py)")
    args.add_argument("--intervals", type=int, default=5)
    args.add_argument("--model", default=None)
    args.add_argument("--sessions", type=int, default=None, help="turns: 16; worker: 3")
    args.add_argument("--frames", type=int, default=444)
    args.add_argument("--minutes", type=float, default=4.0, help="worker: the video's length")
    args.add_argument("--pooled", choices=["yes", "no", "both"], default="both")
    options = args.parse_args()
    if options.what == "worker":  # without --budgets: the default session options
        budget = split_list(options.budgets, int)[0] if options.budgets else None
        worker_memory(options.model or "streamvqa-demo", options.sessions or 3, options.minutes, budget)
        return
    options.budgets, options.sessions = options.budgets or "512", options.sessions or 16
    if options.what == "stream":
        for policy in split_list(options.policies):
            stream(options.model or "streamvqa-demo", options.frames, policy)
        return
    model, budget = options.model or "smollm2-135m-instruct", split_list(options.budgets, int)[0]
    if options.what == "linears":
        linears(model, split_list(options.counts, int))
        return
    if options.what == "decode":
        decode(model, split_list(options.counts, int), budget, options.tokens or 200, [DTYPES[name] for name in options.dtypes.split(",") if name])
        return
    if options.what == "snapshots":
        snapshots(model, budget, options.tokens or 2000, options.intervals)
        return
    tokens = options.tokens or 4000
    if options.pooled != "both":
        turns(model, options.sessions, budget, tokens, options.pooled == "yes")
        return
    for pooled in ("no", "yes"):  # each in a process of its own: resident memory is per process
        subprocess.run([sys.executable, "-m", "bench.pool", "turns", "--model", model, "--sessions", str(options.sessions),
                        "--budgets", str(budget), "--tokens", str(tokens), "--pooled", pooled], check=True)


if __name__ == "__main__":
    main()
