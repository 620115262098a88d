"""The options a client gives `POST /sessions` mean what the engine makes of them."""

from dataclasses import fields

import pytest

from engine import SessionConfig
from engine.policies import POLICY_CLASSES, make_policy
from engine.policies.base import DEFAULT_BUDGET_TOKENS, Policy
from streamvqa import protocol
from streamvqa.protocol import POLICY_KNOBS, SessionOptions


@pytest.mark.parametrize("budget", [256, 1000, 8192])
def test_the_recall_defaults_are_the_engine_s(budget):
    options = SessionOptions(policy="h2o", budget_tokens=budget, recall=True)
    engine = SessionConfig(policy="h2o", budget_tokens=budget, recall=True)
    assert (options.host_tokens, options.borrowed_tokens) == (engine.host_tokens, engine.borrowed_tokens)
    assert (options.host_tokens, options.borrowed_tokens) == (8 * budget, budget // 2)


def test_a_session_asked_for_with_no_options_recalls_what_it_evicts():
    """What was said just before the budget's span is evicted first; with recall a question still
    finds it (docs/benchmarks.md, "Retention"), so it is on unless a client turns it off."""
    assert SessionOptions().recall is True and SessionOptions().host_tokens == 8 * DEFAULT_BUDGET_TOKENS
    assert SessionOptions(policy="sliding", budget_tokens=512).host_tokens == 4096
    assert SessionOptions(recall=False).host_tokens == 0
    assert SessionOptions(policy="full").recall is False  # it evicts nothing
    assert SessionOptions().within(8192).budget_tokens == 3413  # with half of it borrowed: 3413 + 1706 + 3072 fit


def test_each_policy_takes_the_knobs_its_engine_class_has():
    assert POLICY_KNOBS["full"] == ()  # it keeps everything: the knobs it inherits do nothing
    for policy, knobs in POLICY_KNOBS.items():
        if policy != "full":
            assert set(knobs) == {f.name for f in fields(POLICY_CLASSES[policy])} - {"budget_tokens"}, policy


@pytest.mark.parametrize("policy", [policy for policy in POLICY_KNOBS if policy != "full"])
@pytest.mark.parametrize(
    ("knobs", "taken"),
    [({"sinks": 128}, False), ({"sinks": 127}, True), ({"recent": 252}, False), ({"recent": 251}, True)],
)
def test_the_gateway_refuses_the_budgets_the_engine_refuses(policy, knobs, taken):
    """With 256 tokens, a budget must exceed sinks + recent: the gateway counts the knobs left
    unset (sinks 4, recent 128 or, for h2o, half the budget) as the engine does."""
    def accepted(make) -> bool:
        try:
            make()
        except ValueError:
            return False
        return True

    assert accepted(lambda: SessionOptions(policy=policy, budget_tokens=256, policy_options=knobs)) == taken
    assert accepted(lambda: make_policy(policy, budget_tokens=256, **knobs)) == taken


def test_a_session_without_a_budget_gets_one_default_everywhere():
    """The gateway, the session's config and a bare policy agree on the budget nobody gave."""
    assert protocol.DEFAULT_BUDGET_TOKENS == SessionConfig().budget_tokens == Policy().budget_tokens == DEFAULT_BUDGET_TOKENS == 8192
    assert SessionOptions(policy="infmllm").budget == 8192
