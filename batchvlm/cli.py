"""batchvlm command line. Every knob lives in the job file; flags here are operational only.

Every failure a user can cause is one line, `batchvlm: error: <field or file>: <cause>; <fix>`,
exit code 2 for a job that cannot run as written (do not retry), 1 for a run that failed, 75 for
one to run again, 130 for a second Ctrl-C (exits.py); a traceback only with `--debug` (also
passed to the worker processes `run` starts).
"""

from __future__ import annotations

import errno
import json
import os
import sys
import traceback
from pathlib import Path

import typer

from . import __version__
from .data.sources import SourceError, check_first_parquet, count_samples, list_files, no_images_message
from .exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_JOB_ERROR, EXIT_STOPPED
from .job import Job, JobError, load_job
from .output import manifest
from .output.layout import Layout
from .output.lock import RunLockHeld
from .output.placement import check_apart_from_inputs, check_writable
from .output.shardlist import ShardList, plan, skipped_note
from .output.writer import OutputWriteError, write_failure

DEBUG_ENV = "BATCHVLM_DEBUG"

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None,  # plain click help: no `<bool>` metavars on flags
                  help="Label image datasets with vision-language models: shards in, Parquet labels out.")

JOB_ARG = typer.Argument(..., help="The job file (YAML).")


def user_errors() -> tuple[type[Exception], ...]:
    """The failures a user can cause. Imported by the commands that open a model only: status,
    preview, export, --help and --version start without torch (most of a run's start-up)."""
    from .models.base.errors import FamilyError, ModelLoadError

    return JobError, SourceError, ModelLoadError, FamilyError, manifest.OutputConflict


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
    typer.echo(f"batchvlm: error: {message}", err=True)
    raise typer.Exit(code)


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
    from .data.loader import SharedMemoryFull
    from .models.base.errors import ModelFetchError

    try:
        if dry_run:
            _plan(job, overwrite)
            return
        if ray is not None:
            from .integrations.ray_launch import run_on_ray

            raise typer.Exit(run_on_ray(job, ray, limit, overwrite))
        from .dist import LOCAL_RANK_ENV, resolve_rank
        from .launch import spawn, worker_envs
        from .run import StopFlag, run_job

        rank = resolve_rank()
        envs = worker_envs(job, rank)
        clear = overwrite or job.output.mode == "overwrite"
        if envs:  # one worker process per GPU of this node; they start after the clearing
            from .models.registry import check_tasks

            check_tasks(job.model, job.tasks, job.engine, job.output.constrain)  # a refused job clears nothing
            if clear:
                manifest.clear_outputs(Layout(Path(job.output.dir)))
            raise typer.Exit(spawn(job_file, envs, limit, job.name))
        if LOCAL_RANK_ENV in os.environ:  # a worker of the above: the launcher cleared already
            clear = False
            job = job.model_copy(update={"output": job.output.model_copy(update={"mode": "resume"})})
        stop = StopFlag()
        stop.install()
        summary = run_job(job, limit=limit, overwrite=clear, rank=rank, stop=stop)
    except KeyboardInterrupt as e:  # the second Ctrl-C (StopFlag): no summary to wait for
        left, busy = getattr(e, "unwritten", []), getattr(e, "busy", None)  # run.Interrupted: a third Ctrl-C
        lost = (f"; {len(left)} finished shard(s) were not written ({', '.join(left[:3])}"
                f"{', ...' if len(left) > 3 else ''}): the next run labels them again" if left else "")
        lost += f"; {busy} was being written (kept if that finished)" if busy else ""
        typer.echo(f"\nbatchvlm: interrupted: the shards written so far are kept, the unfinished ones are "
                   f"labelled by the next run{lost} (batchvlm status {job_file})", err=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except RunLockHeld as e:  # not the job's fault: run again once the other run is gone
        fail(str(e), EXIT_STOPPED)
    except ModelFetchError as e:  # the hub, for now
        fail(str(e), EXIT_FAILED)
    except user_errors() as e:
        fail(str(e))
    except ValueError as e:  # an inconsistent rank environment
        fail(str(e))
    except (OutputWriteError, SharedMemoryFull) as e:
        fail(str(e), EXIT_FAILED)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EROFS):  # the job record, a stats file: the output again
            fail(str(write_failure(e, Path(job.output.dir))), EXIT_FAILED)
        raise
    typer.echo(summary.line(job.output.dir), err=True)
    if summary.stopped_by_signal:
        raise typer.Exit(EXIT_STOPPED)
    if summary.shards_failed or (summary.shards_damaged and not job.input.allow_damaged):
        raise typer.Exit(EXIT_FAILED)
    if summary.no_images:  # as for an empty folder: the input, not the run, is wrong
        fail(no_images_message(job.input, summary.shards_total))


def _check(job: Job, layout: Layout | None = None) -> tuple[Job, ShardList]:
    """Everything that can be checked before any work starts, loading no weights: inputs,
    output folder, device, and the model's host side (config and tokenizer; every task's
    prompt rendered and measured against the context). `layout`: plan against its frozen
    shard list. -> the job as it runs on this machine (device, dtype), and its shards."""
    from .device import for_device
    from .dist import resolve_rank
    from .models.registry import check_tasks

    out = Path(job.output.dir)
    if job.input.kind == "parquet":
        manifest.check_not_input(Layout(out), list_files(job.input))
    shards = plan(job.input, layout)
    if unreadable := [s for s in shards if not s.planned]:  # a run would fail these shards
        field = "input.folder" if job.input.folder else "input.parquet"
        more = f" (and {len(unreadable) - 1} more)" if len(unreadable) > 1 else ""
        raise SourceError(f"{field}: cannot read {unreadable[0].url}{more}; a run would fail its shard(s)")
    check_first_parquet(shards, job.input)
    check_writable(out)
    check_apart_from_inputs(out, job.input, [(s.stem, s.url) for s in shards])
    job = for_device(job, resolve_rank())
    check_tasks(job.model, job.tasks, job.engine, job.output.constrain)
    return job, shards


