"""The needle as text: what the demo model's language model finds by itself.

    python -m bench.needle_text [--minutes 3] [--trials 2] [--depths 0.1,0.5,0.9] [--distractors 0] [--adapter]

bench.needle's streams and questions, with every frame given to SmolLM2-135M-Instruct as the
words `streamvqa-demo` is trained to say of it instead of as visual tokens: a real frame as the
encoder's own top ImageNet class ("[42.0s] a mountain bike"), a generated one as its
description ("[97.0s] A blue star on a white background."), laid out as a session lays out
frames, after the same opening. The questions are asked in turn, each answer kept in the
conversation, greedy, 24 tokens, judged as bench.needle judges them.

Words are what the projector's warm start aims a frame's visual tokens at, so this says how much
of the needle the language model can find with no help from the projector: SmolLM2 as published,
or with `--adapter` with the shipped weights' adapter merged in (the language model
`streamvqa-demo` runs). Prints one JSON line per cell (accuracy, by question kind) and with
`--verbose` one per answer.
"""

import argparse
import io

import numpy as np
import torch
from PIL import Image

from bench.common import emit, split_list
from bench.needle import build_stream, is_right
from demo_training.data import Layout, name_of
from demo_training.train import sample_videos
from engine.demo.model import assemble, imagenet_names, pooled_features
from engine.session_config import DEFAULT_SYSTEM_PROMPT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    parser.add_argument("--distractors", type=int, default=0)
    parser.add_argument("--adapter", action="store_true", help="SmolLM2 with the shipped weights' adapter merged in")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    model = assemble("cpu", merge_adapter=args.adapter)
    tower, names, layout = model.hf.model.vision_tower, imagenet_names(), Layout(model)
    real = sample_videos()
    by_kind: dict[str, list[bool]] = {}
    for depth in split_list(args.depths, float):
        for trial in range(args.trials):
            stream = build_stream(real, int(args.minutes * 60), depth, trial, args.distractors)
            lines = []
            for t, (time_s, jpeg) in enumerate(stream.frames):
                if t in stream.generated:
                    words = stream.generated[t].describe()
                else:
                    _, logits = pooled_features(tower, [np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"))])
                    words = name_of(names, int(logits[0].argmax()))
                lines.append(f"[{time_s:.1f}s] {words}\n")
            ids = layout.opening(DEFAULT_SYSTEM_PROMPT) + model.tokenize("".join(lines))
            for question in stream.questions:
                ids += model.tokenize(question.text, user=True) + layout.to_assistant
                with torch.inference_mode():
                    out = model.hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                            eos_token_id=sorted(model.stop_ids))
                answer_ids = [i for i in out[0, len(ids):].tolist() if i not in model.stop_ids]
                answer = model.detokenize(answer_ids)
                ids += answer_ids + layout.to_user
                right = is_right(question, answer)
                by_kind.setdefault("what" if question.kind in ("shape", "digit") else question.kind, []).append(right)
                if args.verbose:
                    emit(run="text", depth=depth, trial=trial, needle_s=stream.needle_s, question=question.text,
                         expected=question.expected, answer=answer, right=right)
    answered = [r for rights in by_kind.values() for r in rights]
    emit(model="smollm2-135m-instruct" + (" with the adapter" if args.adapter else "") + " (text)", minutes=args.minutes, distractors=args.distractors,
         accuracy=round(sum(answered) / len(answered), 3), questions=len(answered),
         **{f"accuracy_{kind}": f"{sum(r)}/{len(r)}" for kind, r in sorted(by_kind.items())})


if __name__ == "__main__":
    main()
