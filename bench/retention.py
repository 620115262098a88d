"""A retention curve: one fact at a given distance before the end of a stream, asked after it.

    python -m bench.recall --distances 64,128,256,384,512,1024,2048 [--ratios 8] [--budgets 512]
                           [--policies default,sliding,h2o,snapkv,tova,knorm,infmllm] [--trials 12]
                           [--prose pydoc|idle|licenses|PATH] [--chunk 256]

Model: SmolLM2-135M-Instruct. What `bench.recall` asks at depths (facts at 10% to 90% of a
stream), this asks at distances from its end, where a user expects to be remembered best ("what
did I just say?"): between the `recent` tokens that every bounded policy keeps and the budget,
where eviction and recall meet, and past it.

Each trial draws a stream of prose (`--ratios` times the budget, in tokens, from an offset drawn
per trial) and one fact per distance (bench.recall's templates, subjects and numbers; no two of a
trial alike). For distance d, the stream is the prose with that fact alone planted d tokens
before its end, as a line of its own between blank lines; the question ("How many dollars does
the silver bag cost?") comes right after the stream, from a fresh restored copy of the streamed
session. The distance reported (`distance_tokens`) is measured: the stream's tokens after the
fact's last one.

The streams of one trial are the same prose up to their facts, so one session streams the prose
in chunks of `--chunk` tokens and is forked (snapshot and restore, as a worker takes a session
over) at the last chunk boundary before each fact; the fork streams the rest with its fact.

Per policy and budget (`full`: every token, the reference; `default`: a session of `POST
/sessions` with only the budget given, everything else the service's defaults (recall on); the
other bounded policies are streamed with recall and asked with it and with
`retrieval_tokens` 0, the same device cache either way), prints a JSON line per distance:
`right` of `questions`, `wrong_fact` (another planted number instead), and where the asked
fact's tokens were when the answer began, as shares over every layer, KV head and token of the
fact: `held` (in the device cache), `borrowed` (brought back from the host tier by this
question), `host` (in the host tier, not brought back) and `dropped` (nowhere). Then per budget
and distance a line of every cell's right answers beside `full`'s (`vs_full`), and `behind`: the
cells more than one question behind `full`.
"""

import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from bench.common import emit
from bench.facts import SYSTEM, Fact, Stream, asked, fact_places, make_facts
from engine import Session, SessionConfig
from engine.kv_pool import KVPool
from streamvqa.protocol import POOL_PAGE_TOKENS, SessionOptions, peak_cache_tokens

DEFAULT = "default"  # the engine's defaults, with only the budget given
WHERE = ("held", "borrowed", "host", "dropped")


@dataclass(frozen=True)
class Trial:
    prose: list[int]  # the stream without a fact
    facts: dict[int, Fact]  # by distance
    lines: dict[int, list[int]]  # each fact's line, by distance


def draw(model, prose: list[int], length: int, distances: list[int], seed: int) -> Trial:
    """`length` tokens of prose from an offset drawn from `seed`, and one fact per distance."""
    rng = np.random.default_rng([17, seed])
    facts = dict(zip(distances, make_facts(rng, len(distances)), strict=True))
    lines = {d: model.tokenize(f"\n\n{fact.statement}\n\n") for d, fact in facts.items()}
    offset = int(rng.integers(0, len(prose) - length))
    return Trial(prose[offset : offset + length], facts, lines)


def config_of(policy: str, budget: int | None, peak: int | None, opts) -> SessionConfig:
    """`full`, the engine's defaults (DEFAULT), or a bounded policy with recall (its tier bound
    and drop rule bench.recall's `--host-multiple` and `--host-drop`)."""
    if policy == "full":
        return SessionConfig(policy="full", system_prompt=SYSTEM, question_room_tokens=0)
    if policy == DEFAULT:  # as the worker makes it of a session's record (worker/claims.py)
        options = SessionOptions(budget_tokens=budget)
        recall = {"host_budget_tokens": options.host_tokens, "retrieval_tokens": options.borrowed_tokens} if options.recall else {}
        return SessionConfig(policy=options.policy, budget_tokens=budget, policy_options=options.policy_options.chosen(),
                             recall=options.recall, pin_turns=options.pin_turns, system_prompt=SYSTEM, peak_tokens=peak, **recall)
    return SessionConfig(policy=policy, budget_tokens=budget, system_prompt=SYSTEM, recall=True, peak_tokens=peak,
                         host_budget_tokens=opts.host_multiple * budget, host_drop=opts.host_drop)


