"""The session states and the changes between them that the protocol allows."""

import pytest

from streamvqa.protocol import TRANSITIONS, SessionState, check_transition

S = SessionState


def test_every_state_has_its_row_and_error_is_final():
    assert set(TRANSITIONS) == set(SessionState)
    assert TRANSITIONS[S.ERROR] == frozenset()


def test_a_session_may_fail_from_every_state():
    for state in SessionState:
        check_transition(state, S.ERROR)


@pytest.mark.parametrize(
    ("old", "new"),
    [(S.PENDING, S.READY), (S.PENDING, S.INGESTING), (S.READY, S.INGESTING), (S.INGESTING, S.INGESTED),
     (S.INGESTING, S.READY), (S.INGESTING, S.PENDING), (S.INGESTED, S.INGESTING), (S.READY, S.READY)],
)
def test_the_changes_the_gateway_and_worker_make_are_legal(old, new):
    check_transition(old, new)


@pytest.mark.parametrize(
    ("old", "new"),
    [(S.ERROR, S.READY), (S.ERROR, S.INGESTING), (S.INGESTED, S.PENDING), (S.READY, S.PENDING), (S.PENDING, S.INGESTED)],
)
def test_other_changes_are_refused(old, new):
    with pytest.raises(ValueError):
        check_transition(old, new)
