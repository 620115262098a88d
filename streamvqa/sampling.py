"""Frame sampling by presentation time: the rule the worker applies to every video, and that a
client streaming `frames` can apply first so that each frame it sends is kept."""

import math

TIME_TOLERANCE_S = 1e-3  # frame times within this of a sampling point count as on it


class FrameSampler:
    """Keeps the first frame at or after each point of the grid 0, 1/fps, 2/fps, ...

    Frames that arrive when the next grid point is still ahead are skipped; a gap in the video
    skips the grid points inside it, so no frame is ever repeated and times only increase.
    """

    def __init__(self, fps: float) -> None:
        if not fps > 0:
            raise ValueError(f"fps must be positive, got {fps}")
        self.fps = fps
        self.next_s = 0.0  # the next grid point

    def keep(self, time_s: float) -> bool:
        if time_s + TIME_TOLERANCE_S < self.next_s:
            return False
        self.next_s = (math.floor((time_s + TIME_TOLERANCE_S) * self.fps) + 1) / self.fps
        return True
