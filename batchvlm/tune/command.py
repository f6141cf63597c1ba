"""`batchvlm tune`: every check first (a bad --sample, --budgets or output path is one line
before any image is read or weight loaded), then the draw, the measurement and the report.
Nothing is written into the job's output folder."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..device import for_device
from ..dist import resolve_rank
from ..errors import UsageError
from ..job import Job
from ..models.registry import open_family
from ..output.shardlist import plan
from ..run.log import log
from .measure import check_settings, measure
from .report import has_matplotlib, record, table, write_json, write_plot
from .sample import DEFAULT_SAMPLE, check_size, draw
from .settings import FULL, settings_for


@dataclass(frozen=True)
class TuneArgs:
    sample: int | None  # --sample; None: DEFAULT_SAMPLE, or every image where the inputs hold fewer
    seed: int
    budgets: str | None  # --budgets as written; None: the family's defaults
    json_path: Path
    plot_path: Path | None  # None: no plot
    plot_asked: bool  # --plot given: a missing matplotlib is an error, not a note


def _outside(path: Path, job: Job) -> None:
    out = Path(job.output.dir).resolve()
    if path.resolve().is_relative_to(out):
        raise UsageError(f"{path}: inside the job's output folder {job.output.dir}; tune writes nothing there")


def tune(job: Job, args: TuneArgs) -> str:
    """-> the terminal table. Raises the user errors of errors.user_errors (one line each)."""
    job = for_device(job, resolve_rank())
    for p in (args.json_path, args.plot_path):
        if p is not None:
            _outside(p, job)
    if args.plot_asked and not has_matplotlib():
        raise UsageError("--plot: matplotlib is not installed; pip install 'batchvlm[tune]'")
    shards = plan(job.input)
    if args.sample is not None:
        check_size(shards, args.sample)
    base = open_family(FULL.spec(job.model, None), weights=False)
    budget = base.budget()
    settings = settings_for(base.name, budget, base.can_prune(), args.budgets)
    check_settings(job, settings, budget)
    drawn = draw(shards, job.input, args.sample or DEFAULT_SAMPLE, args.seed, exact=args.sample is not None)
    rows = measure(job, settings, drawn.images, log)
    write_json(args.json_path, record(job.name, base.name, job.model.device, args.seed, drawn.population, rows))
    notes = [f"{args.json_path}: written"]
    if args.plot_path is not None and has_matplotlib():
        write_plot(args.plot_path, rows, f"{job.name}: {len(drawn.images)} images, {base.name}, {job.model.device}")
        notes.append(f"{args.plot_path}: written")
    elif args.plot_path is not None:
        notes.append("no plot: matplotlib is not installed (pip install 'batchvlm[tune]')")
    return "\n".join([table(rows), *notes])