def stream_forks(model, config: SessionConfig, trial: Trial, chunk: int) -> dict[int, tuple[bytes, Stream, int]]:
    """By distance: the snapshot of the session that streamed the prose with that distance's fact,
    the stream it saw (its chunks of text), and its opening's tokens."""
    prose, end = trial.prose, len(trial.prose)
    fork_at = {d: (end - d) // chunk * chunk for d in trial.facts}  # the last chunk boundary before the fact
    session = Session(model, config)
    opening = session.cache.appended
    texts: list[str] = []
    at, streamed = 0, {}
    for boundary in sorted(set(fork_at.values())):
        while at < boundary:
            texts.append(model.detokenize(prose[at : at + chunk]))
            session.append_text(texts[-1])
            at += chunk
        snapshot = session.snapshot()
        for distance in [d for d, b in fork_at.items() if b == boundary]:
            fork = Session.restore(model, snapshot)
            rest = prose[boundary : end - distance] + trial.lines[distance] + prose[end - distance :]
            chunks = [model.detokenize(rest[i : i + chunk]) for i in range(0, len(rest), chunk)]
            for text in chunks:
                fork.append_text(text)
            stream = Stream(texts + chunks, [trial.facts[distance]], boundary + len(rest))
            streamed[distance] = (fork.snapshot(), stream, opening)
            fork.release()
    session.release()
    return streamed


def whereabouts(session: Session, places: range) -> dict[str, float]:
    """Where a fact's tokens (at stream `places`) are now, as shares over every layer, KV head and
    token of it: held, borrowed, host, dropped (WHERE)."""
    if not places:
        return dict.fromkeys(WHERE, float("nan"))
    cache, host = session.cache, session.cache.host
    wanted = torch.arange(places.start, places.stop)
    counts = dict.fromkeys(WHERE, 0)
    for layer in range(cache.num_layers):
        same = cache.order[layer][:, :, None] == wanted  # (kv_heads, n, k)
        on = same.any(1)  # (kv_heads, k)
        borrowed = torch.zeros_like(on)
        lent = cache.loan.borrowed.get(layer)  # (kv_heads, width): the tokens after them came later
        if lent is not None:
            borrowed = (same[:, : lent.shape[1]] & lent[:, :, None]).any(1)
        stored = torch.zeros_like(on)
        if host is not None and host.present is not None:
            slots = torch.tensor([host.slot_of.get(int(p) // host.page_tokens, -1) for p in wanted])
            found = slots >= 0
            if found.any():
                stored[:, found] = host.present[layer][:, slots[found], wanted[found] % host.page_tokens].cpu()
        counts["borrowed"] += int(borrowed.sum())
        counts["held"] += int((on & ~borrowed).sum())
        counts["host"] += int((~on & stored).sum())
        counts["dropped"] += int((~on & ~stored).sum())
    total = sum(counts.values())
    return {name: count / total for name, count in counts.items()}


def ask_fork(model, snapshot: bytes, stream: Stream, opening: int, recall: bool, answer_tokens: int,
             pool: KVPool | None) -> dict:
    """The stream's one question, from a fresh copy of the streamed session (without recall: it
    borrows nothing), and where its fact was when the answer began."""
    session = Session.restore(model, snapshot, pool)
    if not recall:
        session.config = replace(session.config, retrieval_tokens=0)
    places = fact_places(model, stream, opening)[0]
    result = asked(session, stream.facts[0], answer_tokens, places=places, where=whereabouts)
    session.release()
    result["distance_tokens"] = stream.tokens + opening - places.stop if places else float("nan")
    return result


def run(model, prose: list[int], opts) -> None:
    """Every policy and budget at every distance (bench.recall's arguments: `opts`)."""
    distances = sorted(opts.distances)
    started = time.monotonic()
    policies = ([] if opts.no_full else ["full"]) + [p for p in opts.policy_list if p != "full"]
    for budget in opts.budget_list:
        length = int(opts.ratio_list[0] * budget)
        if length <= max(distances):
            raise SystemExit(f"a stream of {length} tokens has no room for a fact {max(distances)} tokens before its end")
        peak = peak_cache_tokens(budget, SessionConfig(budget_tokens=budget, recall=True).borrowed_tokens)
        pool = KVPool(model.num_layers, model.kv_heads, model.head_dim, -(-peak // POOL_PAGE_TOKENS), POOL_PAGE_TOKENS,
                      model.dtype, model.device)
        right: dict[str, dict[int, int]] = {}
        for policy in policies:
            config = config_of(policy, budget, peak, opts)
            asks = (True, False) if config.recall and policy != DEFAULT else (config.recall,)
            results = {(recall, d): [] for recall in asks for d in distances}
            for seed in range(opts.trials):
                trial = draw(model, prose, length, distances, seed)
                for distance, (snapshot, stream, opening) in stream_forks(model, config, trial, opts.chunk).items():
                    for recall in asks:
                        result = ask_fork(model, snapshot, stream, opening, recall, opts.answer_tokens,
                                          None if policy == "full" else pool)
                        results[(recall, distance)].append(result)
                        if opts.verbose:
                            emit(run=policy, recall=recall, distance=distance, trial=seed, question=stream.facts[0].question,
                                 expected=stream.facts[0].number, answer=result["answer"], right=result["right"],
                                 **{k: round(result[k], 3) for k in WHERE})
            for (recall, distance), cell in results.items():
                label = f"{policy}+recall" if recall else policy
                right.setdefault(label, {})[distance] = sum(r["right"] for r in cell)
                mean = lambda key: round(float(np.nanmean([r[key] for r in cell])), 3)  # noqa: E731
                emit(policy=policy, recall=recall, budget=None if policy == "full" else budget, ratio=opts.ratio_list[0],
                     distance=distance, distance_tokens=mean("distance_tokens"), questions=len(cell),
                     right=right[label][distance], wrong_fact=sum(r["wrong_fact"] for r in cell),
                     **{k: mean(k) for k in WHERE}, ttft_ms=mean("ttft_ms"))
        for distance in distances if "full" in right else ():
            reference = right["full"][distance]
            cells = {label: by[distance] for label, by in right.items() if label != "full"}
            emit(budget=budget, distance=distance, questions=opts.trials, full=reference, vs_full=cells,
                 behind=sorted(label for label, n in cells.items() if n < reference - 1))
    emit(event="done", s=round(time.monotonic() - started, 1))
