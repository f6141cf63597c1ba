#!/usr/bin/env bash
# The GPU validation: the one script a lent GPU runs, in two device calls of ~4.5 and ~5.5 minutes
# on a CUDA machine with no network. Every step has its own timeout; any failure, timeout, skipped
# GPU test or flex fallback makes the call exit non-zero and says which step.
#
#   scripts/gpu_check.sh 1          call 1 (270 s): set-up, environment, flex smoke test at the
#                                   engine's real shapes, bench_attention, the GPU tests
#   scripts/gpu_check.sh 2          call 2 (330 s): set-up, bench_engine (Moondream 2 shapes, random
#                                   weights), then a trimmed Qwen3-VL-2B run if more than 90 s remain
#                                   (and with QWEN35=1 a Qwen3.5-2B-like run: scripts/gpu_check_qwen35.sh;
#                                   with MOE=1 the expert paths on a 30B-A3B-shaped stack: bench_moe.py;
#                                   with CLASSIFY=1 classify vs query on the demo model: bench_classify.py)
#   scripts/gpu_check.sh --dry-run  on CPU: prints both calls' plans with budgets and walks every
#                                   step at tiny sizes (checks the script and the steps' arguments)
#
# Before the device calls, here:  scripts/gpu_wheels.sh; mkdir -p shared; cp -r ../shared/fixtures shared/
# and carry [".whl"] (shared/ travels by itself). Logs land in $OUT (the device tool's output
# folder) or ./gpu-results: env.txt, flex_smoke.log, bench_attention.log, gpu_tests.log (call 1);
# bench.log, bench.json, bench_qwen3vl.log, bench_qwen3vl.json (call 2); summary-<call>.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-}
case "$MODE" in 1|2|--dry-run) ;; *) echo "usage: scripts/gpu_check.sh 1|2|--dry-run" >&2; exit 2 ;; esac
DRY=0
[[ "$MODE" == "--dry-run" ]] && DRY=1
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SCALE=$(( DRY ? 4 : 1 ))  # the dry run's tiny steps on a (shared) CPU get 4x the GPU budgets
CALL_BUDGET_1=$(( 270 * SCALE ))
CALL_BUDGET_2=$(( 330 * SCALE ))
KV_BLOCKS=8192  # one KV size for every bench_engine row: 8192 x 16 tokens, 25.8 GB at Moondream 2 bf16

# Each step: name, budget in seconds, the command. It runs under `timeout`, its output goes to
# $OUT/<log> and the console; a failure is recorded and the call goes on to the next step.
FAILED=()
step() {
    local name=$1 budget=$(( $2 * SCALE )) log=$3; shift 3
    local t0=$SECONDS
    if declare -F "$1" >/dev/null; then set -- bash -c "$*"; fi  # a step function, run by a child bash
    echo "== [$CALL] $name (budget ${budget} s, $(( $(budget_left) )) s left in the call): $*"
    timeout --kill-after=10 "$budget" "$@" 2>&1 | tee "$OUT/$log"
    local rc=${PIPESTATUS[0]}
    local took=$(( SECONDS - t0 ))
    if (( rc == 124 || rc == 137 )); then
        echo "!! [$CALL] $name: TIMED OUT after ${budget} s" | tee -a "$OUT/$log"
        FAILED+=("$name (timeout)")
    elif (( rc != 0 )); then
        echo "!! [$CALL] $name: FAILED (exit $rc) after ${took} s" | tee -a "$OUT/$log"
        FAILED+=("$name (exit $rc)")
    else
        echo "== [$CALL] $name: ok in ${took} s"
    fi
    echo "$name: rc=$rc ${took}s/${budget}s" >> "$OUT/summary-$CALL.txt"
    return $rc
}
budget_left() { echo $(( CALL_BUDGET - (SECONDS - CALL_START) )); }

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
        "typing_inspection", "batchvlm.run", "batchvlm.engine.engine", "batchvlm.models.fused_attention"]
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

gpu_tests() {  # any skipped GPU test is a failure: a GPU run that skips proves nothing
    local out
    if (( DRY )); then
        out=$($PY -m pytest -q -m gpu -p no:cacheprovider --collect-only tests/test_gpu.py 2>&1) || { echo "$out"; return 1; }
        echo "$out" | tail -3
        return 0
    fi
    out=$($PY -m pytest -q -m gpu -p no:cacheprovider -rs tests/test_gpu.py 2>&1)
    local rc=$?
    echo "$out"
    if echo "$out" | tail -1 | grep -q "skipped"; then echo "!! GPU tests were skipped"; return 1; fi
    return $rc
}

