"""Image embeddings: `batchvlm run` (JPEG files -> loader workers -> image-level engine path ->
Parquet) against transformers' own batched forward on already decoded, already preprocessed
tensors (get_image_features on the processor's output: the best a hand loop can do), on the same
images, alternated A B A B so both see the same machine load. Random-weight SigLIP 2 (NaFlex)
checkpoints written by transformers; nothing is downloaded.

    python scripts/bench_embed.py [--config small] [--images 256] [--workers 2] [--repeats 2]
    python scripts/bench_embed.py --config base --images 2048 --device cuda --dtype bfloat16 --batch 256

Reported: images/s of each arm and batchvlm / transformers (the issue's goal on CPU: >= 0.9, the
loader and the writer hidden behind the forward). The batchvlm arm is the whole run_job: its
start (the model load, the loader's first batches) is in it, so use enough images that it is small.
On a shared CPU the numbers are indicative only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from PIL import Image

CONFIGS = {  # vision tower shapes (the text tower is small: embed reads no text)
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch=4, patches=64),
    "small": dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=6, patch=16,
                  patches=256),
    "base": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, patch=16,
                 patches=256),  # google/siglip2-base-patch16-naflex's vision tower
}


def checkpoint(name: str, dest: Path) -> Path:
    from transformers import Siglip2Config, Siglip2Model, Siglip2Processor, Siglip2Tokenizer
    from transformers.models.siglip2.image_processing_pil_siglip2 import Siglip2ImageProcessorPil

    c = dict(CONFIGS[name])
    patch, patches = c.pop("patch"), c.pop("patches")
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4, "▁": 5}
    text = dict(hidden_size=c["hidden_size"], intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                vocab_size=len(vocab), max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    model = Siglip2Model(Siglip2Config(text_config=text, vision_config=dict(c, patch_size=patch, num_patches=patches)))
    model.save_pretrained(dest, safe_serialization=True)
    Siglip2Processor(Siglip2ImageProcessorPil(patch_size=patch, max_num_patches=patches),
                     Siglip2Tokenizer(vocab=vocab, merges=[])).save_pretrained(dest)
    return dest


def write_images(folder: Path, n: int, seed: int = 0) -> None:
    """JPEGs of photo-like sizes and aspect ratios (smooth gradients plus noise)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        w, h = int(rng.integers(320, 800)), int(rng.integers(240, 640))
        base = np.linspace(0, 255, w)[None, :, None] * rng.random(3) + np.linspace(0, 255, h)[:, None, None] * rng.random(3)
        px = np.clip(base / 2 + rng.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(px).save(folder / f"{i:06d}.jpg", quality=90)


def batchvlm_arm(work: Path, model: Path, args) -> float:
    from batchvlm.job import load_job
    from batchvlm.run.worker import run_job

    shutil.rmtree(work / "out", ignore_errors=True)
    job = {"name": "bench-embed", "input": {"folder": "imgs"}, "tasks": [{"embed": {}}],
           "model": {"name": str(model), "device": args.device, "dtype": args.dtype},
           "engine": {"max_batch_size": args.batch}, "loader": {"workers": args.workers}, "output": {"dir": "out"}}
    (work / "job.yaml").write_text(yaml.safe_dump(job))
    t0 = time.perf_counter()
    summary = run_job(load_job(work / "job.yaml"), progress=False)
    seconds = time.perf_counter() - t0
    assert summary.images == args.images and summary.errors == 0, summary
    return args.images / seconds


def transformers_arm(model: Path, images: list[Image.Image], args) -> float:
    from transformers import AutoModel
    from transformers.models.siglip2.image_processing_pil_siglip2 import Siglip2ImageProcessorPil

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    device = torch.device(args.device)
    net = AutoModel.from_pretrained(model, dtype=dtype).to(device).eval()
    proc = Siglip2ImageProcessorPil.from_pretrained(model)
    batches = [{k: v.to(device) for k, v in proc(images=images[i: i + args.batch], return_tensors="pt").items()}
               for i in range(0, len(images), args.batch)]  # decoded and preprocessed beforehand: not timed
    with torch.inference_mode():
        net.get_image_features(**batches[0])  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for b in batches:
            net.get_image_features(**b).pooler_output.float().cpu()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return len(images) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="small")
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = checkpoint(args.config, work / "model")
        write_images(work / "imgs", args.images)
        images = [Image.open(p).convert("RGB") for p in sorted((work / "imgs").glob("*.jpg"))]
        ours, theirs = [], []
        for _ in range(args.repeats):
            ours.append(batchvlm_arm(work, model, args))
            theirs.append(transformers_arm(model, images, args))
    best_ours, best_theirs = max(ours), max(theirs)
    result = {"config": args.config, "images": args.images, "batch": args.batch, "workers": args.workers,
              "device": args.device, "dtype": args.dtype, "batchvlm_images_per_s": round(best_ours, 1),
              "transformers_forward_images_per_s": round(best_theirs, 1), "ratio": round(best_ours / best_theirs, 3),
              "repeats": {"batchvlm": [round(x, 1) for x in ours], "transformers": [round(x, 1) for x in theirs]}}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
