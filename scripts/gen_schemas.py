#!/usr/bin/env python
"""Regenerate schemas/job.schema.json and schemas/labels.schema.json (CI checks they are fresh)."""

import json
from pathlib import Path

from batchvlm.job import json_schema as job_schema
from batchvlm.output.rows import json_schema as labels_schema

ROOT = Path(__file__).resolve().parents[1]


def render() -> dict[str, str]:
    return {"job.schema.json": json.dumps(job_schema(), indent=2) + "\n",
            "labels.schema.json": json.dumps(labels_schema(), indent=2) + "\n"}


if __name__ == "__main__":
    for name, text in render().items():
        (ROOT / "schemas" / name).write_text(text)
        print(ROOT / "schemas" / name)
