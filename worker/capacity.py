"""What a worker has room for (cache and host memory, reserved by each session it holds) and
what it has done since it started: both go into its entry in the worker registry."""

import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from engine import Model, SessionConfig
from engine.host_tier import index_bytes_per_token
from streamvqa import protocol
from streamvqa.protocol import SessionRecord
from worker.settings import WorkerSettings


def available_kv_memory(device: torch.device) -> int:
    """Memory the sessions' caches may use: 90% of the GPU's free memory (the model is loaded by
    now), or half the RAM available on a CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.9)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2


def available_host_memory(device: torch.device) -> int:
    """Host memory the sessions' host tiers may use: half the RAM available beside a GPU, a
    quarter on a CPU (where the caches take half)."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return available // 2 if device.type == "cuda" else available // 4


class Capacity:
    """Each session reserves its peak cache (and its index of the host tier) on the device, and
    its host tier's bound in host memory."""

    def __init__(self, settings: WorkerSettings, model: Model) -> None:
        self.kv_bytes_per_token = model.kv_bytes_per_token
        self.context_tokens = min(model.context_tokens, settings.max_context_tokens or model.context_tokens)
        self.kv_memory_bytes = settings.kv_memory_bytes or available_kv_memory(model.device)
        self.host_memory_bytes = settings.host_memory_bytes or available_host_memory(model.device)
        self.host_bytes_per_token = (
            model.kv_bytes_per_token + model.num_layers * model.kv_heads * protocol.HOST_TOKEN_OVERHEAD_BYTES
        )
        self.index_bytes_per_host_token = index_bytes_per_token(
            model.num_layers, model.kv_heads, model.head_dim, SessionConfig.page_tokens, SessionConfig.page_keys
        )

    def peak_tokens(self, record: SessionRecord) -> int:
        """The most tokens the session's cache holds at once."""
        return protocol.session_peak_tokens(record.policy, record.budget_tokens, record.retrieval_tokens, self.context_tokens)

    def device_bytes(self, record: SessionRecord) -> int:
        return protocol.reserved_device_bytes(
            self.peak_tokens(record), record.host_budget_tokens, self.kv_bytes_per_token, self.index_bytes_per_host_token
        )

    def kv_free_bytes(self, held: Iterable[SessionRecord]) -> int:
        return max(0, self.kv_memory_bytes - sum(self.device_bytes(record) for record in held))

    def host_free_bytes(self, held: Iterable[SessionRecord]) -> int:
        reserved = sum(record.host_budget_tokens for record in held) * self.host_bytes_per_token
        return max(0, self.host_memory_bytes - reserved)

    def fits(self, record: SessionRecord, held: list[SessionRecord]) -> bool:
        """Whether the session's peak cache and its host tier fit in the memory not reserved yet."""
        return (
            self.device_bytes(record) <= self.kv_free_bytes(held)
            and record.host_budget_tokens * self.host_bytes_per_token <= self.host_free_bytes(held)
        )


@dataclass
class Counters:
    """Since the worker started (GET /metrics)."""

    frames_ingested: int = 0
    evictions: int = 0
    answers: int = 0
    retrieved_tokens: int = 0  # brought back from host tiers for questions, per layer
    retrieved_pages: int = 0
    retrieval_ms: float = 0.0
    steps: int = 0  # engine steps: of questions starting, of answers, of frames
    step_sessions: int = 0  # sessions those steps ran: step_sessions / steps is the mean batch
