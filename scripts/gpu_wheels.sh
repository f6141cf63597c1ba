#!/usr/bin/env bash
# Fetch the wheels the H200 image lacks (Python 3.12, x86_64) into .whl/, for gpu_check.sh.
# Run where pip reaches PyPI; .whl/ is git-ignored and travels with the device call's `carry`.
# What the image holds: /work/.library/device/KINDS.md, copied into tests/gpu/test_gpu_imports.py, which
# imports every GPU test module with only that set and these wheels importable.
#
#   scripts/gpu_wheels.sh          download REQUIRED (a failure fails) and OPTIONAL (a failure is said)
#   scripts/gpu_wheels.sh --list   the carried distributions, one a line (read by the tests)
#   scripts/gpu_wheels.sh --required   the required ones alone (gpu_check.sh's set-up checks .whl/ holds them)
set -euo pipefail
cd "$(dirname "$0")/.."
REQUIRED=(
    # the package's own dependencies the image lacks
    webdataset braceexpand
    pydantic pydantic-core annotated-types typing-inspection
    typing-extensions  # pydantic needs a newer one than an image may have (it shadows the old one)
    # json tasks' schema checks (batchvlm/json_schema.py); tests/models/qwen3_vl/test_qwen3vl_engine.py imports it at
    # module level, and the GPU tests import that module
    jsonschema referencing jsonschema-specifications rpds-py attrs
    # the json GPU test, at the versions the CPU suite ran
    xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 transformers==5.24.0 regex
)
# Optional: flash-linear-attention's kernels for Qwen3.5's Gated DeltaNet on CUDA (its other needs,
# torch, triton and einops, are on the image). A call runs without them.
OPTIONAL=(flash-linear-attention==0.6.0 fla-core==0.6.0)
if [[ "${1:-}" == "--list" ]]; then printf '%s\n' "${REQUIRED[@]}" "${OPTIONAL[@]}"; exit 0; fi
if [[ "${1:-}" == "--required" ]]; then printf '%s\n' "${REQUIRED[@]}"; exit 0; fi
download() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$@"
}
mkdir -p .whl
download "${REQUIRED[@]}"
download "${OPTIONAL[@]}" || echo "gpu_wheels: the optional wheels (${OPTIONAL[*]}) could not be fetched; the call runs without them"
ls .whl
