#!/usr/bin/env python
"""Peak memory of `batchvlm run` over flat folders of tiny images of different sizes: memory per
rank must be bounded by input.shard_size and the queue depths, not by the dataset.

    python scripts/peak_rss.py --images 10000 100000 --workdir /tmp/rss

Each run labels a whole folder (one caption task, demo model, default shard_size 10,000) in a
subprocess whose process tree (the run and its loader workers) is sampled every 0.1 s:
the peak RSS of the main process, and the peak PSS of the tree (shared pages counted once).
`--real-every K` makes every K-th file a real 8x8 image and the others empty files (error rows:
every stage but the model sees them), for machines too slow to label 100,000 images.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml
from PIL import Image


def make_folder(folder: Path, n: int, real_every: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    have = sum(1 for _ in os.scandir(folder))
    colours = [(i * 37 % 256, i * 91 % 256, i * 53 % 256) for i in range(64)]
    blobs = []
    for i, c in enumerate(colours):
        buf = io.BytesIO()
        Image.new("RGB", (8, 8), c).save(buf, format="PNG" if i % 2 else "JPEG")
        blobs.append((buf.getvalue(), "png" if i % 2 else "jpg"))
    for i in range(have, n):
        data, ext = blobs[i % len(blobs)]
        (folder / f"{i:07d}.{ext}").write_bytes(data if i % real_every == 0 else b"")


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            kids += [int(k) for k in task.read_text().split()]
        except OSError:
            pass
    return kids


def _kib(pid: int, field: str, file: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/{file}").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def measure(job: Path) -> dict[str, float]:
    t0 = time.time()
    p = subprocess.Popen([sys.executable, "-m", "batchvlm.cli", "run", str(job)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, env=os.environ | {"BATCHVLM_PROGRESS": "off"})
    peak_main = peak_tree = 0
    while p.poll() is None:
        tree, todo = [], [p.pid]
        while todo:
            pid = todo.pop()
            tree.append(pid)
            todo += _children(pid)
        peak_main = max(peak_main, _kib(p.pid, "VmRSS", "status"))
        peak_tree = max(peak_tree, sum(_kib(pid, "Pss", "smaps_rollup") for pid in tree))
        time.sleep(0.1)
    err = p.stderr.read()
    if p.returncode != 0:
        raise SystemExit(f"run failed ({p.returncode}):\n{err}")
    return {"seconds": time.time() - t0, "main_rss_mib": peak_main / 1024, "tree_pss_mib": peak_tree / 1024,
            "summary": err.strip().splitlines()[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--workdir", type=Path, default=Path("rss-work"))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--real-every", type=int, default=1)
    args = ap.parse_args()
    results = {}
    for n in args.images:
        folder = args.workdir / f"images-{n}-every{args.real_every}"
        make_folder(folder, n, args.real_every)
        job = args.workdir / f"job-{n}.yaml"
        job.write_text(yaml.safe_dump({
            "name": f"rss-{n}", "input": {"folder": folder.name}, "model": {"name": "demo"},
            "tasks": [{"caption": {"length": "short"}}], "engine": {"max_new_tokens": 2},
            "loader": {"workers": args.workers}, "output": {"dir": f"out-{n}"}}))
        subprocess.run(["rm", "-rf", str(args.workdir / f"out-{n}")], check=True)
        results[n] = measure(job)
        print(f"{n} images: {results[n]}", flush=True)
    print("\n| images | wall s | peak RSS main (MiB) | peak PSS tree (MiB) |\n|---|---|---|---|")
    for n, r in results.items():
        print(f"| {n} | {r['seconds']:.0f} | {r['main_rss_mib']:.0f} | {r['tree_pss_mib']:.0f} |")
    lo, hi = min(results), max(results)
    print(f"\nratio {hi} / {lo}: main RSS {results[hi]['main_rss_mib'] / results[lo]['main_rss_mib']:.2f}x, "
          f"tree PSS {results[hi]['tree_pss_mib'] / results[lo]['tree_pss_mib']:.2f}x")


if __name__ == "__main__":
    main()
