"""The job file: typed, validated, with every default defined here once.

`load_job(path)` reads YAML (job_yaml.py: at a bounded cost) and returns a `Job`, or raises
`JobError` with one line naming the field path and what was expected (job_errors.py). Relative local paths resolve against the job file's folder.
`schemas/job.schema.json` is generated from these models (`scripts/gen_schemas.py`).

Validation is strict where YAML could silently mean something else: a boolean is never a number
(`max_batch_size: true`), a number or date is never a string unless it is a revision, floats
are finite, every number is bounded, and a key given twice is an error.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from .job_errors import format_error
from .job_yaml import MAX_JOB_BYTES, JobFileRefused, read_yaml
from .tasks import SimilarityTask, Strict, Task, label_columns

RESERVED_COLUMNS = {"key", "source", "width", "height", "status", "error"}

# Concurrent sequences when engine.max_batch_size is not given, by device type. Measured with
# scripts/bench_batch_size.py (docs/benchmarks.md, "Batch size"): on CPU, larger batches only add
# allocation churn; on CUDA, the engine needs a wide batch to fill the device.
DEFAULT_MAX_BATCH_SIZE = {"cpu": 64, "cuda": 256}
MAX_BATCH_SIZE = 16384  # beyond any device's KV cache at Moondream's 730-token image prefix
# The most concurrent sequences a device type runs, whatever max_batch_size asks: on CPU a wider
# batch only adds memory (its KV cache and staging are host RAM: 16384 rows took 12 GB for 20
# tiny images), not speed (docs/benchmarks.md, "Batch size"). GPUs are bounded by their memory (engine/sizing.py).
DEVICE_MAX_BATCH_SIZE = {"cpu": 1024}

NonEmpty = Annotated[str, Field(min_length=1, pattern=r"^[^\x00]*\S[^\x00]*$")]  # and no NUL: no path holds one


class JobError(ValueError):
    pass


def is_url(path: str) -> bool:
    return "://" in path


class InputSpec(Strict):
    shards: NonEmpty | list[NonEmpty] | None = Field(
        None, description="Webdataset tar shards: paths or fsspec URLs, with {000..009} brace expansion and globs.")
    folder: NonEmpty | None = Field(None, description="A directory tree of images; each directory is split into "
                                                      "shards of at most shard_size images.")
    parquet: NonEmpty | list[NonEmpty] | None = Field(
        None, description="Parquet files (brace expansion, globs); a file of more than shard_size rows is split "
                          "into row ranges.")
    image_column: NonEmpty = Field("image", description="Parquet: column with image bytes or a path to the image.")
    key_column: NonEmpty | None = Field(None, description="Parquet: column with a sample key (default: row number).")
    image_keys: list[NonEmpty] = Field(["jpg", "jpeg", "png", "webp"], min_length=1,
                                       description="Webdataset: the extensions of the members to label (any case). Every "
                                                   "member whose extension, or last extension (img.v1.jpg), is one "
                                                   "of these is an image and its own row; the others are sidecars "
                                                   "(a folder reads every common image type).")
    shard_size: int = Field(10_000, ge=1, le=100_000_000,
                            description="Folder and Parquet input: images per shard (the unit of "
                            "output, resume and memory). The first run freezes which images each shard holds; "
                            "images added later go into new shards. Tars stay one shard each.")
    keep: list[NonEmpty] = Field([], description="Input metadata passed through as output columns. Parquet: columns "
                                 "of the input table (types kept). Tar / folder: sidecar extensions (json, txt, ...: "
                                 "the file beside the image, as a string; null when missing); folder: also `path`, "
                                 "the image's path relative to input.folder.")
    allow_damaged: bool = Field(False, description="A damaged tar (cut short, not a tar) keeps the samples before "
                                "the break either way; true = the run still exits 0.")

    @model_validator(mode="after")
    def _one_source(self) -> InputSpec:
        given = [k for k in ("shards", "folder", "parquet") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError("give exactly one of shards, folder, parquet")
        return self

    @field_validator("keep")
    @classmethod
    def _keep_names(cls, keep: list[str]) -> list[str]:
        if len(set(keep)) != len(keep):
            raise ValueError("a column is named twice")
        if clash := RESERVED_COLUMNS.intersection(keep):
            raise ValueError(f"{sorted(clash)[0]!r} is a reserved output column")
        return keep

    @property
    def kind(self) -> Literal["tar", "folder", "parquet"]:
        return "tar" if self.shards else "folder" if self.folder else "parquet"

    def fingerprint_fields(self) -> dict[str, Any]:
        """Every setting that changes which image (and which metadata) a row holds."""
        fields: dict[str, Any] = {"kind": self.kind, "keep": self.keep}
        if self.kind == "tar":
            fields["image_keys"] = self.image_keys
        else:
            fields["shard_size"] = self.shard_size
        if self.kind == "parquet":
            fields |= {"image_column": self.image_column, "key_column": self.key_column}
        return fields


class ModelSpec(Strict):
    name: NonEmpty = Field("demo", description="'demo' (built in), a Hugging Face repo id, or a local model folder.")
    family: NonEmpty = Field("auto",
                             description="auto (from the model folder's config.json) or the family it must be, "
                                         "named by config.json's model_type: moondream (the demo and Moondream 2), "
                                         "qwen3_vl, qwen3_vl_moe, qwen3_5, qwen3_5_moe, florence2, or the model_type "
                                         "of a model the transformers backend runs.")
    revision: NonEmpty | None = Field(
        None, description="Hub revision (tag, branch or commit); pin it for reproducible labels.")
    backend: Literal["auto", "native", "transformers"] = Field(
        "auto", description="native = batchvlm's own engine (a family that matches config.json); transformers = "
        "static batches through transformers' generate (pip install 'batchvlm[transformers]'); auto = native where "
        "a family matches, else transformers.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto = float32 on CPU, bfloat16 on GPU.")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="auto, cpu, cuda or cuda:N.")
    max_crops: int | None = Field(None, ge=1, le=64,
                                  description="Local crops per image (default: the model's). Fewer = faster vision.")
    min_pixels: int | None = Field(None, ge=1, description="Qwen3-VL: images are resized to at least this many pixels "
                                                           "(default: the checkpoint's preprocessor_config.json).")
    max_pixels: int | None = Field(None, ge=1, description="Qwen3-VL: images are resized to at most this many pixels "
                                                           "(default: the checkpoint's). Fewer pixels = fewer image "
                                                           "tokens: faster vision and prefill, less KV memory.")
    prune_duplicates: float | None = Field(
        None, ge=0.0, le=1.0, allow_inf_nan=False,
        description="Qwen3-VL / Qwen3.5 / Moondream: drop every image token whose pixels (Qwen: a 2x2 merge "
                    "group of patches; Moondream: a patch of the global crop) equal an already-kept neighbour's "
                    "(left or above) within this tolerance (largest difference of any pixel channel, as a share of "
                    "0-255; 0 = identical), before the vision tower and the prefill; kept tokens keep their "
                    "positions. Florence-2: after its vision tower, the image tokens of cells whose pixel footprint "
                    "repeats a kept neighbour's are left out of the encoder. Off by default. docs/tune.md.")

    @field_validator("revision", mode="before")
    @classmethod
    def _date_revision(cls, v: Any) -> Any:
        """`revision: 2025-06-21` is a tag, though YAML reads a date."""
        return v.isoformat() if isinstance(v, datetime.date) else v


class EngineSpec(Strict):
    max_batch_size: int | None = Field(
        None, ge=1, le=MAX_BATCH_SIZE,
        description="Sequences decoded concurrently (default: "
                    + ", ".join(f"{n} on {d.upper()}" for d, n in DEFAULT_MAX_BATCH_SIZE.items()) + ").")
    max_new_tokens: int = Field(128, ge=1, le=32768, description="Token limit of captions and answers.")
    max_objects: int = Field(50, ge=1, le=1000, description="Limit of points / boxes per object name.")
    temperature: float = Field(0.0, ge=0.0, le=10.0, allow_inf_nan=False, description="0 = greedy (reproducible labels).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False, description="Nucleus sampling for temperature > 0.")
    seed: int = Field(0, ge=0, lt=2**63, description="Sampling seed; each sample draws from (seed, key, task) alone.")
    pipelined: bool | Literal["auto"] = Field(
        "auto", description="auto = pipelined where the device runs asynchronously (CUDA), synchronous on CPU "
        "(nothing to overlap there); false = synchronous steps, for ablation and debugging.")
    cuda_graphs: bool = Field(True, description="Capture decode steps in CUDA graphs (CUDA only).")
    block_size: int = Field(16, ge=1, le=1024, description="KV-cache block size in tokens.")
    kv_memory_fraction: float = Field(0.85, gt=0.0, le=0.98, allow_inf_nan=False,
                                      description="Share of free accelerator memory for the KV cache.")
    max_images_in_flight: int = Field(64, ge=1, le=MAX_BATCH_SIZE, description="Images encoded but not yet fully labelled.")
    prefill_tokens_per_step: int | None = Field(
        None, ge=1, le=1 << 20,
        description="Image-prefix tokens a step prefills at most, at least one image (default: 4096 on CPU; on "
                    "CUDA sized so a step's prefill lasts about 8 decode steps: docs/engine.md).")

    def batch_size_for(self, device_type: str) -> int:
        n = self.max_batch_size or DEFAULT_MAX_BATCH_SIZE.get(device_type, DEFAULT_MAX_BATCH_SIZE["cuda"])
        return min(n, DEVICE_MAX_BATCH_SIZE.get(device_type, n))


class LoaderSpec(Strict):
    workers: int = Field(4, ge=0, le=256,
                         description="CPU processes that decode and crop images (0 = in the main process).")
    prefetch: int = Field(8, ge=1, le=1024, description="Decoded images buffered per worker.")
    max_image_pixels: int = Field(100_000_000, ge=1, le=1_000_000_000, description="Larger images become error rows.")
    jpeg_draft: bool = Field(True, description="Decode JPEGs at reduced size when the model needs fewer pixels.")


class OutputSpec(Strict):
    dir: NonEmpty = Field(description="Output folder, local or mounted (relative paths resolve against the job "
                                      "file), or s3://bucket/prefix in an S3-compatible object store.")
    compression: Literal["zstd", "snappy", "gzip", "none"] = "zstd"
    mode: Literal["resume", "overwrite"] = Field("resume", description="resume skips finished shards.")
    raw_text: bool = Field(False, description="Add <name>_raw beside each detect / point column: the decoded "
                                              "text of each object's sequence (list of {label, text}).")
    constrain: bool = Field(False, description="Native Qwen3-VL / Qwen3.5: decode detect / point answers with the "
                                               "grammar of their JSON grounding format, so every answer the token "
                                               "limit does not cut parses (compact JSON, no fence).")

    @field_validator("dir")
    @classmethod
    def _local(cls, v: str) -> str:
        if is_url(v) and not v.startswith("s3://"):  # else a local `gs:/...` folder would be made
            raise ValueError(f"{v}: an output URL is s3://bucket/prefix (other stores through their S3 API: "
                             "AWS_ENDPOINT_URL), or give a local (or mounted) folder")
        return v


class RuntimeSpec(Strict):
    gpus: Literal["all"] | Annotated[int, Field(le=1024)] | list[Annotated[int, Field(le=1023)]] = Field(
        "all", description="GPUs of this node to use, one worker process each: all, a count (>= 1), or "
        "distinct ids.")

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError("a count of GPUs must be at least 1")
        if isinstance(v, list) and (not v or min(v) < 0 or len(set(v)) != len(v)):
            raise ValueError("GPU ids must be distinct numbers >= 0, at least one")
        return v
    workers_per_node: int = Field(1, ge=1, le=1024, description="Worker processes on a machine without GPUs.")
    work_stealing: bool = Field(False, description="Claim shards with atomic files in the output folder "
                                                   "(shared filesystems; for uneven shards).")
    metrics_file: str | None = Field(None, min_length=1, description="A Prometheus text-format file (e.g. for "
                                     "node_exporter's textfile collector: name it *.prom in its folder) that a run "
                                     "rewrites atomically every few seconds: rows, errors, tokens, images/s, tokens/s, "
                                     "shards done; relative paths resolve against the job file; with several ranks, "
                                     "`{rank}` in the name, or `-rank<N>` added before the suffix.")

    @field_validator("metrics_file")
    @classmethod
    def _local_file(cls, v: str | None) -> str | None:
        if v is not None and is_url(v):
            raise ValueError(f"{v} is a URL; the metrics file is a local path (node_exporter reads a local folder)")
        return v


class Job(Strict):
    name: NonEmpty
    input: InputSpec
    model: ModelSpec = ModelSpec()
    tasks: list[Task] = Field(min_length=1)
    engine: EngineSpec = EngineSpec()
    loader: LoaderSpec = LoaderSpec()
    output: OutputSpec
    runtime: RuntimeSpec = RuntimeSpec()

    @model_validator(mode="after")
    def _columns_distinct(self) -> Job:
        """Every output column has one writer: the row's own, the tasks', `input.keep`'s."""
        owner = {c: "a column every row has" for c in RESERVED_COLUMNS}
        described = {"label": "column", "scores": "scores column", "raw": "raw text column (output.raw_text)",
                     "truncated": "truncation flag", "tokens": "token counts column"}
        for col, i, what in label_columns(self.tasks, self.output.raw_text):
            if col in owner:
                raise ValueError(f"tasks.{i}: its {described[what]} {col!r} is also {owner[col]}; give the task a "
                                 "distinct name")
            owner[col] = f"the {described[what]} of tasks.{i}"
        for col in self.input.keep:
            if col in owner:
                raise ValueError(f"input.keep: column {col!r} is also {owner[col]}; rename the task or leave the column out")
        return self

    @model_validator(mode="after")
    def _texts_kept(self) -> Job:
        """A similarity task's text travels with its image as an input.keep value."""
        for i, t in enumerate(self.tasks):
            if isinstance(t, SimilarityTask) and (col := t.similarity.text_column) not in self.input.keep:
                raise ValueError(f"tasks.{i}.similarity.text_column: {col!r} is not in input.keep; add it there (the "
                                 "text travels with its image as a kept column)")
        return self

    def label_settings(self) -> dict[str, Any]:
        """Every setting that changes labels (not inputs, not speed knobs). `model.dtype` must
        be resolved for the device first (device.py, in preflight): `auto` means different precisions."""
        e = self.engine
        return {
            # the weights hash pins the family; a local folder is named by its real path
            # prune_duplicates only where set: the prints of jobs written before it stay the same
            "model": self.model.model_dump(exclude={"device", "family"} | ({"prune_duplicates"} if
                                                                           self.model.prune_duplicates is None else set()))
                     | {"name": model_path(self.model.name)},
            "tasks": [t.model_dump(by_alias=True) for t in self.tasks],
            "engine": {k: getattr(e, k) for k in ("max_new_tokens", "max_objects", "temperature", "top_p", "seed")},
            # which image a row holds, and the pixels the model sees
            "input": self.input.fingerprint_fields(),
            "loader": {"max_image_pixels": self.loader.max_image_pixels, "jpeg_draft": self.loader.jpeg_draft},
            "raw_text": self.output.raw_text,  # changes the columns
        } | ({"constrain": True} if self.output.constrain else {})  # changes answers (absent: older jobs' prints)

    def label_fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.label_settings(), sort_keys=True).encode()).hexdigest()[:16]


