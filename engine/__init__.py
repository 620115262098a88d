"""Inference: models, visual tokens, and a bounded KV cache per session. No I/O, no servers."""

from engine.model import Model, UnknownModelError
from engine.registry import BUILTIN_MODELS, load_model
from engine.policies import POLICIES
from engine.sampling import Sampling
from engine.memory_map import Memory, SessionStats, Span
from engine.answer import Answer, Evidence
from engine.session import ContextFull, Session, SessionConfig

__all__ = [
    "BUILTIN_MODELS",
    "POLICIES",
    "Answer",
    "ContextFull",
    "Evidence",
    "Memory",
    "Model",
    "Sampling",
    "Session",
    "SessionConfig",
    "SessionStats",
    "Span",
    "UnknownModelError",
    "load_model",
]
