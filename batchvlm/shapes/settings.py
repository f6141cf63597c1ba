"""The demo trainer's settings and the schedules they define (learning rate, soft-bin width):
below the example maker, the objective and the training loop, which all read them."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class TrainSettings:
    steps: int = 30000
    batch_size: int = 32
    lr: float = 1e-3
    warmup: int = 300
    decay_from: float = 0.85  # fraction of steps after which the LR decays (cosine to 5%)
    curriculum: int = 4000  # steps until scenes of up to 3 shapes are common
    balanced_from: int = 0  # step from which object queries are balanced (examples.object_queries)
    finetune_steps: int = 0  # after `steps`: a second stage with the "colour" query mix
    finetune_lr: float = 3e-4  # its peak learning rate (then cosine to 5%)
    seed: int = 0
    ckpt_every: int = 500
    eval_every: int = 2500
    eval_images: int = 48

    @property
    def total_steps(self) -> int:
        return self.steps + self.finetune_steps


def lr_at(step: int, s: TrainSettings) -> float:
    if step >= s.steps:  # fine-tuning stage: short warm-up, then cosine to 5%
        k = step - s.steps
        if k < s.warmup:
            return s.finetune_lr * (k + 1) / s.warmup
        f = (k - s.warmup) / max(1, s.finetune_steps - s.warmup)
        return s.finetune_lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * f)))
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    start = int(s.decay_from * s.steps)
    if step < start:
        return s.lr
    f = (step - start) / max(1, s.steps - start)
    return s.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * f)))


def sigma_at(step: int, s: TrainSettings) -> float:
    """Width of the soft bin targets: wide early (any gradient toward the right place), sharp late."""
    return max(3.0, 40.0 * (1 - step / (0.5 * s.steps)))
