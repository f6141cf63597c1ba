"""A family's visual budget: the one `model.*` knob that sets how many visual tokens (or how
much vision work) an image costs, its range, and the smaller settings `batchvlm tune` tries by
default. Qwen: `max_pixels`; Moondream: `max_crops`; a family with a fixed size has none."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Budget:
    field: str  # the ModelSpec field (model.<field> in the job file)
    lo: int  # the smallest setting the family accepts
    full: int  # the job's setting (or the checkpoint's default): the most this job spends
    ladder: tuple[int, ...]  # smaller settings tried by default, largest first (each in [lo, full))

    def check(self, value: int) -> None:
        """Refuse a setting outside [lo, full] (ValueError naming the knob)."""
        if not self.lo <= value <= self.full:
            raise ValueError(f"{value} is outside model.{self.field}'s range [{self.lo}, {self.full}] (the job's "
                             "setting is the full budget)")


def halvings(full: int, lo: int, steps: int = 3) -> tuple[int, ...]:
    """full/2, full/4, ... (`steps` of them), each at least `lo`, without repeats."""
    out: list[int] = []
    for k in range(1, steps + 1):
        v = max(lo, full >> k)
        if v < full and v not in out:
            out.append(v)
    return tuple(out)
