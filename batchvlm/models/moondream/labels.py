"""Moondream's raw outputs -> one image's column values: text answers decoded, points and boxes
as its grammar emitted them (already normalized to the image)."""

from __future__ import annotations

from typing import Any

from ...tasks import box_values, column_of, kind_of, point_values, truncated_column
from ..base.columns import TaskOutputs


def task_values(decode, o: TaskOutputs) -> dict[str, Any]:
    """One task's columns (base/columns.py); `decode`: the tokenizer's."""
    kind = kind_of(o.task)
    if kind in ("caption", "query"):
        value = decode(o.raws[0].tokens).strip()
    elif kind == "json":  # compact JSON as the grammar let it be written
        value = decode(o.raws[0].tokens)
    else:
        value = (point_values if kind == "point" else box_values)(o.labels, [r.objects for r in o.raws])
    return {column_of(o.task): value, truncated_column(o.task): o.cut}
