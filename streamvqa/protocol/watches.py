"""Watches: standing yes/no conditions on a session's video, each checked every `every_s` seconds of
video in the cache, and the rule that decides when one fires.

A session's watches live in one Redis hash beside its other keys (`Keys.watches`: at most
MAX_WATCHES_PER_SESSION), added and removed by the gateway and checked by the worker that holds
the session (docs/protocol.md has the scripts and who writes what).

The rule (`Watch.checked`), with hysteresis so that a condition that stays true fires once:
- a watch is **armed** when created: its first check fires if p(yes) >= threshold;
- an armed watch fires at a check where p(yes) >= threshold, and is then disarmed;
- a disarmed watch is armed again after REARM_CHECKS consecutive checks below the threshold
  (a condition true, then false for that long, then true again fires twice).
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from streamvqa.protocol.events import Evidence

MAX_CONDITION_CHARS = 300
DEFAULT_EVERY_S = 2.0
MAX_EVERY_S = 3600.0
DEFAULT_THRESHOLD = 0.5  # p(yes) above p(no): the model's own yes
REARM_CHECKS = 2  # consecutive checks below the threshold that arm a watch that fired again
MAX_FIRINGS_KEPT = 100  # a watch keeps its latest firings, no more


class Firing(BaseModel):
    time_s: float = Field(description="Video time of the check that fired: the time of the last frame it saw.")
    probability: float = Field(description="p(yes) at that check, 0 to 1.")
    evidence: list[Evidence] = Field(
        [], description="The frames the check attended to beyond what a question about nothing does, strongest first "
        "(as an answer's evidence; docs/engine.md, Evidence)."
    )


class Watch(BaseModel):
    id: str
    condition: str = Field(description="The yes/no condition, as given.")
    every_s: float = Field(description="Seconds of video in the cache between two checks.")
    threshold: float = Field(description="p(yes) at or above which the watch fires.")
    created_video_s: float = Field(
        description="The session's video time when the watch was created: its first check comes `every_s` after it, "
        "so it never fires for video before it."
    )
    created_at: float = Field(description="Unix time of its creation.")
    fired: list[Firing] = Field([], description=f"Its firings, oldest first (the latest {MAX_FIRINGS_KEPT}).")
    checks: int = Field(0, description="Checks run so far.")
    checked_s: float | None = Field(None, description="Video time of its last check (null before its first).")
    probability: float | None = Field(None, description="p(yes) at its last check.")
    armed: bool = Field(True, description="Whether the next check at or above the threshold fires.")
    below: int = Field(0, description="Consecutive checks below the threshold, up to the last one.")

    def due_s(self) -> float:
        """The video time at or after which its next check runs."""
        return (self.created_video_s if self.checked_s is None else self.checked_s) + self.every_s

    def checked(self, time_s: float, probability: float, evidence: list[Evidence] | None = None) -> tuple[Watch, Firing | None]:
        """The watch after a check at video time `time_s` that gave p(yes) = `probability` (and,
        where it fires, `evidence`), and the firing it makes (None when it does not fire)."""
        above = probability >= self.threshold
        firing = None
        if above and self.armed:
            firing = Firing(time_s=round(time_s, 3), probability=round(probability, 6), evidence=evidence or [])
        below = 0 if above else self.below + 1
        armed = (self.armed and not above) or (not above and below >= REARM_CHECKS)
        fired = [*self.fired, firing][-MAX_FIRINGS_KEPT:] if firing else self.fired
        after = self.model_copy(update={
            "checks": self.checks + 1, "checked_s": round(time_s, 3), "probability": round(probability, 6),
            "armed": armed, "below": below, "fired": fired,
        })
        return after, firing
