set -uo pipefail
python3 scripts/weight_change_cost.py 2>&1 | grep -v Warn | tail -7
python3 scripts/profile_weight_update.py 2>&1 | grep -v Warn | tail -12
timeout 280 python3 -m pytest -q -x -p no:cacheprovider tests/python/test_gpu_weight_writes.py 2>&1 | tail -3
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/python/test_gpu_training.py 2>&1 | tail -3
echo "== base"
(cd .base && ln -sfn ../.kfuse-dist .kfuse-dist && bash scripts/gpu_run.sh --exec "python3 ../scripts/weight_change_cost.py" 2>&1 | grep -v "^\[build\]\|^--\|ninja\|Building\|Linking\|Warn" | tail -7)
