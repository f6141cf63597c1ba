"""The "shapes" world the demo model knows (shared/design/SHAPES.md): images and ground truth.

`draw_scene(rng)` follows the spec exactly; `Variation` widens it for training so the model
does not overfit to one generator's quirks (anti-aliased edges, slightly flatter triangles,
JPEG artefacts).
"""

from __future__ import annotations

import io
import random
from dataclasses import asdict, dataclass

from PIL import Image, ImageDraw

KINDS = ("circle", "square", "triangle")
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 200, 40)}
NUMBERS = ("zero", "one", "two", "three")
COUNT_QUESTION = "how many shapes are there?"


def colour_question(kind: str) -> str:
    return f"what color is the {kind}?"


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    box: tuple[int, int, int, int]  # pixel bbox, x0, y0 inclusive, x1, y1 exclusive

    @property
    def cx(self) -> float:
        return (self.box[0] + self.box[2]) / 2


@dataclass
class Scene:
    width: int
    height: int
    shapes: list[Shape]  # left to right by bbox centre x

    def norm_box(self, s: Shape) -> tuple[float, float, float, float]:
        x0, y0, x1, y1 = s.box
        return (x0 / self.width, y0 / self.height, x1 / self.width, y1 / self.height)

    def matching(self, query: str) -> list[Shape]:
        """Shapes named by `<kind>` or `<colour> <kind>`, left to right."""
        words = query.split()
        return [s for s in self.shapes if s.kind == words[-1] and (len(words) == 1 or s.colour == words[0])]

    def caption(self) -> str:
        parts = [f"a {s.colour} {s.kind}" for s in self.shapes]
        text = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
        return text + "."

    def boxes(self, query: str) -> list[tuple[float, float, float, float]]:
        return [self.norm_box(s) for s in self.matching(query)]

    def points(self, query: str) -> list[tuple[float, float]]:
        return [((b[0] + b[2]) / 2, (b[1] + b[3]) / 2) for b in self.boxes(query)]

    def answer(self, question: str) -> str | None:
        """Ground truth for the two question forms; None when the spec would not ask it."""
        q = question.strip().lower()
        if q == COUNT_QUESTION:
            return NUMBERS[len(self.shapes)]
        for kind in KINDS:
            if q == colour_question(kind):
                same = [s for s in self.shapes if s.kind == kind]
                return same[0].colour if len(same) == 1 else None
        return None

    def questions(self) -> list[str]:
        return [COUNT_QUESTION] + [colour_question(k) for k in KINDS if self.answer(colour_question(k))]

    def to_json(self) -> dict:
        return {"width": self.width, "height": self.height, "shapes": [asdict(s) for s in self.shapes]}

    @classmethod
    def from_json(cls, d: dict) -> Scene:
        return cls(d["width"], d["height"], [Shape(s["kind"], s["colour"], tuple(s["box"])) for s in d["shapes"]])


@dataclass(frozen=True)
class Variation:
    """How far training images stray from the spec (all zero = the spec exactly)."""

    size_range: tuple[float, float] = (0.22, 0.40)
    triangle_height: tuple[float, float] = (1.0, 1.0)  # height / base
    jitter: int = 20
    antialias: float = 0.0  # probability of drawing at 4x and downsampling
    max_shapes: int = 3
    min_shapes: int = 1


SPEC = Variation()
TRAINING = Variation(size_range=(0.20, 0.42), triangle_height=(0.85, 1.0), jitter=24, antialias=0.3)


def _size(rng: random.Random) -> tuple[int, int]:
    while True:
        w, h = rng.randint(160, 320), rng.randint(160, 320)
        if max(w, h) <= 1.5 * min(w, h):
            return w, h


def _background(rng: random.Random) -> tuple[int, int, int]:
    lo, hi = (200, 255) if rng.random() < 0.5 else (0, 55)
    return tuple(rng.randint(lo, hi) for _ in range(3))


def _place(rng: random.Random, w: int, h: int, n: int, var: Variation) -> list[tuple[int, int, int, int, float]]:
    """n non-overlapping boxes (>= 4 px apart), fully inside; each (x0, y0, x1, y1, tri_h)."""
    m = min(w, h)
    while True:
        boxes = []
        for _ in range(200):
            side = max(36, round(rng.uniform(*var.size_range) * m))
            tri_h = rng.uniform(*var.triangle_height)
            x0, y0 = rng.randint(0, w - side), rng.randint(0, h - side)
            box = (x0, y0, x0 + side, y0 + side, tri_h)
            if all(box[0] >= b[2] + 4 or b[0] >= box[2] + 4 or box[1] >= b[3] + 4 or b[1] >= box[3] + 4 for b in boxes):
                boxes.append(box)
                if len(boxes) == n:
                    return boxes


def draw_scene(rng: random.Random, var: Variation = SPEC, n_shapes: int | None = None) -> tuple[Image.Image, Scene]:
    w, h = _size(rng)
    n = n_shapes or rng.randint(var.min_shapes, var.max_shapes)
    scale = 4 if rng.random() < var.antialias else 1
    image = Image.new("RGB", (w * scale, h * scale), _background(rng))
    draw = ImageDraw.Draw(image)
    shapes = []
    for x0, y0, x1, y1, tri_h in _place(rng, w, h, n, var):
        kind, colour = rng.choice(KINDS), rng.choice(list(COLOURS))
        fill = tuple(min(255, max(0, c + rng.randint(-var.jitter, var.jitter))) for c in COLOURS[colour])
        s = scale
        if kind == "circle":
            draw.ellipse((x0 * s, y0 * s, x1 * s - 1, y1 * s - 1), fill=fill)
        elif kind == "square":
            draw.rectangle((x0 * s, y0 * s, x1 * s - 1, y1 * s - 1), fill=fill)
        else:
            # Upright triangle on the box's bottom edge; flatter ones sit lower in the box.
            top = y1 - round((y1 - y0) * tri_h)
            draw.polygon([(x0 * s, y1 * s - 1), (x1 * s - 1, y1 * s - 1), ((x0 + x1) * s / 2, top * s)], fill=fill)
            y0 = top
        shapes.append(Shape(kind, colour, (x0, y0, x1, y1)))
    if scale > 1:
        image = image.resize((w, h), Image.Resampling.LANCZOS)
    shapes.sort(key=lambda s: s.cx)
    return image, Scene(w, h, shapes)


def encode(image: Image.Image, rng: random.Random, jpeg_share: float = 0.5) -> tuple[bytes, str]:
    """PNG or JPEG (quality 85-95) bytes, and the extension."""
    buf = io.BytesIO()
    if rng.random() < jpeg_share:
        image.save(buf, format="JPEG", quality=rng.randint(85, 95))
        return buf.getvalue(), "jpg"
    image.save(buf, format="PNG")
    return buf.getvalue(), "png"
