#!/usr/bin/env python
"""Duplicate visual-token pruning (model.prune_duplicates) measured: the share of Qwen and of
Florence-2 image tokens it removes on photos, rendered documents / screenshots and the shapes
world, at a few tolerances; with --speed, `batchvlm tune` on the *mid* config of the family
(random weights: scripts/bench_qwen3vl.py's, scripts/bench_florence2.py's) over the shapes and
document images, with and without it.

    python scripts/bench_prune.py                   # token shares only (seconds)
    python scripts/bench_prune.py --speed --n 12    # plus tune's images/s on the CPU (minutes)
    python scripts/bench_prune.py --speed --family florence2

Photos: matplotlib's sample images (grace_hopper.jpg, Minduka_Present_Blue_Pack.png).
Documents / screenshots: drawn here (PIL's default font on white pages; a window with a toolbar,
a side bar and text). JPEG-encoded shapes images are decoded first, as the loader does.
"""

from __future__ import annotations

import argparse
import io
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from batchvlm.models.qwen_vl.preprocess import PixelSettings, Preprocessor  # noqa: E402
from batchvlm.models.base.prune import kept_groups  # noqa: E402
from batchvlm.models.florence2 import preprocess as florence2_pre  # noqa: E402
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


def florence2_preprocessor(side: int = 768) -> florence2_pre.Preprocessor:
    """The released Florence-2 models' preprocessing (768 x 768, DaViT's four conv stems), pruning at 0."""
    settings = florence2_pre.PixelSettings(side, side, 3, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), 1 / 255,
                                           True, 577)
    vision = SimpleNamespace(patch_size=(7, 3, 3, 3), patch_stride=(4, 2, 2, 2), patch_padding=(3, 1, 1, 1))
    return florence2_pre.Preprocessor(settings, florence2_pre.Footprint.of(vision, side, side), 0.0)


def removed_florence2(images: list[Image.Image], pre: florence2_pre.Preprocessor, tol: float) -> float:
    kept = total = 0
    for im in images:
        p = replace(pre, prune=tol)(im)
        kept += p.prefix_len - 1
        total += p.cells
    return 1 - kept / total


def florence2_worker_ms(images: list[Image.Image], pre: florence2_pre.Preprocessor) -> tuple[float, float]:
    """(resize, resize + the duplicate test) in ms per image: the loader worker's work."""
    out = []
    for p in (replace(pre, prune=None), replace(pre, prune=0.02)):
        t = time.perf_counter()
        for im in images:
            p(im)
        out.append(1000 * (time.perf_counter() - t) / len(images))
    return out[0], out[1]


def speed(n: int, sets: dict[str, list[Image.Image]], config: str, family: str, pairs: int) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-prune-") as tmp:
        measure_speed(Path(tmp), n, sets, config, family, pairs)


def write_mid_checkpoint(folder: Path, config: str, family: str) -> None:
    folder.mkdir()
    if family == "florence2":
        from bench_florence2 import CONFIGS
        from support.tiny_vlms import florence2

        florence2(folder, seed=0, **(CONFIGS[config] if config == "mid" else {}))  # tiny: the test suite's 64 px
        return
    from bench_qwen3vl import CORPUS, QWEN3VL
    from support import qwen3vl_fixture

    qwen3vl_fixture.write_checkpoint(folder, seed=0, min_pixels=64 * 64, max_pixels=640 * 640, corpus=CORPUS,
                                     **QWEN3VL[config])


def measure_speed(root: Path, n: int, sets: dict[str, list[Image.Image]], config: str, family: str,
                  pairs: int) -> None:
    import yaml

    from batchvlm.job import load_job
    from batchvlm.tune.command import TuneArgs, tune

    folder = root / "mid"
    write_mid_checkpoint(folder, config, family)
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
        print(f"\n## {name}: {min(n, len(sets[name]))} images, {family} {config} (random weights)\n")
        print(tune(load_job(job), TuneArgs(min(n, len(sets[name])), 0, "prune:0,prune:0.02", root / f"{name}.json",
                                           None, False)))
        if family == "florence2" and pairs:
            alternating(folder, sets[name][:n], pairs)


