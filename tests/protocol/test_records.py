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


def test_a_sessions_warnings_are_kept_once_each_the_latest_eight_and_survive_its_hash():
    from streamvqa.protocol import SessionRecord, to_hash

    record = SessionRecord(id="s", model="m", policy="infmllm", budget_tokens=256, fps=1.0)
    assert record.warn("truncated_media", "the file ends after 5.0 s of the 10.0 s it states")
    assert not record.warn("truncated_media", "the file ends after 5.0 s of the 10.0 s it states")  # said once
    for second in range(8):
        record.warn("context_full", f"the frame at {second}.0s needs 18 more tokens")
    assert [w.message[13:16] for w in record.warnings] == [f"{second}.0" for second in range(8)]  # the first went

    fields = to_hash(**record.model_dump())
    assert fields["warnings"].startswith('[{"code": "context_full", "message": "the frame at 0.0s')
    stored = SessionRecord.from_hash({k.encode(): v.encode() for k, v in fields.items()})
    assert stored.warnings == record.warnings
    fresh = SessionRecord(id="t", model="m", policy="infmllm", budget_tokens=256, fps=1.0)
    assert to_hash(**fresh.model_dump())["warnings"] == "[]"
