#!/usr/bin/env python
"""Train (or resume) the built-in demo model, then export it.

    python scripts/train_demo.py --out runs/demo                # resumes if runs/demo/checkpoint.pt exists
    python scripts/train_demo.py --out runs/demo --export batchvlm/models/demo

Interrupt it at any time (Ctrl-C, kill, reboot): re-running the same command continues from the
last checkpoint (every --ckpt-every steps) and sees exactly the batches it would have seen.
"""

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from batchvlm.job import ModelSpec
from batchvlm.models.registry import open_family
from batchvlm.shapes.evaluate import score_model
from batchvlm.shapes.train import Trainer, TrainSettings, write_card


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    d = TrainSettings()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="run folder (checkpoint, history, log)")
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--ckpt-every", type=int, default=d.ckpt_every)
    ap.add_argument("--eval-every", type=int, default=d.eval_every)
    ap.add_argument("--balanced-from", type=int, default=d.balanced_from,
                    help="step from which object queries are balanced (the shipped run: 5500)")
    ap.add_argument("--finetune-steps", type=int, default=d.finetune_steps,
                    help="a second stage after --steps, weighted to colour + kind queries (the shipped run: 4000)")
    ap.add_argument("--until", type=int, default=None, help="stop at this step (resume later)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--export", type=Path, default=None, help="write the model folder here after training")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = TrainSettings(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                             ckpt_every=args.ckpt_every, eval_every=args.eval_every, balanced_from=args.balanced_from,
                             finetune_steps=args.finetune_steps)
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = open(args.out / "train.log", "a")

    def log(line: str) -> None:
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    trainer = Trainer(args.out, settings, torch.device(args.device))
    log(json.dumps({"start_step": trainer.step, "settings": settings.__dict__, "device": args.device,
                    "threads": torch.get_num_threads(), "host": platform.processor() or platform.machine(),
                    "torch": torch.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S")}))
    trainer.run(until=args.until, log=log)
    if args.export and trainer.step >= settings.total_steps:
        trainer.export(args.export)
        family = open_family(ModelSpec(name=str(args.export)))
        final = score_model(family.load("float32", "cpu").model, family.tokenizer, family.preprocessor(), 200,
                            seed=987_654)
        hardware = f"{cpu_name()}, {torch.get_num_threads()} threads, device {args.device}"
        write_card(args.export, trainer, final, hardware)
        log(json.dumps({"exported": str(args.export), "final_eval_200": final}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
