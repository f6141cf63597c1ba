"""`batchvlm tune`: the speed / label trade-off of a job's visual budgets on a sample of its own
images (docs/tune.md). sample.py draws the images, settings.py the budgets, measure.py labels the
sample at each in one process, agreement.py compares with the full budget, report.py shows it."""
