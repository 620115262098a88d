"""What a session's `pin_turns` pins on this worker's model, advertised in its registry entry so
that the gateway refuses a session whose pins cannot fit (SessionOptions.check_pins) rather
than create one its worker cannot open."""

from dataclasses import dataclass

from engine import DEFAULT_SYSTEM_PROMPT, Model, turn_marker_tokens


@dataclass(frozen=True)
class PinCosts:
    opening_tokens: int  # the opening (system prompt and its markers), with the model's default system prompt
    turn_marker_tokens: int  # the markers closing one question and its answer, pinned for each turn

    @classmethod
    def of(cls, model: Model) -> "PinCosts":
        """The counts the engine's session takes (engine/session_state.py, `SessionState.opening`)."""
        return cls(
            opening_tokens=len(model.tokenize(model.chat.open(DEFAULT_SYSTEM_PROMPT))),
            turn_marker_tokens=turn_marker_tokens(model),
        )
