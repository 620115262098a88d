"""An upload on its way from the media stream into frames: spooled to disk, then decoded."""

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from worker.decode import DecodeError, Frame, sample_file


class UploadIngest:
    """Bytes arrive with `write`; after `finish`, `next_frames` yields sampled frames until `exhausted`."""

    def __init__(self, spool_path: Path, fps: float, max_side: int, max_bytes: int) -> None:
        self.spool_path = spool_path
        self.fps = fps
        self.max_side = max_side
        self.max_bytes = max_bytes
        self.bytes_received = 0
        self.exhausted = False
        self._file: BinaryIO | None = spool_path.open("wb")
        self._frames: Iterator[Frame] | None = None

    @property
    def decoding(self) -> bool:
        return self._frames is not None and not self.exhausted

    def write(self, data: bytes) -> None:
        if self._file is None:
            raise DecodeError("media arrived after the end of the upload")
        self.bytes_received += len(data)
        if self.bytes_received > self.max_bytes:
            raise DecodeError(f"the upload exceeds the limit of {self.max_bytes} bytes")
        self._file.write(data)

    def finish(self) -> None:
        """All bytes are in; decoding may start."""
        if self._file is None:
            return
        self._file.close()
        self._file = None
        if self.bytes_received == 0:
            raise DecodeError("the upload is empty")
        self._frames = sample_file(self.spool_path, self.fps, self.max_side)

    def next_frames(self, count: int) -> list[Frame]:
        """Up to `count` more frames; blocking (decoding), so call it off the event loop."""
        if self._frames is None:
            return []
        frames = list(itertools.islice(self._frames, count))
        if len(frames) < count:
            self.exhausted = True
        return frames

    def close(self) -> None:
        """Release the spool file; safe to call twice."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._frames is not None:
            self._frames.close()  # type: ignore[attr-defined]
            self._frames = None
        self.spool_path.unlink(missing_ok=True)
