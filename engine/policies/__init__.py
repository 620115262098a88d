"""Eviction policies: one file each, registered here by name."""

from dataclasses import fields

from engine.policies.base import Observation, Policy, causal_attention
from engine.policies.full import Full
from engine.policies.h2o import H2O
from engine.policies.infmllm import InfMLLM
from engine.policies.knorm import KNorm
from engine.policies.sliding import Sliding
from engine.policies.snapkv import SnapKV
from engine.policies.tova import TOVA

POLICY_CLASSES: dict[str, type[Policy]] = {cls.name: cls for cls in (Full, Sliding, H2O, SnapKV, TOVA, KNorm, InfMLLM)}
POLICIES = tuple(POLICY_CLASSES)


def make_policy(name: str, **options: object) -> Policy:
    """The policy `name` with its options; a clear ValueError for unknown names or options."""
    try:
        cls = POLICY_CLASSES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(POLICIES)}") from None
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"policy {name!r} has no option {', '.join(unknown)}; it has {', '.join(sorted(known))}")
    return cls(**options)


__all__ = ["POLICIES", "POLICY_CLASSES", "Observation", "Policy", "make_policy"]
