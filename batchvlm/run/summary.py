"""What a run did (RunSummary), its one line for the person watching, and its exit code: decided
here once, for a run in this process and for the ranks of a Ray launch together (exits.py)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ..data.sources import no_images_message
from ..errors import error_line
from ..exits import EXIT_FAILED, EXIT_JOB_ERROR, EXIT_OK, EXIT_STOPPED
from ..job import Job
from ..output.shardlist import skipped_note
from .log import log


@dataclass
class RunSummary:
    shards_total: int
    shards_done_before: int
    shards_written: list[str] = field(default_factory=list)  # complete: their done marker is down
    shards_partial: list[str] = field(default_factory=list)  # cut short by --limit: redone next run
    shards_extended: list[str] = field(default_factory=list)  # done before: gained the columns of new tasks
    shards_failed: list[str] = field(default_factory=list)
    shards_damaged: list[str] = field(default_factory=list)  # "<stem>: N samples kept", done now or before
    shards_no_images: list[str] = field(default_factory=list)  # written now, holding no image (an empty tar)
    # done before, not replaced: their input is gone or came back damaged / unreadable (manifest.kept_note)
    shards_kept: list[str] = field(default_factory=list)
    images: int = 0  # rows of the shards handed to the writer
    found: int = 0  # rows from an image (not a sample that held none) in this rank's shards written now or before
    no_images: bool = False  # every shard of the job is done and none holds an image: the input has none to label
    dropped: int = 0  # images labelled in shards left unfinished (stop) or failed: not kept, labelled again
    errors: int = 0
    prompt_tokens: int = 0  # of the rows of `images` (RawOutput's counts)
    generated_tokens: int = 0
    seconds: float = 0.0
    stopped_by_signal: bool = False
    # files of the input that are no images to label, by reason: a folder's, and the members of the
    # tars done now or before
    skipped: Counter[str] = field(default_factory=Counter)

    def line(self, out_dir: str) -> str:
        rate = self.images / self.seconds if self.seconds > 0 else 0.0
        parts = [f"{len(self.shards_written)} shard(s) written", f"{self.shards_done_before} already done"]
        if self.shards_extended:
            parts.append(f"{len(self.shards_extended)} of those gained the new tasks' columns")
        if self.shards_partial:
            parts.append(f"{len(self.shards_partial)} partial (cut short by --limit; redone by the next run)")
        parts.append(f"{self.images} images")
        if self.dropped:  # the progress bar counted them: say where they went
            parts.append(f"{self.dropped} more labelled in unfinished or failed shards (not kept; the next run "
                         "labels them again)")
        parts += [f"{self.errors} errors", f"{rate:.1f} images/s",
                  f"{self.prompt_tokens} prompt + {self.generated_tokens} generated tokens"]
        if self.shards_failed:
            parts.append(f"{len(self.shards_failed)} FAILED ({', '.join(self.shards_failed[:3])})")
        if self.shards_damaged:
            parts.append(f"{len(self.shards_damaged)} DAMAGED ({', '.join(sorted(self.shards_damaged)[:3])})")
        if self.shards_kept:
            parts.append(f"{len(self.shards_kept)} KEPT FROM BEFORE, their input gone or broken "
                         f"({', '.join(k.split(':')[0] for k in self.shards_kept[:3])})")
        if self.shards_no_images:
            parts.append(f"{len(self.shards_no_images)} with no images ({', '.join(self.shards_no_images[:3])})")
        if self.stopped_by_signal:
            parts.append("stopped by signal: unfinished shards left for the next run")
        if self.skipped:
            parts.append(skipped_note(self.skipped))
        return f"batchvlm: {', '.join(parts)} -> {out_dir}"

    def add(self, rank: RunSummary) -> None:
        """One rank's summary into the launch's (Ray): shards by name, each counted once."""
        self.shards_total = max(self.shards_total, rank.shards_total)
        self.shards_written += [w for w in rank.shards_written if w not in self.shards_written]
        self.shards_partial += rank.shards_partial
        self.shards_extended += [e for e in rank.shards_extended if e not in self.shards_extended]
        self.shards_failed += [f for f in rank.shards_failed if f not in self.shards_failed]
        self.shards_damaged = sorted(set(self.shards_damaged) | set(rank.shards_damaged))
        self.shards_no_images += [w for w in rank.shards_no_images if w not in self.shards_no_images]
        self.shards_kept += [k for k in rank.shards_kept if k not in self.shards_kept]
        self.no_images |= rank.no_images  # the rank that saw every shard done, none holding an image
        self.images += rank.images
        self.errors += rank.errors
        self.prompt_tokens += rank.prompt_tokens
        self.generated_tokens += rank.generated_tokens
        self.stopped_by_signal |= rank.stopped_by_signal

    def end(self, job: Job) -> int:
        """Say the summary line (and, for an input without images, why that is the job's fault);
        -> the run's exit code."""
        log(self.line(job.output.dir))
        if self.stopped_by_signal:
            return EXIT_STOPPED
        if self.shards_failed or self.shards_kept or (self.shards_damaged and not job.input.allow_damaged):
            return EXIT_FAILED
        if self.no_images:  # as for an empty folder: the input, not the run, is wrong
            log(error_line(no_images_message(job.input, self.shards_total)))
            return EXIT_JOB_ERROR
        return EXIT_OK
