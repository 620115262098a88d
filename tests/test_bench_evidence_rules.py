"""bench.evidence_rules: an answer's recorded contrast, rebuilt from its JSON line, ranks its
times as the answer did, under the rule now and under the others scored beside it."""

import json
from types import SimpleNamespace

import torch

from bench.evidence_rules import RULES, _contrast_of, _rebuilt
from engine.evidence import Contrast, Evidence, FrameAttention

TIMES = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0])
HELD = torch.tensor([10.0, 10.0, 5.0, 10.0, 10.0])
PROBED = FrameAttention(TIMES, torch.tensor([[2.0, 1.0, 1.0, 1.0, 2.0], [2.0, 1.0, 1.0, 1.0, 6.0]]), HELD)  # its question, its answer
QUESTION = FrameAttention(TIMES, torch.tensor([[2.0, 1.0, 1.6, 1.0, 2.0]]), HELD)


def test_a_recorded_contrast_ranks_as_the_answer_did_under_every_rule():
    contrast = Contrast()
    contrast.probe(PROBED, answer_queries=1)
    contrast.add(QUESTION)
    contrast.add(FrameAttention(TIMES, torch.tensor([[2.0, 1.0, 1.0, 1.0, 3.5], [2.0, 1.2, 1.0, 1.0, 3.0]]), HELD), answer=True)
    line = json.loads(json.dumps(_contrast_of(SimpleNamespace(contrast=contrast))))
    rebuilt = _rebuilt(line)
    assert rebuilt.top(3) == contrast.top(3) == [Evidence(2.0, 1.0)]
    for weight, margin, _ in RULES.values():
        assert rebuilt.top(3, weight, margin) == contrast.top(3, weight, margin)
    assert [e.time_s for e in rebuilt.top(3, *RULES["probe question alone (before)"][:2])] == [4.0]  # the newest, as before
    question = Contrast()  # the question's queries alone
    question.probe(PROBED, answer_queries=1)
    question.add(QUESTION)
    assert _rebuilt(line, answer=False).top(3) == question.top(3) == [Evidence(2.0, 1.0)]