# classify(10) against query(max_new_tokens 8) on the same 256 images, demo model on CUDA, CUDA
# graphs for decode: the decode-bound workload where issue 27 asks classify to be >= 2x faster
# (scripts/bench_classify.py prints the ratios; query(8) / query(1) bounds what classify can gain).
classify_bench() {
    if (( DRY )); then
        $PY scripts/bench_classify.py --images 4 --repeats 1 --batch 16
    else
        $PY scripts/bench_classify.py --device cuda --dtype bfloat16 --images 256 --batch 256 --repeats 3
    fi
}

export -f environment gpu_tests classify_bench
export DRY PY

call_1() {
    CALL=1 CALL_BUDGET=$CALL_BUDGET_1 CALL_START=$SECONDS
    rm -f "$OUT/summary-1.txt"
    setup || { FAILED+=("set-up"); return; }
    step "environment" 20 env.txt environment || { (( DRY )) || return; }
    if (( DRY )); then
        step "flex smoke test" 90 flex_smoke.log $PY scripts/flex_smoke.py --small
        step "bench_attention" 50 bench_attention.log $PY scripts/bench_attention.py --images 2 --rows 3 --prefix 37 \
            --own-max 20 --layers 1 --steps 1 --block-sizes 16 64
    else
        step "flex smoke test" 90 flex_smoke.log $PY scripts/flex_smoke.py
        step "bench_attention" 50 bench_attention.log $PY scripts/bench_attention.py --block-sizes 16 64
    fi
    step "GPU tests" $(( $(budget_left) / SCALE - 5 )) gpu_tests.log gpu_tests
}

call_2() {
    CALL=2 CALL_BUDGET=$CALL_BUDGET_2 CALL_START=$SECONDS
    rm -f "$OUT/summary-2.txt"
    setup || { FAILED+=("set-up"); return; }
    local bench_args qwen_args
    if (( DRY )); then
        bench_args=(--model demo --device cpu --images 2 --repeat 1 --max-new-tokens 3 --max-objects 1
                    --rows mixed/4 mixed@1024x768/4 --one-at-a-time-images 1 --kv-blocks 300 --deadline-s 120)
        qwen_args=(--config tiny --dtype float32 --images 2 --batch 8 --hf-batch 8 --max-new-tokens 3 --skip-one-at-a-time)
    else
        # rows in order of importance; rows stop starting after the deadline (a row takes < 60 s)
        bench_args=(--model full-random --images 128 --fixed-lengths --max-new-tokens 32 --max-objects 6
                    --rows mixed/256 mixed@1024x768/256 caption/256 mixed/64 --one-at-a-time-images 8
                    --kv-blocks $KV_BLOCKS --profile --deadline-s 170)
        qwen_args=(--config 2b --dtype bfloat16 --images 64 --batch 256 --hf-batch 80 --max-new-tokens 16
                   --skip-one-at-a-time)
    fi
    step "bench_engine" 230 bench.log $PY scripts/bench_engine.py "${bench_args[@]}" --json "$OUT/bench.json"
    local left moe_args
    if [[ "${MOE:-0}" == 1 ]]; then  # opt-in, before the Qwen runs take the rest: MoE MLP paths, 30B-A3B-shaped
        left=$(budget_left)
        if (( left > 40 * SCALE )); then
            if (( DRY )); then
                moe_args=(--shape tiny --device cpu --dtype float32 --layers 2 --tokens 8 100 --iters 2)
            else
                moe_args=(--shape 30b-a3b --layers 4 --tokens 64 256 1024 4096)
            fi
            step "bench_moe" $(( 40 < left / SCALE - 10 ? 40 : left / SCALE - 10 )) bench_moe.log \
                $PY scripts/bench_moe.py "${moe_args[@]}" --json "$OUT/bench_moe.json"
        else
            echo "== [2] bench_moe: not run, only ${left} s left (needs > 40 s)" | tee -a "$OUT/summary-2.txt"
        fi
    fi
    if [[ "${CLASSIFY:-0}" == 1 ]]; then  # opt-in, before the Qwen runs take the rest: classify vs query
        left=$(budget_left)
        if (( left > 120 * SCALE )); then  # 13 engines, each capturing its graphs; the first compiles flex
            step "classify_bench" 120 classify_bench.log classify_bench
        else
            echo "== [2] classify_bench: not run, only ${left} s left (needs > 120 s)" | tee -a "$OUT/summary-2.txt"
        fi
    fi
    left=$(budget_left)
    if (( left > 90 * SCALE )); then  # Qwen3-VL-2B shapes, random weights (writes a ~4.5 GB checkpoint)
        step "bench_qwen3vl" $(( left / SCALE - 10 )) bench_qwen3vl.log $PY scripts/bench_qwen3vl.py "${qwen_args[@]}" \
            --json "$OUT/bench_qwen3vl.json"
    else
        echo "== [2] bench_qwen3vl: not run, only ${left} s left (needs > 90 s)" | tee -a "$OUT/summary-2.txt"
    fi
    if [[ "${QWEN35:-0}" == 1 ]]; then  # opt-in: Qwen3.5-2B-like shapes, random weights, when time is left
        left=$(budget_left)
        if (( left > 90 * SCALE )); then
            step "bench_qwen35" $(( left / SCALE - 10 )) bench_qwen35.step.log env QWEN35_BUDGET_S=$(( left / SCALE - 15 )) \
                scripts/gpu_check_qwen35.sh "$OUT" $( (( DRY )) && echo --dry-run )
        else
            echo "== [2] bench_qwen35: not run, only ${left} s left (needs > 90 s)" | tee -a "$OUT/summary-2.txt"
        fi
    fi
}

