"""batchvlm command line: parses the command and hands it on. Every knob lives in the job file;
flags here are operational only.

Every failure a user can cause is one line, `batchvlm: error: <field or file>: <cause>; <fix>`
(errors.py), ending with the exit codes of exits.py; a traceback only with `--debug` (also
passed to the worker processes `run` starts). The checks before a run are run/preflight.py's.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer

from . import __version__
from .data.sources import SourceError, no_images_message
from .errors import error_line, run_failure, user_errors
from .exits import EXIT_INTERRUPTED, EXIT_JOB_ERROR
from .job import Job, JobError, load_job
from .output.layout import OutputConflict, is_store_url
from .output.store import StoreError
from .output.shardlist import skipped_note

DEBUG_ENV = "BATCHVLM_DEBUG"

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None,  # plain click help: no `<bool>` metavars on flags
                  help="Label image datasets with vision-language models: shards in, Parquet labels out.")

JOB_ARG = typer.Argument(..., help="The job file (YAML).")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"batchvlm {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    debug: bool = typer.Option(False, "--debug", help="Show the traceback of a failure."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    if debug:
        os.environ[DEBUG_ENV] = "1"


def fail(message: str, code: int = EXIT_JOB_ERROR) -> None:
    if os.environ.get(DEBUG_ENV) and sys.exc_info()[1] is not None:  # --debug: the failure's traceback too
        traceback.print_exc()
    typer.echo(error_line(message), err=True)
    raise typer.Exit(code)


@contextmanager
def _reading_output(written: Path) -> Iterator[None]:
    """preview / export: an output folder that cannot be read, or a file that cannot be written
    (`written` where the OS names none), is one line."""
    from .output.reader import OutputError

    try:
        yield
    except (OutputError, SourceError, StoreError) as e:
        fail(str(e))
    except OSError as e:
        fail(f"{e.filename or written}: {e.strerror}")


def _load(path: Path) -> Job:
    try:
        return load_job(path)
    except JobError as e:
        fail(str(e))


@app.command()
def run(
    job_file: Path = JOB_ARG,
    limit: int | None = typer.Option(None, "--limit", min=1, help="Stop after N images (a quick look; "
                                                                   "shards cut short are redone next run)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Delete existing output and start over."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate and show what would run; load nothing."),
    ray: str | None = typer.Option(None, "--ray", metavar="ADDRESS",
                                   help="Run one rank per GPU (or CPU slot) of a Ray cluster: auto (RAY_ADDRESS or "
                                        "this machine's cluster), local, HOST:PORT or ray://HOST:PORT."),
) -> None:
    """Label every pending shard of JOB_FILE (finished shards are skipped)."""
    job = _load(job_file)  # a job file refused here never waits for torch to import
    try:
        if dry_run:
            _dry_run(job, overwrite)
            return
        if ray is not None:
            from .run.ray import run_on_ray

            code = run_on_ray(job, ray, limit, overwrite)
        else:
            from .run.launch import run_here

            code = run_here(job_file, job, limit, overwrite)
    except KeyboardInterrupt as e:  # the second Ctrl-C (StopFlag): no summary to wait for
        from .run.stop import interrupted_line

        typer.echo(interrupted_line(e, job_file), err=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except Exception as e:
        if (failure := run_failure(e, job.output.dir)) is None:
            raise  # a bug: main() makes it one line
        fail(failure[1], failure[0])
    raise typer.Exit(code)


def _dry_run(job: Job, overwrite: bool) -> None:
    from .dist import resolve_rank
    from .run.preflight import clears, preflight

    pre = preflight(job, clears(job, overwrite), resolve_rank(), dry=True)
    from .run.extending import to_extend

    done, kept = pre.done(), pre.kept()
    gaining = sum(map(len, to_extend(pre.layout, done, pre.job).values()))  # a job that gained tasks
    typer.echo(f"job {pre.job.name}: {len(pre.shards)} shard(s), {len(done)} done, "
               f"{len(pre.shards) - len(done) - len(kept)} to label"
               + (f", {gaining} done shard(s) to gain the new tasks' columns" if gaining else ""))
    typer.echo(f"model {pre.job.model.name} (revision {pre.job.model.revision or 'default'}), "
               f"{len(pre.job.tasks)} task(s), output {pre.layout.dir}")
    _warn_kept(kept)


def _warn_kept(kept: list[str]) -> None:
    """Done shards whose input files are all gone (an unmounted mount point): not relabelled."""
    for note in kept:
        typer.echo(f"  warning: shard {note}; a run keeps them and exits 1")


@app.command()
def validate(job_file: Path = JOB_ARG) -> None:
    """Check JOB_FILE, its inputs and its output folder without loading a model."""
    job = _load(job_file)
    from .dist import resolve_rank
    from .run.preflight import clears, preflight

    try:
        pre = preflight(job, clears(job, False), resolve_rank(), dry=True)
    except (*user_errors(), ValueError) as e:  # ValueError: an inconsistent rank environment
        fail(str(e))
    job, shards, images = pre.job, pre.shards, pre.images()
    images = f"{images} image(s), " if images is not None else ""
    skipped = f"; {skipped_note(shards.skipped)}" if shards.skipped else ""
    typer.echo(f"{job_file}: ok ({len(shards)} shard(s), {images}{len(job.tasks)} task(s), {job.model.device}, "
               f"{job.model.dtype}){skipped}")
    device_type, asked = job.model.device.split(":")[0], job.engine.max_batch_size
    if asked and (runs := job.engine.batch_size_for(device_type)) < asked:
        typer.echo(f"  engine.max_batch_size: {asked} is more than {device_type.upper()} runs; it runs {runs}")
    _warn_kept(pre.kept())


@app.command()
def status(
    target: str = typer.Argument(..., help="The job file, or its output folder (or s3://bucket/prefix)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable."),
) -> None:
    """Progress from the output folder: shards done / partial / failed / pending, rows, errors."""
    from .output.reader import Output, OutputError
    from .status import collect

    try:
        job = Output.open(target).job if is_store_url(target) or Path(target).is_dir() else _load(Path(target))
        report = collect(job)
    except (OutputError, SourceError, OutputConflict, StoreError) as e:
        fail(str(e))
    if as_json:
        typer.echo(json.dumps(report, indent=1))
        return
    typer.echo(f"{job.name}: {report['done']}/{report['shards'] or '?'} shards done, {report['partial']} partial, "
               f"{report['failed']} failed, {report['pending'] if report['pending'] is not None else '?'} pending, "
               f"{report['damaged']} damaged{_also_running_changed(report)}; {report['rows']} rows, {report['errors']} errors, "
               f"{report['tokens']['prompt']} prompt + {report['tokens']['generated']} generated tokens")
    if report["skipped"]:
        typer.echo(f"  {report['skipped']}")
    if report["inputs_missing"]:
        typer.echo(f"  inputs not found ({report['inputs_missing']}): pending shards unknown")
    for line in report["damaged_shards"][:10]:
        typer.echo(f"  damaged: {line}")
    if report["no_images"]:
        typer.echo(f"  {no_images_message(job.input, report['shards'])}")
    elif names := report["no_image_shards"]:
        typer.echo(f"  holding no image: {', '.join(names[:10])}{', ...' if len(names) > 10 else ''}")
    for name in report["running_shards"][:10]:
        typer.echo(f"  running: {name} (held by a live run)")
    for name in report["changed_shards"][:10]:
        typer.echo(f"  done, input changed: {name} (its rows stay until the next run relabels it)")
    for name in report["partial_shards"][:10]:
        typer.echo(f"  partial: {name}")
    for line in report["failed_shards"][:10]:
        typer.echo(f"  failed: {line}")
    for line in report["kept_shards"][:10]:
        typer.echo(f"  kept: {line}")


def _also_running_changed(report: dict) -> str:
    return "".join(f", {report[k]} {k}" for k in ("running", "changed") if report[k])


@app.command()
def preview(
    output_dir: str = typer.Argument(..., help="A job's output folder (or s3://bucket/prefix)."),
    n: int = typer.Option(200, "--n", min=1, help="Rows to show, in shard order."),
    out: Path = typer.Option(Path("preview.html"), "-o", "--out", help="The HTML file to write."),
) -> None:
    """A self-contained HTML page: thumbnails with boxes and points, answers, errors, filters."""
    from .preview import write

    with _reading_output(out):
        cards = write(output_dir, n, out)
    typer.echo(f"{out}: {cards} rows")


@app.command("export")
def export_cmd(
    fmt: str = typer.Argument(..., metavar="FORMAT", help="coco or yolo."),
    output_dir: str = typer.Argument(..., help="A job's output folder (or s3://bucket/prefix)."),
    dest: Path = typer.Argument(..., help="Folder to write the export to."),
    with_images: bool = typer.Option(False, "--with-images", help="Also write the images (EXIF-oriented)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an export already in DEST."),
) -> None:
    """Detection boxes as COCO or YOLO, plus captions.jsonl with the text answers."""
    from .export import export

    if fmt not in ("coco", "yolo"):
        fail(f"FORMAT must be coco or yolo, not {fmt!r}")
    with _reading_output(dest):
        counts = export(output_dir, dest, fmt, with_images, overwrite)
    typer.echo(f"{dest}: {counts['images']} images, {counts['annotations']} boxes, "
               f"{counts['categories']} categories ({fmt})")


@app.command()
def tune(
    job_file: Path = JOB_ARG,
    sample: int | None = typer.Option(None, "--sample", min=1, help="Images drawn from the job's inputs (default: "
                                      "200, or all of them where they hold fewer)."),
    seed: int = typer.Option(0, "--seed", min=0, help="Which images are drawn (the same seed, the same images)."),
    budgets: str | None = typer.Option(None, "--budgets", help="Comma-separated settings of the family's budget knob "
                                       "(Qwen max_pixels, Moondream max_crops) and prune[:TOL]; default: the "
                                       "family's ladder."),
    json_path: Path | None = typer.Option(None, "--json", help="The JSON report (default: <job name>.tune.json)."),
    plot: Path | None = typer.Option(None, "--plot", help="The PNG plot (default: <job name>.tune.png)."),
    no_plot: bool = typer.Option(False, "--no-plot", help="Write no plot."),
) -> None:
    """Label a sample of JOB_FILE's images at the full visual budget and smaller ones: tokens, images/s
    and agreement with the full budget per task (docs/tune.md). Writes nothing into the job's output."""
    job = _load(job_file)
    from .tune.command import TuneArgs, tune as run_tune

    args = TuneArgs(sample, seed, budgets, json_path or Path(f"{job.name}.tune.json"),
                    None if no_plot else plot or Path(f"{job.name}.tune.png"), plot is not None)
    try:
        typer.echo(run_tune(job, args))
    except user_errors() as e:
        fail(str(e))


def main() -> None:
    """The console entry point: an unexpected failure is one line unless --debug. (Usage
    errors, --help and exits are click's: they end in SystemExit, which passes.)"""
    try:
        app(prog_name="batchvlm")
    except Exception as e:  # noqa: BLE001 - the one place a bug becomes one line
        if os.environ.get(DEBUG_ENV):
            raise
        where = f" ({e.filename})" if isinstance(e, OSError) and e.filename else ""
        typer.echo(f"batchvlm: error: {type(e).__name__}: {e}{where} (run with --debug for the traceback)",
                   err=True)
        sys.exit(1)


if __name__ == "__main__":
    sys.exit(main())
