"""Generated scenes with known content: shapes, colours, counts, large digits and letters, backgrounds.

`draw(rng)` renders one RGB uint8 scene (SIZE x SIZE) with Pillow and returns it with its facts;
a seeded `numpy.random.Generator` makes every scene reproducible.
"""

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from engine.demo import PALETTE

SIZE = 224
COLOURS = PALETTE  # scenes are drawn in the colours the model reads frames against
SHAPES = ("circle", "square", "triangle", "star", "hexagon", "cross")
DIGITS = "0123456789"
LETTERS = "ABCDEFGHKLMNPRSTUVWXYZ"  # no I, J, O, Q: too close to 1, 0 and each other in this font
KINDS = ("shape", "digit", "letter", "count")
MIN_CONTRAST = 110  # least distance between a figure's colour and its background's (RGB units)


@dataclass(frozen=True)
class Scene:
    kind: str  # "shape" (one), "count" (several alike), "digit", "letter", or "plain" (colour only)
    colour: str  # the figure's colour
    background: str | None  # the background's colour; None for a textured background
    shape: str | None = None  # "shape" and "count"
    symbol: str | None = None  # "digit" and "letter"
    count: int = 1

    def describe(self) -> str:
        """One sentence naming everything in the scene: the answer to "What do you see?"."""
        ground = f"on {article(self.background).lower()} {self.background} background" if self.background else "on a patterned background"
        if self.kind == "shape":
            return f"{article(self.colour)} {self.colour} {self.shape} {ground}."
        if self.kind == "plain":
            return f"A plain {self.colour} background."
        if self.kind == "count":
            shapes = self.shape if self.count == 1 else _plural(self.shape)
            return f"{NUMBER_WORDS[self.count].capitalize()} {self.colour} {shapes} {ground}."
        return f"The {self.kind} {self.symbol} in {self.colour} {ground}."


NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six")


def article(word: str) -> str:
    """"A" or "An" before `word`, by its sound: an orange, a unicycle, a European, an hourglass."""
    w = word.lower()
    if w.startswith(("hour", "honest", "honour", "honor", "heir")):
        return "An"
    if w.startswith(("eu", "one", "once")) or (len(w) > 2 and w[0] == "u" and w[1] not in "aeiou" and w[2] in "aeiou"):
        return "A"  # a "you" or "w" sound: uni-, use-, ukulele
    return "An" if w[0] in "aeiou" else "A"


def _plural(shape: str) -> str:
    return shape + ("es" if shape.endswith(("x", "s")) else "s")


def draw(rng: np.random.Generator, kind: str | None = None) -> tuple[np.ndarray, Scene]:
    """A random scene of `kind` (any when None): (SIZE, SIZE, 3) uint8 pixels and its facts."""
    kind = kind or KINDS[rng.integers(len(KINDS))]
    names = list(COLOURS)
    colour = names[rng.integers(len(names))]
    solid = rng.random() < 0.8
    grounds = [n for n in names if _distance(COLOURS[n], COLOURS[colour]) >= MIN_CONTRAST]
    background = grounds[rng.integers(len(grounds))] if solid else None
    image = _background(rng, background, colour)
    pen = ImageDraw.Draw(image)
    fill = _jitter(rng, COLOURS[colour])
    if kind == "shape":
        shape = SHAPES[rng.integers(len(SHAPES))]
        radius = rng.uniform(35, 80)
        centre = rng.uniform(radius + 4, SIZE - radius - 4, size=2)
        _figure(pen, shape, centre, radius, rng.uniform(-0.25, 0.25), fill)
        return np.asarray(image), Scene(kind, colour, background, shape=shape)
    if kind == "count":
        shape = SHAPES[rng.integers(len(SHAPES))]
        count = int(rng.integers(1, 6))
        radius = rng.uniform(16, 26)
        for centre in _spread(rng, count, radius):
            _figure(pen, shape, centre, radius, rng.uniform(-0.25, 0.25), fill)
        return np.asarray(image), Scene(kind, colour, background, shape=shape, count=count)
    symbols = DIGITS if kind == "digit" else LETTERS
    symbol = symbols[rng.integers(len(symbols))]
    font = ImageFont.load_default(size=int(rng.integers(120, 180)))
    centre = SIZE / 2 + rng.uniform(-20, 20, size=2)
    pen.text(tuple(centre), symbol, fill=fill, font=font, anchor="mm")
    return np.asarray(image), Scene(kind, colour, background, symbol=symbol)


