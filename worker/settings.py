from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, field_validator

from streamvqa.settings import CommonSettings
from worker.scheduler import DEFAULT_STEP_TOKENS

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
MEMORY_FORMAT = "`auto`, a share of the whole (`0.5`, `50%`), or bytes (`6000000`, `512MiB`, `8GiB`, `2GB`)"
MIN_MEMORY_BYTES = 2**20  # less is a mistake (a share without its point, bytes without their unit)


@dataclass(frozen=True)
class MemorySize:
    """A stated amount of memory: `auto`, a share of the whole memory (0 < share <= 1), or bytes."""

    text: str
    share: float | None = None  # None: bytes, or auto (both None)
    bytes: int | None = None

    @classmethod
    def parse(cls, text: str | int | float) -> MemorySize:
        """ValueError unless `text` is `auto` (or 0, the old setting's auto), a share, or bytes."""
        text = str(text).strip()
        match = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*(%|[a-zA-Z]*)", text)
        if text.lower() == "auto" or text == "0":
            return cls("auto")
        if match is None or (match[2] != "%" and match[2].lower() not in UNITS):
            raise ValueError(f"{text!r} is not {MEMORY_FORMAT}")
        number, unit = float(match[1]), match[2].lower()
        if unit == "%":
            if not 0 < number <= 100:
                raise ValueError(f"{text!r}: a share must be above 0% and at most 100%")
            number, unit = number / 100, ""
        if unit == "" and number <= 1:
            if number <= 0:
                raise ValueError(f"{text!r}: a share must be above 0")
            return cls(text, share=number)
        if number * UNITS[unit] < MIN_MEMORY_BYTES:  # "2" or "1.5": a share misread, or a unit left out
            raise ValueError(f"{text!r} is under {MIN_MEMORY_BYTES} bytes: {MEMORY_FORMAT}")
        return cls(text, bytes=int(number * UNITS[unit]))

    def of(self, total_bytes: int, auto_share: float) -> int:
        """The bytes it states, of a whole of `total_bytes` (auto: `auto_share` of it)."""
        if self.bytes is not None:
            return self.bytes
        return int(total_bytes * (self.share if self.share is not None else auto_share))


class WorkerSettings(CommonSettings):
    worker_id: str = Field("", description="This worker's name in Redis; hostname-pid when empty.")
    torch_device: str = Field("auto", description="`auto` (CUDA when available), `cpu`, `cuda`, `cuda:1`, ...")
    model_cache_dir: Path = Field(
        Path.home() / ".cache" / "streamvqa" / "models",
        description="Built-in models converted from GGUF (SmolLM2), kept after their first load; one copy per "
        "model, replaced when its package or transformers changes.",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="What the model computes and caches in: `float32`, `bfloat16`, or `auto`: bfloat16 on a CUDA GPU, "
        "float32 on a CPU (on a CPU with AMX bfloat16 answers many sessions at once faster and one slower: "
        "docs/benchmarks.md). Logged at start and shown per worker in `GET /models`; a session moved between "
        "workers of different dtypes is converted.",
    )
    torch_threads: int = Field(0, ge=0, description="CPU threads for torch; 0 keeps torch's default.")
    max_sessions: int = Field(8, ge=1, description="Sessions this worker holds at once, at most.")
    max_context_tokens: int = Field(
        0, ge=0, description="The most tokens a session's cache may hold at once; 0: the model's context "
        "(`max_position_embeddings`). A lower value keeps sessions within what the model attends over well.",
    )
    kv_memory: str = Field(
        "auto", validation_alias=AliasChoices("kv_memory", "kv_memory_bytes"),
        description=f"Memory for the sessions' caches (each reserves its peak): {MEMORY_FORMAT}; a share is of the "
        "GPU's memory (of the machine's RAM on a CPU); auto: 0.9 of the GPU, 2 GiB on a CPU (at most half the RAM). "
        "Never more than what the worker holds for its sessions plus 90% of what is free, read again as sessions come "
        "and go, nor than its KV pool holds (taken at start on a GPU; on a CPU RAM is taken and given back as sessions come and go).",
    )
    host_memory: str = Field(
        "auto", validation_alias=AliasChoices("host_memory", "host_memory_bytes"),
        description=f"Host memory for the sessions' host tiers (recall; each reserves its bound): {MEMORY_FORMAT}; "
        "a share is of the machine's RAM; auto: 0.5 of it beside a GPU, 2 GiB on a CPU (at most a quarter of the RAM: "
        "the caches take RAM too). Capped by what is free and by its pool as KV_MEMORY is.",
    )
    lease_ttl_s: float = Field(15.0, ge=1.0, description="A session whose worker is silent this long is free.")
    idle_release_s: float = Field(
        120.0, ge=0, description="A session with no question, media or answer for this long leaves its worker "
        "(snapshotted) and comes back at its next question or media; 0 keeps sessions until they expire.",
    )
    spool_dir: Path = Field(
        Path(tempfile.gettempdir()) / "streamvqa-spool",
        description="Where uploads wait to be decoded; shared by every worker, an upload survives its worker.",
    )
    snapshot_interval_s: float = Field(
        10.0, gt=0, description="A session that changed is snapshotted at least this often (for crash recovery)."
    )
    snapshot_dir: Path = Field(
        Path(tempfile.gettempdir()) / "streamvqa-snapshots",
        description="Where snapshots too large for Redis go; shared by every worker.",
    )
    snapshot_redis_max_bytes: int = Field(
        32 * 1024 * 1024, ge=0,
        description="Snapshots up to this size are kept in Redis, larger ones in SNAPSHOT_DIR; a host tier larger than "
        "this is saved page by page in SNAPSHOT_DIR, each page once it changed.",
    )
    frames_per_step: int = Field(8, ge=1, le=256, description="Frames decoded and appended per turn of a session.")
    batch_sessions: int = Field(
        16, ge=1, le=256,
        description="Sessions whose next answer tokens (or frames) run in one forward; 1 runs one session at a time.",
    )
    step_tokens: int = Field(
        DEFAULT_STEP_TOKENS, ge=1,
        description="Tokens one engine step takes at most as it adds sessions' frames beside question starts and answer tokens "
        "(a question start counts as 1,024, a token as 1); the first session's frames go in any step without starts.",
    )
    max_frame_side: int = Field(768, ge=32, description="Decoded frames are scaled down to this longer side.")
    live_max_lag_s: float = Field(
        3.0, gt=0, description="A live frame this far behind real time is dropped (the newest is always kept)."
    )
    live_queue_frames: int = Field(
        16, ge=8, le=1024, description="Live frames waiting for the engine, per session (at least a turn's 8 reads)."
    )
    live_feed_bytes: int = Field(
        4 * 1024 * 1024, ge=64 * 1024, description="Live stream bytes waiting for the decoder, per session."
    )

    @field_validator("kv_memory", "host_memory", mode="before")
    @classmethod
    def _memory_size(cls, value: object) -> str:
        return MemorySize.parse(value).text  # checked once here; `MemorySize.parse` again where it is used
