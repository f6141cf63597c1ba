#!/usr/bin/env bash
# The GPU validation: the one script a lent GPU runs, planned for a device budget of 15 minutes per
# task (machine start-ups, idle waits and every call counted in). One call of at most 7 minutes runs
# the checks that prove CUDA correct first, then the headline benches in order of importance; what
# the call's time left would not cover is skipped, and a skip is recorded like a failure. What is
# left of the budget then covers a second, shorter call: a rerun of a step fixed meanwhile, or the
# benches the first one skipped.
#
#   scripts/gpu_check.sh              the call (CALL_BUDGET_S, default 420 s): every step below
#   scripts/gpu_check.sh STEP...      only these steps, in the plan's order (same budgets, same call limit)
#   scripts/gpu_check.sh --plan       the steps and their budgets
#   scripts/gpu_check.sh --prepare    here, before a device call: the wheels, the parity fixture the GPU
#                                     tests read, and the size of what the call will send (< 64 MiB)
#   scripts/gpu_check.sh --dry-run [STEP...]   on CPU: the plan, then the steps at tiny sizes (checks the
#                                     script and every step's arguments; budgets x4 for a shared CPU)
#
# The procedure, for a session whose task has a device (the device tool's `status`: can_start_another):
#   1. here:  scripts/gpu_check.sh --prepare && scripts/gpu_check.sh --dry-run
#             (the dry run walks every step on CPU first: 1-2 minutes; copy all of ../shared/fixtures
#             and the call would exceed the device tool's 64 MiB: it holds other suites' fixtures)
#   2. the device call, carry [".whl"] (shared/ travels by itself), timeout_s 480:
#             OUT=$OUT scripts/gpu_check.sh
#   3. record from $OUT (the device tool brings back 8 files at most, so there are two):
#      summary.txt (each step: rc, seconds / budget, or why skipped) and logs.tar.gz (every step's
#      log and JSON: env.txt, gpu_tests.log, bench.json, bench_qwen3vl.json, bench_moe.json,
#      bench_qwen35.json, bench_florence2.json, bench_classify.log, ...; rewritten after each step,
#      so a call killed at its limit still brings back what it finished). The README's GPU
#      numbers come from these files.
#   4. the second call, with what `status` says is left (budget_left_s; a fresh machine costs 1-2
#      minutes to start and none starts under 4 minutes left; a call made within 30 s of the last
#      finds it warm): the steps the first call skipped, or a step fixed on CPU meanwhile, sized
#      to fit, e.g. (about 280 s after a 420 s first call):
#             CALL_BUDGET_S=280 OUT=$OUT scripts/gpu_check.sh bench_qwen3vl bench_moe bench_qwen35
#      then give the machine back (give_back). What neither call ran is for a later task's device.
# The 420 s call, when every step takes its whole budget: set-up 15, environment 10, flex_smoke 90,
# gpu_tests 180, bench_engine 120; the benches after it are skipped (recorded) unless time is left.
# Every step runs under `timeout`; a failure, timeout, skip, skipped GPU test or flex fallback makes
# the call exit non-zero, and summary.txt says which step.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
PLAN_ONLY=0
if [[ "${1:-}" == "--plan" ]]; then PLAN_ONLY=1; shift; fi
PREPARE=0
if [[ "${1:-}" == "--prepare" ]]; then PREPARE=1; shift; fi
OUT=${OUT:-gpu-results}
LOG_DIR=${LOG_DIR:-/tmp/gpu_check_logs}  # outside $OUT: only summary.txt and logs.tar.gz go there
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SCALE=$(( DRY ? 4 : 1 ))  # the dry run's tiny steps on a (shared) CPU get 4x the GPU budgets
CALL_BUDGET=$(( ${CALL_BUDGET_S:-420} * SCALE ))
KV_BLOCKS=8192  # one KV size for every bench_engine row: 8192 x 16 tokens, 25.8 GB at Moondream 2 bf16

