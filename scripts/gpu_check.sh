#!/usr/bin/env bash
# The GPU validation: the one script a lent GPU runs, planned for a device budget of 15 minutes per
# task (machine start-ups, idle waits and every call counted in) as two calls. The FIRST call
# (380 s) returns the headline numbers before anything else can crash: the environment, then the
# Moondream 2 engine bench (its JSON rewritten after every runner, straight into $OUT), then a cut
# flex_smoke, then the GPU tests of the new CUDA paths. The SECOND call, planned for a cold start
# (a machine goes back 30 s after a call; a fresh one takes 1-2 minutes), runs everything else in
# order of importance; what its time does not cover is skipped, recorded, and left for a later
# task's device. Each step starts only with its minimum left in the call and runs under its own
# timeout; a failure, timeout, skip, skipped GPU test or flex fallback makes the call exit non-zero,
# and summary.txt says which step.
#
#   scripts/gpu_check.sh              the first call (CALL_BUDGET_S, default 380 s)
#   scripts/gpu_check.sh --call 2     the second call (CALL_BUDGET_S, default 220 s)
#   scripts/gpu_check.sh STEP...      only these steps, in the plan's order (CALL_BUDGET_S, default 380 s)
#   scripts/gpu_check.sh --plan       both calls' steps and budgets
#   scripts/gpu_check.sh --prepare    here, before a device call: the wheels (scripts/gpu_wheels.sh: jsonschema,
#                                     flash-linear-attention, ...), the parity fixture the GPU tests read, and
#                                     the size of what the call will send (< 64 MiB)
#   scripts/gpu_check.sh --dry-run [--call N | STEP...]   on CPU: the plan, then both calls (or the one
#                                     named, or the steps named) at tiny sizes, each with its own set-up as
#                                     on a fresh machine (checks the script and every step's arguments;
#                                     budgets x4 for a shared CPU). tests/gpu/test_gpu_check_dry_run.py runs it.
#
# The procedure (prepare and dry-run here, the two calls, what to record from $OUT): CONTRIBUTING.md,
# "The GPU check"; docs/benchmarks.md's GPU numbers come from what it records.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0 PLAN_ONLY=0 PREPARE=0 CALLS=""
while (( $# )); do
    case $1 in
        --dry-run) DRY=1 ;;
        --plan) PLAN_ONLY=1 ;;
        --prepare) PREPARE=1 ;;
        --call) CALLS=${2:-}; shift
                [[ $CALLS == 1 || $CALLS == 2 ]] || { echo "gpu_check: --call 1 or --call 2" >&2; exit 2; } ;;
        *) break ;;
    esac
    shift
done
OUT=${OUT:-gpu-results}
LOG_DIR=${LOG_DIR:-/tmp/gpu_check_logs}  # outside $OUT: only summary.txt, bench.json and logs.tar.gz go there
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SCALE=$(( DRY ? 4 : 1 ))  # the dry run's tiny steps on a (shared) CPU get 4x the GPU budgets
CALL_BUDGETS=([1]=380 [2]=220)
# One KV size for every bench_engine row: 16384 x 16 tokens, 51.5 GB at Moondream 2 bf16. caption at
# 256 rows holds 256 images' 730-token prefixes at once (~12.8k blocks with the rows' own); 8192
# would cap it near 170 rows.
KV_BLOCKS=16384
# The GPU tests (tests/gpu/ after issue 36's move; tests/ before it) and the new CUDA paths among them.
GPU_TESTS=tests/gpu/test_gpu.py
NEW_PATHS="json_masks or newer_model_paths or moe_grouped_gemm or split_admission"