def _plan(job: Job, overwrite: bool) -> None:
    layout = Layout(Path(job.output.dir))
    if not overwrite:
        layout.check()
    job, shards = _check(job, None if overwrite else layout)
    out = layout.dir
    if not overwrite and out.is_dir():
        manifest.check_settings(layout, job.label_fingerprint(), job.label_settings())
    done = [] if overwrite else [s for s in shards if manifest.is_done(layout, s)]
    typer.echo(f"job {job.name}: {len(shards)} shard(s), {len(done)} done, {len(shards) - len(done)} to label")
    typer.echo(f"model {job.model.name} (revision {job.model.revision or 'default'}), "
               f"{len(job.tasks)} task(s), output {out}")


@app.command()
def validate(job_file: Path = JOB_ARG) -> None:
    """Check JOB_FILE, its inputs and its output folder without loading a model."""
    job = _load(job_file)
    try:
        layout = Layout(Path(job.output.dir))
        resume = job.output.mode == "resume" and layout.dir.is_dir()
        if resume:
            layout.check()
        job, shards = _check(job, layout if resume else None)  # the shards a run would have
        if resume:
            manifest.check_settings(layout, job.label_fingerprint(), job.label_settings())
    except user_errors() as e:
        fail(str(e))
    except ValueError as e:  # an inconsistent rank environment
        fail(str(e))
    sizes = [count_samples(s) for s in shards]
    images = f"{sum(sizes)} image(s), " if None not in sizes else ""
    skipped = f"; {skipped_note(shards.skipped)}" if shards.skipped else ""
    typer.echo(f"{job_file}: ok ({len(shards)} shard(s), {images}{len(job.tasks)} task(s), {job.model.device}, "
               f"{job.model.dtype}){skipped}")
    device_type, asked = job.model.device.split(":")[0], job.engine.max_batch_size
    if asked and (runs := job.engine.batch_size_for(device_type)) < asked:
        typer.echo(f"  engine.max_batch_size: {asked} is more than {device_type.upper()} runs; it runs {runs}")


@app.command()
def status(
    target: Path = typer.Argument(..., help="The job file, or its output folder."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable."),
) -> None:
    """Progress from the output folder: shards done / partial / failed / pending, rows, errors."""
    from .output.reader import Output, OutputError
    from .status import collect

    try:
        job = Output.open(target).job if target.is_dir() else _load(target)
        report = collect(job)
    except (OutputError, SourceError, manifest.OutputConflict) as e:
        fail(str(e))
    if as_json:
        typer.echo(json.dumps(report, indent=1))
        return
    typer.echo(f"{job.name}: {report['done']}/{report['shards'] or '?'} shards done, {report['partial']} partial, "
               f"{report['failed']} failed, {report['pending'] if report['pending'] is not None else '?'} pending, "
               f"{report['damaged']} damaged; {report['rows']} rows, {report['errors']} errors")
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
    for name in report["partial_shards"][:10]:
        typer.echo(f"  partial: {name}")
    for line in report["failed_shards"][:10]:
        typer.echo(f"  failed: {line}")


@app.command()
def preview(
    output_dir: Path = typer.Argument(..., help="A job's output folder."),
    n: int = typer.Option(200, "--n", min=1, help="Rows to show, in shard order."),
    out: Path = typer.Option(Path("preview.html"), "-o", "--out", help="The HTML file to write."),
) -> None:
    """A self-contained HTML page: thumbnails with boxes and points, answers, errors, filters."""
    from .output.reader import OutputError
    from .preview import write

    try:
        cards = write(output_dir, n, out)
    except (OutputError, SourceError) as e:
        fail(str(e))
    except OSError as e:
        fail(f"{e.filename or out}: {e.strerror}")
    typer.echo(f"{out}: {cards} rows")


@app.command("export")
def export_cmd(
    fmt: str = typer.Argument(..., metavar="FORMAT", help="coco or yolo."),
    output_dir: Path = typer.Argument(..., help="A job's output folder."),
    dest: Path = typer.Argument(..., help="Folder to write the export to."),
    with_images: bool = typer.Option(False, "--with-images", help="Also write the images (EXIF-oriented)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an export already in DEST."),
) -> None:
    """Detection boxes as COCO or YOLO, plus captions.jsonl with the text answers."""
    from .export import export
    from .output.reader import OutputError

    if fmt not in ("coco", "yolo"):
        fail(f"FORMAT must be coco or yolo, not {fmt!r}")
    try:
        counts = export(output_dir, dest, fmt, with_images, overwrite)
    except (OutputError, SourceError) as e:
        fail(str(e))
    except OSError as e:
        fail(f"{e.filename or dest}: {e.strerror}")
    typer.echo(f"{dest}: {counts['images']} images, {counts['annotations']} boxes, "
               f"{counts['categories']} categories ({fmt})")


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
