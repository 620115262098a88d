"""Rules for choosing an answer's evidence, scored on the same recorded answers.

    python -m bench.evidence_rules record OUT.jsonl [--videos bikes,...,concat] [--needle-trials 0,1]
    python -m bench.evidence_rules score OUT.jsonl [--tune bikes,bigbuckbunny,vtest] [--tune-trials 0]

`record` runs the demo model in process (no service: the same engine, so every rule sees the
same answers) and, per answer, keeps what engine/evidence.py's `Contrast` holds: the shares of
each video time the question's queries and the answer's paid, summed, and the probe's mean
shares for its question and for its answer. Videos: bench.evidence's (sampled at fps 2 and
scaled as the worker does an upload; `recall` on and `--budget` 3,413 tokens, the service's
default session for `streamvqa-demo`), asked bench.evidence's 12 questions; needles:
bench.needle's 1-minute streams at depths 0.1, 0.5 and 0.9 for each of `--needle-trials`, under
`full` and `infmllm` at budget 256, asked bench.needle's three questions.

`score` rebuilds each answer's `Contrast` and ranks its times under every rule of RULES (the
probe answer's weight in an answer's baseline, and the margin), printing one JSON line per rule
and set (`tune`: the videos of `--tune` and the needle trials of `--tune-trials`; `held`: the
rest) with: `opening`, answers not about the opening whose top 3 holds the first second;
`newest`, answers about earlier events in videos of at least 30 s whose top 3 holds one of the
newest 10 s; `needle`, right needle answers whose top 3 holds the needle's second; `none`,
answers citing nothing. Choose on `tune`, report `held`.
"""

import argparse
import io
import json
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from bench.common import emit
from bench.evidence import CONCAT_ORDER, EARLIER, LONG_S, NEWEST_S, QUESTIONS, SOURCES, source, write_concat
from bench.needle import build_stream, is_right
from demo_training.train import sample_videos
from engine import Session, SessionConfig, load_model
from engine.evidence import PROBE_ANSWER_WEIGHT, PROBE_MARGIN, Contrast
from worker.decode import sample_file
from worker.settings import WorkerSettings

DEMO_BUDGET = 3413  # the service's default budget for streamvqa-demo with recall (docs/api.md)
NEEDLE_SECONDS = 60
NEEDLE_DEPTHS = (0.1, 0.5, 0.9)
NEEDLE_RUNS = (("full", None), ("infmllm", 256))
# (the probe answer's weight in an answer's baseline, the margin, whether the answer's queries
# count): the rule now first
RULES = {
    "now": (PROBE_ANSWER_WEIGHT, PROBE_MARGIN, True),
    "probe question alone (before)": (0.0, 0.1, True),
    "probe answer weight 0.25": (0.25, 0.1, True),
    "probe answer weight 1": (1.0, 0.1, True),
    "weight 0.5, margin 0": (0.5, 0.0, True),
    "weight 0.5, margin 0.2": (0.5, 0.2, True),
    "the question's queries alone": (0.0, 0.1, False),
}


def _contrast_of(answer) -> dict:
    contrast = answer.contrast
    by_role = lambda maps: {str(role).lower(): {str(t): v for t, v in values.items()} for role, values in maps.items()}
    return dict(probed=by_role(contrast.probed), paid=by_role(contrast.paid), queries={str(r).lower(): n for r, n in contrast.queries.items()})


def _rebuilt(fields: dict, answer: bool = True) -> Contrast:
    """The recorded contrast; without `answer`, with the question's queries alone."""
    contrast = Contrast()
    maps = lambda by_role: {role == "true": {float(t): v for t, v in values.items()} for role, values in by_role.items()}
    contrast.probed, contrast.paid = maps(fields["probed"]), maps(fields["paid"])
    contrast.queries = {role == "true": n for role, n in fields["queries"].items()}
    if not answer:
        contrast.paid[True], contrast.queries[True] = {}, 0
    return contrast


def _ask(session: Session, text: str) -> tuple[str, dict]:
    answer = session.ask(text, max_new_tokens=24)
    return "".join(answer), _contrast_of(answer)


def _ingest(session: Session, frames: list[tuple[float, np.ndarray]]) -> None:
    for start in range(0, len(frames), 8):
        chunk = frames[start : start + 8]
        session.append_frames([f for _, f in chunk], [t for t, _ in chunk])


