"""The exit codes of `batchvlm run`, for the schedulers that act on them (Slurm requeue,
Kubernetes podFailurePolicy, Ray's driver):

    0   every shard this launch owns is done
    1   the run failed (a shard failed or is damaged, a write failed, a bug): retrying may help,
        and counts against the scheduler's retry budget (Kubernetes backoffLimitPerIndex)
    2   the job cannot run as written (job file, inputs, model name, output folder settings), or
        the command line cannot run as given (errors.UsageError):
        the same launch fails the same way, so do not retry (podFailurePolicy FailIndex)
    75  stopped before the end and nothing is wrong (SIGTERM / SIGUSR1: preemption, a drain,
        a time limit; or another live run holds this rank): run again to continue (EX_TEMPFAIL)
    130 interrupted at once by a second Ctrl-C (SIGINT): the unfinished shards are dropped (finished
        ones are written first, unless a third Ctrl-C comes)

Finished shards are kept whatever the code; the next run labels only what is left.

A run's code is decided in one place for every launcher: RunSummary.end (run/summary.py) for a
run that ended, errors.run_failure for one that failed.
"""

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_JOB_ERROR = 2
EXIT_STOPPED = 75
EXIT_INTERRUPTED = 130