# The steps, in order: name, call, budget (GPU seconds), minimum worth starting with (a step whose
# first result needs that long), log file, what it is. Call 1 is set-up 15 + 365 = 380 s.
STEPS=(
    "environment        1  10  10 env.txt                nvidia-smi, python / torch / CUDA / Triton versions; torch sees the GPU"
    "bench_engine       1 200 120 bench.log              the headline: Moondream 2 shapes, random bf16 weights, 256 images, ${KV_BLOCKS} KV blocks: caption@1024x768/256 (13 crops: the goal row), then mixed/256; engine pipelined, engine sync (+ GPU busy), static batch, one-at-a-time on 2 images; one repeat; \$OUT/bench.json after every runner"
    "flex_smoke_cut     1  60  40 flex_smoke_cut.log     compiled flex at Moondream 2 and Qwen3.5-2B (head dim 256) shapes, bf16, 1 and 128 queries per row, vs the reference, replayed in a CUDA graph"
    "gpu_tests_new      1  95  80 gpu_tests_new.log      the GPU tests of the new CUDA paths: json masks, Qwen3.5, Qwen3-VL-MoE, Florence-2 graphs vs eager vs CPU, MoE grouped GEMM, split admission steps; a skipped test fails"
    "gpu_tests          2 150 120 gpu_tests.log          the other GPU tests: graphs vs eager, upstream parity, bf16, KV sizing, pinned staging, compiled flex, classify"
    "prefill_sweep      2  90  60 prefill_sweep.log      engine pipelined on mixed/256 (Moondream 2 shapes as bench_engine): the prefill budget the H200 gets (engine/prefill.py), 2048 and 8192 tokens, and admission steps as one mixed eager forward instead of split (prefill eager + decode graph)"
    "flex_smoke_rest    2  90  60 flex_smoke_rest.log    flex_smoke's other checks: Qwen3-VL-2B / 8B-GQA, Moondream 2 fp32, 8 and 64 queries per row"
    "bench_qwen35       2 120  90 bench_qwen35.log       Qwen3.5-2B-like shapes, random bf16 weights, 128 images: engine vs transformers' batched generate"
    "bench_qwen3vl      2 120  90 bench_qwen3vl.log      Qwen3-VL-2B shapes, random bf16 weights, 64 images: engine (built untimed) vs transformers' batched generate"
    "bench_engine_more  2 120  90 bench_more.log         Moondream 2 shapes as bench_engine: mixed@1024x768/256, caption/256; one-at-a-time on 8 images"
    "bench_moe          2  40  40 bench_moe.log          MoE MLP, 4 Qwen3-VL-30B-A3B-shaped layers (128 x 768, top 8): grouped / gathered / loop vs dense SwiGLU, graph replays vs eager"
    "bench_florence2    2  60  45 bench_florence2.log    Florence-2-base shapes, random weights, 32 images: native engine vs the transformers backend, labels equal"
    "classify_bench     2  90  60 bench_classify.log     classify(10) vs query(8) vs query(1) on Qwen3-VL-2B shapes, bf16, batch 256"
    "bench_attention    2  50  50 bench_attention.log    one decode step's attention at Moondream 2 shapes, blocks 16 and 64, CUDA events on a captured step"
    "bench_embed        2  90  60 bench_embed.log        SigLIP 2 base NaFlex shapes, random bf16 weights, 1024 JPEGs: batchvlm run (embed) vs transformers' batched forward on preprocessed tensors"
    "bench_prune        2  90  45 bench_prune.log        duplicate-token pruning (issue 43): share of Qwen and Florence-2 image tokens removed, then batchvlm tune on the Qwen3-VL and the Florence-2 mid configs (random weights), shapes and documents, pruned vs not"
)