# The steps, in order: name, budget (GPU seconds), minimum worth starting with (a bench whose
# first result needs that long), log file, what it is.
STEPS=(
    "environment      10  10 env.txt              nvidia-smi, python / torch / CUDA / Triton versions; torch sees the GPU"
    "flex_smoke       90  90 flex_smoke.log       compiled flex at Moondream 2 / Qwen3-VL-2B / 8B-GQA / Qwen3.5-2B (head dim 256) shapes, bf16 + fp32, 1-128 queries, vs the reference, one call replayed in a CUDA graph"
    "gpu_tests       180 150 gpu_tests.log        pytest -m gpu tests/gpu/test_gpu.py: graphs vs eager, upstream parity, bf16, json masks, Qwen3.5, Qwen3-VL-MoE (grouped GEMM), Florence-2, classify; a skipped test fails"
    "bench_engine    120  90 bench.log            Moondream 2 shapes, random bf16 weights, ${KV_BLOCKS} KV blocks: mixed/256, mixed@1024x768/256, caption/256; engine sync + pipelined vs static vs one-at-a-time; busy / graph-step share, compile s"
    "bench_qwen3vl   120  90 bench_qwen3vl.log    Qwen3-VL-2B shapes, random bf16 weights, 64 images: engine (built untimed) vs transformers' batched generate"
    "bench_moe        40  40 bench_moe.log        MoE MLP, 4 Qwen3-VL-30B-A3B-shaped layers (128 x 768, top 8): grouped / gathered / loop vs dense SwiGLU, graph replays vs eager"
    "bench_qwen35    120  90 bench_qwen35.log     Qwen3.5-2B-like shapes, random bf16 weights, 128 images: engine vs transformers' batched generate"
    "bench_florence2  60  45 bench_florence2.log  Florence-2-base shapes, random weights, 32 images: native engine vs the transformers backend, labels equal"
    "classify_bench   90  60 bench_classify.log   classify(10) vs query(8) vs query(1) on Qwen3-VL-2B shapes, bf16, batch 256"
    "bench_attention  50  50 bench_attention.log  one decode step's attention at Moondream 2 shapes, blocks 16 and 64, CUDA events on a captured step"
)

plan() {
    echo "gpu_check plan: one call of ${CALL_BUDGET_S:-420} s (CALL_BUDGET_S); budgets in GPU seconds, a step starts"
    echo "only with its minimum left in the call (else: skipped, recorded, the call fails); the dry run"
    echo "walks the same steps at tiny sizes on CPU with 4x these budgets"
    echo "  set-up             ~15   install .whl/ into /tmp/site, check modules, find the parity fixtures"
    local s
    for s in "${STEPS[@]}"; do
        read -r name budget least _log what <<<"$s"
        printf "  %-16s %4s  (starts with >= %s s left)  %s\n" "$name" "$budget" "$least" "$what"
    done
}

