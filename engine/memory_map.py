"""What a session has seen and what its memory holds of it: counters and the memory map.

`Seen` counts the tokens appended per whole second of video and per kind; `memory_map` sets
them beside what the cache and the host tier hold now, in equal spans of whole seconds (what
the dashboard draws); `SessionStats` is a session's counters at one moment.
"""

import math
from dataclasses import dataclass

import torch

from engine.host_tier import HostTier
from engine.kv_buffers import outside_inference
from engine.kv_cache import FRAME, TEXT, KVCache

MAX_SECONDS = 7 * 24 * 3600  # seconds of video tracked; later seconds count as the last one


@dataclass(frozen=True)
class SessionStats:
    frames: int  # frames appended so far
    video_time_s: float  # video time of the last frame appended
    tokens_seen: int  # every token ever run through the model
    cache_tokens: int  # tokens each layer of the cache holds now
    cache_bytes: int  # bytes of keys and values held now
    evictions: int  # evictions so far
    evicted_tokens: int  # tokens evicted so far, per layer
    evict_ms: float  # time spent scoring, selecting and gathering
    max_position: int  # the highest position any token has had
    host_tokens: int = 0  # tokens each layer of the host tier holds now
    host_bytes: int = 0  # host memory of the host tier
    host_index_bytes: int = 0  # device memory of its representative keys and which places it holds
    retrievals: int = 0  # questions that borrowed from the host tier
    retrieved_tokens: int = 0  # tokens borrowed so far, per layer
    retrieved_pages: int = 0  # host pages borrowed from so far, in the first layer (by any of its KV heads)
    retrieval_ms: float = 0.0  # time spent scoring pages and bringing them in


@dataclass(frozen=True)
class Span:
    start_s: int  # [start_s, end_s) of video
    end_s: int
    frame_seen: int  # frame tokens appended from it
    frame_held: float  # of those, held now (mean over layers and KV heads)
    text_seen: int  # text tokens appended while it was the latest video time
    text_held: float
    frame_host: float = 0.0  # of the frame tokens, in the host tier now (mean over layers and KV heads)
    text_host: float = 0.0


@dataclass(frozen=True)
class Memory:
    policy: str
    budget_tokens: int | None  # None: the cache never evicts
    cache_tokens: int
    frame_tokens: float  # held, mean over layers and KV heads
    text_tokens: float
    spans: list[Span]  # the stream so far, in equal spans of whole seconds
    host_budget_tokens: int = 0  # 0: no host tier
    host_tokens: int = 0


class Seen:
    """Tokens appended per whole second of video, per kind (rows FRAME and TEXT): 16 bytes a
    second, grown as the video goes on, at most MAX_SECONDS."""

    def __init__(self, counts: torch.Tensor | None = None) -> None:
        """`counts` (2, seconds): what `counts()` gave, to go on from."""
        seconds = 0 if counts is None else counts.shape[1]
        self._counts = torch.zeros(2, max(64, seconds), dtype=torch.int64)
        if counts is not None:
            self._counts[:, :seconds] = counts
        self.seconds = seconds  # seconds of video seen so far

    def add(self, kind: int, time_s: float, tokens: int) -> None:
        second = min(int(time_s), MAX_SECONDS - 1)
        if second >= self._counts.shape[1]:
            with outside_inference():  # whichever step crosses the size, a lone or a batched one
                grown = torch.zeros(2, min(max(2 * self._counts.shape[1], second + 1), MAX_SECONDS), dtype=torch.int64)
                grown[:, : self._counts.shape[1]] = self._counts
            self._counts = grown
        self._counts[kind, second] += tokens
        self.seconds = max(self.seconds, second + 1)

    def counts(self) -> torch.Tensor:
        """(2, seconds) tokens appended per second, rows FRAME and TEXT."""
        return self._counts[:, : self.seconds]


def memory_map(seen: Seen, cache: KVCache, host_budget_tokens: int, max_spans: int) -> Memory:
    """What the cache (and its host tier) still hold of the stream so far, in at most
    `max_spans` equal spans of whole seconds, and of each kind."""
    seconds, host, policy = seen.seconds, cache.host, cache.policy
    heads = cache.num_layers * cache.kv_heads  # what is held is counted as a mean over the layers and KV heads
    width = max(1, math.ceil(seconds / max_spans))
    count = math.ceil(seconds / width)

    def per_span(values: torch.Tensor) -> list[float]:
        padded = torch.zeros(count * width, dtype=values.dtype)
        padded[:seconds] = values[:seconds]
        return padded.view(count, width).sum(dim=1).tolist()

    def per_second(times: torch.Tensor) -> list[float]:  # tokens from each second, over layers and KV heads
        return per_span(torch.bincount(times.floor().long().clamp(0, max(seconds - 1, 0)), minlength=seconds).float() / heads)

    counts = seen.counts()
    frame_seen, text_seen = per_span(counts[FRAME]), per_span(counts[TEXT])
    held = {kind: held_times(cache, kind) for kind in (FRAME, TEXT)}
    frame_held, text_held = per_second(held[FRAME]), per_second(held[TEXT])
    frame_host, text_host = per_second(host_times(host, FRAME)), per_second(host_times(host, TEXT))
    spans = [
        Span(i * width, min((i + 1) * width, seconds), int(frame_seen[i]), round(frame_held[i], 2), int(text_seen[i]),
             round(text_held[i], 2), round(frame_host[i], 2), round(text_host[i], 2))
        for i in range(count)
    ]
    frame_tokens, text_tokens = (held[kind].numel() / heads for kind in (FRAME, TEXT))
    return Memory(policy.name, policy.budget_tokens if policy.evicts else None, cache.tokens, frame_tokens, text_tokens, spans,
                  host_budget_tokens, host.tokens if host is not None else 0)


def held_times(cache: KVCache, kind: int) -> torch.Tensor:
    """The video times of the tokens of `kind` the cache holds, of every layer and KV head (a
    token held in two heads is there twice)."""
    return torch.cat([times[kinds == kind] for kinds, times in zip(cache.kinds, cache.times)])


def host_times(host: HostTier | None, kind: int) -> torch.Tensor:
    """The same for what the host tier holds."""
    if host is None or host.present is None:
        return torch.zeros(0)
    return host.times[host.present & (host.kinds == kind)]


def cache_stats(cache: KVCache, frames: int, video_time_s: float, tokens_seen: int) -> SessionStats:
    host = cache.host
    return SessionStats(
        frames=frames,
        video_time_s=video_time_s,
        tokens_seen=tokens_seen,
        cache_tokens=cache.tokens,
        cache_bytes=cache.nbytes,
        evictions=cache.evictions,
        evicted_tokens=cache.evicted_tokens,
        evict_ms=round(cache.evict_s * 1000, 3),
        max_position=cache.max_position,
        host_tokens=host.tokens if host else 0,
        host_bytes=host.nbytes if host else 0,
        host_index_bytes=host.device_bytes if host else 0,
        retrievals=cache.loan.retrievals,
        retrieved_tokens=cache.loan.retrieved_tokens,
        retrieved_pages=cache.loan.retrieved_pages,
        retrieval_ms=round(cache.loan.retrieve_s * 1000, 3),
    )
