#!/usr/bin/env python
"""Write webdataset shards of shapes scenes (image + <key>.json ground truth).

    python scripts/make_shapes_shards.py --out jobs/data --shards 4 --per-shard 25 --seed 2026
"""

import argparse
from pathlib import Path

from batchvlm.shapes.shards import write_shards

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--out", type=Path, required=True)
ap.add_argument("--shards", type=int, default=4)
ap.add_argument("--per-shard", type=int, default=25)
ap.add_argument("--seed", type=int, default=2026)
ap.add_argument("--prefix", default="shapes")
args = ap.parse_args()
for p in write_shards(args.out, args.shards, args.per_shard, args.seed, args.prefix):
    print(p)
