#!/usr/bin/env bash
# The GPU validation, as one call of at most 8 minutes on a CUDA machine with no network:
#   1. install what the image lacks from .whl/ (scripts/gpu_wheels.sh fetches them) and check
#      that every module batchvlm and its tests import is there,
#   2. run the GPU-marked tests (the parity fixtures must be in shared/fixtures of the checkout
#      or under $BATCHVLM_SHARED: their absence fails the check, it does not skip tests),
#   3. run scripts/bench_attention.py (reference vs fused decode-step attention, Moondream 2 shapes),
#   4. run scripts/bench_engine.py on full-size Moondream 2 shapes with random weights, bf16
#      (mixed and caption on the synthetic scenes, mixed on 1024x768 photos = 13 crops;
#      batch 256 then 64; fixed output lengths; best of 3; GPU busy fraction), rows in order of
#      importance, stopping cleanly before its time is up.
#   5. with QWEN3VL=1: scripts/bench_qwen3vl.py on Qwen3-VL-2B shapes with random weights
#      (batchvlm's engine vs transformers' batched generate, bfloat16; needs transformers).
#   6. with QWEN35=1: scripts/gpu_check_qwen35.sh, the same for Qwen3.5-2B-like shapes.
# Results land in $OUT (the device tool's output folder) or ./gpu-results.
#
# Before the device call, here:  scripts/gpu_wheels.sh; mkdir -p shared; cp -r ../shared/fixtures shared/
# and carry [".whl"] (shared/ travels by itself).
#
#   scripts/gpu_check.sh --dry-run   the same steps on CPU with tiny sizes (checks the script itself)
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "gpu_check: installing .whl/ failed"; exit 2; }
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1

# 1. Every module the package and the GPU tests need (the carried wheels included).
$PY - <<'EOF' || exit 2
import importlib, sys
need = ["torch", "numpy", "PIL", "pyarrow", "tokenizers", "safetensors", "huggingface_hub", "fsspec", "yaml",
        "tqdm", "typer", "pytest", "webdataset", "braceexpand", "pydantic", "pydantic_core", "annotated_types",
        "typing_inspection", "batchvlm.run", "batchvlm.engine.engine"]
missing = []
for name in need:
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - report every missing module at once
        missing.append(f"{name} ({type(e).__name__}: {e})")
if missing:
    sys.exit("gpu_check: missing modules: " + "; ".join(missing) + " -- run scripts/gpu_wheels.sh and carry .whl")
EOF

FIXTURES=""
for d in ${BATCHVLM_SHARED:+"$BATCHVLM_SHARED"} shared ../shared; do
    if [[ -d "$d/fixtures/moondream-tiny" ]]; then FIXTURES=$(cd "$d" && pwd); break; fi
done
if [[ -z "$FIXTURES" ]]; then
    echo "gpu_check: parity fixtures not found (shared/fixtures/moondream-tiny): cp -r ../shared/fixtures shared/"
    exit 2
fi
export BATCHVLM_SHARED=$FIXTURES BATCHVLM_REQUIRE_FIXTURES=1

if (( DRY )); then
    echo "gpu_check: dry run on CPU" | tee "$OUT/env.txt"
    $PY -m pytest -q -m gpu -p no:cacheprovider --collect-only tests/test_gpu.py 2>&1 | tail -3 | tee "$OUT/gpu_tests.log"
    tests=${PIPESTATUS[0]}
    attention=0
    bench_args=(--model demo --device cpu --images 3 --batch 4 --repeat 1 --max-new-tokens 4 --max-objects 2
                --workloads mixed mixed@1024x768 --skip-one-at-a-time --deadline-s 200)
else
    {
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
        $PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
    } | tee "$OUT/env.txt"
    # 2. GPU tests: 150 s at most.
    timeout 150 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log"
    tests=${PIPESTATUS[0]}
    # 3. Decode-step attention, reference vs fused: 60 s at most.
    timeout 60 $PY scripts/bench_attention.py 2>&1 | tee "$OUT/bench_attention.log"
    attention=${PIPESTATUS[0]}
    # 4. The benchmark: 260 s at most, rows stop starting after 200 s (a row takes < 60 s).
    bench_args=(--model full-random --batch 256 64 --images 128 --fixed-lengths --max-new-tokens 32 --max-objects 6
                --workloads mixed mixed@1024x768 caption --skip-one-at-a-time --profile --deadline-s 200)
fi
timeout 260 $PY scripts/bench_engine.py "${bench_args[@]}" --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
bench=${PIPESTATUS[0]}
qwen=0
if [ "${QWEN3VL:-0}" = 1 ]; then  # opt-in: Qwen3-VL-2B shapes, random weights (writes a ~4.5 GB checkpoint)
    timeout 420 $PY scripts/bench_qwen3vl.py --config 2b --dtype bfloat16 --images 256 --batch 256 \
        --hf-batch 80 --max-new-tokens 32 --skip-one-at-a-time --json "$OUT/bench_qwen3vl.json" 2>&1 \
        | tee "$OUT/bench_qwen3vl.log"
    qwen=${PIPESTATUS[0]}
fi
qwen35=0
if [ "${QWEN35:-0}" = 1 ]; then  # opt-in: Qwen3.5-2B-like shapes, random weights
    scripts/gpu_check_qwen35.sh "$OUT"
    qwen35=$?
fi
echo "gpu_check: tests exit $tests, attention bench exit $attention, bench exit $bench, qwen3vl bench exit $qwen," \
     "qwen3.5 bench exit $qwen35"
exit $(( tests != 0 || attention != 0 || bench != 0 || qwen != 0 || qwen35 != 0 ))
