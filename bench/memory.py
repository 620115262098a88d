"""Memory and time per chunk as a stream grows: bounded policies stay flat, `full` grows.

    python -m bench.memory [--tokens 1000000] [--policies ...] [--budgets 1024] [--chunk 256] [--recall]
                           [--host-drop novel,oldest] [--model tiny-random-qwen2-5-vl --frames 2]

Streams random text through the tiny text model (`--model`: another; `--frames`: that many random
frames before each chunk of text, for a model that sees frames, one second apart). At every decade of tokens seen (and at the
end) prints: policy, budget, tokens_seen, cache_tokens, cache_bytes, max_position, rss_bytes,
ms_per_chunk (mean since the previous line), evict_ms_per_chunk. `full` stops at --full-cap
tokens (its attention grows with the stream) and says so. Each policy's last line adds the
ratios of cache_bytes and ms_per_chunk to the line at 10,000 tokens (after the cache has
filled, so that the ratios compare like with like).

--recall runs every bounded policy with recall (a host tier of 16x the budget): lines add
host_tokens and host_bytes (the pages the host tier holds), and the last line host_bytes_ratio,
against the first line after the tier first let a page go. --host-drop runs each policy once per
rule by which pages leave a full tier ("novel" lets an eighth of the tier go at once, so
host_bytes moves between 7/8 of the bound and all of it; the pool is allocated whole either way).
"""

import time

import numpy as np

from bench.common import emit, parser, random_text, rss_bytes, split_list
from engine import Session, SessionConfig, load_model
from engine.host_tier import DROP_RULES

BASELINE_TOKENS = 10_000


def run(model, policy: str, budget: int, tokens: int, chunk: int, full_cap: int, recall: bool = False,
        host_drop: str = SessionConfig.host_drop, frames: int = 0) -> None:
    config = SessionConfig(policy=policy, budget_tokens=budget, recall=recall and policy != "full", host_drop=host_drop)
    session = Session(model, config)
    rng = np.random.default_rng(0)
    limit = min(tokens, full_cap) if policy == "full" else tokens
    next_report, first, host_full, chunks, elapsed_s, evict_before = 1000, None, None, 0, 0.0, 0.0
    while True:
        seen = session.stats().tokens_seen
        if seen >= next_report or seen >= limit:
            stats = session.stats()
            line = {
                "policy": policy,
                "budget": budget,
                "tokens_seen": stats.tokens_seen,
                "cache_tokens": stats.cache_tokens,
                "cache_bytes": stats.cache_bytes,
                "max_position": stats.max_position,
                "rss_bytes": rss_bytes(),
                "ms_per_chunk": round(1000 * elapsed_s / max(chunks, 1), 3),
                "evict_ms_per_chunk": round((stats.evict_ms - evict_before) / max(chunks, 1), 3),
            }
            if config.recall:
                line |= {"host_drop": host_drop, "host_tokens": stats.host_tokens, "host_bytes": stats.host_bytes}
                if host_full is None and session.cache.host.dropped_pages:
                    host_full = line
            if first is None and (seen >= BASELINE_TOKENS or seen >= limit):
                first = line
            if seen >= limit:
                line["cache_bytes_ratio"] = round(line["cache_bytes"] / first["cache_bytes"], 3)
                if host_full is not None:
                    line["host_bytes_ratio"] = round(line["host_bytes"] / host_full["host_bytes"], 3)
                    line["host_full_at"] = host_full["tokens_seen"]
                line["ms_per_chunk_ratio"] = round(line["ms_per_chunk"] / max(first["ms_per_chunk"], 1e-9), 3)
                if limit < tokens:
                    line["stopped"] = f"full stops at --full-cap {full_cap} tokens"
                emit(**line)
                return
            emit(**line)
            while next_report <= seen:
                next_report *= 10
            chunks, elapsed_s, evict_before = 0, 0.0, stats.evict_ms
        text = random_text(chunk, rng)
        images = [rng.integers(0, 256, (90, 160, 3), dtype=np.uint8) for _ in range(frames)]
        started = time.perf_counter()
        if frames:
            second = session.stats().frames + session.frames_waiting
            session.append_frames(images, [float(second + i) for i in range(frames)])
        session.append_text(text)
        elapsed_s += time.perf_counter() - started
        chunks += 1


def main() -> None:
    args = parser(__doc__.splitlines()[0], tokens=1_000_000)
    args.add_argument("--chunk", type=int, default=256, help="tokens per append")
    args.add_argument("--full-cap", type=int, default=65_536, help="tokens after which `full` stops")
    args.add_argument("--model", default="tiny-random-llama")
    args.add_argument("--recall", action="store_true", help="bounded policies keep what they evict in a host tier")
    args.add_argument("--host-drop", default=SessionConfig.host_drop, help="with --recall: novel, oldest or both")
    args.add_argument("--frames", type=int, default=0, help="random frames before each chunk of text")
    opts = args.parse_args()
    drops = opts.host_drop.split(",") if opts.recall else [SessionConfig.host_drop]
    if set(drops) - set(DROP_RULES):
        args.error(f"--host-drop takes {', '.join(DROP_RULES)}")
    model = load_model(opts.model, "cpu")
    for budget in split_list(opts.budgets, int):
        for policy in split_list(opts.policies):
            for drop in drops:
                run(model, policy, budget, opts.tokens, opts.chunk, opts.full_cap, opts.recall, drop, opts.frames)


if __name__ == "__main__":
    main()
