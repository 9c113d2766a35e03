#!/usr/bin/env bash
# A/B of the programmatic-launch policies (KFUSE_PDL 0-3), kfuse alone, two interleaved rounds; then the official
# resnet-infer bench (kfuse, torch-compile-ro, torch-cudagraph) under the policy with the best mean back-to-back.
py=python3
for r in 1 2; do
  for m in 0 1 2 3; do
    KFUSE_PDL=$m $py -m kfuse bench --workload resnet-infer --impl kfuse --out build-gpu/ab-r$r-p$m 2>&1 |
      grep "kfuse: latency" | sed "s/^/[pdl=$m round=$r] /"
  done
done
best=$($py - <<'EOPY'
import json, glob, statistics, sys
res = {}
for m in "0123":
    rows = [json.load(open(f))["rows"][0] for f in glob.glob(f"build-gpu/ab-r*-p{m}/*/resnet-infer-c*.json")]
    res[m] = (statistics.mean(r["back_to_back_ms"] for r in rows), statistics.mean(r["latency_ms"] for r in rows))
    print(f"policy {m}: mean b2b {res[m][0]:.4f} ms, mean latency {res[m][1]:.4f} ms over {len(rows)} runs",
          file=sys.stderr)
print(min("123", key=lambda m: res[m][0]))
EOPY
)
echo "[ab] best policy: $best"
KFUSE_PDL=$best $py -m kfuse bench --workload resnet-infer --impl kfuse torch-compile-ro torch-cudagraph --out bench/results 2>&1 | tail -12
KFUSE_PDL=$best $py -m pytest tests/python/test_gpu_inference.py -q -p no:cacheprovider -k programmatic 2>&1 | tail -2
