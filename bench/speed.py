"""Time per token of prefill with eviction, and of decoding, for each policy at one budget, side by
side with plain transformers on the same model.

    python -m bench.speed [--model smollm2-135m-instruct] [--policies ...] [--budgets 1024]
                          [--tokens 4096] [--chunk 128] [--decode-tokens 64] [--rounds 1] [--pool]

For each policy: fill the cache past its budget, then stream --tokens of English text in
chunks of --chunk (phase "prefill"), then generate --decode-tokens (phase "decode", timed from
the first generated token, so without the question's prefill; the closing of the turn and
its eviction are included). Then `plain`, the same work with transformers alone: a DynamicCache
of `budget` tokens of the same text, each chunk run against it (with every position's logits
and their loss, as `append_text` computes them) and cut off again, then greedy decoding from a
cache of as many tokens as a bounded policy's held when it began to decode, and the turn's
close. With --pool, each session's cache leases its pages from a KV pool, as a worker holds
them (`engine/kv_pool.py`). Each round runs every policy and `plain` once, one after the other, so that a busy
machine slows them alike; the figures are medians over --rounds.

Prints policy, budget, phase, tokens, ms_per_token, eviction_ms_per_token and eviction_overhead
(eviction time / the rest of the time). The last line of each budget compares: `vs_infmllm` is
a policy's ms_per_token over infmllm's, `vs_plain` over plain transformers', per phase.
"""

import statistics
import time

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from bench.common import emit, english_text, parser, split_list
from engine import Session, SessionConfig, load_model
from engine.kv_pool import KVPool
from streamvqa.protocol import POOL_PAGE_TOKENS, peak_cache_tokens

QUESTION = "Summarise what you just read."


def measure(
    model, policy: str, budget: int, ids: list[int], chunk: int, decode_tokens: int, pool: KVPool | None = None
) -> tuple[list[dict], int]:
    """The policy's prefill and decode lines, and the tokens its cache held when decoding began."""
    config = SessionConfig(policy=policy, budget_tokens=budget, system_prompt="", peak_tokens=peak_cache_tokens(budget))
    session = Session(model, config, pool)
    text = model.detokenize
    warm = budget + chunk  # untimed: the cache starts full, as in a long stream
    for start in range(0, warm, chunk):
        session.append_text(text(ids[start : start + chunk]))
    evict_before, started = session.stats().evict_ms, time.perf_counter()
    streamed = session.stats().tokens_seen
    for start in range(warm, len(ids), chunk):
        session.append_text(text(ids[start : start + chunk]))
    stats = session.stats()
    lines = [_line(policy, budget, "prefill", stats.tokens_seen - streamed, started, stats.evict_ms - evict_before)]
    # decoding: from the first generated token to the last (the question's prefill is not timed)
    answer = session.ask(QUESTION, max_new_tokens=decode_tokens)
    next(answer)
    context_tokens = session.stats().cache_tokens
    evict_before, started = session.stats().evict_ms, time.perf_counter()
    for _ in answer:
        pass
    generated = answer.tokens - 1
    lines.append(_line(policy, budget, "decode", generated, started, session.stats().evict_ms - evict_before))
    session.release()  # its pages, for the next
    return lines, context_tokens


@torch.inference_mode()
def plain(model, budget: int, ids: list[int], chunk: int, decode_tokens: int, context_tokens: int) -> list[dict]:
    """The same work with transformers alone, at the same context lengths, evicting nothing."""
    hf, device = model.hf, model.device

    def run(tokens: list[int], cache: DynamicCache, all_logits: bool = False) -> torch.Tensor:
        ids_t = torch.tensor([tokens], device=device)
        return hf(input_ids=ids_t, cache=cache, use_cache=True, logits_to_keep=0 if all_logits else 1).logits[0]

    cache = DynamicCache()
    run(ids[:budget], cache)
    started = time.perf_counter()
    streamed = 0
    for start in range(budget + chunk, len(ids), chunk):
        piece = ids[start : start + chunk]
        logits = run(piece, cache, all_logits=True)
        float(F.cross_entropy(logits[:-1].float(), torch.tensor(piece[1:], device=device), reduction="sum"))
        cache.crop(-len(piece))  # back to the budget, as an eviction leaves it
        streamed += len(piece)
    lines = [_line("plain", budget, "prefill", streamed, started, 0.0)]
    cache = DynamicCache()
    token = int(run(ids[:context_tokens], cache)[-1].argmax())
    started = time.perf_counter()
    for _ in range(decode_tokens - 1):
        token = int(run([token], cache)[-1].argmax())
    run([token, *model.tokenize(model.chat.assistant_to_user)], cache)  # the last token and the turn's close
    lines.append(_line("plain", budget, "decode", decode_tokens - 1, started, 0.0))
    return lines