plan() {
    echo "gpu_check plan: two calls (CALL_BUDGET_S overrides a call's budget); budgets in GPU seconds, a step"
    echo "starts only with its minimum left in the call (else: skipped, recorded, the call fails); the dry"
    echo "run walks the same steps at tiny sizes on CPU with 4x these budgets"
    local s call=0
    for s in "${STEPS[@]}"; do
        read -r name c budget least _log what <<<"$s"
        if (( c != call )); then
            call=$c
            echo "call $c (${CALL_BUDGETS[$c]} s$( (( c == 2 )) && echo ", a cold start"))"
            echo "  set-up               ~15   install .whl/ into /tmp/site, check modules and wheels, find the parity fixtures"
        fi
        printf "  %-18s %4s  (starts with >= %s s left)  %s\n" "$name" "$budget" "$least" "$what"
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

# Each call's first work, as on a fresh machine: the carried wheels installed, every module the
# package and the GPU tests import (tests/gpu/test_gpu_imports.py checks the same set on CPU), the
# parity fixtures found.
setup() {
    local wheels
    if compgen -G ".whl/*.whl" >/dev/null; then
        # every required carried distribution has its wheel (scripts/gpu_wheels.sh --required)
        wheels=" $(ls .whl | cut -d- -f1 | tr 'A-Z' 'a-z' | tr '\n' ' ')"  # a wheel's name: dist_name-version-...
        for d in $(scripts/gpu_wheels.sh --required); do
            d=$(echo "${d%%[=<>]*}" | tr 'A-Z.-' 'a-z__')
            [[ $wheels == *" $d "* ]] || { echo "gpu_check: no wheel for $d in .whl/: run scripts/gpu_wheels.sh"; return 2; }
        done
        if (( DRY )); then
            echo "gpu_check: dry run: the wheels are for the device's Python 3.12; not installed here"
        else
            $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
                .whl/*.whl || { echo "gpu_check: installing .whl/ failed"; return 2; }
            export PYTHONPATH=/tmp/site
        fi
    elif (( ! DRY )); then
        echo "gpu_check: no .whl/ (jsonschema, xgrammar, ... are not on the image): run scripts/gpu_wheels.sh, carry .whl"
        return 2
    fi
    export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
    $PY - <<'PYEOF' || return 2
import importlib, sys
need = ["torch", "numpy", "PIL", "pyarrow", "tokenizers", "safetensors", "huggingface_hub", "fsspec", "yaml",
        "tqdm", "typer", "pytest", "webdataset", "braceexpand", "pydantic", "pydantic_core", "annotated_types",
        "typing_inspection", "jsonschema", "referencing", "jsonschema_specifications", "rpds", "attrs",
        "transformers", "xgrammar", "batchvlm.run.worker", "batchvlm.engine.engine", "batchvlm.attention.fused"]
missing = []
for name in need:
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - report every missing module at once
        missing.append(f"{name} ({type(e).__name__}: {e})")
if missing:
    sys.exit("gpu_check: missing modules: " + "; ".join(missing) + " -- run scripts/gpu_wheels.sh and carry .whl")
try:  # optional: Qwen3.5's Gated DeltaNet kernels on CUDA
    import fla
    print("gpu_check: flash-linear-attention", getattr(fla, "__version__", "?"))
except Exception as e:  # noqa: BLE001 - optional: say why, go on
    print(f"gpu_check: flash-linear-attention not importable (optional): {type(e).__name__}: {e}")
PYEOF
    FIXTURES=""
    for d in ${BATCHVLM_SHARED:+"$BATCHVLM_SHARED"} shared ../shared; do
        if [[ -d "$d/fixtures/moondream-tiny" ]]; then FIXTURES=$(cd "$d" && pwd); break; fi
    done
    if [[ -z "$FIXTURES" ]]; then
        echo "gpu_check: parity fixtures not found (shared/fixtures/moondream-tiny): scripts/gpu_check.sh --prepare"
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
    $PY - "$DRY" <<'PYEOF'
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
PYEOF
}

# Moondream 2 at full size (GPU) or the demo model (dry run); rows in order, a row starts only
# before the deadline; --json is rewritten after every runner.
moondream_bench() {  # JSON ROW... (then bench_engine.py's own arguments after --)
    local json=$1; shift
    local rows=() more=() runners=("engine pipelined" "engine sync" "static batch" "one-at-a-time")  # the headline first
    while (( $# )) && [[ $1 != -- ]]; do rows+=("$1"); shift; done
    (( $# )) && { shift; more=("$@"); }
    local args=(--model full-random --images 256 --fixed-lengths --max-new-tokens 32 --max-objects 6 --repeat 1
                --kv-blocks $KV_BLOCKS --deadline-s $(( STEP_BUDGET / SCALE - 80 )))
    if (( DRY )); then
        args=(--model demo --device cpu --images 2 --repeat 1 --max-new-tokens 3 --max-objects 1 --kv-blocks 300
              --deadline-s 120)
        rows=("${rows[@]/%\/256/\/4}")
    fi
    $PY scripts/bench_engine.py "${args[@]}" --rows "${rows[@]}" --runners "${runners[@]}" "${more[@]}" --json "$json"
}

bench_engine() {
    moondream_bench "$OUT/bench.json" caption@1024x768/256 mixed/256 -- \
        --one-at-a-time-images 2 --profile "engine sync"
}

bench_engine_more() {
    moondream_bench "$LOG_DIR/bench_more.json" mixed@1024x768/256 caption/256 -- \
        --one-at-a-time-images $(( DRY ? 1 : 8 )) --profile
}

# engine.prefill_tokens_per_step swept around the per-device default, and split vs mixed admission steps.
prefill_sweep() {
    moondream_bench "$LOG_DIR/prefill_sweep.json" mixed/256 -- --runners "engine pipelined" \
        --prefill-sweep 2048 8192 --mixed-admission
}

flex_smoke_cut() { $PY scripts/flex_smoke.py --part first $( (( DRY )) && echo --small ); }
flex_smoke_rest() { $PY scripts/flex_smoke.py --part rest $( (( DRY )) && echo --small ); }

gpu_tests_of() {  # -k EXPRESSION; any skipped GPU test is a failure: a GPU run that skips proves nothing
    if (( DRY )); then
        $PY -m pytest -q -m gpu -p no:cacheprovider --collect-only -k "$1" "$GPU_TESTS" 2>&1 | tail -3
        return "${PIPESTATUS[0]}"
    fi
    # -v: each test's line as it ends, so a timeout still says which ran; durations of the slow ones
    local out
    out=$(mktemp)
    $PY -m pytest -v -m gpu -p no:cacheprovider -rs --durations=15 -k "$1" "$GPU_TESTS" 2>&1 | tee "$out"
    local rc=${PIPESTATUS[0]}
    if tail -1 "$out" | grep -q "skipped"; then echo "!! GPU tests were skipped"; return 1; fi
    return "$rc"
}
gpu_tests_new() { gpu_tests_of "$NEW_PATHS"; }
gpu_tests() { gpu_tests_of "not ($NEW_PATHS)"; }

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

bench_qwen35() {  # Gated DeltaNet on flash-linear-attention's kernels on both sides when the carried fla imports (the log says which)
    local args=(--config 2b --dtype bfloat16 --images 128 --batch 256 --hf-batch 64 --max-new-tokens 32)
    (( DRY )) && args=(--config tiny --device cpu --images 2 --batch 16 --hf-batch 8 --max-new-tokens 3)
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

bench_embed() {
    local args=(--config base --device cuda --dtype bfloat16 --images 1024 --batch 256 --workers 8 --repeats 2)
    (( DRY )) && args=(--config tiny --images 8 --batch 4 --workers 1 --repeats 1)
    $PY scripts/bench_embed.py "${args[@]}" --json "$LOG_DIR/bench_embed.json"
}

bench_attention() {
    local args=(--block-sizes 16 64)
    (( DRY )) && args=(--images 2 --rows 3 --prefix 37 --own-max 20 --layers 1 --steps 1 --block-sizes 16 64)
    $PY scripts/bench_attention.py "${args[@]}"
}

bench_prune() {
    local args=(--speed --n 16) f2=(--speed --n 16 --family florence2)
    (( DRY )) && args=(--speed --n 2 --config tiny) && f2=(--speed --n 2 --pairs 1 --config tiny --family florence2)
    $PY scripts/bench_prune.py "${args[@]}" && $PY scripts/bench_prune.py "${f2[@]}"
}

export -f bench_embed environment moondream_bench bench_engine bench_engine_more prefill_sweep flex_smoke_cut flex_smoke_rest gpu_tests_of \
    gpu_tests_new gpu_tests bench_qwen3vl bench_moe bench_qwen35 bench_florence2 classify_bench bench_attention \
    bench_prune
export DRY PY LOG_DIR OUT SCALE KV_BLOCKS GPU_TESTS NEW_PATHS

# ---------------------------------------------------------------- the calls

if (( PLAN_ONLY )); then plan; exit 0; fi
if (( PREPARE )); then prepare; exit $?; fi
NAMES=()
for s in "${STEPS[@]}"; do NAMES+=("${s%% *}"); done
for want in "$@"; do
    [[ " ${NAMES[*]} " == *" $want "* ]] || { echo "gpu_check: no step '$want' (steps: ${NAMES[*]})" >&2; exit 2; }
done
if [[ -z $CALLS ]]; then CALLS=$( (( DRY && ! $# )) && echo "1 2" || echo 1); fi
(( DRY )) && plan
rm -rf "$OUT/summary.txt" "$OUT/logs.tar.gz" "$OUT/bench.json" "$LOG_DIR"
mkdir -p "$LOG_DIR"
# One call, run in a subshell as on a fresh machine: its set-up, then its steps (or the steps
# named, whatever their call), then its verdict, the summary's last line for it.
run_call() {
    local call=$1 s label="call $1"
    (( $# > 1 )) && label=gpu_check
    (( DRY )) && label+=" dry run"
    CALL_BUDGET=$(( ${CALL_BUDGET_S:-${CALL_BUDGETS[$call]}} * SCALE ))
    CALL_START=$SECONDS
    (( $# > 1 )) || record "== call $call: $(( CALL_BUDGET / SCALE )) s$( (( DRY )) && echo " x$SCALE on CPU")"
    if ! setup; then
        record "set-up: FAILED"
        FAILED+=("set-up")
    else
        for s in "${STEPS[@]}"; do
            read -r name c budget least log _what <<<"$s"
            if (( $# > 1 )); then [[ " ${*:2} " == *" $name "* ]] || continue
            elif (( c != call )); then continue; fi
            step "$name" "$budget" "$least" "$log"
        done
    fi
    if (( ${#FAILED[@]} )); then
        record "$label: FAILED: ${FAILED[*]} ($(( SECONDS - CALL_START )) s)"
        return 1
    fi
    record "$label: every step ok ($(( SECONDS - CALL_START )) s)"
}
rc=0
if (( $# )); then
    (run_call 1 "$@") || rc=1
else
    for call in $CALLS; do (run_call "$call") || rc=1; done
fi
exit $rc
