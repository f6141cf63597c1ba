#!/usr/bin/env python
"""Moondream's duplicate-token pruning measured: the share of image tokens it drops (patches of
the global crop repeating a kept neighbour, base/prune.py), for full-size Moondream 2 and the demo
model, on bench_prune.py's photos, documents / screenshots and shapes world; with --scores, the
demo model's SHAPES.md scores at each tolerance (the quality test's 60 scenes, seed 31337).

    python scripts/bench_prune_moondream.py            # token shares (seconds)
    python scripts/bench_prune_moondream.py --scores   # plus the demo's scores (a minute)

docs/tune.md (Moondream pruning) holds the numbers.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_prune import document, photos, screenshot, shapes  # noqa: E402

from batchvlm.models.base.prune import kept_groups  # noqa: E402
from batchvlm.models.moondream.config import MoondreamConfig, VisionConfig  # noqa: E402
from batchvlm.models.moondream.preprocess import Preprocessor  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "batchvlm" / "models" / "demo" / "config.json"
TOLERANCES = (0.0, 0.02, 0.05)


def dropped(images, pre: Preprocessor, tol: float) -> tuple[float, float]:
    """-> (share of image tokens dropped, crops per image)."""
    v = pre.vision
    kept = crops = 0
    for im in images:
        p = pre(im)
        keep = kept_groups(p.crops[0].numpy(), v.enc_patch_size, tol)
        kept += v.n_image_tokens if keep is None else keep.numel()
        crops += p.cost
    return 1 - kept / (v.n_image_tokens * len(images)), crops / len(images)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scores", action="store_true")
    args = ap.parse_args()
    rng = random.Random(0)
    sets = {"photos": photos(), "documents": [document(rng) for _ in range(3)] + [screenshot(rng) for _ in range(3)],
            "shapes": shapes(rng, 50)}
    demo = MoondreamConfig.from_dict(json.loads(DEMO.read_text())["config"]).vision
    models = {"Moondream 2": Preprocessor(VisionConfig(), 12), "demo": Preprocessor(demo, demo.max_crops)}
    print("| images | model | " + " | ".join(f"tolerance {t:g}" for t in TOLERANCES) + " | crops / image |")
    print("|---|---|" + "---|" * (len(TOLERANCES) + 1))
    for name, images in sets.items():
        for model, pre in models.items():
            if images:
                shares = [dropped(images, pre, t) for t in TOLERANCES]
                print(f"| {name} ({len(images)}) | {model} | " + " | ".join(f"{s:.1%}" for s, _ in shares)
                      + f" | {shares[0][1]:.1f} |")
    if args.scores:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from support.moondream import LoadedMoondream

        from batchvlm.shapes.evaluate import score_model

        md = LoadedMoondream("demo")
        print("\n| setting | caption exact | query exact | detect F1@0.5 | point F1 |\n|---|---|---|---|---|")
        for tol in (None, *TOLERANCES):
            s = score_model(md.model, md.family.tokenizer, Preprocessor(demo, demo.max_crops, tol), 60, seed=31337)
            name = "off" if tol is None else f"prune {tol:g}"
            print(f"| {name} | " + " | ".join(f"{v:.3f}" for v in s.values()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
