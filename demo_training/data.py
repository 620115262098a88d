"""The demo model's training data: encoded images, conversations about them, and their tokens.

A `Pool` holds every image once, as the projector reads it (pooled encoder features), with what
is known of it: a generated scene's facts, or a real frame's ImageNet probabilities by the
encoder's own head. Samples are conversations drawn from the pool by seeded generators: a
single scene or real frame with one to three questions, a few frames with time markers and a
question about one moment, a "needle" (scenes among real frames, one of them asked about by what
came right before it, its time or its kind), a run of real video frames, and a watch's check (a
yes/no condition about what the video shows now, in engine/check.py's prompt). `Layout` turns a
sample into exactly the token stream a `Session` runs (engine/session_state.py): per frame `[t.ts]`,
its visual tokens and a newline, then the question, the chat's turn markers and the answer.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from demo_training import scenes
from demo_training.scenes import Scene
from engine.check import prompt_text
from engine.model import Model

TOKENS_PER_FRAME = 9
VISUAL = -1  # a placeholder id: the frame's visual tokens go there
IGNORE = -100  # a position whose prediction is not trained
NEEDLE_FRAMES = 24  # the longest short needle conversation, in frames (384 visual tokens)
MAX_SCENES = 40  # scenes in one needle conversation, at most
DISTRACTOR_SHARE = 0.4  # of a needle conversation's frames, at most, are scenes
LONE_SHARE = 0.5  # of needle conversations with several scenes: one is the only one of its kind, and often asked about
HELD_OUT_EVERY = 10  # real frames whose index % 10 == 7 are never trained on: they test naming
HELD_OUT_PHASE = 7


@dataclass(frozen=True)
class RealFrame:
    video: str  # file name of the sample video
    index: int  # frame index in the video
    time_s: float
    pixels: np.ndarray  # (H, W, 3) uint8

    @property
    def held_out(self) -> bool:
        return self.index % HELD_OUT_EVERY == HELD_OUT_PHASE


@dataclass
class Pool:
    """Every image a sample may show, encoded once."""

    features: torch.Tensor  # (M, 9, FEATURE_CHANNELS) float16: the projector's input per image
    probs: torch.Tensor  # (M, 1000) float16: the ImageNet head's softmax per image
    scenes: list[Scene | None]  # the facts of a generated scene; None for a real frame
    video: list[str | None]  # real frames: the video's name
    index: list[int]  # real frames: the frame's index in the video (-1 for scenes and crops)
    time_s: list[float]  # real frames: the frame's time in the video

    def __len__(self) -> int:
        return len(self.scenes)

    def state(self) -> dict:
        return dict(vars(self))

    def scene_items(self, kind: str | None = None) -> list[int]:
        return [i for i, s in enumerate(self.scenes) if s is not None and (kind is None or s.kind == kind)]

    def real_items(self) -> list[int]:
        return [i for i, s in enumerate(self.scenes) if s is None]

    def video_frames(self) -> dict[str, list[int]]:
        """Whole (uncropped) real frames by video, in time order."""
        runs: dict[str, list[int]] = {}
        for i, (name, index) in enumerate(zip(self.video, self.index, strict=True)):
            if name is not None and index >= 0:
                runs.setdefault(name, []).append(i)
        return {name: sorted(items, key=lambda i: self.index[i]) for name, items in runs.items()}


def build_pool(
    encode: Callable[[list[np.ndarray]], tuple[torch.Tensor, torch.Tensor]],
    frames: Sequence[RealFrame],
    scene_count: int,
    crops_per_frame: int,
    rng: np.random.Generator,
    plain_per_colour: int = 0,
    batch: int = 32,
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> Pool:
    """Render `scene_count` scenes and `plain_per_colour` plain frames of each colour, take every
    real frame whole and `crops_per_frame` random crops of it, and encode them all.
    `encode(images)` returns (N, 9, FEATURE_CHANNELS) features and (N, 1000) logits."""
    images: list[np.ndarray] = []
    pool = Pool(torch.empty(0), torch.empty(0), [], [], [], [])
    for _ in range(scene_count):
        image, scene = scenes.draw(rng)
        images.append(image)
        pool.scenes.append(scene), pool.video.append(None), pool.index.append(-1), pool.time_s.append(0.0)
    for colour in [c for c in scenes.COLOURS for _ in range(plain_per_colour)]:
        image, scene = scenes.plain(rng, colour)
        images.append(image)
        pool.scenes.append(scene), pool.video.append(None), pool.index.append(-1), pool.time_s.append(0.0)
    for frame in frames:
        views = [(frame.pixels, frame.index)] + [(_crop(rng, frame.pixels), -1) for _ in range(crops_per_frame)]
        for pixels, index in views:
            images.append(pixels)
            pool.scenes.append(None), pool.video.append(frame.video), pool.index.append(index)
            pool.time_s.append(frame.time_s)
    features, probs = [], []
    for start in range(0, len(images), batch):
        feats, logits = encode(images[start : start + batch])
        features.append(feats.to(torch.float16))
        probs.append(logits.softmax(-1).to(torch.float16))
        progress(min(start + batch, len(images)), len(images))
    pool.features, pool.probs = torch.cat(features), torch.cat(probs)
    return pool


def _crop(rng: np.random.Generator, pixels: np.ndarray) -> np.ndarray:
    """A random crop of 45-100% of the shorter side, near square, flipped half the time."""
    height, width = pixels.shape[:2]
    side = rng.uniform(0.45, 1.0) * min(height, width)
    aspect = rng.uniform(0.8, 1.25)
    h, w = int(min(height, side * aspect)), int(min(width, side / aspect))
    top, left = int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1))
    crop = pixels[top : top + h, left : left + w]
    return np.ascontiguousarray(crop[:, ::-1] if rng.random() < 0.5 else crop)


# -- conversations -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    frames: list[tuple[int, float]]  # (pool item, video time) in order
    turns: list[tuple[str, str]]  # (question, answer)
    task: str  # what the last turn asks, for per-task accuracy


def name_of(names: Sequence[str], cls: int) -> str:
    name = names[cls]
    return f"{scenes.article(name).lower()} {name}"


def _pick(rng: np.random.Generator, options: Sequence):
    return options[rng.integers(len(options))]


# Answers are short sentences in the language model's own style ("The shape is red."), so that
# the frozen model has only the content to learn, not a new way of answering.
AFTER = ("What came right after the {colour} background?", "What did you see right after the {colour} screen?",
         "What came after the {colour} background?")
TIME_QUESTIONS = ("What was shown at {when}?", "What did you see at {when}?", "What was on screen at {when}?",
                  "What was in the video at {when}?")
DESCRIBE = ("What do you see?", "What is in the picture?", "Describe what you see.", "What is shown?", "What is this?")


def scene_questions(scene: Scene, rng: np.random.Generator) -> list[tuple[str, str, str]]:
    """Every (task, question, answer) one may ask of a scene, each in a random wording."""
    thing = {"shape": "the shape", "count": "the shapes", "digit": "the digit", "letter": "the letter"}[scene.kind]
    verb = "are" if scene.kind == "count" else "is"
    colour = _pick(rng, ("colour", "color"))
    description = scene.describe()
    qa = [
        ("describe", _pick(rng, DESCRIBE), f"I see {description[0].lower()}{description[1:]}"),
        ("colour", f"What {colour} {verb} {thing}?", f"{thing.capitalize()} {verb} {scene.colour}."),
    ]
    if scene.background:
        qa.append(("background", f"What {colour} is the background?", f"The background is {scene.background}."))
    if scene.kind == "shape":
        qa.append(("shape", _pick(rng, ("What shape is it?", "What shape do you see?", "Which shape is shown?")),
                   f"It is a {scene.shape}."))
    elif scene.kind == "count":
        plural = scenes._plural(scene.shape)
        many = f"There is one {scene.shape}." if scene.count == 1 else f"There are {scenes.NUMBER_WORDS[scene.count]} {plural}."
        qa.append(("count", _pick(rng, ("How many shapes are there?", f"How many {plural} are there?")), many))
    else:
        questions = {"digit": ("What digit is shown?", "Which number do you see?", "What number is this?"),
                     "letter": ("What letter is shown?", "Which letter do you see?")}[scene.kind]
        qa.append((scene.kind, _pick(rng, questions), f"The {scene.kind} is {scene.symbol}."))
    return qa


def _family(scene: Scene) -> str:
    """What a question by kind calls a scene: one shape or several are both "the shape(s)"."""
    return "shape" if scene.shape else scene.kind


def _clock(rng: np.random.Generator, time_s: float) -> str:
    """A whole second of a stream as a person might write it: 0:42, 1:05, 42s, 42 seconds."""
    whole = int(time_s)
    return _pick(rng, (f"{whole // 60}:{whole % 60:02d}", f"{whole}s", f"{whole} seconds", f"second {whole}", f"{time_s:.1f}s"))


def _at(rng: np.random.Generator, time_s: float) -> str:
    """A time as a person might write it."""
    return _pick(rng, (f"at {time_s:.1f}s", f"at {time_s:g} seconds", f"at second {time_s:g}", f"at {time_s:g}s"))


def _in_past(question: str, when: str | None) -> str:
    """"What colour is the shape?" -> "What colour was the shape at 3.0s?" (or without a time)."""
    if question.startswith("Describe"):
        return "Describe what you saw" + (f" {when}." if when else ".")
    past = question.replace(" is ", " was ").replace(" are ", " were ").replace("do you see", "did you see")
    past = past.replace("What is ", "What was ")
    return past[:-1] + (f" {when}?" if when else "?")


def _past(answer: str) -> str:
    return answer.replace("I see", "I saw").replace(" is ", " was ").replace(" are ", " were ")


WATCH_FRAMES = 16  # the most frames of a watch's check conversation
# How a watch's condition may be worded: what is seen ("a red circle"), then one of these
SEEN = ("{thing} is visible", "there is {thing}", "{thing} is on screen", "the video shows {thing}",
        "you can see {thing}", "{thing} appears", "{thing} is shown")


def condition_for(scene: Scene, rng: np.random.Generator) -> tuple[str, str]:
    """(a condition that `scene` makes true, what it tests: "colour shape", "shape", "symbol"
    or "colour"), worded at random."""
    if scene.kind in ("shape", "count"):
        test = _pick(rng, ("colour shape", "colour shape", "shape", "colour"))
        shape = scene.shape if scene.kind == "shape" else scenes._plural(scene.shape)
        several = "" if scene.kind == "shape" else _pick(rng, ("some ", "several "))
        lead = f"{scenes.article(scene.colour).lower()} " if scene.kind == "shape" else several
        thing = {"colour shape": f"{lead}{scene.colour} {shape}",
                 "shape": f"{scenes.article(shape).lower()} {shape}" if scene.kind == "shape" else f"{several}{shape}",
                 "colour": f"something {scene.colour}"}[test]
    else:
        test = _pick(rng, ("symbol", "symbol", "colour"))
        thing = f"the {scene.kind} {scene.symbol}" if test == "symbol" else f"something {scene.colour}"
    worded = _pick(rng, SEEN).format(thing=thing)
    if scene.kind == "count" and test != "colour":
        worded = worded.replace("there is", "there are").replace(" is ", " are ").replace("appears", "appear")
    return worded, test


def _holds(scene: Scene, target: Scene, condition: tuple[str, str]) -> bool | None:
    """Whether `scene` makes the condition drawn from `target` true; None where it cannot be told
    (a colour and a patterned background, which may hold it)."""
    test = condition[1]
    if test == "colour":  # the figure's colour or the background's
        if scene.colour == target.colour or scene.background == target.colour:
            return True
        return None if scene.background is None else False
    if test == "symbol":
        return scene.kind == target.kind and scene.symbol == target.symbol
    shaped = scene.kind in ("shape", "count") and scene.shape == target.shape and (scene.kind == "count") == (target.kind == "count")
    return shaped and (test == "shape" or scene.colour == target.colour)


def misses(scene: Scene, target: Scene, condition: tuple[str, str], near: bool) -> bool:
    """Whether `scene` makes the condition drawn from `target` false, as a near miss of `target`
    where `near`."""
    return _holds(scene, target, condition) is False and (not near or _near(scene, target))


def _near(scene: Scene, target: Scene) -> bool:
    """A near miss of `target`: the same shape in another colour or another shape in its colour;
    another digit or letter."""
    if target.kind in ("digit", "letter"):
        return scene.kind == target.kind
    return scene.kind == target.kind and (scene.shape == target.shape) != (scene.colour == target.colour)


class Samples:
    """Seeded generators of conversations over a pool, by kind."""

    def __init__(self, pool: Pool, names: Sequence[str], items: Sequence[int] | None = None) -> None:
        self.pool, self.names = pool, names
        allowed = set(range(len(pool)) if items is None else items)
        self.scene = [i for i in pool.scene_items() if i in allowed and pool.scenes[i].kind != "plain"]
        families = sorted({_family(pool.scenes[i]) for i in self.scene})
        self.of_family = {f: [i for i in self.scene if _family(pool.scenes[i]) == f] for f in families}
        self.besides = {f: [i for i in self.scene if _family(pool.scenes[i]) != f] for f in families}
        self.plain: dict[str, list[int]] = {}  # colour -> plain frames of it
        for i in pool.scene_items("plain"):
            if i in allowed:
                self.plain.setdefault(pool.scenes[i].colour, []).append(i)
        self.real = [i for i in pool.real_items() if i in allowed]
        self.runs = {v: [i for i in run if i in allowed] for v, run in pool.video_frames().items()}
        self.runs = {v: run for v, run in self.runs.items() if len(run) >= 8}
        self.generators: dict[str, Callable[[np.random.Generator], Sample]] = {
            "scene": self.single_scene,
            "real": self.single_real,
            "moment": self.moment,
            "needle": self.needle,
            "video": self.video,
            "watch": self.watch,
        }

    def label(self, item: int) -> str:
        """What the encoder's head sees in a real frame, as an answer."""
        return f"I see {name_of(self.names, int(self.pool.probs[item].float().argmax()))}."

    def single_scene(self, rng: np.random.Generator) -> Sample:
        item = _pick(rng, self.scene)
        qa = scene_questions(self.pool.scenes[item], rng)
        order = rng.permutation(len(qa))[: int(rng.integers(1, 4))]
        turns = [(qa[k][1], qa[k][2]) for k in order]
        return Sample([(item, self._start(rng))], turns, qa[order[-1]][0])

    def single_real(self, rng: np.random.Generator) -> Sample:
        item = _pick(rng, self.real)
        return Sample([(item, self._start(rng))], [(_pick(rng, DESCRIBE), self.label(item))], "real")

    def moment(self, rng: np.random.Generator) -> Sample:
        """2-5 frames, scenes and real frames; a question about the one at a given time (or now)."""
        count = int(rng.integers(2, 6))
        items = [_pick(rng, self.scene if rng.random() < 0.7 else self.real) for _ in range(count)]
        times = self._times(rng, count)
        now = rng.random() < 0.2
        k = count - 1 if now else int(rng.integers(count))
        scene = self.pool.scenes[items[k]]
        if scene is None:
            task, question, answer = "real", _pick(rng, DESCRIBE[:1]), self.label(items[k])
        else:
            task, question, answer = _pick(rng, scene_questions(scene, rng))
        if now:
            question = question[:-1] + " now" + question[-1]
        else:
            question, answer = _in_past(question, _at(rng, times[k])), _past(answer)
        return Sample(list(zip(items, times, strict=True)), [(question, answer)], "moment-" + task)

    def needle(self, rng: np.random.Generator, frames: int | None = None) -> Sample:
        """A haystack of `frames` (else 3 to NEEDLE_FRAMES) real frames walking through the sample
        videos one a second, as bench.needle streams them, with one or more scenes among them (up
        to DISTRACTOR_SHARE of the frames, of every kind), some right after a plain colour frame,
        and a few plain frames alone; then one to three questions in turn, each about one frame:
        named by what came right before it ("What came right after the red background?"), by its
        time ("What was shown at 0:42?"), or by its kind where it is the only one of its kind
        ("What colour was the digit?", "What shape did you see?").

        Drawn freely, several scenes are seldom all of other kinds than one of them (with 20, one
        digit among shapes and letters comes in about 1 of 250), so the kind question would come
        only where there are few scenes. In LONE_SHARE of conversations with several, one scene
        (the "lone" one) is the only one of its kind; half the questions are about it, and half of
        those by its kind."""
        count = frames or int(rng.integers(3, NEEDLE_FRAMES + 1))
        start = 0.0 if rng.random() < 0.5 else float(rng.integers(1, 150))  # streams run for minutes
        walk = self._walk(rng, count)
        most = max(1, min(MAX_SCENES, int(DISTRACTOR_SHARE * count)))
        shown = 1 if rng.random() < 0.25 else int(rng.integers(1, most + 1))
        slots = [int(at) for at in rng.permutation(count)[:shown]]
        lone = slots[0] if shown > 1 and len(self.of_family) > 1 and rng.random() < LONE_SHARE else None
        family = _pick(rng, sorted(self.of_family)) if lone is not None else None
        for at in slots:
            if lone is None:
                walk[at] = _pick(rng, self.scene)
            else:
                walk[at] = _pick(rng, self.of_family[family] if at == lone else self.besides[family])
        # plain frames of distinct colours: right before some scenes (after-questions), and alone
        free = sorted(set(range(count)) - set(slots))
        colours = list(rng.permutation(list(self.plain))) if self.plain else []
        before: dict[int, str] = {}  # scene position -> colour of the plain frame right before it
        for at in slots:
            scene = self.pool.scenes[walk[at]]
            if at - 1 in free and colours and rng.random() < 0.6:
                options = [c for c in colours if c not in (scene.colour, scene.background)]
                if options:
                    before[at] = options[0]
                    colours.remove(options[0])
                    walk[at - 1] = _pick(rng, self.plain[options[0]])
                    free.remove(at - 1)
        for at in rng.permutation(free)[: int(rng.integers(0, 3))]:
            if colours and rng.random() < 0.5:
                walk[at] = _pick(rng, self.plain[colours.pop()])
        times = [start + i for i in range(count)]
        turns: list[tuple[str, str, str]] = []
        for _ in range(int(rng.integers(1, 4))):
            asked = self._needle_question(rng, walk, times, slots, before, lone)
            if asked[1:] not in [t[1:] for t in turns]:
                turns.append(asked)
        return Sample(list(zip(walk, times, strict=True)), [t[1:] for t in turns], turns[-1][0])

    def _needle_question(self, rng: np.random.Generator, walk: list[int], times: list[float], slots: list[int],
                         before: dict[int, str], lone: int | None) -> tuple[str, str, str]:
        """(task, question, answer) about one frame of a needle conversation: a scene named by the
        plain frame before it, by its time, or by its kind; now and then a real frame by its time.
        Half of them are about the `lone` scene, where there is one, and half of those by its kind."""
        if rng.random() < 0.1:
            at = int(rng.integers(len(walk)))
            if self.pool.scenes[walk[at]] is None:
                question = _pick(rng, TIME_QUESTIONS).format(when=_clock(rng, times[at]))
                return "needle-time", question, _past(self.label(walk[at]))
        at = lone if lone is not None and rng.random() < 0.5 else _pick(rng, slots)
        scene = self.pool.scenes[walk[at]]
        description = scene.describe()
        saw = f"I saw {description[0].lower()}{description[1:]}"
        styles = ["time"] + (["after"] if at in before else [])
        family = [s for s in slots if _family(self.pool.scenes[walk[s]]) == _family(scene)]
        if len(family) == 1:
            styles.append("kind")
        style = _pick(rng, styles + ["kind", "kind"] * ("kind" in styles) + ["after", "after"] * ("after" in styles))
        if at == lone and rng.random() < 0.5:
            style = "kind"
        if style == "after":
            return "needle-after", _pick(rng, AFTER).format(colour=before[at]), saw
        if style == "time":
            return "needle-time", _pick(rng, TIME_QUESTIONS).format(when=_clock(rng, times[at])), saw
        thing = {"shape": "shape", "count": "shapes", "digit": "digit", "letter": "letter"}[scene.kind]
        named = thing
        same_shape = [s for s in family if self.pool.scenes[walk[s]].shape == scene.shape]
        if scene.shape and len(same_shape) == 1 and rng.random() < 0.5:  # "What colour was the star?"
            named = scene.shape if scene.kind == "shape" else scenes._plural(scene.shape)
        options = [(task, question, answer) for task, question, answer in scene_questions(scene, rng)
                   if task not in ("describe", "background")]
        _, question, answer = _pick(rng, options)
        return "needle-what", _in_past(question.replace(f"the {thing}", f"the {named}"), None), _past(answer)

    def video(self, rng: np.random.Generator) -> Sample:
        """2-6 frames of one real video: what it shows overall (the head's mean), or at a time."""
        run = self._run(rng, int(rng.integers(2, 11)))
        if rng.random() < 0.5:
            mean = self.pool.probs[[item for item, _ in run]].float().mean(dim=0)
            answer = f"I see {name_of(self.names, int(mean.argmax()))}."
            return Sample(run, [(_pick(rng, DESCRIBE[:2] + ("What does the video show?",)), answer)], "video")
        k = int(rng.integers(len(run)))
        question = f"What did you see {_at(rng, run[k][1])}?"
        return Sample(run, [(question, _past(self.label(run[k][0])))], "video-moment")

    def watch(self, rng: np.random.Generator) -> Sample:
        """A watch's check: real frames walking through the sample videos one a second, the last
        1-4 of them (now) one frame held, then the check's prompt (engine/check.py) about a scene
        ("Is this true of the video now: a red circle is visible? Answer yes or no.") answered
        "Yes." or "No.", each half the time. Now shows the condition's scene where it is true;
        where not, a near miss (the same shape in another colour, another shape in the colour,
        another digit or letter), another scene or a real frame, and in half of those the
        condition's scene was shown before now and is gone. Now and then another scene earlier."""
        count = int(rng.integers(3, WATCH_FRAMES + 1))
        walk = self._walk(rng, count)
        shown = _pick(rng, self.scene)
        target = self.pool.scenes[shown]
        condition = condition_for(target, rng)
        held = int(rng.integers(1, min(4, count - 1) + 1))
        if rng.random() < 0.3:
            walk[int(rng.integers(count - held))] = _pick(rng, self.scene)
        true = rng.random() < 0.5
        if true:
            now = shown
        else:
            other = _pick(rng, ("near", "near", "scene", "real"))
            if other == "real" and condition[1] != "colour":  # a real frame may show any colour
                now = _pick(rng, self.real)
            else:
                near = other == "near" and target.kind != "count"
                now = self._matching(rng, lambda scene: misses(scene, target, condition, near))
            if count - held >= 2 and rng.random() < 0.5:  # the condition was true a while ago
                before = int(rng.integers(count - held - 1))
                walk[before] = shown
        walk[count - held :] = [now] * held
        start = 0.0 if rng.random() < 0.5 else float(rng.integers(1, 150))
        times = [start + i for i in range(count)]
        return Sample(list(zip(walk, times, strict=True)), [(prompt_text(condition[0]), "Yes." if true else "No.")],
                      "watch-yes" if true else "watch-no")

    def _matching(self, rng: np.random.Generator, test: Callable[[Scene], bool], tries: int = 200) -> int:
        """A scene of the pool that passes `test`: drawn at random, else the first that does."""
        for _ in range(tries):
            item = _pick(rng, self.scene)
            if test(self.pool.scenes[item]):
                return item
        return next(item for item in self.scene if test(self.pool.scenes[item]))

    def _walk(self, rng: np.random.Generator, count: int) -> list[int]:
        """`count` whole real frames walking through the sample videos in turn (bench.needle's
        haystack), from a random place and with a random stride."""
        step = _pick(rng, (1, 4, 7))
        walk = [run[i] for _, run in sorted(self.runs.items()) for i in range(0, len(run), step)]
        first = int(rng.integers(len(walk)))
        return [walk[(first + i) % len(walk)] for i in range(count)]

    def _start(self, rng: np.random.Generator) -> float:
        return 0.0 if rng.random() < 0.6 else float(rng.integers(1, 60))

    def _times(self, rng: np.random.Generator, count: int) -> list[float]:
        step = _pick(rng, (1.0, 1.0, 1.0, 0.5, 2.0))
        start = 0.0 if rng.random() < 0.6 else float(rng.integers(1, 60))
        return [start + i * step for i in range(count)]

    def _run(self, rng: np.random.Generator, count: int) -> list[tuple[int, float]]:
        """`count` whole frames of one video about one second apart, at their video times."""
        run = self.runs[_pick(rng, sorted(self.runs))]
        fps = len(run) / (self.pool.time_s[run[-1]] - self.pool.time_s[run[0]] + 1e-9)
        stride = max(1, round(fps * _pick(rng, (1.0, 1.0, 0.5))))
        count = min(count, (len(run) - 1) // stride + 1)
        first = int(rng.integers(0, len(run) - (count - 1) * stride))
        items = [run[first + i * stride] for i in range(count)]
        return [(i, round(self.pool.time_s[i], 1)) for i in items]


# -- tokens --------------------------------------------------------------------------------------


class Layout:
    """Token ids of a sample as a session runs them, after the opening with the system prompt."""

    def __init__(self, model: Model) -> None:
        self.model = model
        chat = model.chat
        self.to_assistant = model.tokenize(chat.user_to_assistant)
        self.to_user = model.tokenize(chat.assistant_to_user)
        if self.to_user[0] not in model.stop_ids:
            raise ValueError("the chat's closing marker does not start with a stop token")
        self.newline = model.tokenize("\n")

    def opening(self, system_prompt: str) -> list[int]:
        return self.model.tokenize(self.model.chat.open(system_prompt))

    def ids(self, sample: Sample) -> tuple[list[int], list[int], list[int]]:
        """(ids with TOKENS_PER_FRAME VISUAL placeholders per frame, the pool item of each frame,
        the target of each position: the next token where it is trained, else IGNORE). The ids end
        at the last trained position."""
        ids: list[int] = []
        items: list[int] = []
        targets: list[int] = []
        for item, time_s in sample.frames:
            marker = self.model.tokenize(f"[{float(time_s):.1f}s]")
            ids += marker + [VISUAL] * TOKENS_PER_FRAME + self.newline
            items.append(item)
        for question, answer in sample.turns:
            ids += self.model.tokenize(question, user=True) + self.to_assistant
            answer_ids = self.model.tokenize(answer) + self.to_user
            first = len(ids)
            ids += answer_ids
            targets += [IGNORE] * (first - 1 - len(targets)) + answer_ids[: len(answer_ids) - len(self.to_user) + 1]
        return ids[: len(targets)], items, targets
