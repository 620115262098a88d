"""A session's state: one model, one bounded KV cache, one conversation.

The token stream the cache sees is one conversation in the model's chat format (`engine/chat.py`;
docs/engine.md, "The token stream"). Each group of `frames_per_prompt` frames is a prompt; so is
each question, and each answer with the markers that close its turn. The cache evicts down to
the policy's budget after every prompt (after a question only with `evict_on_question`; h2o
also after every generated token), so it never holds more than the budget plus one prompt plus
one answer.

With `recall`, what the cache evicts goes to a bounded host tier (`engine/host_tier.py`), and
each question borrows back up to `retrieval_tokens` of it for its answer: then the cache holds
at most the budget, the retrieval, the question and the answer, and between prompts exactly
what it would hold without recall.

This is state: an engine step (`engine/step.py`) asks it for prompts and gives it what ran; it
runs nothing itself. `engine/session.py`'s `Session` is the face that runs the steps. An answer
in progress is state of its own (`engine/answer.py`); a session has at most one open
(`open_answer`), whose turn a step closes before the session's frames or text enter the cache.
Its counters and memory map are `engine/memory_map.py`'s.
"""

import io
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Self

import numpy as np
import torch

from engine.kv_buffers import outside_inference
from engine.kv_cache import FRAME, TEXT, KVCache
from engine.kv_pool import KVPool, PoolFull
from engine.memory_map import Memory, Seen, SessionStats, cache_stats, memory_map
from engine.model import Model
from engine.session_config import SessionConfig, turn_marker_tokens

EVIDENCE_WINDOW = 32  # the last queries of an answer whose attention picks its evidence
SNAPSHOT_FORMAT = 3  # 3: host pages by stream place; 2: with stream order and the host tier; 1 and 2 are still read


class ContextFull(ValueError):
    """A prompt that would take the cache past the model's context: nothing of it was run."""

    def __init__(self, what: str, needed_tokens: int, cache_tokens: int, context_tokens: int, kept_tokens: int = 0) -> None:
        kept = f" ({kept_tokens} of it kept for questions)" if kept_tokens else ""
        super().__init__(
            f"{what} needs {needed_tokens} more tokens, but the cache holds {cache_tokens} of the model's "
            f"{context_tokens}-token context{kept}"
        )
        self.needed_tokens = needed_tokens
        self.cache_tokens = cache_tokens
        self.context_tokens = context_tokens


@dataclass(frozen=True)
class Part:
    """A run of tokens of one kind, from one moment of the video."""

    embeds: torch.Tensor  # (1, k, hidden)
    kind: int  # TEXT or FRAME
    time_s: float
    grid: tuple[int, int] | None = None  # with 3-D positions, a visual group's (rows, columns)
    deepstack: torch.Tensor | None = None  # (1, k, hidden * D) Qwen3-VL's deep-stack features of a visual group

    @property
    def tokens(self) -> int:
        return self.embeds.shape[1]


