"""Training examples: one image, several task segments packed after its shared prefix.

Layout of one packed example (positions restart at P for every segment):

    [BOS, image tokens]            P tokens, bidirectional
    [prompt, answer inputs] ...    one segment per task; sees the prefix and its own past only

Each input item is a token, a coordinate or a size (model.INPUT_*), exactly what inference
feeds. Targets sit on the item whose hidden state predicts them:
    token  next token (answer tokens, EOS, or the "another object" id / EOS of point & detect)
    coord  the next x or y (coordinate decoder)
    size   the next (w, h) (size decoder)
Coordinates and sizes fed back in are quantized to their bins, as at inference.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ..models.moondream.model import INPUT_COORD, INPUT_SIZE, INPUT_TOKEN
from .vocab import ID, TEMPLATES
from .world import COLOURS, KINDS, Scene, colour_question, COUNT_QUESTION

CONTINUE_ID = ID["<|coord|>"]  # what the model emits for "another object follows"
EOS_ID = 0
COORD_BINS, SIZE_BINS = 1024, 1024


def quantize_coord(v: float) -> float:
    return min(COORD_BINS - 1, max(0, round(v * COORD_BINS))) / COORD_BINS


def size_bin(s: float) -> float:
    """Continuous log-scale bin of a size (fraction of the image side)."""
    return (math.log2(max(s, 2**-10)) + 10.0) / 10.0 * (SIZE_BINS - 1)


def quantize_size(s: float) -> float:
    b = min(SIZE_BINS - 1, max(0, round(size_bin(s))))
    return 2.0 ** (b / (SIZE_BINS - 1) * 10.0 - 10.0)


@dataclass
class Segment:
    kind: list[int]  # INPUT_* per item
    token: list[int]
    value: list[tuple[float, float]]
    t_token: list[int]  # -100 = none
    t_coord: list[float]  # nan = none
    t_size: list[tuple[float, float]]  # nan = none

    @classmethod
    def from_prompt(cls, prompt: list[int]) -> Segment:
        n = len(prompt)
        nan = float("nan")
        return cls([INPUT_TOKEN] * n, list(prompt), [(0.0, 0.0)] * n, [-100] * n, [nan] * n, [(nan, nan)] * n)

    def push(self, kind: int, token: int = 0, value: tuple[float, float] = (0.0, 0.0)) -> None:
        nan = float("nan")
        self.kind.append(kind), self.token.append(token), self.value.append(value)
        self.t_token.append(-100), self.t_coord.append(nan), self.t_size.append((nan, nan))

    def __len__(self) -> int:
        return len(self.kind)


def text_segment(prompt: list[int], answer: list[int]) -> Segment:
    seg = Segment.from_prompt(prompt)
    for tok in answer:
        seg.t_token[-1] = tok
        seg.push(INPUT_TOKEN, tok)
    seg.t_token[-1] = EOS_ID
    return seg


def spatial_segment(prompt: list[int], objects: list[tuple[float, ...]], detect: bool) -> Segment:
    """objects: (cx, cy, w, h) left to right."""
    seg = Segment.from_prompt(prompt)
    for cx, cy, w, h in objects:
        seg.t_token[-1] = CONTINUE_ID
        seg.t_coord[-1] = cx
        seg.push(INPUT_COORD, value=(quantize_coord(cx), 0.0))
        seg.t_coord[-1] = cy
        seg.push(INPUT_COORD, value=(quantize_coord(cy), 0.0))
        if detect:
            seg.t_size[-1] = (w, h)
            seg.push(INPUT_SIZE, value=(quantize_size(w), quantize_size(h)))
    seg.t_token[-1] = EOS_ID
    return seg


def object_queries(scene: Scene, rng: random.Random, n: int, balanced: bool) -> list[str]:
    """`<kind>` / `<colour> <kind>` queries. Balanced: half plain kinds (uniform, so absent ones
    are common, as when a job asks for every kind), half colour + kind (half present).
    Otherwise mostly present ones (the first stage of the shipped run)."""
    present_ck = [f"{s.colour} {s.kind}" for s in scene.shapes]
    every_ck = [f"{c} {k}" for c in COLOURS for k in KINDS]
    if balanced:
        return [rng.choice(KINDS) if rng.random() < 0.5 else
                rng.choice(present_ck) if rng.random() < 0.5 else rng.choice(every_ck) for _ in range(n)]
    present = [s.kind for s in scene.shapes] + present_ck
    return [rng.choice(present) if rng.random() < 0.7 else rng.choice(list(KINDS) + every_ck) for _ in range(n)]


def segments_for(scene: Scene, rng: random.Random, encode, balanced: bool = True) -> list[Segment]:
    """The task segments trained on one image. `encode(text) -> ids`."""
    segs = []
    length = rng.choice(["short", "normal", "long"])
    segs.append(text_segment(TEMPLATES["caption"][length], encode(scene.caption())))
    q = TEMPLATES["query"]
    questions = [COUNT_QUESTION] + [colour_question(k) for k in KINDS if scene.answer(colour_question(k))]
    for question in rng.sample(questions, min(2, len(questions))):
        asked = question if rng.random() < 0.7 else question.capitalize()
        prompt = q["prefix"] + encode(asked) + q["suffix"] + q["suffix"]
        segs.append(text_segment(prompt, encode(scene.answer(question))))
    for kind in ("detect", "point"):
        t = TEMPLATES[kind]
        for query in object_queries(scene, rng, 2, balanced):
            boxes = scene.boxes(query)
            objs = [((b[0] + b[2]) / 2, (b[1] + b[3]) / 2, b[2] - b[0], b[3] - b[1]) for b in boxes]
            segs.append(spatial_segment(t["prefix"] + encode(" " + query) + t["suffix"], objs, kind == "detect"))
    return segs
