"""The strings around turns of a chat model, read off its own chat template.

A session's token stream is one long conversation in which frames stream into an open user
turn:

    opening(system) [frames] question user_to_assistant answer assistant_to_user [frames] question ...

The three strings come from rendering the model's template with placeholder messages and
cutting at the placeholders, so any template (ChatML, Llama 3, LLaVA's "USER:/ASSISTANT:")
works without a table of formats.
"""

from collections.abc import Callable
from dataclasses import dataclass

_SYSTEM, _USER, _ASSISTANT, _NEXT = "\x00S\x00", "\x00U\x00", "\x00A\x00", "\x00V\x00"


@dataclass(frozen=True)
class ChatFormat:
    opening: str  # what precedes the first user content; "{system}" marks the system prompt
    user_to_assistant: str  # closes a user turn and opens the assistant's
    assistant_to_user: str  # closes the assistant's turn and opens a user turn

    def open(self, system_prompt: str) -> str:
        return self.opening.replace("{system}", system_prompt)


CHATML = ChatFormat(
    opening="<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n",
    user_to_assistant="<|im_end|>\n<|im_start|>assistant\n",
    assistant_to_user="<|im_end|>\n<|im_start|>user\n",
)


def from_template(render: Callable[[list[dict], bool], str]) -> ChatFormat:
    """Cut a template at placeholders. `render(messages, add_generation_prompt)` returns text;
    templates that refuse a system message get the system prompt at the start of the user turn."""
    turns = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}, {"role": "user", "content": _NEXT}]
    try:
        full = render([{"role": "system", "content": _SYSTEM}, *turns], True)
        with_system = _SYSTEM in full
    except Exception:
        with_system = False
    if not with_system:
        full = render(turns, True)
    if not all(mark in full for mark in (_USER, _ASSISTANT, _NEXT)):
        raise ValueError("the chat template does not render every message")
    opening, rest = full.split(_USER)
    _, rest = rest.split(_ASSISTANT)
    assistant_to_user, user_to_assistant = rest.split(_NEXT)  # the latter: the generation prompt
    opening = opening.replace(_SYSTEM, "{system}") if with_system else opening + "{system}\n"
    return ChatFormat(opening, user_to_assistant, assistant_to_user)
