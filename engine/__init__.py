"""Inference: models, visual tokens, and a bounded KV cache per session. No I/O, no servers."""

from engine.model import Model, UnknownModelError, resolve_device
from engine.registry import BUILTIN_MODELS, load_model
from engine.policies import POLICIES
from engine.sampling import Sampling
from engine.memory_map import Memory, SessionStats, Span
from engine.evidence import Evidence
from engine.session_config import DEFAULT_SYSTEM_PROMPT, SessionConfig, turn_marker_tokens
from engine.session_state import ContextFull
from engine.session import Answer, Session
from engine.step import Check, Checked, Frames, Result, Text, TextScore, step
from engine.kv_pool import KVPool, PoolFull, page_bytes
from engine.host_pool import GRID_BYTES, HostPool, host_page_bytes
from engine.host_tier import index_bytes_per_token
from engine.page_runs import PageRuns, Run
from engine.numerics import choose_dtype
from engine.resident import trim_heap

__all__ = [
    "BUILTIN_MODELS",
    "DEFAULT_SYSTEM_PROMPT",
    "GRID_BYTES",
    "POLICIES",
    "Answer",
    "Check",
    "Checked",
    "ContextFull",
    "Evidence",
    "Frames",
    "HostPool",
    "KVPool",
    "Memory",
    "Model",
    "PageRuns",
    "PoolFull",
    "Result",
    "Run",
    "Sampling",
    "Session",
    "SessionConfig",
    "SessionStats",
    "Span",
    "Text",
    "TextScore",
    "UnknownModelError",
    "choose_dtype",
    "host_page_bytes",
    "index_bytes_per_token",
    "load_model",
    "page_bytes",
    "resolve_device",
    "step",
    "trim_heap",
    "turn_marker_tokens",
]
