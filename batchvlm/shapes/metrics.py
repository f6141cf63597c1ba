"""Scoring labels against shapes ground truth with SHAPES.md's metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from .world import Scene


def iou(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def match_boxes(pred: list[tuple[float, ...]], truth: list[tuple[float, ...]], threshold: float = 0.5) -> int:
    """Greedy one-to-one matching by IoU -> true positives."""
    pairs = sorted(((iou(p, t), i, j) for i, p in enumerate(pred) for j, t in enumerate(truth)), reverse=True)
    used_p, used_t, tp = set(), set(), 0
    for score, i, j in pairs:
        if score >= threshold and i not in used_p and j not in used_t:
            used_p.add(i), used_t.add(j)
            tp += 1
    return tp


def match_points(pred: list[tuple[float, float]], truth: list[tuple[float, ...]]) -> int:
    """A point counts when inside a matching box; each box is matched once."""
    used, tp = set(), 0
    for x, y in pred:
        for j, b in enumerate(truth):
            if j not in used and b[0] <= x <= b[2] and b[1] <= y <= b[3]:
                used.add(j)
                tp += 1
                break
    return tp


@dataclass
class F1:
    tp: int = 0
    n_pred: int = 0
    n_true: int = 0

    def add(self, tp: int, n_pred: int, n_true: int) -> None:
        self.tp, self.n_pred, self.n_true = self.tp + tp, self.n_pred + n_pred, self.n_true + n_true

    @property
    def value(self) -> float:
        if self.n_pred + self.n_true == 0:
            return 1.0
        return 2 * self.tp / (self.n_pred + self.n_true)


@dataclass
class Accuracy:
    hits: int = 0
    total: int = 0

    def add(self, ok: bool) -> None:
        self.hits += int(ok)
        self.total += 1

    @property
    def value(self) -> float:
        return self.hits / self.total if self.total else 1.0


@dataclass
class Scores:
    caption: Accuracy = field(default_factory=Accuracy)
    query: Accuracy = field(default_factory=Accuracy)
    detect: F1 = field(default_factory=F1)
    point: F1 = field(default_factory=F1)
    classify: Accuracy = field(default_factory=Accuracy)  # chosen labels, where the spec asks the question

    def add_caption(self, scene: Scene, text: str) -> None:
        self.caption.add(text.strip() == scene.caption())

    def add_query(self, scene: Scene, question: str, text: str) -> None:
        truth = scene.answer(question)
        if truth is not None:
            self.query.add(text.strip().lower().rstrip(".") == truth)

    def add_classify(self, scene: Scene, question: str, label: str) -> None:
        truth = scene.answer(question)
        if truth is not None:
            self.classify.add(label == truth)

    def add_detect(self, scene: Scene, query: str, boxes: list[tuple[float, ...]]) -> None:
        truth = scene.boxes(query)
        self.detect.add(match_boxes(boxes, truth), len(boxes), len(truth))

    def add_point(self, scene: Scene, query: str, points: list[tuple[float, float]]) -> None:
        truth = scene.boxes(query)
        self.point.add(match_points(points, truth), len(points), len(truth))

    def table(self) -> dict[str, float]:
        """SHAPES.md's metrics, and classify_exact once a classify label was scored."""
        table = {"caption_exact": self.caption.value, "query_exact": self.query.value,
                 "detect_f1@0.5": self.detect.value, "point_f1": self.point.value}
        if self.classify.total:
            table["classify_exact"] = self.classify.value
        return table

    def passes(self, bar: float = 0.9) -> bool:
        return all(v >= bar for v in self.table().values())
