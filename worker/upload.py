"""An uploaded file on its way to frames: its bytes spooled to disk as they arrive, then sampled
(decord, PyAV). Nothing is dropped; the worker goes as fast as it can. One `worker.ingest.Ingest`.

Its progress is the video time its frames in the cache cover over the file's duration, and the
time left the remaining steps' seconds, from the cost of its steps measured since its last byte
arrived (`worker.step_costs`): so an estimate follows a worker that other sessions slow down.
"""

import itertools
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from streamvqa.protocol import MediaEntry, MediaKind
from worker.decode import DecodeError, FileFrames, VideoInfo, probe, sample_file
from worker.ingest import Batch
from worker.step_costs import CacheFill, StepCosts


class UploadIngest:
    """Bytes arrive with `receive('data')`; after `receive('end')`, `next_frames` yields sampled
    frames until `finished`."""

    format = "upload"
    connection = ""  # an upload's media is not a stream socket's
    frames_block = True  # `next_frames` decodes the file
    backlog = 0  # frames are decoded when taken: none wait
    frames_queued = 0
    dropped = 0

    def __init__(
        self, spool_path: Path, fps: float, max_side: int, max_bytes: int, clock: Callable[[], float] = time.monotonic,
        bytes_received: int = 0,
    ) -> None:
        """`bytes_received`: the spool file's bytes that count, going on after a takeover (those
        written after them are cut off: they come again from the media stream)."""
        self.spool_path = spool_path
        self.fps = fps
        self.max_side = max_side
        self.max_bytes = max_bytes
        self.clock = clock  # monotonic seconds, which its steps are timed by
        self.bytes_received = bytes_received
        self.info: VideoInfo | None = None
        self.finished = False
        self._file: BinaryIO | None = spool_path.open("ab")
        self._file.truncate(bytes_received)
        self._sampled: FileFrames | None = None  # the file's frames, once it has ended
        self._frames = None  # those not yet taken (after a takeover, past the cache's last frame)
        self._costs: StepCosts | None = None  # its steps' seconds, from its end on

    @property
    def accepts_media(self) -> bool:
        return self._file is not None

    @property
    def expects_media(self) -> bool:
        """Its end has not come yet."""
        return self._file is not None

    @property
    def has_work(self) -> bool:
        return self._frames is not None and not self.finished

    def receive(self, entry: MediaEntry) -> None:
        if self._file is None:
            raise DecodeError("media arrived after the end of the upload")
        if entry.kind == MediaKind.DATA:
            data = entry.data
            self.bytes_received += len(data)
            if self.bytes_received > self.max_bytes:
                raise DecodeError(f"the upload exceeds the limit of {self.max_bytes} bytes")
            self._file.write(data)
            self._file.flush()  # acknowledged next: the bytes must be in the file, for another worker
        elif entry.kind == MediaKind.END:
            self._end()
        else:
            raise DecodeError(f"unexpected media entry {entry.kind!r} in an upload")

    def receipt(self, kind: str) -> dict[str, object]:
        """The received bytes are in the spool file: the record fields that go with the entry's
        acknowledgement, so that a worker taking over finds the file and the count in agreement."""
        fields: dict[str, object] = {"upload_bytes": self.bytes_received}
        if kind == MediaKind.END:
            fields |= {"upload_ended": True, "media_duration_s": self.info.duration_s if self.info else None}
        return fields

    @classmethod
    def resume(
        cls, spool: Path, bytes_received: int, ended: bool, fps: float, max_side: int, max_bytes: int, after_s: float | None
    ) -> "UploadIngest":
        """The upload another worker held, as the session's record has it (`upload_bytes`,
        `upload_ended`); frames up to `after_s` (already in the cache) are skipped. DecodeError
        when its spool file is gone or shorter than it was."""
        if not spool.is_file() or spool.stat().st_size < bytes_received:
            raise DecodeError("the upload was lost with the worker that held it; upload it again to a new session")
        ingest = cls(spool, fps, max_side, max_bytes, bytes_received=bytes_received)
        if ended:
            ingest._end(after_s)
        return ingest

    def _end(self, after_s: float | None = None) -> None:
        """The file is whole: its frames are sampled, those up to `after_s` (in the cache already) skipped."""
        self._file.close()
        self._file = None
        if self.bytes_received == 0:
            raise DecodeError("the upload is empty")
        self.info = probe(self.spool_path)
        self._sampled = sample_file(self.spool_path, self.fps, self.max_side, self.info)
        self._frames = self._sampled if after_s is None else (f for f in self._sampled if f.time_s > after_s)
        self._costs = StepCosts(self.clock(), after_s or 0.0)

    def next_frames(self, count: int) -> Batch:
        """Up to `count` more frames; blocking (decoding)."""
        if self._frames is None:
            return Batch([])
        frames = list(itertools.islice(self._frames, count))
        if len(frames) < count:
            self.finished = True
        return Batch(frames)

    def estimate(self, covered_s: float, cache: CacheFill, known_full_step_s: float | None) -> tuple[float | None, float | None]:
        """After a step: (share of the video in the cache, 0 to 1; seconds left) once the cache's
        frames cover `covered_s` of video and it stands at `cache`; `known_full_step_s`: what a
        step at a full cache took the worker in an earlier upload like this one, where it knows.
        None for what is not known yet (a file that states no duration, no step measured)."""
        duration_s = self.info.duration_s if self.info else None
        if not duration_s or self._costs is None:
            return None, None
        covered_s = min(covered_s, duration_s)
        self._costs.observe(self.clock(), covered_s, cache)
        left_s = self._costs.seconds_left(duration_s - covered_s, known_full_step_s)
        return round(covered_s / duration_s, 4), None if left_s is None else round(left_s, 1)

    @property
    def full_step_s(self) -> float | None:
        """What a step at a full cache takes this upload, once measured (for the worker to keep)."""
        return self._costs.full_step_s if self._costs is not None else None

    def cut_short(self) -> tuple[float, float | None] | None:
        """Once every frame is taken, for a file cut part-way (its frames end well before the
        duration its container states, or its container shows it ends part-way): (where its
        frames end, the duration it states, None where it states none), in s; else None."""
        sampled = self._sampled
        if not self.finished or sampled is None or not sampled.cut_short:
            return None
        info = sampled.info
        return sampled.end_s, None if info.ends_part_way else info.duration_s

    def take_errors(self) -> list[tuple[str, str, str]]:
        return []  # an upload's errors end it: raised as DecodeError

    def hold(self, answering: bool) -> None:
        pass  # nothing of a file is late

    def state(self) -> None:
        return None  # its progress is in the session's record (`upload_bytes`, `upload_ended`)

    def close(self, delete: bool = True) -> None:
        """Release the spool file, and delete it unless another worker goes on with it; safe to
        call twice."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._frames is not None:
            self._frames.close()
            self._sampled.close()
            self._frames = self._sampled = None
        if delete:
            self.spool_path.unlink(missing_ok=True)