CHOICES = ["a photo", "a document", "a screenshot", "shapes"]


def alternating(folder: Path, images: list[Image.Image], pairs: int) -> None:
    """Off against prune:0 on a workload whose work the labels do not change (a classify task: the
    same scored decoder rows whatever random weights answer; tune's caption / detect rows decode
    as long as the answers run), the two alternating, `pairs` times, each run's process CPU time
    beside its wall time (on a loaded machine the wall also counts waits for a core)."""
    from pydantic import TypeAdapter

    from batchvlm.data.loader import Sample
    from batchvlm.engine.engine import EngineLabeler
    from batchvlm.job import EngineSpec, ModelSpec
    from batchvlm.models.registry import open_family
    from batchvlm.tasks import Task

    tasks = [TypeAdapter(Task).validate_python({"classify": {"question": "What is it?", "choices": CHOICES}})]
    engine = EngineSpec(max_new_tokens=16)
    loaded = open_family(ModelSpec(name=str(folder))).load("float32", "cpu")
    runs = {}
    for name, tol in (("off", None), ("prune 0", 0.0)):
        family = open_family(ModelSpec(name=str(folder), prune_duplicates=tol))
        model = loaded if tol is None else family.device_side(loaded.model, loaded.info)
        prepared = [family.preprocessor()(im) for im in images]
        runs[name] = (family, model, family.sequences(tasks, engine), prepared)
    wall: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(pairs):
        for name, (family, model, seqs, prepared) in runs.items():
            labeler = EngineLabeler(model, seqs, engine, family.max_prefix_len(), lambda _: None)
            t, c = time.perf_counter(), time.process_time()
            for _ in labeler.label(Sample(0, i, f"k{i}", p) for i, p in enumerate(prepared)):
                pass
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    print(f"\nclassify ({len(CHOICES)} choices), {len(images)} images, {pairs} alternating runs each (medians):\n")
    print("| setting | prefix/img | CPU s/img | wall s/img |\n|---|---|---|---|")
    for name, (_, _, _, prepared) in runs.items():
        tokens = sum(p.prefix_len for p in prepared) / len(prepared)
        print(f"| {name} | {tokens:.0f} | {statistics.median(cpu[name]) / len(images):.3f} | "
              f"{statistics.median(wall[name]) / len(images):.3f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-pixels", type=int, default=1024 * 1024)
    ap.add_argument("--speed", action="store_true")
    ap.add_argument("--n", type=int, default=12, help="images per set in --speed")
    ap.add_argument("--config", choices=["mid", "tiny"], default="mid", help="--speed's model (tiny: the dry run)")
    ap.add_argument("--family", choices=["qwen3_vl", "florence2"], default="qwen3_vl", help="--speed's model family")
    ap.add_argument("--pairs", type=int, default=3, help="florence2 --speed: off / prune:0 classify runs, alternating")
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
    f2 = florence2_preprocessor()
    print("\nshare of Florence-2 image tokens removed (cells of 32 x 32 px reading 63 x 63 stem footprints, "
          "768 x 768)\n")
    print("| images | " + " | ".join(f"tolerance {t:g}" for t in tols) + " |\n|---|" + "---|" * len(tols))
    for name, images in sets.items():
        if images:
            shares = " | ".join(f"{removed_florence2(images, f2, t):.1%}" for t in tols)
            print(f"| {name} ({len(images)}) | {shares} |")
    resize_ms, both_ms = florence2_worker_ms(sets["documents"] + sets["shapes"][:10], f2)
    print(f"\nFlorence-2 loader worker, per image: resize {resize_ms:.1f} ms, resize + duplicate test {both_ms:.1f} ms")
    if args.speed:
        speed(args.n, sets, args.config, args.family, args.pairs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
