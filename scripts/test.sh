#!/usr/bin/env bash
# The test command: set-up, build, then the C++ tests (CTest/GoogleTest) and the Python tests (pytest).
# Without a GPU the GPU tier skips itself; on a GPU machine it runs.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
start=$SECONDS
bash scripts/build.sh
export PATH="$root/.venv/bin:$PATH"  # the CMake/CTest that configured build/
# ctest runs tests in parallel: one OpenMP thread each, or the CPU reference's threads spin against each other.
OMP_NUM_THREADS=1 ctest --test-dir build --output-on-failure -j "${KFUSE_JOBS:-2}"
.venv/bin/python -m pytest tests/python -q -p no:cacheprovider
echo "[test] all tests passed in $((SECONDS - start)) s"
