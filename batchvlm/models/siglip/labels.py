"""One task's raw outputs -> its column (classify is base/columns.py's, as for every family)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...tasks import args_of, column_of, kind_of
from ..base.columns import TaskOutputs


def task_values(o: TaskOutputs) -> dict[str, Any]:
    objects = o.raws[0].objects
    if kind_of(o.task) == "embed":  # a float32 numpy row (Arrow takes float16 columns' values as float16)
        half = args_of(o.task).dtype == "float16"
        return {column_of(o.task): (objects[0].astype(np.float16) if half else objects[0]) if objects else None}
    return {column_of(o.task): objects[0][0] if objects else None}  # similarity: null without a text
