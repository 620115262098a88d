"""A chat completion's `messages`, as OpenAI's clients send them, read as one dialogue: the
opening (system messages), the earlier turns (a user's question and the assistant's answer),
the media (`video_url` and `image_url` parts) and the question (the user's text after the last
answer). What cannot be used is a 400 naming the message, never dropped. A media part's URL is
read once, by the one who loads it (`MediaRef.take_url`): a data URL can be tens of MB, and the
gateway holds it only until it is decoded."""

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from app.errors import ApiError

MAX_MESSAGES = 256
MAX_CONTENT_PARTS = 64
OPENING_ROLES = ("system", "developer")  # developer: OpenAI's newer name for a system message


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class MediaUrl(BaseModel):
    url: str = Field(description="A data URL (`data:video/mp4;base64,...`) or an http(s) URL the gateway fetches.")
    detail: str | None = Field(None, description="Accepted and not used (OpenAI's image detail).")


class VideoPart(BaseModel):
    type: Literal["video_url"]
    video_url: MediaUrl


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: MediaUrl


Part = Annotated[TextPart | VideoPart | ImagePart, Field(discriminator="type")]


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[Part], Field(max_length=MAX_CONTENT_PARTS)] | None = Field(
        None, description="Text, or parts: text, and in a user's message `video_url` or `image_url`."
    )
    name: str | None = Field(None, description="Accepted and not used.")

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content if isinstance(part, TextPart))
        return self.content or ""


@dataclass(frozen=True)
class MediaRef:
    """A media part: its kind, its URL (in the message), and where it is in the request (for errors)."""

    kind: Literal["video", "image"]
    source: MediaUrl
    param: str  # like messages.0.content.1.video_url.url

    def take_url(self) -> str:
        """The URL, taken out of its message: the message keeps none (so that a data URL, decoded,
        is not held twice for the rest of the request)."""
        url, self.source.url = self.source.url, ""
        return url


@dataclass(frozen=True)
class Turn:
    question: str
    answer: str


@dataclass(frozen=True)
class Dialogue:
    opening: str | None  # the system messages' text, None without one
    turns: tuple[Turn, ...]  # the earlier questions and answers, oldest first
    media: tuple[MediaRef, ...]
    question: str  # the user messages' text after the last answer


def read(messages: list[Message]) -> Dialogue:
    """The dialogue of `messages`; ApiError 400 (`param` the message at fault) when a message
    cannot be used: a tool message, a system message after the conversation began, an answer
    without a question or text, media outside a user's message, or a last message not the user's."""
    opening: list[str] = []
    turns: list[Turn] = []
    media: list[MediaRef] = []
    asked: list[str] = []  # the user's text since the last answer
    began = False
    for index, message in enumerate(messages):
        at = f"messages.{index}"
        if message.role == "tool":
            raise _unusable(at, "tool messages are not supported (no tools are offered)")
        if message.role != "user" and _media(message, at):
            raise _unusable(at, f"a {message.role} message cannot carry media: send the video or image in a user message")
        if message.role in OPENING_ROLES:
            if began:
                raise _unusable(at, "a system message must come before the conversation's first user message")
            if message.text.strip():
                opening.append(message.text)
            continue
        began = True
        if message.role == "assistant":
            if not asked:
                raise _unusable(at, "an assistant message must answer a user message before it")
            if message.content is None:
                raise _unusable(at, "an assistant message needs its text (tool calls are not supported)")
            turns.append(Turn("\n".join(asked), message.text))
            asked = []
            continue
        media += _media(message, at)
        if message.text.strip():
            asked.append(message.text)
    last = messages[-1]
    if last.role != "user":
        raise _unusable("messages", f"the last message is the question: its role must be 'user', not {last.role!r}")
    return Dialogue("\n".join(opening) or None, tuple(turns), tuple(media), "\n".join(asked))


def _media(message: Message, at: str) -> list[MediaRef]:
    if not isinstance(message.content, list):
        return []
    found = []
    for index, part in enumerate(message.content):
        if isinstance(part, VideoPart):
            found.append(MediaRef("video", part.video_url, f"{at}.content.{index}.video_url.url"))
        elif isinstance(part, ImagePart):
            found.append(MediaRef("image", part.image_url, f"{at}.content.{index}.image_url.url"))
    return found


def _unusable(param: str, message: str) -> ApiError:
    return ApiError(400, "invalid_request", message, param=param)
