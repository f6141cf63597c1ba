"""One task's raw outputs -> its column (classify is base/columns.py's, as for every family)."""

from __future__ import annotations

from typing import Any

from ...tasks import column_of, kind_of
from ..base.columns import TaskOutputs


def task_values(o: TaskOutputs) -> dict[str, Any]:
    objects = o.raws[0].objects
    if kind_of(o.task) == "embed":
        return {column_of(o.task): list(objects[0]) if objects else None}
    return {column_of(o.task): objects[0][0] if objects else None}  # similarity: null without a text