class SessionState:
    def __init__(self, model: Model, config: SessionConfig | None = None, pool: KVPool | None = None) -> None:
        """With `pool` (the worker's, of this model), the cache leases its slots there, for the
        most it holds at once (`peak_tokens`, or the context), and its host tier its pages in the
        pool's `host` pool when it has one, until `release()`; PoolFull when no run of pages is free.
        Its opening is not yet run (`Session` runs it)."""
        config = config or SessionConfig()
        self.model = model
        self.config = config
        self.policy = config.make_policy()
        self.context_tokens = min(model.context_tokens, config.context_tokens or model.context_tokens)
        most_tokens = min(config.peak_tokens or self.context_tokens, self.context_tokens)
        host = config.make_host_tier(None if pool is None else pool.host)
        try:
            lease = None if pool is None else pool.lease(most_tokens, owner=self)
        except PoolFull:
            if host is not None:
                host.release()  # now: a refused session takes nothing
            raise
        self.cache = KVCache(
            self.policy, model.rotary, model.num_layers, model.kv_heads, EVIDENCE_WINDOW, host, most_tokens=most_tokens, lease=lease,
            positions_3d=model.position_axes == 3,
        )
        # Frames waiting for the rest of their group (a model that sees frames in pairs), with their times
        self._held_frames: list[tuple[np.ndarray, float]] = []
        self._frames = 0
        self._video_time_s = 0.0
        self._tokens_seen = 0
        self._logits: torch.Tensor | None = None  # (vocab,) after the last token run
        self._seen = Seen()  # tokens appended per second of video
        self.open_answer: object | None = None  # the answer under way (`engine/answer.py`) until over: a step closes it first
        self.frame_tokens = 0  # tokens a frame took, with its time's markers (0 before the first)

    # What an engine step (`engine/step.py`) asks of a session: check its frames, cut them into
    # prompts, make room for each and for text, and apply what ran.

    def check_frames(self, frames: Sequence[np.ndarray], times_s: Sequence[float], flush: bool = False) -> bool:
        """Raise on frames the session cannot take; False when there are none (nor, with
        `flush`, any held back)."""
        if len(frames) != len(times_s):
            raise ValueError(f"{len(frames)} frames but {len(times_s)} times")
        if not frames:
            return flush and bool(self._held_frames)
        if not self.model.sees_frames:
            raise ValueError(f"model {self.model.name!r} is text-only: it cannot see frames")
        previous = self._held_frames[-1][1] if self._held_frames else self._video_time_s if self._frames else 0.0
        for t in times_s:
            if not (math.isfinite(t) and t >= previous):
                raise ValueError(f"frame times must be finite, >= 0 and must not decrease: {t} after {previous}")
            previous = t
        return True

    @property
    def frames_waiting(self) -> int:
        """Frames held back for the rest of their group: the next frames or question take them."""
        return len(self._held_frames)

    def frame_groups(
        self, frames: Sequence[np.ndarray], times_s: Sequence[float], flush: bool = False
    ) -> tuple[list[np.ndarray], list[float], int]:
        """The frames to encode now, in whole groups of the model's `frames_per_group` (Qwen's
        pairs), with their times, and how many of them are real: the frames held back before
        first; the last ones short of a group held back for the next call, unless `flush` (a
        question comes, and should see them): then the group is filled with copies of its last
        frame, as Qwen's processor fills a video of an odd number of frames."""
        size = self.model.frames_per_group
        held, self._held_frames = self._held_frames, []
        frames = [f for f, _ in held] + list(frames)
        times = [t for _, t in held] + [float(t) for t in times_s]
        real, short = len(frames), len(frames) % size
        if short and flush:
            frames += [frames[-1]] * (size - short)
            times += [times[-1]] * (size - short)
        elif short:
            self._held_frames = list(zip(frames[-short:], times[-short:]))
            frames, times, real = frames[:-short], times[:-short], real - short
        return frames, times, real

    def frame_prompts(
        self, visual: torch.Tensor, times_s: Sequence[float], grid: tuple[int, int] | None = None
    ) -> list[tuple[list[Part], list[float]]]:
        """Visual tokens (N, tokens, hidden) of N groups of `frames_per_group` frames (`grid`:
        their rows and columns, with 3-D positions) as prompts of `frames_per_prompt` groups,
        each after its first frame's time (between the model's frame markers): (parts, the times
        of the real frames, `times_s`) per prompt."""
        each, size, prompts = self.config.frames_per_prompt, self.model.frames_per_group, []
        for start in range(0, len(visual), each):
            parts, times = [], []
            for group, tokens in enumerate(visual[start : start + each], start):
                group_times = [float(t) for t in times_s[group * size : (group + 1) * size]]
                before, after = self.model.frame_text(group_times)
                embeds, deepstack = self.model.split_visual(tokens[None])
                t = group_times[0]
                parts += [self._text(before, t), Part(embeds, FRAME, t, grid, deepstack), self._text(after, t)]
                times += group_times
            prompts.append((parts, times))
            self.frame_tokens = sum(part.tokens for part in parts) // len(times)
        return prompts

    def make_frame_room(self, parts: list[Part], times: list[float]) -> None:
        """Refuse a frame prompt that would take the cache into the room kept for questions."""
        self._make_room(f"the frame at {times[0]:.1f}s", sum(p.tokens for p in parts), self.config.question_room_tokens)

    def make_check_room(self, tokens: int) -> None:
        """Refuse a check of `tokens` while an answer is under way (its prompt would fall inside
        the answer's turn), or past the context."""
        if self.open_answer is not None:
            raise ValueError("the session is answering: a check waits until its answer is over")
        self._make_room("the check", tokens)

    def ran(self, parts: list[Part], logits: torch.Tensor | None) -> None:
        """A prompt of these parts ran: its tokens are in the cache (not yet evicted), counted as
        seen; `logits` (vocab,) after its last token."""
        for part in parts:
            self._seen.add(part.kind, part.time_s, part.tokens)
            self._tokens_seen += part.tokens
        if logits is not None:
            with outside_inference():  # kept across steps, like everything a session keeps (engine/kv_cache.py)
                self._logits = logits.clone()

    def appended_frames(self, times: list[float]) -> None:
        """After a frame prompt ran: evict, and count its frames."""
        self.cache.evict()
        self._frames += len(times)
        self._video_time_s = times[-1]

    def opening(self, text: str) -> Part:
        """The conversation's opening (`text`, the system prompt in the model's chat template),
        its tokens pinned with `pin_turns`; refused past the context."""
        opening = self._text(text)
        if self.config.pin_turns and self.policy.evicts:
            pinned = opening.tokens + self.config.pin_turns * turn_marker_tokens(self.model)
            if pinned + self.policy.sinks + self.policy.recent >= self.policy.budget_tokens:
                kept = self.policy.sinks + self.policy.recent
                raise ValueError(
                    f"pin_turns ({self.config.pin_turns}) pins {pinned} tokens: beside sinks and recent ({kept}), "
                    f"budget_tokens ({self.policy.budget_tokens}) leaves no room for them"
                )
            self.cache.pin(torch.arange(opening.tokens), self.config.pin_turns)
        self._make_room("the system prompt", opening.tokens)
        return opening

    def user_text(self, text: str) -> list[int]:
        """`text` in the user's turn as token ids; refused past the room kept for questions."""
        ids = self.model.tokenize(text, user=True)
        if ids:
            self._make_room("the text", len(ids), self.config.question_room_tokens)
        return ids

    def question(self, question: str, max_new_tokens: int) -> tuple[list[Part], Part, int]:
        """A question's prompt (its words and the markers closing them), the markers that will
        close its answer's turn, and the most tokens the answer may take; refused past the
        context (with room for a one-token answer)."""
        chat = self.model.chat
        question_ids = self.model.tokenize(question, user=True)
        turn = self._text(chat.user_to_assistant), self._text(chat.assistant_to_user)  # closing the question, the answer
        borrowable = min(self.config.borrowed_tokens, self.cache.host.available()) if self.cache.host else 0
        prompt = len(question_ids) + turn[0].tokens + borrowable
        self._make_room("the question", prompt + 1 + turn[1].tokens)
        answer_room = self._room() - prompt - turn[1].tokens
        return [self.part(question_ids), turn[0]], turn[1], min(max_new_tokens, answer_room - self._kept_for_questions(answer_room))

    def _room(self) -> int:
        """Tokens the cache may still take before it reaches the context."""
        return self.context_tokens - self.cache.tokens

    def _kept_for_questions(self, answer_room: int) -> int:
        """Of the `answer_room` an answer could take, what it leaves for later questions: in a
        cache that does not evict, the room kept for them, or half of what is left when less
        is; nothing in one that evicts (its room comes back after every answer)."""
        if self.policy.evicts:
            return 0
        return min(self.config.question_room_tokens, answer_room // 2)

    @property
    def context_full(self) -> bool:
        """The cache takes no more frames nor text: what is left of the context is the room
        kept for questions (only a cache that does not evict fills up)."""
        return self._room() <= self.config.question_room_tokens

    def _make_room(self, what: str, tokens: int, kept_tokens: int = 0) -> None:
        """Refuse a prompt of `tokens` that would take the cache past the context, or into the
        `kept_tokens` before its end."""
        if tokens > self._room() - kept_tokens:
            raise ContextFull(what, tokens, self.cache.tokens, self.context_tokens, kept_tokens)

    # What a step asks of a session for an answer (`engine/answer.py`): its tokens as parts, its turn's markers pinned.

    def pin_turn(self, start: int, count: int, new_turn: bool) -> None:
        """With `pin_turns`: never evict the `count` tokens from stream place `start` on."""
        if self.config.pin_turns and self.policy.evicts:
            self.cache.pin(torch.arange(start, start + count), self.config.pin_turns, new_turn)

    def part(self, ids: Sequence[int], time_s: float | None = None) -> Part:
        """Text tokens, taken at `time_s` (the current video time when None)."""
        return Part(self.model.embed_tokens(ids), TEXT, self._video_time_s if time_s is None else time_s)

    def _text(self, text: str, time_s: float | None = None) -> Part:
        return self.part(self.model.tokenize(text), time_s)

    # -- reading -------------------------------------------------------------------------------

    @property
    def logits(self) -> torch.Tensor:
        """(vocab,) the model's prediction for the next token, after everything appended."""
        return self._logits

    def stats(self) -> SessionStats:
        return cache_stats(self.cache, self._frames, self._video_time_s, self._tokens_seen)

    def memory(self, max_spans: int = 600) -> Memory:
        """What the cache still holds of the stream so far, in at most `max_spans` equal spans of
        whole seconds, and of each kind."""
        return memory_map(self._seen, self.cache, self.config.host_tokens, max_spans)

    # -- snapshot ------------------------------------------------------------------------------

    def snapshot(self, host_pages: bool = True) -> bytes:
        """Everything needed to go on elsewhere, as bytes: the cache, the counters, the config.
        Without `host_pages`, the host tier's pages are left out, to be saved apart, each once
        it changed (`changed_host_pages`), and read back by `restore`'s `read_page`: so the
        bytes written per snapshot follow the tokens streamed, not the tier's size. Refused
        while an answer is open (`Session.snapshot` closes it first)."""
        if self.open_answer is not None:
            raise ValueError("the session is answering: a snapshot waits until its answer's turn is closed")
        state = {
            "format": SNAPSHOT_FORMAT,
            "model": self.model.name,
            "dtype": str(self.model.dtype).removeprefix("torch."),  # restored into another, keys and values are converted
            "config": {**asdict(self.config), "policy_options": dict(self.config.policy_options)},
            "cache": self.cache.state(host_pages),
            "counters": [self._frames, self._video_time_s, self._tokens_seen],
            "logits": self._logits,
            "seen": self._seen.counts(),
            "held_frames": [(torch.from_numpy(frame), t) for frame, t in self._held_frames],
        }
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return buffer.getvalue()

    def release(self) -> None:
        """The session is over: its cache's slots and its host tier's pages go back to the
        worker's pools, and it holds nothing more."""
        self.cache.release()

    def changed_host_pages(self) -> dict[int, bytes]:
        """By page number, the host tier's pages held that changed since the last call (at the
        first: every page held), as bytes; `unsaved_host_pages` gives back those that could not
        be saved."""
        host = self.cache.host
        if host is None:
            return {}
        pages, changed = {}, host.take_changed()
        try:
            for number in changed:
                buffer = io.BytesIO()
                torch.save(host.page_state(number), buffer)
                pages[number] = buffer.getvalue()
        except BaseException:
            host.changed.update(changed)
            raise
        return pages

    def unsaved_host_pages(self, numbers: Iterable[int]) -> None:
        if self.cache.host is not None:
            self.cache.host.changed.update(n for n in numbers if n in self.cache.host.slot_of)

    @property
    def host_pages(self) -> list[int]:
        """The page numbers the host tier holds (a snapshot without them needs each)."""
        return [] if self.cache.host is None else self.cache.host.pages

    @classmethod
    def restore(
        cls, model: Model, data: bytes, pool: KVPool | None = None, read_page: Callable[[int], bytes] | None = None
    ) -> Self:
        """The session a `snapshot` was taken of, on `model` (the same model), in `pool`'s slots if
        given; `read_page(number)`: the bytes `changed_host_pages` gave for that page, for a
        snapshot taken without its host pages."""
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        if state.get("format") not in (1, 2, SNAPSHOT_FORMAT):
            raise ValueError(f"unknown snapshot format {state.get('format')!r}")
        if state["model"] != model.name:
            raise ValueError(f"the snapshot is of model {state['model']!r}, not {model.name!r}")
        session = cls.__new__(cls)
        SessionState.__init__(session, model, SessionConfig(**state["config"]), pool)
        def page(number: int) -> dict:
            return torch.load(io.BytesIO(read_page(number)), map_location="cpu", weights_only=True)

        session.cache.load(state["cache"], model.device, page if read_page is not None else None, model.dtype)
        session._frames, session._video_time_s, session._tokens_seen = state["counters"]
        session._logits = None if state["logits"] is None else state["logits"].to(model.device, model.dtype)
        session._seen = Seen(state["seen"])
        session._held_frames = [(frame.numpy(), t) for frame, t in state.get("held_frames", [])]
        return session
