"""Inference: vision encoder, visual tokens and a KV cache per session. No I/O, no servers."""

from engine.model import BUILTIN_MODELS, UnknownModelError, VisionLanguageModel, load_model
from engine.session import POLICIES, Session, SessionConfig, SessionStats

__all__ = [
    "BUILTIN_MODELS",
    "POLICIES",
    "Session",
    "SessionConfig",
    "SessionStats",
    "UnknownModelError",
    "VisionLanguageModel",
    "load_model",
]