def model_path(name: str) -> str:
    """`model.name` as it is compared between runs: a local folder by its real path (`./m` and
    `/abs/m` are one model), anything else (demo, a hub repo id) as written."""
    path = Path(name).expanduser()
    return os.path.realpath(path) if name != "demo" and path.is_dir() else name


def _resolve(base: Path, p: str) -> str:
    if is_url(p):
        return p
    # normpath: `jobs/../data/x.tar` is `data/x.tar` in the source column and in messages
    return os.path.normpath(base / Path(p).expanduser())  # an absolute path replaces base


def parse_job(data: Any, base: Path, source: str = "job", node: yaml.Node | None = None) -> Job:
    """`node`: the YAML the data was read from, for hints that quote the file."""
    if not isinstance(data, dict):
        raise JobError(f"{source}: expected a mapping at the top level")
    try:
        job = Job.model_validate(data, strict=True)  # YAML gives real types: `true` is no count
    except ValidationError as e:
        raise JobError(f"{source}: {format_error(e, Job, node)}") from None
    inp = job.input
    updates = {}
    for field in ("shards", "parquet"):
        value = getattr(inp, field)
        if value:
            updates[field] = [_resolve(base, v) for v in ([value] if isinstance(value, str) else value)]
    if inp.folder:
        updates["folder"] = _resolve(base, inp.folder)
    return job.model_copy(update={
        "input": inp.model_copy(update=updates),
        "output": job.output.model_copy(update={"dir": _resolve(base, job.output.dir)}),
        "runtime": job.runtime.model_copy(update={"metrics_file": job.runtime.metrics_file and _resolve(
            base, job.runtime.metrics_file)}),
    })


def load_job(path: str | Path) -> Job:
    path = Path(path)
    try:
        if (size := path.stat().st_size) > MAX_JOB_BYTES:
            raise JobError(f"{path}: {size / 2**20:.0f} MB; a job file is at most {MAX_JOB_BYTES >> 20} MB (is it "
                           "the job file?)")
        data, node = read_yaml(path.read_text(), str(path))
    except JobFileRefused as e:
        raise JobError(str(e)) from None
    except OSError as e:
        raise JobError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise JobError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise JobError(f"{path}:{where} invalid YAML: {getattr(e, 'problem', e)}") from None
    return parse_job(data, path.resolve().parent, str(path), node)


def json_schema() -> dict[str, Any]:
    schema = Job.model_json_schema()
    schema["title"] = "batchvlm job"
    return schema
