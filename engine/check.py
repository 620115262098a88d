"""A check: a yes/no condition scored against a session's cache as it is now, which it leaves as it was.

A watch's condition goes in the model's own yes/no prompt, in the open user turn where the frames
stream, and opens the assistant's turn (`engine/chat.py`):

    ... [12.0s]<frame tokens>\\n Is this true of the video now: {condition}? Answer yes or no.<user_to_assistant>

It runs read only (`runner.Prompt.keep` False, `engine/step.py`'s `Check`): nothing of it is
stored, observed, counted or borrowed, and the next frame takes the position it would have taken.
p(yes) is read from the logits after its last token: the softmax over two classes, each the
log-sum-exp of the logits of its spellings (`answer_ids`). docs/engine.md, "Watches: checks".
"""

from dataclasses import dataclass
from functools import lru_cache

import torch
from transformers import PreTrainedTokenizerBase

PROMPT = "Is this true of the video now: {condition}? Answer yes or no."
YES = ("yes", "Yes", "YES")  # each also after a space
NO = ("no", "No", "NO")


@dataclass(frozen=True)
class AnswerIds:
    """The token ids that begin a "yes" and those that begin a "no", none in both."""

    yes: tuple[int, ...]
    no: tuple[int, ...]


@lru_cache(maxsize=16)  # a process loads a few models; each tokenizer's ids are found once
def answer_ids(tokenizer: PreTrainedTokenizerBase) -> AnswerIds:
    """The spellings of yes and no (YES, NO; with and without a leading space) that the tokenizer
    makes one token each (SmolLM2: "yes", "Yes", " yes", " Yes"; "no", "No", " no", " No", "NO",
    " NO"); in a vocabulary that makes none of them one token (a character-level one), the first
    token of each spelling, less those that begin both a yes and a no (a space)."""

    def spellings(words: tuple[str, ...]) -> list[list[int]]:
        return [tokenizer(text, add_special_tokens=False)["input_ids"] for word in words for text in (word, " " + word)]

    yes, no = spellings(YES), spellings(NO)
    whole_yes, whole_no = {ids[0] for ids in yes if len(ids) == 1}, {ids[0] for ids in no if len(ids) == 1}
    if not (whole_yes and whole_no):
        whole_yes, whole_no = {ids[0] for ids in yes if ids}, {ids[0] for ids in no if ids}
        whole_yes, whole_no = whole_yes - whole_no, whole_no - whole_yes
    if not (whole_yes and whole_no):
        raise ValueError("the tokenizer has no token that begins a yes but not a no (or the other way round)")
    return AnswerIds(tuple(sorted(whole_yes)), tuple(sorted(whole_no)))


def prompt_text(condition: str) -> str:
    """The user text of a check of `condition` (its closing punctuation dropped: the prompt asks)."""
    condition = condition.strip().rstrip("?.!").strip()
    if not condition:
        raise ValueError("a check needs a condition")
    return PROMPT.format(condition=condition)


def p_yes(logits: torch.Tensor, ids: AnswerIds) -> float:
    """p(yes) in [0, 1] from the logits (vocab,) after a check's prompt: softmax over [yes, no],
    each the log-sum-exp of its ids' logits (the sum of their probabilities)."""
    logits = logits.float()
    yes = logits[list(ids.yes)].logsumexp(dim=0)
    no = logits[list(ids.no)].logsumexp(dim=0)
    return float(torch.sigmoid(yes - no))
