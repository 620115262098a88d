"""What a session is made with: its policy, budgets, recall and the room it keeps, validated once."""

from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.host_pool import HostPool
from engine.host_tier import HostTier
from engine.model import Model
from engine.policies import Policy, make_policy
from engine.policies.base import DEFAULT_BUDGET_TOKENS

DEFAULT_SYSTEM_PROMPT = (
    "You watch a video stream. Frames arrive in order, each after its time in seconds. "
    "Answer questions about what you have seen, briefly."
)
HOST_BUDGET_MULTIPLE = 8  # host_budget_tokens when not given: this many times the budget (the protocol's)


@dataclass(frozen=True)
class SessionConfig:
    policy: str = "infmllm"  # full, sliding, h2o, snapkv, tova, knorm or infmllm
    budget_tokens: int = DEFAULT_BUDGET_TOKENS  # B, per layer
    policy_options: Mapping[str, object] = field(default_factory=dict)  # the policy's other knobs
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    frames_per_prompt: int = 1  # frames appended (and evicted after) together
    pool: int | None = None  # spatial pooling stride of each frame's patch grid; None: the model's
    prefill_chunk_tokens: int = 512  # the longest run of tokens in one forward
    evidence_top_k: int = 3  # video times returned as an answer's evidence
    recall: bool = False  # keep what the cache evicts in a host tier; each question borrows from it
    host_budget_tokens: int | None = None  # the host tier's bound, per layer; None: 8x the budget
    retrieval_tokens: int | None = None  # borrowed per question, per layer; None: half the budget
    page_tokens: int = 32  # evicted tokens per host page: the unit retrieved
    page_keys: int = 4  # representative keys a page is scored by (bench.recall: 2, 4 and 8 compared)
    host_drop: str = "novel"  # which pages leave a full host tier: "novel" (the least novel) or "oldest"
    # Never evict the opening (system prompt and its markers) nor the turn markers (those that
    # close a question and an answer) of the last `pin_turns` questions; 0: only sinks and recent
    pin_turns: int = 0
    # The most tokens the cache may hold at once (every position below it); None: the model's
    # context. A prompt that would pass it is refused (`ContextFull`), an answer ends at it.
    context_tokens: int | None = None
    # The most tokens the cache is expected to hold at once (a bounded cache: its budget, a
    # prompt and an answer), so that its buffers grow no larger while it holds no more; None:
    # the context
    peak_tokens: int | None = None
    # Frames and text stop this many tokens short of the context, so that questions still fit;
    # an answer in a cache that does not evict leaves it too (or half of what is left, if less)
    question_room_tokens: int = 256

    def __post_init__(self) -> None:
        for name, least in (
            ("frames_per_prompt", 1), ("prefill_chunk_tokens", 1), ("context_tokens", 1), ("peak_tokens", 1),
            ("question_room_tokens", 0), ("pool", 1), ("evidence_top_k", 0), ("pin_turns", 0),
            ("host_budget_tokens", 0), ("retrieval_tokens", 0),
        ):
            if getattr(self, name) is not None and getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}, got {getattr(self, name)}")
        policy = self.make_policy()  # validates the policy and its options
        if self.recall:
            if not policy.evicts:
                raise ValueError(f"recall needs a policy that evicts; {self.policy!r} keeps everything")
            self.make_host_tier()  # validates the page options

    def make_policy(self) -> Policy:
        return make_policy(self.policy, budget_tokens=self.budget_tokens, **self.policy_options)

    @property
    def host_tokens(self) -> int:
        """The host tier's bound, per layer (0 without recall)."""
        if not self.recall:
            return 0
        return HOST_BUDGET_MULTIPLE * self.budget_tokens if self.host_budget_tokens is None else self.host_budget_tokens

    @property
    def borrowed_tokens(self) -> int:
        """The most a question borrows, per layer (0 without recall)."""
        if not self.recall:
            return 0
        return self.budget_tokens // 2 if self.retrieval_tokens is None else self.retrieval_tokens

    def make_host_tier(self, pool: HostPool | None = None) -> HostTier | None:
        """With recall, its host tier: in `pool`'s pages if given (the worker's; PoolFull when they are taken)."""
        return HostTier(self.host_tokens, self.page_tokens, self.page_keys, self.host_drop, pool) if self.recall else None


def turn_marker_tokens(model: Model) -> int:
    """The markers closing one question and its answer: what `pin_turns` pins of each turn."""
    return len(model.tokenize(model.chat.user_to_assistant)) + len(model.tokenize(model.chat.assistant_to_user))
