"""When a held session's watches fall due, and how many frames its ingest takes before the next check."""

import pytest

from streamvqa.protocol import Watch
from worker.watches import SessionWatches


def watch(every_s: float, created_video_s: float = 0.0) -> Watch:
    return Watch(id="w", condition="a red circle is visible", every_s=every_s, threshold=0.5,
                 created_video_s=created_video_s, created_at=0.0)


def test_the_first_check_falls_due_every_s_after_creation_then_every_s_after_the_last():
    watches = SessionWatches({"w": watch(2.0, created_video_s=5.0)})
    assert watches.due(6.9) is None
    assert watches.due(7.0).id == "w"
    watches.watches["w"], _ = watches.watches["w"].checked(7.0, 0.1)
    assert watches.due(8.0) is None and watches.due(9.0).id == "w"


@pytest.mark.parametrize(("created_video_s", "next_frame_s", "taken"), [
    (0.0, 0.0, 10),  # frames 0..9 s: the last at the check's time, 9 s
    (0.0, 6.0, 4),  # frames 6..9 s
    (0.0, 8.5, 1),  # the next frame is the first at or past it
    (0.0, 10.0, 9),  # the check at 9 s is due now and runs before these frames: the next is at 18 s
    (-7.0, 3.0, 9),  # one due at 2 s runs before them: the next is at 11 s
])
def test_an_ingest_takes_frames_up_to_the_next_check(created_video_s, next_frame_s, taken):
    watches = SessionWatches({"w": watch(9.0, created_video_s)})
    assert watches.frames_before_check(next_frame_s, fps=1.0, most=16) == taken
    assert watches.frames_before_check(next_frame_s, fps=1.0, most=8) == min(taken, 8)
    assert SessionWatches().frames_before_check(next_frame_s, fps=1.0, most=16) == 16
