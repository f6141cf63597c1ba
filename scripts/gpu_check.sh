#!/usr/bin/env bash
# The GPU validation, as one call of at most ~8 minutes on a CUDA machine with no network:
#   1. install what the image lacks from .whl/ (scripts/gpu_wheels.sh fetches them),
#   2. run the GPU-marked tests,
#   3. run scripts/bench_attention.py (reference vs fused decode-step attention, Moondream 2 shapes),
#   4. run scripts/bench_engine.py on full-size Moondream 2 shapes with random weights
#      (caption, detect+point, mixed; batch 64 and 256; fixed output lengths; GPU busy
#      fraction from the torch profiler) and write the results table.
# Results land in $OUT (the device tool's output folder) or ./gpu-results.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
} | tee "$OUT/env.txt"

timeout 180 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log"
tests=${PIPESTATUS[0]}

timeout 120 python3 scripts/bench_attention.py 2>&1 | tee "$OUT/bench_attention.log"
attention=${PIPESTATUS[0]}

timeout 330 python3 scripts/bench_engine.py --model full-random --batch 64 256 --images 192 --fixed-lengths \
    --max-new-tokens 32 --max-objects 6 --skip-one-at-a-time --profile --json "$OUT/bench.json" 2>&1 \
    | tee "$OUT/bench.log"
bench=${PIPESTATUS[0]}
echo "gpu_check: tests exit $tests, attention bench exit $attention, bench exit $bench"
exit $(( tests != 0 || attention != 0 || bench != 0 ))
