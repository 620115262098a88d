"""bench.watch's quality part: streams whose condition is true over known seconds, a watch run
over them as the service runs it, and what is counted of its firings."""

from types import SimpleNamespace

import numpy as np
import pytest

from bench.watch import CheckRecord, Episode, Outcome, Stream, build_stream, watched
from engine import load_model


@pytest.fixture(scope="module")
def real() -> list:
    """Stand-ins for the sample videos' frames: two videos of flat frames."""
    return [SimpleNamespace(video=f"v{v}", pixels=np.full((48, 64, 3), 40 * v + i, np.uint8)) for v in range(2) for i in range(20)]


def test_a_stream_shows_its_condition_exactly_in_its_episodes_with_near_misses_between(real):
    stream = build_stream(real, 120, index=0, seed=1)
    assert stream.condition == "a red circle is visible"
    shown = {t for e in stream.episodes for t in range(e.start_s, e.end_s + 1)}
    assert {t for t, truth in enumerate(stream.truth) if truth == "true"} == shown
    assert len(stream.episodes) >= 2 and stream.episodes[0].start_s >= 8
    assert all(6 <= e.end_s - e.start_s + 1 <= 14 for e in stream.episodes)
    assert "near" in stream.truth and "scene" in stream.truth
    assert build_stream(real, 120, index=0, seed=1).truth == stream.truth  # seeded


def test_firings_are_counted_in_time_late_or_false():
    frame = np.zeros((1, 1, 3), np.uint8)
    stream = Stream("a red circle is visible", [frame] * 40, ["real"] * 40, [Episode(10, 15), Episode(30, 35)])
    fired_at = {12.0, 24.0, 36.0}  # the episode at 10 in time (its 2nd check), a false one, the one at 30 late (4th)
    checks = [CheckRecord(float(t), 0.9 if t in fired_at else 0.1, "real", t in fired_at, 0.05, 0.2) for t in range(2, 40, 2)]
    outcome = Outcome()
    outcome.add(stream, checks, every_s=2.0)
    line = outcome.line()
    assert (line["episodes"], line["in_time"], line["false_firings"], line["repeats"]) == (2, 1, 1, 0)
    assert line["delay_video_s_mean"] == 4.0  # 2 s and 6 s
    assert line["delay_wall_s_mean"] == 4.25  # each + its frame's 0.2 s and its check's 0.05 s
    assert line["false_per_10_min"] == 15.0  # 1 in 40 s


def test_a_watch_at_the_least_threshold_fires_once_at_its_first_check_and_one_at_1_never(real):
    model = load_model("tiny-random-llava", "cpu")
    stream = build_stream(real, 40, index=1, seed=1)
    least = watched(model, stream, "infmllm", 256, every_s=2.0, threshold=1e-6)
    assert [c.time_s for c in least] == [float(t) for t in range(2, 40, 2)]  # a check every 2 s of video
    assert [c.time_s for c in least if c.fired] == [2.0]  # then silent: p(yes) never went below it to re-arm
    never = watched(model, stream, "sliding", 256, every_s=2.0, threshold=1.0)
    assert not any(c.fired for c in never)
