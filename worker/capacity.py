"""What a worker has room for (cache and host memory, reserved by each session it holds) and
what it has done since it started: both go into its entry in the worker registry.

Memory is sized from a stated setting (KV_MEMORY, HOST_MEMORY: a share of the whole memory, or
bytes), never above what the worker holds for its sessions now plus FREE_SHARE of what is free:
read again each time it advertises (as sessions come and go, and at each heartbeat), so that it
neither takes memory others use nor keeps a small size it once found; and never above what its
pools hold. On a GPU the pools are taken at start, from the memory offered then; on a CPU they
are as large as stated, take RAM only as sessions use their pages and give it back as they end
(`engine/resident.py`), so what is offered can grow as memory is freed."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine import HostPool, KVPool, Model, SessionConfig, host_page_bytes, index_bytes_per_token, page_bytes
from streamvqa import protocol
from streamvqa.protocol import (
    QUEUE_TIME_BUCKETS_S, STEP_SESSIONS_BUCKETS, TIME_PER_OUTPUT_TOKEN_BUCKETS_S, Histogram, SessionRecord,
)
from worker.settings import MemorySize, WorkerSettings

log = logging.getLogger(__name__)

FREE_SHARE = 0.9  # of the memory free now, what sessions may take; the rest is left to others and to a step's activations
AUTO_KV_SHARE = {"cuda": 0.9, "cpu": 0.5}  # KV_MEMORY=auto: of the GPU's memory, or at most this of the RAM on a CPU
AUTO_HOST_SHARE = {"cuda": 0.5, "cpu": 0.25}  # HOST_MEMORY=auto: of the RAM (on a CPU the caches take RAM too)
# On a CPU, auto is at most this much of each (a laptop's RAM is the user's too): with the demo
# model, three sessions with the default options and recall in each (vLLM's CPU backend: 4 GiB of KV)
AUTO_CPU_BYTES = 2 * 2**30
MIN_DEFAULT_SESSIONS = 2  # fewer sessions with the default options than this in the cache memory: a warning
RELOG_CHANGE = 0.125  # the memory offered is logged again once it changed by this share


@dataclass(frozen=True)
class Reading:
    """One look at a memory: a device's, or the machine's RAM."""

    total_bytes: int
    free_bytes: int  # free to anyone now
    held_bytes: int  # what this process holds of it now (blocks it freed and keeps count: it reuses them)


ReadMemory = Callable[[torch.device], Reading]


def read_memory(device: torch.device) -> Reading:
    """A GPU's memory (torch's view, this process's hold being its allocator's pool), or the
    machine's RAM for a CPU (available RAM, this process's resident memory)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return Reading(total, free, torch.cuda.memory_reserved(device))
    page = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page
    free = os.sysconf("SC_AVPHYS_PAGES") * page
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():  # MemAvailable counts the page cache the kernel would give back
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    statm = Path("/proc/self/statm")
    held = int(statm.read_text().split()[1]) * page if statm.exists() else 0
    return Reading(total, free, held)


@dataclass
class Offer:
    """What a worker offers of one kind of memory: the setting, what it states, what is offered now."""

    setting: MemorySize
    target_bytes: int  # what the setting states
    stated: str  # how: "8GiB", "0.5 of 16,384 MiB", "auto: 0.9 of 81,920 MiB"
    offered_bytes: int = 0  # now: the target, or less when memory is short or its pool holds less
    free_bytes: int = 0  # free to anyone in that memory when last read
    pool_bytes: int | None = None  # what its pool holds, once made
    logged_bytes: int = -1  # the offer last logged

    @classmethod
    def of(cls, setting: MemorySize, whole_bytes: int, auto_share: float, auto_most_bytes: int | None = None) -> Offer:
        """`auto_most_bytes`: auto is at most this (None: the share alone)."""
        stated = setting.text
        target = setting.of(whole_bytes, auto_share)
        if setting.bytes is None:
            share = f"auto: {auto_share}" if setting.share is None else setting.text
            stated = f"{share} of {_mib(whole_bytes)}"
            if setting.share is None and auto_most_bytes is not None and auto_most_bytes < target:
                target, stated = auto_most_bytes, f"auto: {_mib(auto_most_bytes)}, at most {auto_share} of {_mib(whole_bytes)}"
        return cls(setting, target, stated)

    def offer(self, room_bytes: int, free_bytes: int) -> None:
        """Offer the target, or less: `room_bytes` (what memory is free for it now) or what its pool holds."""
        self.offered_bytes = max(0, min(self.target_bytes, room_bytes, self.pool_bytes if self.pool_bytes is not None else room_bytes))
        self.free_bytes = free_bytes

    def why(self) -> str:
        if self.offered_bytes < self.target_bytes:
            if self.pool_bytes is not None and self.offered_bytes == self.pool_bytes:
                return f"less than the {_mib(self.target_bytes)} stated ({self.stated}): its pool, made at start, holds that"
            return f"less than the {_mib(self.target_bytes)} stated ({self.stated}): {_mib(self.free_bytes)} free now"
        return f"as stated ({self.stated}), {_mib(self.free_bytes)} free now"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