def _line(policy: str, budget: int, phase: str, tokens: int, started: float, evict_ms: float) -> dict:
    elapsed_ms = 1000 * (time.perf_counter() - started)
    per = max(tokens, 1)
    return {
        "policy": policy,
        "budget": budget,
        "phase": phase,
        "tokens": tokens,
        "ms_per_token": elapsed_ms / per,
        "eviction_ms_per_token": evict_ms / per,
        "eviction_overhead": evict_ms / max(elapsed_ms - evict_ms, 1e-9),
    }


def _median(rounds: list[dict]) -> dict:
    """One line of the medians of the same policy, budget and phase over rounds."""
    line = dict(rounds[0])
    for field in ("ms_per_token", "eviction_ms_per_token", "eviction_overhead"):
        line[field] = round(statistics.median(r[field] for r in rounds), 3)
    if len(rounds) > 1:
        line["rounds"] = len(rounds)
    return line


def main() -> None:
    args = parser(__doc__.splitlines()[0], tokens=4096)
    args.add_argument("--model", default="smollm2-135m-instruct")
    args.add_argument("--chunk", type=int, default=128)
    args.add_argument("--decode-tokens", type=int, default=64)
    args.add_argument("--rounds", type=int, default=1, help="times each policy and plain run, alternating")
    args.add_argument("--pool", action="store_true", help="sessions lease their caches from a KV pool, as in a worker")
    opts = args.parse_args()
    model = load_model(opts.model, "cpu")
    pool = None
    if opts.pool:  # room for one session of the largest budget (each ends before the next)
        pages = -(-peak_cache_tokens(max(split_list(opts.budgets, int))) // POOL_PAGE_TOKENS)
        pool = KVPool(model.num_layers, model.kv_heads, model.head_dim, pages, POOL_PAGE_TOKENS, model.dtype, model.device)
    all_ids = model.tokenize(english_text())
    measure(model, "sliding", 256, all_ids[:1024], opts.chunk, 4)  # warm-up, untimed: first calls are slow
    plain(model, 256, all_ids[:1024], opts.chunk, 4, 256)
    for budget in split_list(opts.budgets, int):
        ids = all_ids[: budget + opts.chunk + opts.tokens]
        runs: dict[tuple[str, str], list[dict]] = {}
        for _ in range(opts.rounds):
            contexts = [budget]
            for policy in split_list(opts.policies):
                lines, context_tokens = measure(model, policy, budget, ids, opts.chunk, opts.decode_tokens, pool)
                contexts.append(context_tokens)
                for line in lines:
                    runs.setdefault((line["policy"], line["phase"]), []).append(line)
            context_tokens = min(contexts[1:] or contexts)  # a bounded policy's (full holds more)
            for line in plain(model, budget, ids, opts.chunk, opts.decode_tokens, context_tokens):
                runs.setdefault((line["policy"], line["phase"]), []).append(line)
        lines = [_median(rounds) for rounds in runs.values()]
        for line in lines:
            emit(**line)
        emit(budget=budget, **{f"vs_{base}": _versus(lines, base) for base in ("infmllm", "plain")})


def _versus(lines: list[dict], base: str) -> dict[str, float]:
    """Every policy's ms_per_token over `base`'s, per phase ({} when `base` did not run)."""
    of = {line["phase"]: line["ms_per_token"] for line in lines if line["policy"] == base}
    return {
        f"{line['policy']}/{line['phase']}": round(line["ms_per_token"] / of[line["phase"]], 2)
        for line in lines
        if of and line["policy"] != base
    }


if __name__ == "__main__":
    main()
