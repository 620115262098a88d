"""Time per token of prefill with eviction, and of decoding, for each policy at one budget, side by side.

    python -m bench.speed [--model smollm2-135m-instruct] [--policies ...] [--budgets 1024]
                          [--tokens 4096] [--chunk 128] [--decode-tokens 64]

For each policy: fill the cache past its budget, then stream --tokens of English text in
chunks of --chunk (phase "prefill"), then generate --decode-tokens (phase "decode", timed from
the first generated token, so without the question's prefill; the closing of the turn and
its eviction are included). Prints
policy, budget, phase, tokens, ms_per_token, eviction_ms_per_token and eviction_overhead
(eviction time / the rest of the time). The last line compares every policy with infmllm:
`vs_infmllm` is a policy's ms_per_token over infmllm's, per phase.
"""

import time

from bench.common import emit, english_text, parser, split_list
from engine import Session, SessionConfig, load_model


def measure(model, policy: str, budget: int, ids: list[int], chunk: int, decode_tokens: int) -> list[dict]:
    session = Session(model, SessionConfig(policy=policy, budget_tokens=budget, system_prompt=""))
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
    answer = session.ask("Summarise what you just read.", max_new_tokens=decode_tokens)
    next(answer)
    evict_before, started = session.stats().evict_ms, time.perf_counter()
    for _ in answer:
        pass
    generated = answer.tokens - 1
    lines.append(_line(policy, budget, "decode", generated, started, session.stats().evict_ms - evict_before))
    return lines


def _line(policy: str, budget: int, phase: str, tokens: int, started: float, evict_ms: float) -> dict:
    elapsed_ms = 1000 * (time.perf_counter() - started)
    per = max(tokens, 1)
    return {
        "policy": policy,
        "budget": budget,
        "phase": phase,
        "tokens": tokens,
        "ms_per_token": round(elapsed_ms / per, 3),
        "eviction_ms_per_token": round(evict_ms / per, 3),
        "eviction_overhead": round(evict_ms / max(elapsed_ms - evict_ms, 1e-9), 3),
    }


def main() -> None:
    args = parser(__doc__.splitlines()[0], tokens=4096)
    args.add_argument("--model", default="smollm2-135m-instruct")
    args.add_argument("--chunk", type=int, default=128)
    args.add_argument("--decode-tokens", type=int, default=64)
    opts = args.parse_args()
    model = load_model(opts.model, "cpu")
    all_ids = model.tokenize(english_text())
    measure(model, "sliding", 256, all_ids[:1024], opts.chunk, 4)  # warm-up, untimed: first calls are slow
    for budget in split_list(opts.budgets, int):
        ids = all_ids[: budget + opts.chunk + opts.tokens]
        lines = [line for p in split_list(opts.policies) for line in measure(model, p, budget, ids, opts.chunk, opts.decode_tokens)]
        for line in lines:
            emit(**line)
        base = {l["phase"]: l["ms_per_token"] for l in lines if l["policy"] == "infmllm"}
        if base:
            emit(
                budget=budget,
                vs_infmllm={
                    f"{l['policy']}/{l['phase']}": round(l["ms_per_token"] / base[l["phase"]], 2) for l in lines
                },
            )


if __name__ == "__main__":
    main()