# Here, before a device call: wheels, the one fixture the GPU tests read (the upstream Moondream
# tiny parity set, 31 MB), and what the call will send: tracked and untracked-not-ignored files,
# shared/ (git-ignored, it travels all the same) and the carried .whl/, against the tool's 64 MiB.
prepare() {
    scripts/gpu_wheels.sh || return 1
    local src=${BATCHVLM_SHARED:-../shared}/fixtures/moondream-tiny dst=shared/fixtures/moondream-tiny
    mkdir -p "$dst" && cp -r "$src"/{config.json,weights.safetensors,expected.json,images} "$dst"/ || return 1
    local bytes
    bytes=$( { git ls-files -z --cached --others --exclude-standard; find .whl shared -type f -print0; } \
             | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
    echo "gpu_check: the device call will send $(( bytes / 1048576 )) MiB (the limit is 64)"
    (( bytes < 64 * 1048576 ))
}

FAILED=()
record() { echo "$*" | tee -a "$OUT/summary.txt"; }
budget_left() { echo $(( CALL_BUDGET - (SECONDS - CALL_START) )); }

# One step under its timeout: its budget, or what the call has left (less a margin for the summary).
step() {
    local name=$1 budget=$(( $2 * SCALE )) least=$(( $3 * SCALE )) log=$4
    local left=$(( $(budget_left) - 5 * SCALE ))
    if (( left < least )); then
        record "$name: skipped: needs ${least} s, ${left} s left in the call"
        FAILED+=("$name (skipped)")
        return
    fi
    (( budget > left )) && budget=$left
    echo "== $name (budget ${budget} s, ${left} s left in the call)"
    local t0=$SECONDS
    STEP_BUDGET=$budget timeout --kill-after=10 "$budget" bash -c "$name" 2>&1 | tee "$LOG_DIR/$log"
    local rc=${PIPESTATUS[0]} took=$(( SECONDS - t0 ))
    if (( rc == 124 || rc == 137 )); then
        record "$name: TIMED OUT after ${budget} s"
        FAILED+=("$name (timeout)")
    elif (( rc != 0 )); then
        record "$name: FAILED (exit $rc) after ${took} s"
        FAILED+=("$name (exit $rc)")
    else
        record "$name: ok in ${took}s/${budget}s"
    fi
    tar czf "$OUT/logs.tar.gz" -C "$LOG_DIR" .
}

setup() {
    if compgen -G ".whl/*.whl" >/dev/null; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            || { echo "gpu_check: installing .whl/ failed"; return 2; }
        export PYTHONPATH=/tmp/site
    fi
    export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
    # Every module the package and the GPU tests need (the carried wheels included).
    $PY - <<'EOF' || return 2
import importlib, sys
need = ["torch", "numpy", "PIL", "pyarrow", "tokenizers", "safetensors", "huggingface_hub", "fsspec", "yaml",
        "tqdm", "typer", "pytest", "webdataset", "braceexpand", "pydantic", "pydantic_core", "annotated_types",
        "typing_inspection", "transformers", "xgrammar", "batchvlm.run.worker", "batchvlm.engine.engine",
        "batchvlm.attention.fused"]
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
        return 2
    fi
    export BATCHVLM_SHARED=$FIXTURES BATCHVLM_REQUIRE_FIXTURES=1
}

# ---------------------------------------------------------------- the steps (each run by a child bash)

environment() {
    if (( DRY )); then
        echo "dry run on CPU: no nvidia-smi"
    else
        nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader || return 1
    fi
    $PY - "$DRY" <<'EOF'
import sys
import torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("triton missing")
if sys.argv[1] == "0":
    assert torch.cuda.is_available(), "torch sees no CUDA device"
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
EOF
}

flex_smoke() { $PY scripts/flex_smoke.py $( (( DRY )) && echo --small ); }

gpu_tests() {  # any skipped GPU test is a failure: a GPU run that skips proves nothing
    if (( DRY )); then
        $PY -m pytest -q -m gpu -p no:cacheprovider --collect-only tests/gpu/test_gpu.py 2>&1 | tail -3
        return "${PIPESTATUS[0]}"
    fi
    # -v: each test's line as it ends, so a timeout still says which ran; durations of the slow ones
    $PY -m pytest -v -m gpu -p no:cacheprovider -rs --durations=15 tests/gpu/test_gpu.py 2>&1 | tee /tmp/gpu_tests.out
    local rc=${PIPESTATUS[0]}
    if tail -1 /tmp/gpu_tests.out | grep -q "skipped"; then echo "!! GPU tests were skipped"; return 1; fi
    return "$rc"
}

bench_engine() {  # rows in order of importance; rows stop starting at the deadline (a row takes < 60 s)
    local args=(--model full-random --images 128 --fixed-lengths --max-new-tokens 32 --max-objects 6
                --rows mixed/256 mixed@1024x768/256 caption/256 --one-at-a-time-images 8
                --kv-blocks $KV_BLOCKS --profile --deadline-s $(( STEP_BUDGET / SCALE - 60 )))
    (( DRY )) && args=(--model demo --device cpu --images 2 --repeat 1 --max-new-tokens 3 --max-objects 1
                       --rows mixed/4 mixed@1024x768/4 --one-at-a-time-images 1 --kv-blocks 300 --deadline-s 120)
    $PY scripts/bench_engine.py "${args[@]}" --json "$LOG_DIR/bench.json"
}

bench_qwen3vl() {  # writes a ~4.5 GB random checkpoint first
    local args=(--config 2b --dtype bfloat16 --images 64 --batch 256 --hf-batch 80 --max-new-tokens 16)
    (( DRY )) && args=(--config tiny --dtype float32 --images 2 --batch 8 --hf-batch 8 --max-new-tokens 3)
    $PY scripts/bench_qwen3vl.py "${args[@]}" --skip-one-at-a-time --json "$LOG_DIR/bench_qwen3vl.json"
}

bench_moe() {
    local args=(--shape 30b-a3b --layers 4 --tokens 64 256 1024 4096)
    (( DRY )) && args=(--shape tiny --device cpu --dtype float32 --layers 2 --tokens 8 100 --iters 2)
    $PY scripts/bench_moe.py "${args[@]}" --json "$LOG_DIR/bench_moe.json"
}

bench_qwen35() {  # the Gated DeltaNet layers in plain torch (flash-linear-attention is not used)
    local args=(--config 2b --dtype bfloat16 --images 128 --batch 256 --hf-batch 64 --max-new-tokens 32)
    (( DRY )) && args=(--config mid --device cpu --images 2 --batch 16 --hf-batch 8 --max-new-tokens 3)
    $PY scripts/bench_qwen3vl.py --family qwen3_5 "${args[@]}" --skip-one-at-a-time --json "$LOG_DIR/bench_qwen35.json"
}

bench_florence2() {
    local args=(--config base --device cuda --images 32 --hf-batch 32 --pairs 2)
    (( DRY )) && args=(--config mid --device cpu --images 1 --hf-batch 1 --pairs 1 --max-new-tokens 3)
    $PY scripts/bench_florence2.py "${args[@]}" --json "$LOG_DIR/bench_florence2.json"
}

classify_bench() {
    local args=(--model qwen3_vl --config 2b --device cuda --dtype bfloat16 --batch 256 --images 64 --repeats 2)
    (( DRY )) && args=(--model qwen3_vl --config tiny --images 2 --repeats 1 --batch 8)
    $PY scripts/bench_classify.py "${args[@]}"
}

bench_attention() {
    local args=(--block-sizes 16 64)
    (( DRY )) && args=(--images 2 --rows 3 --prefix 37 --own-max 20 --layers 1 --steps 1 --block-sizes 16 64)
    $PY scripts/bench_attention.py "${args[@]}"
}

export -f environment flex_smoke gpu_tests bench_engine bench_qwen3vl bench_moe bench_qwen35 bench_florence2 \
    classify_bench bench_attention
export DRY PY LOG_DIR SCALE KV_BLOCKS

# ---------------------------------------------------------------- the call

if (( PLAN_ONLY )); then plan; exit 0; fi
if (( PREPARE )); then prepare; exit $?; fi
NAMES=()
for s in "${STEPS[@]}"; do NAMES+=("${s%% *}"); done
for want in "$@"; do
    [[ " ${NAMES[*]} " == *" $want "* ]] || { echo "gpu_check: no step '$want' (steps: ${NAMES[*]})" >&2; exit 2; }
done
(( DRY )) && plan
CALL_START=$SECONDS
rm -rf "$OUT/summary.txt" "$OUT/logs.tar.gz" "$LOG_DIR"
mkdir -p "$LOG_DIR"
if ! setup; then
    record "set-up: FAILED"
    exit 1
fi
for s in "${STEPS[@]}"; do
    read -r name budget least log _what <<<"$s"
    if (( $# )) && [[ " $* " != *" $name "* ]]; then continue; fi
    step "$name" "$budget" "$least" "$log"
done
if (( ${#FAILED[@]} )); then
    record "gpu_check$( (( DRY )) && echo " dry run"): FAILED: ${FAILED[*]} ($(( SECONDS - CALL_START )) s)"
    exit 1
fi
record "gpu_check$( (( DRY )) && echo " dry run"): every step ok ($(( SECONDS - CALL_START )) s)"
