"""Facts planted in prose and asked after it: what bench.recall and bench.retention share.

A fact comes from one of several templates ("The blue box weighs 4817 grams.", "Maria's room
number is 2093.", ...) with subject words and a four-digit number drawn from a seeded generator;
its question repeats the subject ("How many grams does the blue box weigh?"). An answer is right
when it contains the number.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine import Session

SYSTEM = "You are a helpful assistant."

# (fact, question): {a} and {b} are subject words, {n} the number
TEMPLATES = [
    ("The secret number of {c} is {n}.", "What is the secret number of {c}?"),
    ("The {a} box weighs {n} grams.", "How many grams does the {a} box weigh?"),
    ("{b}'s phone number is {n}.", "What is {b}'s phone number?"),
    ("The pass code of the {a} door is {n}.", "What is the pass code of the {a} door?"),
    ("The {a} bag costs {n} dollars.", "How many dollars does the {a} bag cost?"),
    ("{b} lives at house number {n}.", "At which house number does {b} live?"),
]
WORDS = {
    "a": ["blue", "red", "green", "yellow", "purple", "orange", "silver", "golden", "black", "white"],
    "b": ["Maria", "Tomas", "Aisha", "Kenji", "Olga", "Pedro", "Ingrid", "Ravi", "Chloe", "Samuel"],
    "c": ["Oslo", "Lima", "Cairo", "Hanoi", "Quito", "Dublin", "Nairobi", "Lisbon", "Manila", "Zagreb"],
}


@dataclass(frozen=True)
class Fact:
    statement: str
    question: str
    number: str


@dataclass(frozen=True)
class Stream:
    chunks: list[str]
    facts: list[Fact]
    tokens: int


def fact_places(model, stream: Stream, opening_tokens: int) -> list[range]:
    """Each fact's stream places (those of its statement) as the session runs the chunks; an
    empty range where its text was cut so that it cannot be found."""
    ids = [t for text in stream.chunks for t in model.tokenize(text, user=True)]
    pieces = [model.detokenize([t]) for t in ids]
    ends = np.cumsum([len(piece) for piece in pieces])  # character after each token
    text = "".join(pieces)
    places = []
    for fact in stream.facts:
        at = text.find(fact.statement)
        if at < 0:
            places.append(range(0))
            continue
        first = int(np.searchsorted(ends, at, side="right"))
        last = int(np.searchsorted(ends, at + len(fact.statement), side="left"))
        places.append(range(opening_tokens + first, opening_tokens + last + 1))
    return places


def held_share(session: Session, places: range) -> float:
    """Of a fact's tokens, the share the cache holds now (borrowed ones too), over every layer
    and KV head."""
    if not places:
        return float("nan")
    wanted = torch.arange(places.start, places.stop)
    held = [torch.isin(order, wanted).sum() for order in session.cache.order]
    return float(sum(held)) / (len(held) * session.cache.kv_heads * len(wanted))


def make_facts(rng: np.random.Generator, count: int) -> list[Fact]:
    """`count` facts, cycling through the templates from a random one; subjects and numbers
    are never repeated within a stream."""
    words = {slot: list(rng.permutation(choices)) for slot, choices in WORDS.items()}
    numbers = rng.choice(np.arange(1000, 10_000), size=count, replace=False)
    first = int(rng.integers(len(TEMPLATES)))
    facts = []
    for i in range(count):
        statement, question = TEMPLATES[(first + i) % len(TEMPLATES)]
        fill = {slot: words[slot][i % len(words[slot])] for slot in words} | {"n": str(numbers[i])}
        facts.append(Fact(statement.format(**fill), question.format(**fill), str(numbers[i])))
    return facts


def asked(session: Session, fact: Fact, answer_tokens: int, others: list[Fact] = (), places: range = range(0),
          where: Callable[[Session, range], dict] | None = None) -> dict:
    """Ask about `fact`; `others`, the stream's other facts, tell a wrong fact's number; `places`,
    the fact's stream places, what share of it the cache holds when the answer begins (and
    `where(session, places)` then, if given)."""
    before = session.stats()
    started = time.perf_counter()
    answer = session.ask(f"\n\n{fact.question}", max_new_tokens=answer_tokens)
    pieces = [next(answer, "")]
    ttft_ms = 1000 * (time.perf_counter() - started)
    held = held_share(session, places)
    whereabouts = where(session, places) if where is not None else {}
    text = "".join(pieces + list(answer))
    after = session.stats()
    return {
        "right": fact.number in text,
        "wrong_fact": fact.number not in text and any(other.number in text for other in others if other != fact),
        "fact_held": held,
        "ttft_ms": ttft_ms,
        "retrieval_ms": after.retrieval_ms - before.retrieval_ms,
        "retrieved_tokens": after.retrieved_tokens - before.retrieved_tokens,
        "answer": text,
        **whereabouts,
    }
