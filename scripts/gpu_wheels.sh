#!/usr/bin/env bash
# Fetch the wheels the H200 image lacks (Python 3.12, x86_64) into .whl/, for gpu_check.sh.
# Run where pip reaches PyPI; .whl/ is git-ignored and travels with the device call's `carry`.
# typing-extensions too: pydantic needs a newer one than an image may have (it shadows the old one).
# xgrammar (with apache-tvm-ffi) and transformers (with regex): the json GPU test, at the versions
# the CPU suite ran.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl webdataset braceexpand pydantic pydantic-core annotated-types typing-inspection typing-extensions \
    xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 transformers==5.24.0 regex
ls .whl
