"""batchvlm inside a Ray Data pipeline: a class UDF for `map_batches`.

    ds = ray.data.read_parquet("s3://bucket/images/")          # a column of image bytes or paths
    ds = ds.map_batches(Labeler, fn_constructor_kwargs={"job": "job.yaml"},
                        batch_size=256, num_gpus=1, concurrency=4)
    ds.write_parquet("s3://bucket/labels/")

Each actor builds the job's model family and engine once; each batch comes back with its own
columns plus the label columns of `batchvlm run`'s Parquet output (width, height, status, error,
one per task, the truncation flags, the token counts) in the same Arrow types. An image that cannot be read or
decoded is a row with status `error`, never an exception. The job file's model, tasks, engine
and loader sections apply; its input and output sections do not (Ray reads and writes).
Delivery is Ray's: a task retried after a failure labels its batch again (at-least-once), and
nothing here resumes; `batchvlm run --ray` gives exactly-once shards with resume. Ray is not
imported here: the class is a plain callable that Ray runs on its actors.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pyarrow as pa

from ..data.loader import prepare
from ..data.sources import image_cells
from ..device import for_device
from ..dist import Rank
from ..job import Job, load_job, parse_job
from ..tasks import SimilarityTask, token_columns

IDENTITY = ("key", "source")  # Parquet output columns that name a shard's sample: the pipeline has its own


class Labeler:
    def __init__(self, job: str | os.PathLike | dict[str, Any] | Job, image_column: str | None = None,
                 key_column: str | None = None):
        """`job`: a job file, its parsed YAML (relative paths against the working folder) or a Job.
        `image_column`: image bytes, a path / URL (fsspec), or a {bytes, path} struct; default
        the job's `input.image_column` for Parquet input, else "image". `key_column`: the sample
        key that seeds sampling (temperature > 0), as `input.key_column` in `batchvlm run`;
        default the job's, else a hash of the image bytes."""
        from ..engine.engine import EngineLabeler
        from ..engine.images import ImageLabeler
        from ..models import registry
        from ..models.base.contract import ImageModel, StaticModel
        from ..output.writer import schema

        if isinstance(job, dict):
            job = parse_job(job, Path.cwd())
        elif not isinstance(job, Job):
            job = load_job(job)
        self.job = job = for_device(job, Rank(0, 1, 0))
        parquet = job.input.kind == "parquet"
        self.input = job.input.model_copy(update={
            "image_column": image_column or (job.input.image_column if parquet else "image"),
            "key_column": key_column if key_column or not parquet else job.input.key_column, "keep": []})
        self.family = registry.open_family(job.model)
        self.seqs = self.family.sequences(job.tasks, job.engine, job.output.constrain)
        self.preprocess = self.family.preprocessor()
        model = self.family.load(job.model.dtype, job.model.device)
        self.labeler = (model.labeler(self.seqs, job.engine) if isinstance(model, StaticModel)
                        else ImageLabeler(model, self.seqs, job.engine) if isinstance(model, ImageModel)
                        else EngineLabeler(model, self.seqs, job.engine, self.family.max_prefix_len()))
        # a similarity task's text: a column of the batch, as input.keep would pass it in a run
        self.texts = [t.similarity.text_column for t in job.tasks if isinstance(t, SimilarityTask)]
        full = schema(job.tasks, {}, [], job.output.raw_text, self.family.embed_dim)
        self.schema = pa.schema([f for f in full if f.name not in IDENTITY])

    def __call__(self, batch: Any) -> pa.Table:
        table = _to_arrow(batch)
        if self.input.image_column not in table.column_names:
            raise KeyError(f"Labeler: the batch has no column {self.input.image_column!r} (has {table.column_names}); "
                           "pass image_column=")
        # the cells are read as `batchvlm run` reads a Parquet input's: bytes, path or struct
        encoded = list(image_cells(table, 0, self.input, os.getcwd()))
        samples = [prepare(enc, self.preprocess, self.job.loader, 0, i) for i, enc in enumerate(encoded)]
        rows: list[dict[str, Any]] = [{"width": s.width or None, "height": s.height or None,
                                       "status": "error" if s.error else "ok", "error": s.error} for s in samples]
        for s in samples:  # the key seeds sampling: without a key column, the image's bytes name it
            if not self.input.key_column and s.error is None:
                s.key = _digest(encoded[s.index].data)
            if self.texts:
                s.meta = {c: table.column(c)[s.index].as_py() for c in self.texts if c in table.column_names}
        for s, raws in self.labeler.label([s for s in samples if s.error is None]):
            rows[s.index] |= self.family.columns(self.job.tasks, self.seqs, raws, s.seen) \
                | token_columns(self.job.tasks, self.seqs, raws)
        labels = pa.Table.from_pylist(rows, schema=self.schema)
        for name in labels.column_names:  # a label column replaces an input column of its name
            if name in table.column_names:
                table = table.drop_columns([name])
            table = table.append_column(labels.schema.field(name), labels.column(name))
        return table


def _to_arrow(batch: Any) -> pa.Table:
    """Ray's batch formats (numpy dict, pandas, pyarrow) -> Arrow."""
    if isinstance(batch, pa.Table):
        return batch
    if isinstance(batch, dict):
        return pa.table({k: pa.array(list(v)) if getattr(v, "ndim", 1) == 1 else pa.array([x.tolist() for x in v])
                         for k, v in batch.items()})
    return pa.Table.from_pandas(batch, preserve_index=False)


def _digest(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()
