#!/usr/bin/env python
"""Qwen3-VL (or, with --family qwen3_5, Qwen3.5) throughput, three ways on the same images and
prompts, in one run:

  (a) hf one-at-a-time  transformers' generate, one (image, task sequence) per call
  (b) hf batched        transformers' generate, many rows per call (left padding), the way a
                        transformers user batches: every row carries its own copy of its image
  (c) batchvlm engine   the native family in batchvlm's engine: each image encoded and
                        prefilled once and shared by its tasks, continuous batching, paged KV

All greedy, same random-weight checkpoint (written by transformers itself), same chat
template and image processing; in float32 the labels (token ids) of every runner must be
identical (checked; in bfloat16 the share of identical sequences is printed). Workload "mixed" = caption + query + 2 detect + 1 point per image.

    python scripts/bench_qwen3vl.py                                   # CPU, the mid-size config
    python scripts/bench_qwen3vl.py --config 2b --images 256 --batch 256 --hf-batch 64 \\
        --skip-one-at-a-time --dtype bfloat16                         # GPU, Qwen3-VL-2B shapes
    python scripts/bench_qwen3vl.py --family qwen3_5                  # CPU, Qwen3.5's mid-size config
    python scripts/bench_qwen3vl.py --moe                             # CPU, the mid-size config with
                                                                      # sparse MLPs (qwen3_vl_moe)

Qwen3.5 prompts use its template's non-thinking form (enable_thinking false), as batchvlm does.
`--moe` swaps every text MLP of the config for a mixture of experts (MOE below; Qwen3.5's with
its shared expert): model types qwen3_vl_moe / qwen3_5_moe, transformers' *Moe* classes.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the random hub-layout checkpoints
from support import qwen3vl_fixture, qwen35_fixture  # noqa: E402
from support.qwen3vl_fixture import IDS  # noqa: E402

from batchvlm.data.loader import Sample  # noqa: E402
from batchvlm.engine.engine import Engine  # noqa: E402
from batchvlm.job import EngineSpec, ModelSpec  # noqa: E402
from batchvlm.models.registry import open_family  # noqa: E402
from batchvlm.tasks import CaptionTask, DetectTask, PointTask, QueryTask  # noqa: E402

TASKS = [CaptionTask(caption={"length": "normal"}), QueryTask(query={"question": "What is in the picture?"}),
         DetectTask(detect={"objects": ["person", "car"]}), PointTask(point={"objects": ["dog"]})]
PROMPTS = ["Describe this image.", "What is in the picture?",
           'Locate every instance that belongs to the following categories: "person". Report bbox coordinates in JSON format.',
           'Locate every instance that belongs to the following categories: "car". Report bbox coordinates in JSON format.',
           "Locate every dog in this image with points. Output the point coordinates in JSON format."]
# Big enough that the model, not Python, dominates on a CPU; small enough for minutes on 2 cores.
QWEN3VL = {
    "mid": dict(text_dim=512, heads=8, kv_heads=4, head_dim=64, layers=6, section=(12, 10, 10), vision_dim=384,
                vision_heads=6, depth=6, pos_embeddings=256, deepstack=(1, 3), vocab=4096, shard_size="200MB"),
    # for scripts/gpu_check.sh --dry-run: the script itself, in seconds
    "tiny": dict(text_dim=64, heads=4, kv_heads=2, head_dim=16, layers=2, section=(4, 2, 2), vision_dim=64,
                 vision_heads=2, depth=2, pos_embeddings=256, deepstack=(0,), vocab=1024, shard_size="50MB"),
    # Qwen3-VL-2B-Instruct's shapes (random weights)
    "2b": dict(text_dim=2048, heads=16, kv_heads=8, head_dim=128, layers=28, section=(24, 20, 20), ff=6144,
               vision_dim=1024, vision_heads=16, depth=24, vision_ff=4096, pos_embeddings=2304,
               deepstack=(5, 11, 17), tie=True, vocab=151936, shard_size="2GB"),
}
# Qwen3.5: every 4th layer full attention, the rest Gated DeltaNet; same vision tower, no DeepStack
QWEN35 = {
    "mid": dict(text_dim=512, heads=8, kv_heads=2, head_dim=128, layers=8, partial_rotary=0.25, section=(6, 5, 5),
                lin_k_heads=4, lin_v_heads=8, lin_k_dim=64, lin_v_dim=64, vision_dim=384, vision_heads=6, depth=6,
                pos_embeddings=256, vocab=4096, shard_size="200MB"),
    # for scripts/gpu_check.sh --dry-run: the script itself, in seconds (one full layer in four, as mid)
    "tiny": dict(text_dim=64, heads=4, kv_heads=2, head_dim=16, layers=4, partial_rotary=0.5, section=(2, 1, 1),
                 lin_k_heads=2, lin_v_heads=4, lin_k_dim=16, lin_v_dim=16, vision_dim=64, vision_heads=2, depth=2,
                 pos_embeddings=256, vocab=1024, shard_size="50MB"),
    # Qwen3.5-2B-like shapes (random weights): 24 layers (6 full), head_dim 256, rotary on a quarter
    "2b": dict(text_dim=2048, heads=8, kv_heads=2, head_dim=256, layers=24, partial_rotary=0.25, section=(11, 11, 10),
               ff=6144, lin_k_heads=16, lin_v_heads=16, lin_k_dim=128, lin_v_dim=128, vision_dim=1024,
               vision_heads=16, depth=24, vision_ff=4096, pos_embeddings=2304, tie=True, vocab=248320,
               shard_size="2GB"),
}
FAMILIES = {"qwen3_vl": (qwen3vl_fixture, "Qwen3VLForConditionalGeneration", QWEN3VL, {}),
            "qwen3_5": (qwen35_fixture, "Qwen3_5ForConditionalGeneration", QWEN35, {"enable_thinking": False})}
# --moe: the MLPs of a config as experts (Qwen3.5: plus a shared expert). mid: 32 experts, 4 active,
# expert width 3/8 of the text width (the 30B-A3B ratio); 2b: 30B-A3B's own expert counts
MOE = {"mid": dict(experts=32, top_k=4, ff=192, shared=192), "tiny": dict(experts=4, top_k=2, ff=32, shared=32),
       "2b": dict(experts=128, top_k=8, ff=768, shared=512)}
HF_MOE = {"qwen3_vl": "Qwen3VLMoeForConditionalGeneration", "qwen3_5": "Qwen3_5MoeForConditionalGeneration"}
# (width, height): 192 to 300 image tokens each, like typical web photos at a lowered max_pixels
SIZES = [(448, 448), (640, 480), (480, 640), (512, 384), (576, 432), (448, 576)]
# English text for the tokenizer's merges, so prompts have realistic token counts (~20-30).
CORPUS = " ".join(PROMPTS * 20) + " " + " ".join([
    "A photo of a person walking a dog along a quiet street next to parked cars.",
    "The image shows a red car in front of a building with large windows and a tree.",
    "Two people are sitting at a table in a restaurant, talking and smiling at each other.",
    "There is a cat sleeping on a sofa near a window; sunlight falls across the room.",
    "A group of children play football on a green field under a cloudy sky.",
    "The picture contains several objects: a cup, a laptop, a phone and a notebook on a desk.",
] * 40)


def make_images(n: int) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in
            (SIZES[i % len(SIZES)] for i in range(n))]


def hf_rows(tok, processor, im: Image.Image, template_kwargs: dict) -> tuple[list[list[int]], dict]:
    pix = processor(images=[im], return_tensors="pt")
    n = int(pix["image_grid_thw"].prod()) // 4
    rows = []
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)
        rows.append(tok(text.replace("<|image_pad|>", "<|image_pad|>" * n))["input_ids"])
    return rows, pix


def hf_generate(model, rows: list[list[int]], pix: list[dict], max_new: int, dev: torch.device) -> list[list[int]]:
    """One left-padded generate call over rows (row r uses image pix[r])."""
    L = max(map(len, rows))
    pad, stops = IDS["<|endoftext|>"], [IDS["<|im_end|>"], IDS["<|endoftext|>"]]
    ids = torch.tensor([[pad] * (L - len(r)) + r for r in rows], device=dev)
    mask = torch.tensor([[0] * (L - len(r)) + [1] * len(r) for r in rows], device=dev)
    gen = model.generate(input_ids=ids, attention_mask=mask,
                         pixel_values=torch.cat([p["pixel_values"] for p in pix]).to(dev, model.dtype),
                         image_grid_thw=torch.cat([p["image_grid_thw"] for p in pix]).to(dev),
                         mm_token_type_ids=(ids == IDS["<|image_pad|>"]).int(), do_sample=False,
                         max_new_tokens=max_new, eos_token_id=stops, pad_token_id=pad)
    out = []
    for row in gen[:, L:].tolist():
        end = next((j for j, t in enumerate(row) if t in stops), len(row))
        out.append(row[:end])
    return out


def run_hf(model, tok, processor, images, max_new, rows_per_call, dev, template_kwargs) -> list[list[list[int]]]:
    work = []  # (image index, row, pixels)
    for i, im in enumerate(images):
        rows, pix = hf_rows(tok, processor, im, template_kwargs)
        work += [(i, r, pix) for r in rows]
    outs: list[list[int]] = []
    for k in range(0, len(work), rows_per_call):
        chunk = work[k : k + rows_per_call]
        outs += hf_generate(model, [w[1] for w in chunk], [w[2] for w in chunk], max_new, dev)
    per = len(PROMPTS)
    return [outs[i * per : (i + 1) * per] for i in range(len(images))]


def engine_runner(family, model, seqs, images, max_new, batch):
    """Build the engine now (KV sizing, warm-up, graph capture: untimed, as a job's start-up) and
    preprocess the images (the loader's CPU workers do that in a job). -> (engine, its timed run)."""
    pre = family.preprocessor()
    spec = EngineSpec(max_new_tokens=max_new, max_batch_size=batch, max_images_in_flight=max(8, 2 * batch // len(seqs)))
    engine = Engine(model, seqs, spec, family.max_prefix_len())
    prepared = [pre(im) for im in images]

    def run() -> list[list[list[int]]]:
        items = [Sample(0, i, str(i), p) for i, p in enumerate(prepared)]
        out = {im.sample.index: [s.output.tokens for s in im.seqs] for im in engine.run(items)}
        return [out[i] for i in range(len(images))]

    return engine, run


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def delta_rule_kernels(dev: torch.device) -> str:
    """Which kernels run Qwen3.5's Gated DeltaNet on both sides: flash-linear-attention's when it
    imports on CUDA (batchvlm: models/qwen3_5/fla_rule.py; transformers picks it itself when its
    modeling module is imported, hub_kernels.use_kernel_func_from_hub_with_fallback), else torch.
    A comparison where only one side has fla says so here."""
    from batchvlm.models.qwen3_5 import fla_rule

    ours = "fla" if fla_rule.kernels(dev) else "torch"
    try:
        import fla  # noqa: F401

        theirs = "fla" if dev.type == "cuda" else "torch (fla runs on CUDA only)"
    except Exception as e:  # noqa: BLE001 - any import failure means the torch path
        theirs = f"torch (fla not importable: {type(e).__name__})"
    return f"batchvlm {ours}, transformers {theirs}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=list(FAMILIES), default="qwen3_vl")
    ap.add_argument("--config", choices=["mid", "2b", "tiny"], default="mid", help="tiny: the dry run's")
    ap.add_argument("--moe", action="store_true", help="the config's MoE variant (qwen3_vl_moe / qwen3_5_moe)")
    ap.add_argument("--seed", type=int, default=0, help="of the random checkpoint's weights")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--images", type=int, default=24)
    ap.add_argument("--one-at-a-time-images", type=int, default=4, help="(a) runs on the first N images only")
    ap.add_argument("--batch", type=int, default=64, help="engine.max_batch_size (sequences)")
    ap.add_argument("--hf-batch", type=int, default=60, help="rows per transformers generate call")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=1, help="time each runner this many times, keep the fastest")
    ap.add_argument("--skip-one-at-a-time", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    fixture, hf_class, configs, template_kwargs = FAMILIES[args.family]
    if args.config not in configs:
        ap.error(f"--config {args.config}: not a {args.family} config ({', '.join(configs)})")
    config = dict(configs[args.config])
    if args.moe:
        hf_class = HF_MOE[args.family]
        moe = dict(MOE[args.config])
        if args.family == "qwen3_vl":
            moe.pop("shared")
        config["moe"] = moe

    dev = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                       ("cpu" if args.device == "auto" else args.device))
    dtype = getattr(torch, args.dtype)
    folder = Path(tempfile.mkdtemp(prefix=f"bench-{args.family}-"))
    t0 = time.perf_counter()
    fixture.write_checkpoint(folder, seed=args.seed, min_pixels=64 * 64, max_pixels=640 * 640, corpus=CORPUS,
                             dtype=dtype, **config)
    print(f"# checkpoint written in {time.perf_counter() - t0:.1f} s: {folder}", file=sys.stderr)
    hf = getattr(transformers, hf_class).from_pretrained(folder, dtype=dtype).to(dev).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    processor = Qwen2VLImageProcessorPil.from_pretrained(folder)
    family = open_family(ModelSpec(name=str(folder)))
    model = family.load(args.dtype, str(dev))
    seqs = family.sequences(TASKS, EngineSpec(max_new_tokens=args.max_new_tokens))
    images = make_images(args.images)
    tokens = sum(family.preprocessor()(im).grid[0] * family.preprocessor()(im).grid[1] for im in images) / len(images)
    host = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    hw = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU ({host})"
    moe_note = f" moe {config['moe']}" if args.moe else ""
    print(f"# bench_qwen3vl: family={args.family} config={args.config}{moe_note} seed={args.seed} device={hw} dtype={args.dtype} torch={torch.__version__} "
          f"images={args.images} (mean {tokens:.0f} image tokens) sequences/image={len(seqs)} "
          f"max_new_tokens={args.max_new_tokens} engine batch={args.batch} hf rows/call={args.hf_batch} "
          f"repeat={args.repeat} (best of)")
    if args.family == "qwen3_5":
        print(f"# gated delta rule: {delta_rule_kernels(dev)}")

    runners = {}
    n_one = min(args.one_at_a_time_images, args.images)
    if not args.skip_one_at_a_time:
        runners["hf one-at-a-time"] = (n_one, lambda: run_hf(hf, tok, processor, images[:n_one],
                                                             args.max_new_tokens, 1, dev, template_kwargs))
    runners["hf batched"] = (args.images, lambda: run_hf(hf, tok, processor, images, args.max_new_tokens,
                                                         args.hf_batch, dev, template_kwargs))
    t0 = time.perf_counter()
    engine_, run_engine = engine_runner(family, model, seqs, images, args.max_new_tokens, args.batch)
    setup_s = time.perf_counter() - t0
    print(f"# engine built in {setup_s:.1f} s (untimed): {engine_.summary()}", file=sys.stderr)
    runners["batchvlm engine"] = (args.images, run_engine)
    results, outputs = {}, {}
    with torch.inference_mode():
        for label, (n, fn) in runners.items():
            if dev.type == "cuda":
                fn()  # warm-up
            times = []
            for _ in range(args.repeat):
                sync(dev)
                t = time.perf_counter()
                outputs[label] = fn()
                sync(dev)
                times.append(time.perf_counter() - t)
            dt = min(times)
            results[label] = {"images": n, "seconds": round(dt, 3), "images_per_s": round(n / dt, 3),
                              "tokens": sum(len(t) for img in outputs[label] for t in img)}
            if label == "batchvlm engine":
                results[label] |= {"setup_s": round(setup_s, 2), "stats": dict(engine_.stats)}
            print(json.dumps({label: results[label]}), file=sys.stderr, flush=True)
    # float32: every runner's labels must be identical. bfloat16 rounds differently in different
    # kernels, so there the share of identical sequences is reported instead.
    reference = outputs["batchvlm engine"]
    agreement = {}
    for label, out in outputs.items():
        pairs = [(a, b) for img_a, img_b in zip(out, reference) for a, b in zip(img_a, img_b)]
        agreement[label] = sum(a == b for a, b in pairs) / len(pairs)
        if args.dtype == "float32" and agreement[label] < 1:
            print(f"!! {label}: labels differ from the engine's", file=sys.stderr)
            return 1
    engine = results["batchvlm engine"]["images_per_s"]
    lines = ["| runner | images | seconds | images/s | engine speed-up |", "|---|---|---|---|---|"]
    for label, r in results.items():
        lines.append(f"| {label} | {r['images']} | {r['seconds']} | {r['images_per_s']} | "
                     f"{engine / r['images_per_s']:.2f}x |")
    print("\n".join(lines))
    print("sequences identical to the engine's: " + ", ".join(f"{k} {v:.1%}" for k, v in agreement.items()))
    if args.json:
        args.json.write_text(json.dumps({"hardware": hw, "args": vars(args) | {"json": str(args.json)},
                                         "results": results, "agreement": agreement}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
