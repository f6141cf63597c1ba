#!/usr/bin/env python
"""Score a job's output folder against the shapes ground truth in its input shards.

    python scripts/eval_shapes.py jobs/out/shapes-demo

Prints the SHAPES.md metrics (caption / query exact match, detect F1 at IoU 0.5, point F1;
classify exact match, where a classify task asks a question the spec answers)
for the task kinds the job ran, as a markdown table. Exit code 1 if any is below --bar.
"""

import argparse
import sys
from pathlib import Path

from batchvlm.shapes.evaluate import score_output

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("output_dir", type=Path)
ap.add_argument("--bar", type=float, default=0.9)
args = ap.parse_args()
metrics, n = score_output(args.output_dir)
print(f"{n} images from {args.output_dir}\n")
print("| metric | score |\n|---|---|")
for name, value in metrics.items():
    print(f"| {name} | {value:.3f} |")
sys.exit(0 if all(v >= args.bar for v in metrics.values()) else 1)