def plain(rng: np.random.Generator, colour: str) -> tuple[np.ndarray, Scene]:
    """A frame of one palette colour (slightly jittered) and nothing on it."""
    image = Image.new("RGB", (SIZE, SIZE), _jitter(rng, COLOURS[colour]))
    return np.asarray(image), Scene("plain", colour, colour)


def _distance(a: tuple[int, ...], b: tuple[int, ...]) -> float:
    return math.dist(a, b)


def _jitter(rng: np.random.Generator, rgb: tuple[int, int, int], spread: int = 14) -> tuple[int, ...]:
    return tuple(int(np.clip(c + rng.integers(-spread, spread + 1), 0, 255)) for c in rgb)


def _background(rng: np.random.Generator, name: str | None, figure: str) -> Image.Image:
    """A plain colour, or else a texture of two colours that both stand apart from the figure."""
    if name is not None:
        return Image.new("RGB", (SIZE, SIZE), _jitter(rng, COLOURS[name]))
    far = [c for n, c in COLOURS.items() if _distance(c, COLOURS[figure]) >= MIN_CONTRAST]
    a, b = (np.array(far[i], dtype=np.float32) for i in rng.choice(len(far), size=2, replace=False))
    if rng.random() < 0.5:  # a gradient
        t = np.linspace(0, 1, SIZE, dtype=np.float32)[:, None, None]
        pixels = np.broadcast_to(a * (1 - t) + b * t, (SIZE, SIZE, 3))
        if rng.random() < 0.5:
            pixels = pixels.transpose(1, 0, 2)
    else:  # blotches
        coarse = rng.random((8, 8, 1)).astype(np.float32)
        t = np.asarray(Image.fromarray((coarse[..., 0] * 255).astype(np.uint8)).resize((SIZE, SIZE), Image.Resampling.BICUBIC))
        t = (t.astype(np.float32) / 255)[..., None]
        pixels = a * (1 - t) + b * t
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def _spread(rng: np.random.Generator, count: int, radius: float) -> list[np.ndarray]:
    """`count` centres whose figures do not touch (rejection sampling, fixed by the seed)."""
    centres: list[np.ndarray] = []
    while len(centres) < count:
        candidate = rng.uniform(radius + 4, SIZE - radius - 4, size=2)
        if all(np.linalg.norm(candidate - c) > 2 * radius + 8 for c in centres):
            centres.append(candidate)
    return centres


def _figure(pen: ImageDraw.ImageDraw, shape: str, centre: np.ndarray, radius: float, turn: float, fill) -> None:
    x, y = float(centre[0]), float(centre[1])
    if shape == "circle":
        pen.ellipse((x - radius, y - radius, x + radius, y + radius), fill=fill)
        return
    if shape == "cross":
        arm = radius / 3
        outline = [(-arm, -radius), (arm, -radius), (arm, -arm), (radius, -arm), (radius, arm), (arm, arm),
                   (arm, radius), (-arm, radius), (-arm, arm), (-radius, arm), (-radius, -arm), (-arm, -arm)]
    elif shape == "star":
        outline = [_polar(radius if i % 2 == 0 else radius * 0.45, -math.pi / 2 + i * math.pi / 5) for i in range(10)]
    else:
        sides, start = {"square": (4, math.pi / 4), "triangle": (3, -math.pi / 2), "hexagon": (6, 0.0)}[shape]
        scale = 1.15 if shape == "square" else 1.0  # a square as big as the circle beside it
        outline = [_polar(radius * scale, start + i * 2 * math.pi / sides) for i in range(sides)]
    cos, sin = math.cos(turn), math.sin(turn)
    pen.polygon([(x + px * cos - py * sin, y + px * sin + py * cos) for px, py in outline], fill=fill)


def _polar(radius: float, angle: float) -> tuple[float, float]:
    return radius * math.cos(angle), radius * math.sin(angle)
