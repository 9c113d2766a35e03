#!/usr/bin/env bash
# The main job: set-up, build, then `kfuse bench` (the benchmark on the embedded default network; without a GPU
# it says so and runs the CPU reference). Arguments go to `kfuse bench` (see `kfuse bench --help`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/build.sh
exec .venv/bin/kfuse bench "$@"
