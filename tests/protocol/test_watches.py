"""When a watch fires: at its first check at or above the threshold, once per episode, armed again
after two consecutive checks below it."""

import pytest

from streamvqa.protocol import Firing, Watch
from streamvqa.protocol.watches import MAX_FIRINGS_KEPT


def watch(threshold: float = 0.5, every_s: float = 2.0, created_video_s: float = 0.0) -> Watch:
    return Watch(id="w", condition="a red circle is visible", every_s=every_s, threshold=threshold,
                 created_video_s=created_video_s, created_at=0.0)


def firings(probabilities: list[float], threshold: float = 0.5) -> list[float]:
    """The video times at which a watch checked every 2 s from 2 s with these p(yes) fires."""
    state, fired = watch(threshold), []
    for at, probability in enumerate(probabilities, start=1):
        state, firing = state.checked(2.0 * at, probability)
        if firing is not None:
            fired.append(firing.time_s)
    assert [f.time_s for f in state.fired] == fired
    return fired


@pytest.mark.parametrize(("probabilities", "fired"), [
    ([0.1, 0.2, 0.9, 0.8, 0.95], [6.0]),  # becomes true once and stays: one firing
    ([0.9, 0.9, 0.9], [2.0]),  # true at its first check: fires there
    ([0.9, 0.1, 0.9, 0.9], [2.0]),  # one check below is a flicker, not a new episode
    ([0.9, 0.1, 0.2, 0.9, 0.1, 0.9], [2.0, 8.0]),  # two below arm it again; then one below does not
    ([0.5, 0.49, 0.49, 0.5], [2.0, 8.0]),  # at the threshold counts as true
    ([0.1, 0.2, 0.3], []),
])
def test_a_watch_fires_once_per_episode_and_is_armed_again_after_two_checks_below(probabilities, fired):
    assert firings(probabilities) == fired


def test_a_threshold_of_one_fires_only_at_certainty():
    assert firings([0.999999, 0.5, 1.0], threshold=1.0) == [6.0]


def test_a_check_records_its_time_and_probability_and_counts():
    after, firing = watch().checked(4.00001, 0.734567891)
    assert firing == Firing(time_s=4.0, probability=0.734568)
    assert (after.checks, after.checked_s, after.probability, after.armed, after.below) == (1, 4.0, 0.734568, False, 0)
    assert after.due_s() == 6.0


def test_a_watch_keeps_its_latest_firings():
    state = watch()
    for at in range(MAX_FIRINGS_KEPT + 5):  # true, then false twice: a firing every third check
        for offset, probability in enumerate((0.9, 0.1, 0.1)):
            state, _ = state.checked(at * 6.0 + offset * 2.0 + 2.0, probability)
    assert len(state.fired) == MAX_FIRINGS_KEPT
    assert (state.fired[0].time_s, state.fired[-1].time_s) == (32.0, 626.0)
