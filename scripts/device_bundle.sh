#!/usr/bin/env bash
# Packs what the GPU machine needs from this machine's build into .kfuse-dist/ (git-ignored, carried by the device
# tool): libkfuse and its CMake package, and the C++ GPU test binaries. The GPU machine then builds only the small
# Python extension for its own Python (scripts/gpu_run.sh), instead of spending device time on CUTLASS.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/build.sh
rm -rf .kfuse-dist
cmake --install build --prefix .kfuse-dist >/dev/null
mkdir -p .kfuse-dist/bin
cp build/tests/cpp/test_*_gpu .kfuse-dist/bin/ 2>/dev/null || true
git rev-parse --short HEAD > .kfuse-dist/COMMIT 2>/dev/null || echo unknown > .kfuse-dist/COMMIT
git status --porcelain | grep -q . && sed -i 's/$/+dirty/' .kfuse-dist/COMMIT
du -sh .kfuse-dist
