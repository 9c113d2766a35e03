#!/usr/bin/env bash
# A/B of an inference switch read when the encoder is created (default KFUSE_FUSED_BLOCK): kfuse alone on the
# resnet-infer workload (C = 3 and 1), VAR=0 then VAR=1, two interleaved rounds, then the mean back-to-back and
# latency of each setting. Usage (on the GPU machine): bash scripts/infer_ab.sh [VAR]
var="${1:-KFUSE_FUSED_BLOCK}"
py=python3
for r in 1 2; do
  for v in 0 1; do
    env "$var=$v" $py -m kfuse bench --workload resnet-infer --impl kfuse --out "build-gpu/ab-r$r-v$v" 2>&1 |
      grep "kfuse: latency" | sed "s/^/[$var=$v round=$r] /"
  done
done
$py - "$var" <<'EOPY'
import glob, json, statistics, sys
for v in "01":
    rows = [json.load(open(f))["rows"][0] for f in glob.glob(f"build-gpu/ab-r*-v{v}/*/resnet-infer-c*.json")]
    print(f"[ab] {sys.argv[1]}={v}: mean back-to-back {statistics.mean(r['back_to_back_ms'] for r in rows):.4f} ms, "
          f"mean latency {statistics.mean(r['latency_ms'] for r in rows):.4f} ms over {len(rows)} runs")
EOPY
