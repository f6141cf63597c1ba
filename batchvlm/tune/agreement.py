"""Agreement of one setting's labels with the full budget's, per task (the full budget's labels
stand in for the truth: `tune` measures what a smaller budget changes, not accuracy).

caption / ocr: token-level F1 (lower-cased words), averaged over images. query / classify /
json: exact-match share. detect: F1 of boxes matched one-to-one at IoU >= 0.5, per object label,
pooled over images. point: F1 of points matched one-to-one within RADIUS (normalized image
units), per label, pooled. An image the full budget could not label is left out; one only the
smaller setting failed on agrees in nothing (detect / point: it misses every reference object, so
it counts only where the reference found some).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..shapes.metrics import F1, match_boxes
from ..tasks import Task, column_of, kind_of

RADIUS = 0.05  # a point agrees within 5% of the image's side
METRICS = {"caption": "token_f1", "ocr": "token_f1", "query": "exact", "classify": "exact", "json": "exact",
           "detect": "f1@iou0.5", "point": f"f1@r{RADIUS:g}"}


def token_f1(ref: str, got: str) -> float:
    a, b = Counter(ref.lower().split()), Counter(got.lower().split())
    if not a and not b:
        return 1.0
    common = sum((a & b).values())
    return 2 * common / (sum(a.values()) + sum(b.values()))


def match_near(pred: list[tuple[float, float]], ref: list[tuple[float, float]], radius: float = RADIUS) -> int:
    """Greedy one-to-one matching, nearest pairs first, within `radius` -> matches."""
    pairs = sorted(((((p[0] - r[0]) ** 2 + (p[1] - r[1]) ** 2) ** 0.5, i, j) for i, p in enumerate(pred)
                    for j, r in enumerate(ref)))
    used_p, used_r, tp = set(), set(), 0
    for d, i, j in pairs:
        if d <= radius and i not in used_p and j not in used_r:
            used_p.add(i), used_r.add(j)
            tp += 1
    return tp


@dataclass
class Mean:
    """A mean of per-image scores: token F1, or exact match as 0 / 1."""

    total: float = 0.0
    n: int = 0

    def add(self, v: float) -> None:
        self.total, self.n = self.total + v, self.n + 1

    @property
    def value(self) -> float:
        return self.total / self.n if self.n else 1.0


def _by_label(objects: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[Any, list[tuple[float, ...]]]:
    out: dict[Any, list[tuple[float, ...]]] = {}
    for o in objects:
        out.setdefault(o["label"], []).append(tuple(o[k] for k in keys))
    return out


@dataclass
class Agreement:
    """One setting's agreement, task by task, built image by image."""

    tasks: list[Task]
    scores: dict[str, Mean | F1] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for t in self.tasks:
            kind = kind_of(t)
            self.scores[column_of(t)] = F1() if kind in ("detect", "point") else Mean()

    def add(self, ref: dict[str, Any] | None, got: dict[str, Any] | None) -> None:
        if ref is None:
            return
        for t in self.tasks:
            col, kind = column_of(t), kind_of(t)
            score, r, g = self.scores[col], ref[col], None if got is None else got[col]
            if kind in ("caption", "ocr"):
                score.add(token_f1(r or "", g or "") if g is not None else 0.0)
            elif kind in ("detect", "point"):
                keys = ("x_min", "y_min", "x_max", "y_max") if kind == "detect" else ("x", "y")
                rs, gs = _by_label(r, keys), _by_label(g or [], keys)
                for label in rs.keys() | gs.keys():
                    a, b = rs.get(label, []), gs.get(label, [])
                    score.add((match_boxes if kind == "detect" else match_near)(b, a), len(b), len(a))
            else:
                score.add(float(g is not None and g == r))

    def table(self) -> dict[str, dict[str, Any]]:
        """{column: {"metric": ..., "value": ...}} in task order."""
        return {column_of(t): {"metric": METRICS[kind_of(t)], "value": round(self.scores[column_of(t)].value, 4)}
                for t in self.tasks}