plan() {
    cat <<EOF
gpu_check plan (budgets in seconds on the GPU; each step runs under its own timeout; the dry run
walks the same steps at tiny sizes on CPU with 4x these budgets)
call 1, ${CALL_BUDGET_1} s:
  set-up            ~10   install .whl/ into /tmp/site, check modules, find the parity fixtures
  environment        20   nvidia-smi, python / torch / CUDA / Triton versions, assert torch.cuda.is_available()
  flex smoke test    90   scripts/flex_smoke.py: compiled flex at Moondream 2 / Qwen3-VL-2B / 8B-GQA shapes,
                          bf16 + fp32, 1/8/64/128 queries (decode and main kernels), vs the reference,
                          one call captured in a CUDA graph and replayed
  bench_attention    50   scripts/bench_attention.py --block-sizes 16 64: decode step, CUDA events on a
                          captured step, fails beyond its tolerance
  GPU tests        rest   pytest -m gpu tests/test_gpu.py; a skipped test is a failure
call 2, ${CALL_BUDGET_2} s:
  set-up            ~10
  bench_engine      230   Moondream 2 shapes, random weights, bf16, ${KV_BLOCKS} KV blocks for every row:
                          mixed/256, mixed@1024x768/256, caption/256, mixed/64; engine sync + pipelined vs
                          static batches vs one-at-a-time (8 images); GPU busy share, graph-step share,
                          compile seconds and compiled shapes; rows stop starting after 170 s
  bench_moe         40   only with MOE=1: scripts/bench_moe.py, the MoE MLP on 4 Qwen3-VL-30B-A3B-shaped
                          layers (128 experts x 768, top 8, random weights): grouped GEMM / gathered / loop
                          vs a dense SwiGLU of the same active width, CUDA-graph replays checked against eager
  classify_bench   120   only with CLASSIFY=1: scripts/bench_classify.py, demo model, bf16, 256 images,
                          batch 256: classify(10) vs query(max_new_tokens 8) vs query(1), best of 3
  bench_qwen3vl    rest   only if > 90 s remain: Qwen3-VL-2B shapes, 64 images, engine (built untimed) vs
                          transformers' batched generate, bf16
EOF
}

if (( DRY )); then
    plan
    call_1
    call_2
    echo "gpu_check dry run: $(( ${#FAILED[@]} )) step(s) failed${FAILED[*]:+: ${FAILED[*]}}"
    (( ${#FAILED[@]} == 0 ))
    exit $?
fi
call_$MODE
if (( ${#FAILED[@]} )); then
    echo "gpu_check call $MODE: FAILED: ${FAILED[*]}" | tee -a "$OUT/summary-$MODE.txt"
    exit 1
fi
echo "gpu_check call $MODE: every step ok" | tee -a "$OUT/summary-$MODE.txt"
