set -uo pipefail
.kfuse-dist/bin/test_param_fingerprint_gpu --gtest_brief=1 2>&1 | tail -2
timeout 330 python3 -m pytest -q -x -p no:cacheprovider tests/python/test_gpu_weight_writes.py tests/python/test_gpu_ops.py 2>&1 | tail -8
python3 scripts/weight_change_cost.py 2>&1 | grep -v Warn | tail -7
python3 scripts/profile_weight_update.py 2>&1 | grep -v Warn | tail -14
echo "== base"
(cd .base && ln -sfn ../.kfuse-dist .kfuse-dist && bash scripts/gpu_run.sh --exec "python3 ../scripts/weight_change_cost.py" 2>&1 | grep -v "^\[build\]\|^--\|ninja\|Building\|Linking\|Warn" | tail -7)