class Capacity:
    """Each session reserves its peak cache (and its index of the host tier) on the device, and
    its host tier's bound in host memory; `refresh` sizes both memories again. The caches live in
    the worker's KV pool and the host tiers in its host pool (`make_pool`; pinned beside a GPU): a
    session is taken only when its bytes fit what is offered now and a run of each pool's pages
    is free for it."""

    def __init__(self, settings: WorkerSettings, model: Model, read: ReadMemory = read_memory) -> None:
        self.kv_bytes_per_token = model.kv_bytes_per_token
        self.dtype = str(model.dtype).removeprefix("torch.")
        self.context_tokens = min(model.context_tokens, settings.max_context_tokens or model.context_tokens)
        # keys and values as host pages keep them (bfloat16 for a float32 model), kinds, times, held and grids
        self.host_bytes_per_token = host_page_bytes(
            model.num_layers, model.kv_heads, model.head_dim, 1, model.dtype, model.position_axes == 3
        )
        self.index_bytes_per_host_token = index_bytes_per_token(
            model.num_layers, model.kv_heads, model.head_dim, SessionConfig.page_tokens, SessionConfig.page_keys
        )
        self.device, self.ram = model.device, torch.device("cpu")
        self.shared = self.device.type != "cuda"  # caches and host tiers take the same RAM
        self._read = read
        device, ram = read(self.device), read(self.ram)
        self._held_at_start = {"device": device.held_bytes, "ram": ram.held_bytes}  # the model is loaded by now
        kind = "cuda" if self.device.type == "cuda" else "cpu"
        kv, host = MemorySize.parse(settings.kv_memory), MemorySize.parse(settings.host_memory)
        most = AUTO_CPU_BYTES if kind == "cpu" else None
        self.kv = Offer.of(kv, device.total_bytes, AUTO_KV_SHARE[kind], most)
        self.host = Offer.of(host, ram.total_bytes, AUTO_HOST_SHARE[kind], most)
        self._ram_total_bytes = ram.total_bytes
        self.default_session_bytes = self._default_session_bytes()
        self.warning: str | None = None  # said in the registry while the cache memory is short
        self._warned_sessions = -1
        self._model = model
        self.pool: KVPool | None = None  # made by `make_pool`
        self.refresh([])

    def make_pool(self) -> None:
        """The worker's KV pool with its host pool beside it: on a GPU as many pages as the
        memory offered now holds (taken now), on a CPU as many as the setting states, at most
        the RAM (taken as sessions use them, given back as they end); then offers again."""
        model = self._model
        shape = (model.num_layers, model.kv_heads, model.head_dim)
        lazy = model.device.type == "cpu"
        positions_3d = model.position_axes == 3
        kv_bytes, host_bytes = (
            (min(offer.target_bytes, self._ram_total_bytes) for offer in (self.kv, self.host)) if lazy
            else (self.kv.offered_bytes, self.host.offered_bytes)
        )
        # whole pages, at least what is offered (sessions reserve whole pages of the KV pool)
        kv_page = page_bytes(*shape, protocol.POOL_PAGE_TOKENS, model.dtype)
        host_page = host_page_bytes(*shape, SessionConfig.page_tokens, model.dtype, positions_3d)
        host = HostPool.sized(
            -(-host_bytes // host_page) * host_page, *shape, SessionConfig.page_tokens, model.dtype, model.device, positions_3d
        )
        self.pool = KVPool.sized(
            -(-kv_bytes // kv_page) * kv_page, *shape, protocol.POOL_PAGE_TOKENS, model.dtype, model.device, host
        )
        self.kv.pool_bytes, self.host.pool_bytes = self.pool.nbytes, host.nbytes
        taken = "RAM taken as sessions use it, given back as they end" if lazy else "taken now"
        for name, pool in (("KV pool", self.pool), ("host pool", host)):
            log.info("%s: %d pages of %d tokens, %s (%s)", name, pool.total_pages, pool.page_tokens, _mib(pool.nbytes), taken)
        self.refresh([])

    @property
    def kv_memory_bytes(self) -> int:
        return self.kv.offered_bytes

    @property
    def host_memory_bytes(self) -> int:
        return self.host.offered_bytes

    def _default_session_bytes(self) -> int:
        """What a session with the default options reserves on the device (its budget, what a
        question borrows and its host tier's index); for a context too small for a bounded cache,
        the context's."""
        try:
            default = protocol.SessionOptions().within(self.context_tokens)
        except ValueError:
            return protocol.reserved_device_bytes(self.context_tokens, 0, self.kv_bytes_per_token, 0)
        return protocol.reserved_device_bytes(default.peak_tokens(self.context_tokens), default.host_tokens,
                                              self.kv_bytes_per_token, self.index_bytes_per_host_token)

    @property
    def default_sessions(self) -> int:
        """Sessions with the default options (a bounded policy's, with recall) the cache memory holds."""
        return self.kv.offered_bytes // self.default_session_bytes if self.default_session_bytes else 0

    def refresh(self, held: Iterable[SessionRecord]) -> None:
        """Size both memories again, from what is free now: each offers its target, or less: what
        this process took since it started serving (its sessions use it) plus FREE_SHARE of what
        is free, less what the other kind reserved where both take the same RAM; never more than
        its pool holds. Logs a change of RELOG_CHANGE or more; warns (and says in `warning`) when
        the cache memory holds fewer than MIN_DEFAULT_SESSIONS sessions with the default options."""
        held = list(held)
        kv_reserved = sum(self.device_bytes(record) for record in held)
        host_reserved = sum(record.host_budget_tokens for record in held) * self.host_bytes_per_token
        device = self._read(self.device)
        ram = device if self.shared else self._read(self.ram)
        for offer, reading, start, other in (
            (self.kv, device, self._held_at_start["device"], host_reserved if self.shared else 0),
            (self.host, ram, self._held_at_start["ram"], kv_reserved if self.shared else 0),
        ):
            offer.offer(max(0, reading.held_bytes - start) + int(reading.free_bytes * FREE_SHARE) - other, reading.free_bytes)
        for name, offer in (("caches", self.kv), ("host tiers", self.host)):
            if abs(offer.offered_bytes - offer.logged_bytes) > RELOG_CHANGE * max(offer.logged_bytes, 1):
                log.info("memory for the sessions' %s: %s, %s", name, _mib(offer.offered_bytes), offer.why())
                offer.logged_bytes = offer.offered_bytes
        short = self.default_sessions < MIN_DEFAULT_SESSIONS
        if short and (self.warning is None or self.default_sessions != self._warned_sessions):
            log.warning(
                "%s for caches (%s) holds %d session(s) with the default options (%s each): set KV_MEMORY, "
                "or free memory", _mib(self.kv.offered_bytes), self.kv.why(), self.default_sessions,
                _mib(self.default_session_bytes),
            )
        self._warned_sessions = self.default_sessions
        self.warning = (
            f"room for {self.default_sessions} session(s) with the default options in {_mib(self.kv.offered_bytes)} "
            f"for caches: {self.kv.why()}" if short else None
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
        """Whether the session's peak cache and its host tier fit in the memory not reserved yet,
        its cache in a run of the KV pool's free pages and its host tier in one of the host pool's."""
        host = None if self.pool is None or not record.recall else self.pool.host
        return (
            self.device_bytes(record) <= self.kv_free_bytes(held)
            and record.host_budget_tokens * self.host_bytes_per_token <= self.host_free_bytes(held)
            and (self.pool is None or self.pool.can_lease(self.peak_tokens(record)))
            and (host is None or host.can_lease(record.host_budget_tokens))
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
    prompt_tokens: int = 0  # questions' tokens prefilled, with their turns' markers
    generation_tokens: int = 0  # answer tokens generated
    queue_time_s: Histogram = field(default_factory=lambda: Histogram.empty(QUEUE_TIME_BUCKETS_S))
    time_per_output_token_s: Histogram = field(default_factory=lambda: Histogram.empty(TIME_PER_OUTPUT_TOKEN_BUCKETS_S))
    step_batch_sessions: Histogram = field(default_factory=lambda: Histogram.empty(STEP_SESSIONS_BUCKETS))
