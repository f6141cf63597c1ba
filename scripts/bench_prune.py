#!/usr/bin/env python
"""Duplicate visual-token pruning (model.prune_duplicates) measured: the share of Qwen image
tokens it removes on photos, rendered documents / screenshots and the shapes world, at a few
tolerances; with --speed, `batchvlm tune` on the Qwen3-VL *mid* config (random weights,
scripts/bench_qwen3vl.py's) over the shapes and document images, with and without it.

    python scripts/bench_prune.py                   # token shares only (seconds)
    python scripts/bench_prune.py --speed --n 12    # plus tune's images/s on the CPU (minutes)

Photos: matplotlib's sample images (grace_hopper.jpg, Minduka_Present_Blue_Pack.png).
Documents / screenshots: drawn here (PIL's default font on white pages; a window with a toolbar,
a side bar and text). JPEG-encoded shapes images are decoded first, as the loader does.
"""

from __future__ import annotations

import argparse
import io
import random
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from batchvlm.models.qwen_vl.preprocess import PixelSettings, Preprocessor  # noqa: E402
from batchvlm.models.base.prune import kept_groups  # noqa: E402
from batchvlm.shapes.world import draw_scene, encode  # noqa: E402

WORDS = ("the engine labels every image of a dataset with a vision language model and writes one parquet file per "
         "shard while the loader decodes the next images in parallel").split()


def photos() -> list[Image.Image]:
    try:
        import matplotlib
    except ImportError:  # a bare device machine: no photos to measure
        return []

    data = Path(matplotlib.get_data_path()) / "sample_data"
    return [Image.open(data / n).convert("RGB") for n in ("grace_hopper.jpg", "Minduka_Present_Blue_Pack.png")]


def document(rng: random.Random, w: int = 850, h: int = 1100) -> Image.Image:
    im = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(im)
    y = 60
    d.text((60, y), " ".join(rng.choices(WORDS, k=6)).title(), fill="black")
    y += 40
    while y < h - 80:
        if rng.random() < 0.15:
            y += 24  # a paragraph break
        d.text((60, y), " ".join(rng.choices(WORDS, k=rng.randint(8, 14))), fill=(20, 20, 20))
        y += 16
    return im


def screenshot(rng: random.Random, w: int = 1280, h: int = 800) -> Image.Image:
    im = Image.new("RGB", (w, h), (245, 246, 248))
    d = ImageDraw.Draw(im)
    d.rectangle((0, 0, w, 36), fill=(52, 58, 70))
    for i in range(6):
        d.text((16 + 90 * i, 12), rng.choice(WORDS).title(), fill="white")
    d.rectangle((0, 36, 220, h), fill=(230, 232, 236))
    for i in range(14):
        d.text((16, 56 + 28 * i), " ".join(rng.choices(WORDS, k=2)), fill=(40, 40, 40))
    for j in range(3):
        x, y = 260 + 330 * j, 80
        d.rounded_rectangle((x, y, x + 300, y + 180), 8, fill="white", outline=(210, 210, 215))
        for k in range(6):
            d.text((x + 14, y + 16 + 24 * k), " ".join(rng.choices(WORDS, k=4)), fill=(30, 30, 30))
    for k in range(12):
        d.text((260, 300 + 26 * k), " ".join(rng.choices(WORDS, k=rng.randint(6, 12))), fill=(30, 30, 30))
    return im


def shapes(rng: random.Random, n: int) -> list[Image.Image]:
    out = []
    for _ in range(n):
        im, _ = draw_scene(rng)
        data, _ = encode(im, rng)
        out.append(Image.open(io.BytesIO(data)).convert("RGB"))
    return out


def removed(images: list[Image.Image], pre: Preprocessor, tol: float) -> float:
    kept = total = 0
    for im in images:
        pixels = pre.resize(im)
        keep = kept_groups(pixels, pre.factor, tol)
        n = (pixels.shape[0] // pre.factor) * (pixels.shape[1] // pre.factor)
        kept += n if keep is None else keep.numel()
        total += n
    return 1 - kept / total


def speed(n: int, sets: dict[str, list[Image.Image]], config: str) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-prune-") as tmp:
        measure_speed(Path(tmp), n, sets, config)


def measure_speed(root: Path, n: int, sets: dict[str, list[Image.Image]], config: str) -> None:
    import yaml

    from bench_qwen3vl import CORPUS, QWEN3VL
    from support import qwen3vl_fixture

    from batchvlm.job import load_job
    from batchvlm.tune.command import TuneArgs, tune

    folder = root / "mid"
    folder.mkdir()
    qwen3vl_fixture.write_checkpoint(folder, seed=0, min_pixels=64 * 64, max_pixels=640 * 640, corpus=CORPUS,
                                     **QWEN3VL[config])
    for name in ("shapes", "documents"):
        src = root / name
        src.mkdir()
        for i, im in enumerate(sets[name][:n]):
            im.save(src / f"{i:03d}.png")
        job = root / f"{name}.yaml"
        job.write_text(yaml.safe_dump({
            "name": f"prune-{name}", "input": {"folder": str(src)}, "model": {"name": str(folder)},
            "tasks": [{"caption": {"length": "normal"}}, {"detect": {"objects": ["person"]}}],
            "engine": {"max_new_tokens": 16}, "output": {"dir": str(root / "out")}}))
        print(f"\n## {name}: {min(n, len(sets[name]))} images, Qwen3-VL {config} (random weights)\n")
        print(tune(load_job(job), TuneArgs(min(n, len(sets[name])), 0, "prune:0,prune:0.02", root / f"{name}.json",
                                           None, False)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-pixels", type=int, default=1024 * 1024)
    ap.add_argument("--speed", action="store_true")
    ap.add_argument("--n", type=int, default=12, help="images per set in --speed")
    ap.add_argument("--config", choices=["mid", "tiny"], default="mid", help="--speed's model (tiny: the dry run)")
    args = ap.parse_args()
    rng = random.Random(0)
    sets = {"photos": photos(), "documents": [document(rng) for _ in range(3)] + [screenshot(rng) for _ in range(3)],
            "shapes": shapes(rng, 50)}
    pre = Preprocessor(PixelSettings(64 * 64, args.max_pixels, (0.5,) * 3, (0.5,) * 3, 1 / 255, True), 32, 2, 0)
    print(f"share of image tokens removed (Qwen merge groups of 32 x 32 px, max_pixels {args.max_pixels})\n")
    tols = (0.0, 0.02, 0.05)
    print("| images | " + " | ".join(f"tolerance {t:g}" for t in tols) + " |\n|---|" + "---|" * len(tols))
    for name, images in sets.items():
        if images:
            print(f"| {name} ({len(images)}) | " + " | ".join(f"{removed(images, pre, t):.1%}" for t in tols) + " |")
    if args.speed:
        speed(args.n, sets, args.config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
