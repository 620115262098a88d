"""A hosted session's media phases: the moves an upload and a live stream make, and no other."""

import pytest

from worker.hosted import MOVES, Hosted, Phase


def _moved(*phases: Phase) -> Hosted:
    hosted = Hosted(record=None, engine=None)  # the phase machine reads neither
    for phase in phases:
        hosted.move(phase)
    return hosted


def test_an_upload_goes_from_its_bytes_to_its_last_frame():
    assert _moved(Phase.UPLOADING, Phase.SAMPLING, Phase.INGESTED).phase is Phase.INGESTED
    assert _moved(Phase.UPLOADING, Phase.WAITING, Phase.UPLOADING).phase is Phase.UPLOADING  # aborted, then again


def test_a_live_stream_settles_and_comes_back():
    assert _moved(Phase.STREAMING, Phase.SETTLED, Phase.STREAMING, Phase.SETTLED).phase is Phase.SETTLED


@pytest.mark.parametrize(("path", "illegal"), [
    ((Phase.UPLOADING, Phase.SAMPLING), Phase.WAITING),  # a whole upload cannot be given up
    ((Phase.UPLOADING, Phase.SAMPLING, Phase.INGESTED), Phase.STREAMING),  # nor streamed into after
    ((Phase.STREAMING,), Phase.UPLOADING),
    ((Phase.WAITING,), Phase.SETTLED),
])
def test_other_moves_are_refused(path, illegal):
    hosted = _moved(*path)
    with pytest.raises(ValueError, match=f"from {hosted.phase} to {illegal}"):
        hosted.move(illegal)
    assert hosted.phase is path[-1]


def test_every_phase_may_fail_and_a_failure_is_final():
    for phase in Phase:
        if phase is not Phase.FAILED:
            assert Phase.FAILED in MOVES[phase]
    hosted = _moved(Phase.STREAMING)
    hosted.fail("not a readable video file")
    assert (hosted.failed, hosted.error) == (True, "not a readable video file")
    for phase in Phase:
        if phase is not Phase.FAILED:
            with pytest.raises(ValueError):
                hosted.move(phase)
