"""An answer in progress, as state: what it has said, the token it runs next, why it stopped.

Its `Phase` only moves forward, each move an explicit call (`stop` stops it from any phase; a
step then closes its turn). An engine step (`engine/step.py`) runs the prompts of many answers,
and frames, in one forward and calls these; it imports nothing that runs (the answer a user
iterates is `engine/session.py`'s). It changes only itself: the step hands it what ran and
does to the cache what follows (reserve, pin, evict, give back). An answer left open is stopped
and closed by the step of its session's next frames or text (`SessionState.open_answer`).
"""

from enum import Enum, auto
from typing import TYPE_CHECKING

import torch

from engine.evidence import Contrast, Evidence, FrameAttention
from engine.sampling import GARBAGE_CHARS, Repeats, Sampling, clean_end

if TYPE_CHECKING:
    from engine.model import Model
    from engine.session_state import Part, SessionState


class Phase(Enum):
    ASKED = auto()  # its question's prompt not yet given out (`begin` gives it)
    BEGUN = auto()  # the prompt given out, not yet run (`question_ran`, or `failed`)
    ANSWERING = auto()  # tokens are chosen (`accept`) and run (`unfed`, `fed`), one a step (`advance`)
    STOPPING = auto()  # the last token is chosen: the text held back and the turn's closing remain
    OVER = auto()  # its turn closed in the cache (`closing`, `closed`), or its question never ran