def record(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    model = load_model("streamvqa-demo", "cpu")
    folder = Path(tempfile.mkdtemp(prefix="streamvqa-evidence-rules-"))
    with open(args.out, "a") as out:
        for name in [n for n in args.videos.split(",") if n]:
            path = write_concat([n for n in CONCAT_ORDER if source(n)], 240, folder / "concat.mp4") if name == "concat" else source(name)
            if path is None:
                emit(warning="video missing", video=name)
                continue
            frames = [(f.time_s, f.image) for f in sample_file(path, 2.0, WorkerSettings().max_frame_side)]  # as an upload is
            session = Session(model, SessionConfig(recall=True, budget_tokens=args.budget))
            _ingest(session, frames)
            duration_s = frames[-1][0]
            for question in QUESTIONS:
                text = question.text.format(middle_s=int(duration_s / 2))
                said, contrast = _ask(session, text)
                out.write(json.dumps(dict(set=name, about=question.about, question=text, answer=said, duration_s=duration_s, contrast=contrast)) + "\n")
            emit(recorded=name, frames=len(frames))
        real = sample_videos() if args.needle_trials else []
        for trial in [int(t) for t in args.needle_trials.split(",") if t]:
            for depth in NEEDLE_DEPTHS:
                stream = build_stream(real, NEEDLE_SECONDS, depth, trial)
                frames = [(t, np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"))) for t, jpeg in stream.frames]
                for policy, budget in NEEDLE_RUNS:
                    session = Session(model, SessionConfig(policy=policy, **({"budget_tokens": budget} if budget else {})))
                    _ingest(session, frames)
                    for question in stream.questions:
                        said, contrast = _ask(session, question.text)
                        out.write(json.dumps(dict(set=f"needle{trial}", about="needle", question=question.text, answer=said, duration_s=frames[-1][0],
                                                  needle_s=stream.needle_s, right=is_right(question, said), contrast=contrast)) + "\n")
            emit(recorded=f"needle trial {trial}")


def score(args: argparse.Namespace) -> None:
    rows = [json.loads(line) for line in open(args.out)]
    tune = {n for n in args.tune.split(",") if n} | {f"needle{t}" for t in args.tune_trials.split(",") if t}
    for rule, (weight, margin, answer) in RULES.items():
        for label, chosen in (("tune", [r for r in rows if r["set"] in tune]), ("held", [r for r in rows if r["set"] not in tune])):
            cited = [[e.time_s for e in _rebuilt(r["contrast"], answer).top(3, weight, margin)] for r in chosen]
            counts = {"opening": [0, 0], "newest": [0, 0], "needle": [0, 0], "none": [0, 0]}

            def count(key: str, hit: bool) -> None:
                counts[key][0] += hit
                counts[key][1] += 1

            for row, times in zip(chosen, cited):
                count("none", not times)
                if row["about"] == "needle":
                    if row["right"]:
                        count("needle", row["needle_s"] in times)
                    continue
                if row["about"] != "opening":
                    count("opening", any(t < 1.0 for t in times))
                if row["about"] in EARLIER and row["duration_s"] >= LONG_S:
                    count("newest", any(t >= row["duration_s"] - NEWEST_S for t in times))
            emit(rule=rule, answer_weight=weight, margin=margin, set=label, **{k: f"{hit}/{of}" for k, (hit, of) in counts.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    recording = commands.add_parser("record", help="record answers in process")
    recording.add_argument("out", type=Path)
    recording.add_argument("--videos", default=",".join([*SOURCES, "concat"]))
    recording.add_argument("--needle-trials", default="0,1")
    recording.add_argument("--budget", type=int, default=DEMO_BUDGET, help="the videos' sessions' budget (recall on)")
    recording.add_argument("--threads", type=int, default=2)
    scoring = commands.add_parser("score", help="score every rule on the recorded answers")
    scoring.add_argument("out", type=Path)
    scoring.add_argument("--tune", default="bikes,bigbuckbunny,vtest", help="the videos the rule is chosen on")
    scoring.add_argument("--tune-trials", default="0", help="the needle trials the rule is chosen on")
    args = parser.parse_args()
    record(args) if args.command == "record" else score(args)


if __name__ == "__main__":
    main()
