import tempfile
from pathlib import Path

from pydantic import Field

from streamvqa.settings import CommonSettings


class WorkerSettings(CommonSettings):
    worker_id: str = Field("", description="This worker's name in Redis; hostname-pid when empty.")
    torch_device: str = Field("auto", description="`auto` (CUDA when available), `cpu`, `cuda`, `cuda:1`, ...")
    model_cache_dir: Path = Field(
        Path.home() / ".cache" / "streamvqa" / "models",
        description="Built-in models converted from GGUF (SmolLM2), kept after their first load; one copy per "
        "model, replaced when its package or transformers changes.",
    )
    torch_threads: int = Field(0, ge=0, description="CPU threads for torch; 0 keeps torch's default.")
    max_sessions: int = Field(8, ge=1, description="Sessions this worker holds at once, at most.")
    max_context_tokens: int = Field(
        0, ge=0, description="The most tokens a session's cache may hold at once; 0: the model's context "
        "(`max_position_embeddings`). A lower value keeps sessions within what the model attends over well.",
    )
    kv_memory_bytes: int = Field(
        0, ge=0, description="Memory for the sessions' caches (each reserves its peak); 0: 90% of the GPU's "
        "free memory once the model is loaded, or half the available RAM on a CPU.",
    )
    host_memory_bytes: int = Field(
        0, ge=0, description="Host memory for the sessions' host tiers (recall; each reserves its bound); 0: a "
        "quarter of the available RAM on a CPU, half of it beside a GPU.",
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
        32 * 1024 * 1024, ge=0, description="Snapshots up to this size are kept in Redis, larger ones in SNAPSHOT_DIR."
    )
    frames_per_step: int = Field(8, ge=1, le=256, description="Frames decoded and appended per turn of a session.")
    batch_sessions: int = Field(
        16, ge=1, le=256,
        description="Sessions whose next answer tokens (or frames) run in one forward; 1 runs one session at a time.",
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
