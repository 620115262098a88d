"""The memory report (GET /sessions/{id}/memory) is the engine's own `Memory` and `SessionStats`."""

import time

import pytest

from engine.memory_map import Memory, SessionStats, Span
from streamvqa.protocol import MemoryReport, MemorySpan


def test_a_memory_report_carries_the_engines_memory_and_counters():
    memory = Memory(
        policy="infmllm", budget_tokens=64, cache_tokens=70, frame_tokens=51.123456, text_tokens=18.876543,
        spans=[Span(0, 2, 40, 20.5, 8, 8.0, frame_host=12.25)], host_budget_tokens=256, host_tokens=30,
    )
    stats = SessionStats(
        frames=5, video_time_s=4.00049, tokens_seen=300, cache_tokens=70, cache_bytes=1 << 20, evictions=3,
        evicted_tokens=230, evict_ms=1.5, max_position=99, host_tokens=30, host_bytes=4096, retrievals=2,
    )
    report = MemoryReport.of(memory, stats, recall=True)
    assert report.model_dump(exclude={"updated_at"}) == {
        "policy": "infmllm", "budget_tokens": 64, "cache_tokens": 70, "frame_tokens": 51.12, "text_tokens": 18.88,
        "evictions": 3, "evicted_tokens": 230, "frames": 5, "video_time_s": 4.0,
        "spans": [MemorySpan(start_s=0, end_s=2, frame_seen=40, frame_held=20.5, text_seen=8, text_held=8.0,
                             frame_host=12.25, text_host=0.0).model_dump()],
        "recall": True, "host_budget_tokens": 256, "host_tokens": 30, "host_bytes": 4096, "retrievals": 2,
    }
    assert report.updated_at == pytest.approx(time.time(), abs=5)
