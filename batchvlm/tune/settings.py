"""The settings `tune` labels the sample at: the full budget first (the reference), then smaller
settings of the family's knob (models/base/budget.py), then duplicate pruning at the full budget.

`--budgets` is a comma-separated list: an integer is a setting of the knob (Qwen max_pixels,
Moondream max_crops); `prune` or `prune:TOL` is model.prune_duplicates at TOL (default 0) at
the full budget. Without it: the family's default ladder, and `prune:0` where the family prunes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError
from ..job import JobError, ModelSpec
from ..models.base.budget import Budget


@dataclass(frozen=True)
class Setting:
    name: str  # as the table shows it: "full", "max_pixels=65536", "prune=0"
    value: int | None  # the knob's setting; None: the job's own (full)
    prune: float | None = None  # model.prune_duplicates

    def spec(self, base: ModelSpec, budget: Budget | None) -> ModelSpec:
        """The job's model section at this setting (pruning off unless the setting prunes)."""
        update: dict = {"prune_duplicates": self.prune}
        if budget is not None and self.value is not None:
            update[budget.field] = self.value
        return base.model_copy(update=update)


FULL = Setting("full", None)


def _prune(item: str) -> Setting:
    tol = item.partition(":")[2] or "0"
    try:
        value = float(tol)
    except ValueError:
        raise UsageError(f"--budgets: {item!r}: the tolerance must be a number in [0, 1]") from None
    if not 0.0 <= value <= 1.0:
        raise UsageError(f"--budgets: {item!r}: the tolerance must be in [0, 1]")
    return Setting(f"prune={value:g}", None, value)


def settings_for(family_name: str, budget: Budget | None, can_prune: bool, asked: str | None) -> list[Setting]:
    """-> the full setting then the others, each once; refuses (UsageError naming --budgets)
    a value outside the knob's range, a knob or pruning the family does not have, and a family
    with nothing to vary."""
    if asked is None:
        return _defaults(family_name, budget, can_prune)
    out: list[Setting] = [FULL]
    for item in (i.strip() for i in asked.split(",") if i.strip()):
        setting = _asked(item, family_name, budget, can_prune)
        if setting not in out:
            out.append(setting)
    if len(out) == 1:
        raise UsageError("--budgets: only the full budget; name a smaller setting or prune[:TOL]")
    return out


def _defaults(family_name: str, budget: Budget | None, can_prune: bool) -> list[Setting]:
    """Without --budgets: the knob's ladder, then prune:0 where the family prunes."""
    if budget is None and not can_prune:
        raise UsageError(f"tune: {family_name} has no visual budget to vary (its images have one fixed size) "
                         "and cannot prune duplicate visual tokens")
    out = [Setting(f"{budget.field}={v}", v) for v in budget.ladder] if budget else []
    if not out and not can_prune:
        raise JobError(f"tune: model.{budget.field} is {budget.full}, the smallest {family_name} takes: "
                       "nothing smaller to compare; set it higher in the job file")
    return [FULL, *out, *([_prune("prune:0")] if can_prune else [])]


def _asked(item: str, family_name: str, budget: Budget | None, can_prune: bool) -> Setting:
    """One --budgets item: an integer setting of the knob, or prune[:TOL]."""
    if item == "prune" or item.startswith("prune:"):
        if not can_prune:
            raise UsageError(f"--budgets: {item!r}: {family_name} cannot prune duplicate visual tokens "
                             "(native Qwen3-VL, Qwen3.5, Florence-2 and Moondream can)")
        return _prune(item)
    try:
        value = int(item)
    except ValueError:
        raise UsageError(f"--budgets: {item!r} is neither an integer setting nor prune[:TOL]") from None
    if budget is None:
        raise UsageError(f"--budgets: {value}: {family_name} has no visual budget knob (one fixed size); "
                         "only prune[:TOL] applies")
    try:
        budget.check(value)
    except ValueError as e:
        raise UsageError(f"--budgets: {e}") from None
    return FULL if value == budget.full else Setting(f"{budget.field}={value}", value)
