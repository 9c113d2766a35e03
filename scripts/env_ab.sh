#!/usr/bin/env bash
# A/B of environment switches on the batch-128 inference forward, kfuse alone (run on the GPU machine, e.g. through
# scripts/gpu_run.sh --exec): per setting, the kernel timeline of one graph replay (scripts/profile_infer.py), then
# `kfuse bench --workload resnet-infer --impl kfuse` in interleaved rounds; the mean back-to-back and latency per
# setting last. A setting is a comma-separated list of VAR=VALUE, or "-" for the defaults.
# Usage: bash scripts/env_ab.sh [--rounds N] SETTING...    e.g. bash scripts/env_ab.sh - KFUSE_PDL=0
set -uo pipefail
py="${PYTHON:-python3}"
rounds=2
if [[ "${1:-}" == "--rounds" ]]; then rounds="$2"; shift 2; fi
(($#)) || { echo "usage: bash scripts/env_ab.sh [--rounds N] SETTING..." >&2; exit 2; }
out=build-gpu/env-ab
rm -rf "$out"
mkdir -p "$out"
env_of() { [[ "$1" == "-" ]] && return; tr ',' '\n' <<<"$1"; }
for s in "$@"; do
  mapfile -t vars < <(env_of "$s")
  echo "=== $s: timeline"
  env ${vars[@]+"${vars[@]}"} "$py" scripts/profile_infer.py 128 --timeline 2>&1 | grep -v -e 'host part' -e Warning -e _warn_once
done
for r in $(seq 1 "$rounds"); do
  i=0
  for s in "$@"; do
    mapfile -t vars < <(env_of "$s")
    env ${vars[@]+"${vars[@]}"} "$py" -m kfuse bench --workload resnet-infer --impl kfuse --out "$out/s$i-r$r" 2>&1 |
      grep "kfuse: latency" | sed "s/^/[$s round $r] /"
    i=$((i + 1))
  done
done
"$py" - "$out" "$@" <<'EOPY'
import glob, json, statistics, sys
out, settings = sys.argv[1], sys.argv[2:]
print(f"{'setting':40s} {'b2b ms':>8s} {'latency ms':>11s} runs")
for i, s in enumerate(settings):
    rows = [json.load(open(f))["rows"][0] for f in glob.glob(f"{out}/s{i}-r*/*/resnet-infer-c*.json")]
    if rows:
        print(f"{s:40s} {statistics.mean(r['back_to_back_ms'] for r in rows):8.4f} "
              f"{statistics.mean(r['latency_ms'] for r in rows):11.4f} {len(rows)}")
EOPY