class Answer:
    """One piece of text per generated token; after the last, `tokens` and `evidence` are final.

    A piece ends at the text's last letter or digit, or before what may begin a stop string: what
    follows (spaces, punctuation, a partial character) waits for the next, so a piece may be
    empty. The last token's piece holds nothing back; when the model ends its turn, what was held
    back is one more piece. When the answer ends for garbage (`engine/sampling.py`), it is left out.
    """

    def __init__(self, session: "SessionState", model: "Model", prompt: list["Part"], closing: "Part", max_new_tokens: int,
                 sampling: Sampling) -> None:
        self.session = session  # whose answer it is: the step's to read, never the answer's
        self._model = model  # its stop ids and detokenizer
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self._random = sampling.generator()
        self._repeats = Repeats()  # its token 3-grams, none to come a 4th time
        self.phase = Phase.ASKED
        self._prompt: list[Part] | None = prompt  # the question and the markers closing it, until begun
        self._closing = closing  # the markers closing the answer's turn
        self._fed: torch.Tensor | None = None  # (vocab,) logits after the last token run, not yet accepted
        self._ids: list[int] = []
        self._emitted = ""  # the text given out so far
        self._rest = ""  # text held back, given out if the model ends its turn
        self._unfed: list[int] = []  # the token chosen last, not yet run through the model
        self._contrast = Contrast()  # what the question's queries paid each frame time, then the answer's excess
        self.unweighed = 0  # the answer's tokens run since its evidence was last read (`weighed`)
        self.finish_reason = "stop"  # `stop`: the model ended its turn, a stop string came, or garbage;
        # `length`: it reached `max_new_tokens`, or the model's context
        self.prompt_tokens = 0  # tokens the question added to the cache, with the markers of its turn
        self.borrowed = 0  # places the step reserved for what the question borrows from the host tier
        self.evidence: list[Evidence] = []  # once over
        self.recalled_s: list[int] = []  # whole seconds of video the answer borrowed, once over

    @property
    def tokens(self) -> int:
        return len(self._ids)

    @property
    def contrast(self) -> Contrast:
        """What its question and answer paid each frame time, and its probe's baseline."""
        return self._contrast

    # -- the steps -----------------------------------------------------------------------------

    def begin(self) -> list["Part"] | None:
        """The question's prompt (its words, the markers closing them), to be run next by a
        step; None once begun."""
        if self.phase is not Phase.ASKED:
            return None
        self.phase, prompt, self._prompt = Phase.BEGUN, self._prompt, None
        self.prompt_tokens = sum(part.tokens for part in prompt)
        return prompt

    def probed(self, answer_queries: int, attention: FrameAttention | None) -> None:
        """The probe ran before the question, read only: what it paid the frames (`attention`),
        its last `answer_queries` queries apart (its answer's), is the baseline of the answer's
        evidence (engine/evidence.py)."""
        self._contrast.probe(attention, answer_queries)

    def question_ran(self, attention: FrameAttention | None, logits: torch.Tensor) -> None:
        """The question's prompt ran: what its queries paid the frames (`attention`) is weighed
        against its probe's, and the answer begins from the `logits` (vocab,) after it."""
        self.phase, self._fed = Phase.ANSWERING, logits
        self._contrast.add(attention)

    def failed(self) -> None:
        """The question's prompt did not run: the answer is over, with no turn in the cache."""
        self._finish()

    def unfed(self) -> list[int] | None:
        """The token chosen last, to be run next; None when there is none to run."""
        if self.phase is not Phase.ANSWERING or not self._unfed:
            return None
        return self._unfed

    def fed(self, logits: torch.Tensor) -> None:
        """The token chosen last ran: the logits (vocab,) after it."""
        self._fed, self._unfed = logits, []
        self.unweighed += 1

    def advance(self) -> str | None:
        """After the step that ran its prompt (or with nothing to run): the next piece, or None
        once it has said all (the step then closes its turn: `closing`, `closed`)."""
        if self.phase is Phase.ANSWERING:
            piece = self.accept(self._fed)
            if piece is not None:
                return piece
        rest, self._rest = self._rest, ""
        return rest or None  # STOPPING: the text held back, once

    @property
    def over(self) -> bool:
        return self.phase is Phase.OVER

    def accept(self, logits: torch.Tensor) -> str | None:
        """The next token, chosen from `logits` (vocab,): its piece of text; None when the model
        ended its turn (no piece)."""
        self._fed = None
        if len(self._ids) >= self.max_new_tokens:
            self.phase, self.finish_reason = Phase.STOPPING, "length"
            return None
        token = self.sampling.choose(logits, self._random, self._repeats.banned(self._ids))
        if token in self._model.stop_ids:
            self.phase, self.finish_reason = Phase.STOPPING, "stop"
            return None
        self._ids.append(token)
        self._repeats.add(self._ids, any(c.isdigit() for c in self._model.detokenize([token])))
        self._unfed = [token]
        text = self._model.detokenize(self._ids)
        shown, stopped = self.sampling.cut(text)  # held back: what may begin a stop string
        clean = clean_end(shown)
        garbage = not stopped and len(shown) - clean >= GARBAGE_CHARS
        last = stopped or garbage or len(self._ids) >= self.max_new_tokens
        if not stopped:  # held back too: what follows the last letter or digit, but by the last piece; garbage never shown
            shown = shown[:clean] if garbage or not last else text
        piece = shown.rstrip("\ufffd")[len(self._emitted) :]  # never a partial character
        self._emitted += piece
        self._rest = "" if last else text[len(self._emitted) :].rstrip("\ufffd")  # given out if the model ends its turn next
        if last:
            self.phase, self.finish_reason = Phase.STOPPING, "stop" if stopped or garbage else "length"
        return piece

    def closing(self) -> tuple[list[int], "Part"] | None:
        """What closes its turn in the cache: the token chosen last, unless it ran, and the markers
        closing the answer; None when its question never ran (then there is no turn to close)."""
        if self.phase not in (Phase.ANSWERING, Phase.STOPPING):
            return None
        return self._unfed, self._closing

    def closed(self, evidence: list[Evidence], recalled_s: list[int]) -> None:
        """Its closing ran, and its evidence and the seconds it borrowed were read: it is over."""
        self.evidence, self.recalled_s = evidence, recalled_s
        self._finish()

    def stop(self) -> bool:
        """Stop now: nothing more is said. True when its turn is still to close in the cache (a
        step closes it, as it closes the turn of any answer that said all); else it is over (its
        question never ran, or it was over already)."""
        if self.phase is Phase.OVER:
            return False
        if self.phase not in (Phase.ANSWERING, Phase.STOPPING):
            self._finish()
            return False
        self.phase, self._fed, self._rest = Phase.STOPPING, None, ""
        return True

    def _finish(self) -> None:
        self.phase = Phase.OVER
        self._fed, self._unfed, self._rest = None, [], ""  # an answer over gives out nothing more

    def weighed(self, attention: FrameAttention | None) -> None:
        """What its tokens run since last weighed paid the frames, against its question's
        (engine/evidence.py)."""
        self._contrast.add(attention, answer=True)
        self.unweighed = 0
