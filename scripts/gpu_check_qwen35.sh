#!/usr/bin/env bash
# gpu_check.sh's opt-in Qwen3.5 step (QWEN35=1), on its own so the main script only calls it:
# scripts/bench_qwen3vl.py --family qwen3_5 on Qwen3.5-2B-like shapes with random weights
# (a ~4.5 GB checkpoint written first), batchvlm's engine vs transformers' batched generate,
# bfloat16, within a budget of $QWEN35_BUDGET_S seconds (default 420). The CUDA path is the
# torch one (Gated DeltaNet chunked / recurrent in plain torch); flash-linear-attention is not used.
#   scripts/gpu_check_qwen35.sh OUT_DIR [--dry-run]   (--dry-run: the mid-size config on CPU, 4 images)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if [[ "${2:-}" == "--dry-run" ]]; then
    args=(--config mid --device cpu --images 4 --batch 16 --hf-batch 8 --max-new-tokens 4)
else
    args=(--config 2b --dtype bfloat16 --images 128 --batch 256 --hf-batch 64 --max-new-tokens 32)
fi
timeout "${QWEN35_BUDGET_S:-420}" $PY scripts/bench_qwen3vl.py --family qwen3_5 "${args[@]}" --skip-one-at-a-time \
    --json "$OUT/bench_qwen35.json" 2>&1 | tee "$OUT/bench_qwen35.log"
exit "${PIPESTATUS[0]}"
