"""What a client chooses: a session's options (its policy and the policy's knobs) and how
each answer is asked for and sampled."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from streamvqa.protocol.keys import (
    DEFAULT_BUDGET_TOKENS,
    HOST_BUDGET_MULTIPLE,
    MAX_ANSWER_TOKENS,
    MAX_HOST_BUDGET_TOKENS,
    MAX_QUESTION_CHARS,
    MAX_SYSTEM_PROMPT_CHARS,
    PROMPT_RESERVE_TOKENS,
    session_peak_tokens,
)


Policy = Literal["full", "sliding", "h2o", "snapkv", "tova", "knorm", "infmllm"]
POLICIES: tuple[str, ...] = get_args(Policy)  # the engine's registry holds the same names (tested)


class PolicyOptions(BaseModel):
    """A policy's knobs; each unset one keeps the engine's default (docs/engine.md)."""

    model_config = ConfigDict(extra="forbid")

    sinks: int | None = Field(None, ge=0, le=1024, strict=True, description="S: first tokens always kept (default 4).")
    recent: int | None = Field(None, ge=0, le=65_536, strict=True, description="R: latest tokens always kept (default 128; h2o: half the budget).")
    per_layer: bool | None = Field(
        None, strict=True, description="One selection per layer instead of one per KV head (default false; tova: true)."
    )
    evict_on_question: bool | None = Field(None, strict=True, description="Also evict right after a question, before answering.")
    block_tokens: int | None = Field(
        None, ge=1, le=256, strict=True, description="Tokens kept or evicted together: runs of this many stream places (default 16)."
    )
    window: int | None = Field(None, ge=1, le=1024, strict=True, description="infmllm, snapkv: the prompt's last queries that score the cache (default 32).")
    beta: float | None = Field(None, ge=0, le=1000, strict=True, description="infmllm: weight of the recency bias (default 0.5).")
    bias_shape: Literal["linear", "square"] | None = Field(None, description="infmllm: how the bias grows with recency.")
    local_sum: int | None = Field(None, ge=1, le=63, strict=True, description="infmllm: keys summed around each one, odd (default 5).")
    kernel: int | None = Field(None, ge=1, le=63, strict=True, description="snapkv: pooling width, odd (default 7).")

    @field_validator("local_sum", "kernel")
    @classmethod
    def _odd(cls, value: int | None) -> int | None:
        if value is not None and value % 2 == 0:
            raise ValueError("must be odd")
        return value

    def chosen(self) -> dict[str, object]:
        """The knobs set, by name."""
        return self.model_dump(exclude_none=True)


# The knobs each policy takes: the fields of its engine dataclass (engine/policies/), and the
# engine's defaults for sinks and recent (tests/worker/test_session_options.py checks both).
_COMMON_KNOBS = ("sinks", "recent", "per_layer", "evict_on_question", "block_tokens")
POLICY_KNOBS: dict[str, tuple[str, ...]] = {
    "full": (),
    "sliding": _COMMON_KNOBS,
    "h2o": _COMMON_KNOBS,
    "snapkv": (*_COMMON_KNOBS, "window", "kernel"),
    "tova": _COMMON_KNOBS,
    "knorm": _COMMON_KNOBS,
    "infmllm": (*_COMMON_KNOBS, "window", "beta", "bias_shape", "local_sum"),
}
DEFAULT_SINKS, DEFAULT_RECENT = 4, 128


class SessionOptions(BaseModel):
    """What a client may choose when it creates a session."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"fps": 1.0, "policy": "infmllm", "budget_tokens": 4096, "policy_options": {"beta": 0.5, "recent": 256}},
                {"policy": "sliding", "budget_tokens": 2048, "system_prompt": "Describe what you see in one sentence."},
            ]
        },
    )

    fps: float = Field(1.0, ge=0.1, le=4.0, strict=True, description="Frames sampled per second of video.")
    model: str | None = Field(
        None, min_length=1, max_length=200, description="Model name; the gateway's default when absent."
    )
    policy: Policy = Field(
        "infmllm",
        description="KV cache policy: infmllm (bounded, attention-scored with a recency bias), "
        "snapkv, tova, knorm, h2o, sliding (sinks and recent tokens), or full (no eviction: memory grows).",
    )
    budget_tokens: int | None = Field(
        None, ge=256, le=1_000_000, strict=True,
        description=f"Tokens each cache layer keeps after an eviction; when absent {DEFAULT_BUDGET_TOKENS}, or the "
        "most the model's context leaves room for beside a prompt, an answer and the retrieval.",
    )
    policy_options: PolicyOptions = Field(
        default_factory=PolicyOptions, description="The policy's knobs; only those the policy has are accepted."
    )
    system_prompt: str | None = Field(
        None, min_length=1, max_length=MAX_SYSTEM_PROMPT_CHARS, description="Replaces the model's default system prompt."
    )
    recall: bool | None = Field(
        None, strict=True,
        description="Keep what the cache evicts in a bounded host tier (CPU memory), and let each question "
        "bring back the parts of the past it needs for its answer. Needs a policy that evicts; when absent, "
        "on for a policy that evicts (what was said just before the budget's span is then still answered).",
    )
    host_budget_tokens: int | None = Field(
        None, ge=32, le=MAX_HOST_BUDGET_TOKENS, strict=True,
        description=f"With recall: evicted tokens the host tier keeps, per layer (oldest and least recalled "
        f"pages go first); {HOST_BUDGET_MULTIPLE}x budget_tokens when absent.",
    )
    retrieval_tokens: int | None = Field(
        None, ge=0, le=1_000_000, strict=True,
        description="With recall: host tokens one question brings back, per layer; half of budget_tokens when absent.",
    )

    pin_turns: int = Field(
        0, ge=0, le=64, strict=True,
        description="Never evict the opening (system prompt) nor the markers that close the last this many "
        "questions and answers; 0: only the first and the latest tokens are kept for sure.",
    )

    @model_validator(mode="after")
    def _recall_options(self) -> SessionOptions:
        if self.recall is None:
            self.recall = self.policy != "full"
        if not self.recall:
            given = [name for name in ("host_budget_tokens", "retrieval_tokens") if getattr(self, name) is not None]
            if given:
                raise ValueError(f"{' and '.join(given)} need recall: true")
        elif self.policy == "full":
            raise ValueError("recall needs a policy that evicts; 'full' keeps everything")
        return self

    def within(self, context_tokens: int) -> SessionOptions:
        """These options for a model whose cache may hold `context_tokens` (0: not known): the
        budget chosen when absent, and checked so that the cache's peak stays within the context.
        A ValueError says why they cannot be."""
        budget = self.budget_tokens
        if self.policy != "full" and context_tokens:
            largest = self._largest_budget(context_tokens - PROMPT_RESERVE_TOKENS - MAX_ANSWER_TOKENS)
            beside = f"beside a {PROMPT_RESERVE_TOKENS}-token prompt and a {MAX_ANSWER_TOKENS}-token answer"
            if self.recall:
                beside += " and what a question retrieves"
            if budget is None and largest < 256:
                raise ValueError(
                    f"the model's {context_tokens}-token context leaves no room for a bounded cache {beside}; "
                    "use policy 'full'"
                )
            if budget is not None and budget > largest:
                raise ValueError(
                    f"budget_tokens {budget} does not fit the model's {context_tokens}-token context {beside}: "
                    f"at most {max(largest, 0)}"
                )
            budget = min(budget or DEFAULT_BUDGET_TOKENS, largest)
        chosen = self.model_dump(exclude_unset=True, exclude_none=True)
        return SessionOptions.model_validate({**chosen, "budget_tokens": budget or DEFAULT_BUDGET_TOKENS})

    def _largest_budget(self, room_tokens: int) -> int:
        """The largest budget whose peak, with the retrieval, leaves `room_tokens` for itself."""
        if not self.recall or self.retrieval_tokens is not None:
            return room_tokens - (self.retrieval_tokens or 0)
        largest = (2 * room_tokens + 1) // 3  # half the budget is borrowed
        return largest - (largest + largest // 2 > room_tokens)

    def check_pins(self, opening_tokens: int, turn_marker_tokens: int) -> None:
        """A ValueError when what `pin_turns` pins leaves the policy no room in the budget beside
        sinks and recent (the engine's rule, engine/session_state.py): the opening (`opening_tokens`,
        with the model's default system prompt) and `turn_marker_tokens` for each pinned turn.
        A system prompt of the session's own is counted as nothing here, for want of a
        tokenizer: its worker counts it when it opens the session. 0: not known, not checked."""
        if not self.pin_turns or self.policy == "full" or not turn_marker_tokens:
            return
        opening = opening_tokens if self.system_prompt is None else 0
        pinned = opening + self.pin_turns * turn_marker_tokens
        kept = _kept_tokens(self.policy, self.budget, self.policy_options)
        if pinned + kept >= self.budget:
            most = max(0, (self.budget - 1 - kept - opening) // turn_marker_tokens)
            raise ValueError(
                f"pin_turns {self.pin_turns} pins {pinned} tokens ({opening} of the opening, {turn_marker_tokens} "
                f"for each turn): beside sinks and recent ({kept}), budget_tokens {self.budget} leaves room for "
                f"pin_turns {most} at most"
            )

    @property
    def budget(self) -> int:
        return self.budget_tokens if self.budget_tokens is not None else DEFAULT_BUDGET_TOKENS

    def peak_tokens(self, context_tokens: int) -> int:
        """The most tokens the session's cache holds, on a model of `context_tokens` (0: not known)."""
        return session_peak_tokens(self.policy, self.budget, self.borrowed_tokens, context_tokens)

    @property
    def host_tokens(self) -> int:
        """The host tier's bound, per layer (0 without recall)."""
        if not self.recall:
            return 0
        return self.host_budget_tokens if self.host_budget_tokens is not None else HOST_BUDGET_MULTIPLE * self.budget

    @property
    def borrowed_tokens(self) -> int:
        """The most one question borrows from the host tier, per layer (0 without recall)."""
        if not self.recall:
            return 0
        return self.retrieval_tokens if self.retrieval_tokens is not None else self.budget // 2

    @field_validator("policy_options")
    @classmethod
    def _knobs_of_the_policy(cls, options: PolicyOptions, info: ValidationInfo) -> PolicyOptions:
        policy, budget = info.data.get("policy"), info.data.get("budget_tokens")
        if policy is None:
            return options
        foreign = sorted(set(options.chosen()) - set(POLICY_KNOBS[policy]))
        if foreign:
            takes = ", ".join(POLICY_KNOBS[policy]) or "none"
            raise ValueError(f"policy {policy!r} has no option {', '.join(foreign)} (it takes: {takes})")
        if budget is not None and policy != "full":
            kept = _kept_tokens(policy, budget, options)
            if budget <= kept:
                raise ValueError(f"budget_tokens ({budget}) must exceed sinks + recent ({kept})")
        return options


def _kept_tokens(policy: str, budget: int, options: PolicyOptions) -> int:
    """Sinks and recent tokens, which a bounded policy always keeps (their defaults when unset)."""
    default_recent = budget // 2 if policy == "h2o" else DEFAULT_RECENT  # h2o: half the budget
    sinks = options.sinks if options.sinks is not None else DEFAULT_SINKS
    return sinks + (options.recent if options.recent is not None else default_recent)


# The engine's bounds (engine/sampling.py; tests/engine/test_sampling.py checks they agree).
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 64
MAX_TEMPERATURE = 2.0
MAX_TOP_K = 1000
MAX_SEED = 2**63 - 1


class Sampling(BaseModel):
    """How an answer's tokens are chosen: greedy by default, else drawn at `temperature`."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(
        0.0, ge=0, le=MAX_TEMPERATURE, strict=True,
        description="0: greedy, the most likely token each time (top_p, top_k and seed are then unused); "
        "higher draws more freely.",
    )
    top_p: float = Field(
        1.0, gt=0, le=1, strict=True, description="Draw among the fewest most likely tokens whose probabilities reach top_p."
    )
    top_k: int = Field(0, ge=0, le=MAX_TOP_K, strict=True, description="Draw among the k most likely tokens; 0: no such limit.")
    seed: int | None = Field(
        None, ge=0, le=MAX_SEED, strict=True,
        description="The same seed, question and cache give the same answer; without one each draw is fresh.",
    )
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] = Field(
        [], max_length=MAX_STOP_STRINGS,
        description=f"Up to {MAX_STOP_STRINGS} strings (or one string): the answer ends before the first of them.",
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _one_string(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    def sampling(self) -> Sampling:
        """Only the sampling options (of a request that has others too)."""
        return Sampling.model_validate(self.model_dump(include=set(Sampling.model_fields)))


class AskOptions(Sampling):
    """What every way of asking takes besides the question: the answer's length and sampling."""

    max_new_tokens: int = Field(
        64, ge=1, le=MAX_ANSWER_TOKENS, strict=True, description="The most tokens the answer may have."
    )
    max_tokens: int | None = Field(
        None, ge=1, le=MAX_ANSWER_TOKENS, strict=True, description="The same as max_new_tokens (the name OpenAI's API uses)."
    )

    @model_validator(mode="after")
    def _one_length(self) -> AskOptions:
        if self.max_tokens is not None and "max_new_tokens" in self.model_fields_set:
            raise ValueError("give max_tokens or max_new_tokens, not both")
        return self

    @property
    def answer_tokens(self) -> int:
        return self.max_tokens if self.max_tokens is not None else self.max_new_tokens


def _not_blank(text: str) -> str:
    if not text.strip():
        raise ValueError("the question has no text: only white space")
    return text


# A question, however it is asked: 1 to MAX_QUESTION_CHARS characters, not all of them white space.
QuestionText = Annotated[str, Field(min_length=1, max_length=MAX_QUESTION_CHARS), AfterValidator(_not_blank)]
