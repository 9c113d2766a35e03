#!/usr/bin/env bash
# Configures and builds libkfuse, the C++ tests and the Python extension (written into python/kfuse/) in build/.
# Uses the virtualenv of scripts/setup.sh, Ninja and ccache. KFUSE_JOBS sets the parallelism (default 2: an sm90
# CUTLASS translation unit needs ~3.5 GB and ~60 s of one core).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
py="$root/.venv/bin/python"
export PATH="$root/.venv/bin:$PATH"

cuda=ON
if [[ -z "${CUDACXX:-}" ]]; then
  if command -v nvcc >/dev/null; then export CUDACXX="$(command -v nvcc)";
  elif [[ -x /usr/local/cuda/bin/nvcc ]]; then export CUDACXX=/usr/local/cuda/bin/nvcc;
  else
    echo "[build] no CUDA compiler (nvcc) found: building the CPU-only library (no GPU kernels)"
    cuda=OFF
  fi
fi
# ccache hashes the paths under the checkout relative to it: another clone of the same sources (CI's fresh clone)
# reuses this machine's cache.
export CCACHE_BASEDIR="$root"
cmake -S . -B build -G Ninja -DPython_EXECUTABLE="$py" -DKFUSE_WITH_CUDA="$cuda" ${KFUSE_CMAKE_ARGS:-} >/dev/null
cmake --build build -j "${KFUSE_JOBS:-2}"
