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

import io
import math
import random
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from ..models.base.decoding import INPUT_TOKEN
from ..models.moondream.grammar import INPUT_COORD, INPUT_SIZE
from ..models.moondream.preprocess import Preprocessor
from .settings import TrainSettings
from .vocab import ID, TEMPLATES
from .world import COLOURS, COUNT_QUESTION, KINDS, TRAINING, Scene, colour_question, draw_scene

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


def object_queries(scene: Scene, rng: random.Random, n: int, mix: str) -> list[str]:
    """`<kind>` / `<colour> <kind>` queries, drawn by one of three mixes:
    present   mostly objects in the image (the first stage of the shipped run)
    balanced  half plain kinds drawn uniformly (absent ones are common, as when a job asks
              for every kind), half colour + kind (half of those present)
    colour    a quarter plain kinds, the rest colour + kind, 60% present: binding a colour to
              the right shape among several (the fine-tuning stage)"""
    present_ck = [f"{s.colour} {s.kind}" for s in scene.shapes]
    every_ck = [f"{c} {k}" for c in COLOURS for k in KINDS]
    if mix == "balanced":
        return [rng.choice(KINDS) if rng.random() < 0.5 else
                rng.choice(present_ck) if rng.random() < 0.5 else rng.choice(every_ck) for _ in range(n)]
    if mix == "colour":
        return [rng.choice(KINDS) if rng.random() < 0.25 else
                rng.choice(present_ck) if rng.random() < 0.6 else rng.choice(every_ck) for _ in range(n)]
    present = [s.kind for s in scene.shapes] + present_ck
    return [rng.choice(present) if rng.random() < 0.7 else rng.choice(list(KINDS) + every_ck) for _ in range(n)]


def segments_for(scene: Scene, rng: random.Random, encode, mix: str = "balanced") -> list[Segment]:
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
        for query in object_queries(scene, rng, 2, mix):
            boxes = scene.boxes(query)
            objs = [((b[0] + b[2]) / 2, (b[1] + b[3]) / 2, b[2] - b[0], b[3] - b[1]) for b in boxes]
            segs.append(spatial_segment(t["prefix"] + encode(" " + query) + t["suffix"], objs, kind == "detect"))
    return segs


# ---------------------------------------------------------------- batches


def patch_targets(scene: Scene, grid: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each patch of the global crop: kind / colour class (0 = background) and geometry."""
    kind = np.zeros(grid * grid, dtype=np.int64)
    colour = np.zeros(grid * grid, dtype=np.int64)
    geom = np.full((grid * grid, 4), np.nan, dtype=np.float32)
    for s in scene.shapes:
        x0, y0, x1, y1 = scene.norm_box(s)
        for r in range(grid):
            for c in range(grid):
                px, py = (c + 0.5) / grid, (r + 0.5) / grid
                if x0 <= px <= x1 and y0 <= py <= y1:
                    i = r * grid + c
                    kind[i] = 1 + KINDS.index(s.kind)
                    colour[i] = 1 + list(COLOURS).index(s.colour)
                    geom[i] = ((x0 + x1) / 2 * grid - (c + 0.5), (y0 + y1) / 2 * grid - (r + 0.5),
                               math.log2(x1 - x0), math.log2(y1 - y0))
    return kind, colour, geom


@dataclass
class Batch:
    crops: torch.Tensor  # uint8 [B, S, S, 3]
    kind: torch.Tensor  # [B, T] INPUT_* of segment items
    token: torch.Tensor  # [B, T]
    value: torch.Tensor  # [B, T, 2]
    pos: torch.Tensor  # [B, T] positions (segments restart at P)
    seg: torch.Tensor  # [B, T] segment id (0 = padding)
    t_token: torch.Tensor  # [B, T]
    t_coord: torch.Tensor  # [B, T]
    t_size: torch.Tensor  # [B, T, 2]
    p_kind: torch.Tensor  # [B, grid*grid]
    p_colour: torch.Tensor
    p_geom: torch.Tensor  # [B, grid*grid, 4]

    def to(self, device: torch.device) -> Batch:
        return Batch(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def max_shapes_at(step: int, curriculum: int) -> int:
    f = step / max(1, curriculum)
    return 1 if f < 0.15 else 2 if f < 0.4 else 3


def make_batch(step: int, settings: TrainSettings, pre: Preprocessor, encode, prefix_len: int) -> Batch:
    rng = random.Random(f"{settings.seed}/{step}")
    crops, segs_per_image, targets = [], [], []
    top = max_shapes_at(step, settings.curriculum)
    for _ in range(settings.batch_size):
        image, scene = draw_scene(rng, TRAINING, n_shapes=rng.randint(1, top))
        if rng.random() < 0.5:  # JPEG artefacts, as in real shards
            buf = io.BytesIO()
            image.save(buf, format="JPEG", quality=rng.randint(80, 95))
            image = Image.open(buf).convert("RGB")
        crops.append(pre(image).crops[0])
        mix = "present" if step < settings.balanced_from else "balanced" if step < settings.steps else "colour"
        segs_per_image.append(segments_for(scene, rng, encode, mix))
        targets.append(patch_targets(scene, pre.vision.grid))
    return collate(crops, segs_per_image, targets, prefix_len)


def collate(crops, segs_per_image: list[list[Segment]], targets, prefix_len: int) -> Batch:
    B = len(crops)
    T = max(sum(len(s) for s in segs) for segs in segs_per_image)
    kind = torch.zeros(B, T, dtype=torch.long)
    token = torch.zeros(B, T, dtype=torch.long)
    value = torch.zeros(B, T, 2)
    pos = torch.full((B, T), prefix_len, dtype=torch.long)
    seg_id = torch.zeros(B, T, dtype=torch.long)
    t_token = torch.full((B, T), -100, dtype=torch.long)
    t_coord = torch.full((B, T), float("nan"))
    t_size = torch.full((B, T, 2), float("nan"))
    for b, segs in enumerate(segs_per_image):
        at = 0
        for k, s in enumerate(segs):
            n = len(s)
            sl = slice(at, at + n)
            kind[b, sl], token[b, sl] = torch.tensor(s.kind), torch.tensor(s.token)
            value[b, sl] = torch.tensor(s.value)
            pos[b, sl] = torch.arange(prefix_len, prefix_len + n)
            seg_id[b, sl] = k + 1
            t_token[b, sl], t_coord[b, sl] = torch.tensor(s.t_token), torch.tensor(s.t_coord)
            t_size[b, sl] = torch.tensor(s.t_size)
            at += n
    p_kind, p_colour, p_geom = (torch.from_numpy(np.stack(x)) for x in zip(*targets))
    return Batch(torch.stack(crops), kind, token, value, pos, seg_id, t_token, t_coord, t_size,
                 p_kind, p_colour, p_geom)
