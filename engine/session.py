"""A streaming video question-answering session, as its user drives it: each call is an engine step.

`Session` is a session's state (engine/session_state.py: the cache, the stream's clock, the
frames held back, the last logits) with the calls that run it, each a step of one
(`engine/step.py`): its opening when made, `append_frames`, `append_text`, `check`, and `ask`,
whose `Answer` gives one piece per step as it is iterated. The worker runs many sessions' work
in one step instead; these calls are that step for one session. An answer left open is closed
by the step of its session's next frames or text; `ask` and `snapshot` run such a step first.
"""

from collections.abc import Iterator, Sequence

import numpy as np

from engine.answer import Answer as AnswerState
from engine.kv_pool import KVPool
from engine.model import Model
from engine.sampling import GREEDY, Sampling
from engine.session_config import SessionConfig
from engine.session_state import SessionState
from engine.step import Check, Frames, Text, TextScore, Work, step


def _alone(item: Work) -> object:
    """The result of a step of one, raised when it failed."""
    result = step([item])[0]
    if isinstance(result, Exception):
        raise result
    return result


class Answer(AnswerState, Iterator[str]):
    """An answer as its user reads it: one piece per `next` (a step of one), until it is over."""

    def __next__(self) -> str:
        piece = _alone(self)
        if piece is None:
            raise StopIteration
        return piece

    def end(self) -> None:
        """Stop now and close the answer's turn in the cache: a step of one, as a step closes
        the turns of the answers that said all. An answer whose question never ran ends with no change."""
        self.stop()
        _alone(self)  # closes its turn, or (over already) lets it go

    close = end


class Session(SessionState):
    def __init__(self, model: Model, config: SessionConfig | None = None, pool: KVPool | None = None) -> None:
        """A session with its opening run (the system prompt in the model's chat template); see
        `SessionState` for `pool`."""
        super().__init__(model, config, pool)
        try:
            _alone(Text(self, model.chat.open(self.config.system_prompt), opening=True))
        except BaseException:
            self.release()
            raise

    def append_frames(self, frames: Sequence[np.ndarray], times_s: Sequence[float]) -> None:
        """Append RGB uint8 frames (H, W, 3) taken at non-decreasing video times."""
        _alone(Frames(self, frames, times_s))

    def append_text(self, text: str) -> TextScore:
        """Append text to the user turn (a transcript, a document) and score how well the model
        predicted it: the summed negative log-likelihood of its tokens given everything before."""
        return _alone(Text(self, text))

    def check(self, condition: str) -> float:
        """p(yes) that `condition` holds of the video so far, from the model's yes/no logits
        against the cache as it is (a watch's check, `engine/check.py`), after which the cache is
        exactly as it was."""
        return _alone(Check(self, condition)).p_yes

    def ask(self, question: str, max_new_tokens: int = 64, sampling: Sampling = GREEDY) -> Answer:
        """Answer against the cache, greedily unless `sampling` says otherwise; the question and
        the tokens generated stay in it (those of a stop string too, though the text ends before it)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        if self.open_answer is not None or self.frames_waiting:  # the last answer's turn closed, and the question sees the frames held
            _alone(Frames(self, [], [], flush=True))
        prompt, closing, most = self.question(question, max_new_tokens)
        self.open_answer = Answer(self, self.model, prompt, closing, most, sampling)
        return self.open_answer

    def snapshot(self, host_pages: bool = True) -> bytes:
        """`SessionState.snapshot`, after a step of no frames, which closes an answer left open."""
        if self.open_answer is not None:
            _alone(Frames(self, [], []))
        return super().snapshot(host_pages)
