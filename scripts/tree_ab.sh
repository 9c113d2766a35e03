#!/usr/bin/env bash
# Same-run A/B of two source trees on one GPU machine: another checkout (A, e.g. an older commit unpacked into .base/
# with its own .kfuse-dist bundle) against this tree (B), kfuse alone on the given workloads (default resnet-infer,
# resnet-train and mlp), rounds interleaved (A B, A B, ...); then, per result file and timing, the mean of each tree,
# the spread over rounds and B/A. Each tree keeps its own tuning cache across rounds, so only the first round tunes.
# Usage (on the GPU machine, inside this tree's scripts/gpu_run.sh --exec, after A was built by its own gpu_run.sh):
#   bash scripts/tree_ab.sh [--rounds N] A_DIR [workload ...]
# Results: build-gpu/tree-ab/{A,B}-r<round>/ (and a copy of the log in $OUT when set).
set -uo pipefail
py="${PYTHON:-python3}"
rounds=2
if [[ "${1:-}" == "--rounds" ]]; then rounds="$2"; shift 2; fi
base="$(cd "${1:?usage: bash scripts/tree_ab.sh [--rounds N] A_DIR [workload ...]}" && pwd)"; shift
workloads=("$@")
((${#workloads[@]})) || workloads=(resnet-infer resnet-train mlp)
root="$(pwd)"
out="$root/build-gpu/tree-ab"
rm -rf "$out"
mkdir -p "$out"
log="${OUT:-$out}/tree-ab.log"

# A runs in its own directory with its own extension, library and tuning cache; B in the environment gpu_run set up.
run_tree() {  # tree round workload
  local dir="$root" tag="B" env_a=()
  if [[ "$1" == A ]]; then
    dir="$base" tag="A"
    env_a=(PYTHONPATH="$base/python" LD_LIBRARY_PATH="$base/build-gpu/full/src:${LD_LIBRARY_PATH:-}"
           KFUSE_CACHE_DIR="$base/build-gpu/cache" KFUSE_COMMIT="$(cat "$base/.kfuse-dist/COMMIT" 2>/dev/null)")
  fi
  local t0=$SECONDS
  (cd "$dir" && env ${env_a[@]+"${env_a[@]}"} "$py" -m kfuse bench --workload "$3" --impl kfuse \
     --out "$out/$tag-r$2" >"$out/$tag-r$2-$3.log" 2>&1) || echo "[tree-ab] $tag round $2 $3 FAILED" | tee -a "$log"
  echo "[tree-ab] $tag round $2 $3: $((SECONDS - t0)) s" | tee -a "$log"
}

summary() {  # after every round, so that a run cut short still reports the rounds it finished
"$py" - "$out" <<'EOPY' | tee -a "$log"
import glob, json, os, statistics, sys
out = sys.argv[1]
timings = {}  # (file, key) -> {tree: [values]}
for path in glob.glob(f"{out}/*-r*/*/*.json"):
    tree = os.path.basename(os.path.dirname(os.path.dirname(path)))[0]
    name = os.path.basename(path)
    for row in json.load(open(path)).get("rows", []):
        if row.get("impl") != "kfuse":
            continue
        for key, value in row.items():
            if key.endswith("_ms") and isinstance(value, (int, float)):
                timings.setdefault((name, key), {}).setdefault(tree, []).append(value)
print(f"{'result':22s} {'timing':16s} {'A mean':>9s} {'A range':>17s} {'B mean':>9s} {'B range':>17s} {'B/A':>7s}")
for (name, key), per in sorted(timings.items()):
    if key in ("min_ms", "max_ms") or not per.get("A") or not per.get("B"):
        continue
    a, b = per["A"], per["B"]
    span = lambda v: f"{min(v):.4f}-{max(v):.4f}"
    print(f"{name:22s} {key:16s} {statistics.mean(a):9.4f} {span(a):>17s} {statistics.mean(b):9.4f} {span(b):>17s} "
          f"{statistics.mean(b) / statistics.mean(a):7.3f}")
EOPY
}

for r in $(seq 1 "$rounds"); do
  for w in "${workloads[@]}"; do run_tree A "$r" "$w"; run_tree B "$r" "$w"; done
  echo "[tree-ab] after round $r:" | tee -a "$log"
  summary
done
