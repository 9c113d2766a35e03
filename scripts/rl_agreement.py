"""kfuse's DD-PPO loop against plain PyTorch's from one seed, at the benchmark's size (128 environments x 32 steps):
per-iteration losses and the weights after the run, with the noise of two plain-PyTorch runs that differ only in
cuDNN's algorithms (NCHW with its heuristics; channels-last with cudnn.benchmark) as the yardstick. Usage: python scripts/rl_agreement.py [iterations=20] [seed=0]"""

import sys

import torch

from kfuse.bench_rl import RL_ENVS, RL_STEPS, agreement

iterations = int(sys.argv[1]) if len(sys.argv) > 1 else 20
seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
a = agreement(iterations, RL_ENVS, RL_STEPS, seed)
print(f"{torch.cuda.get_device_name()}: {iterations} iterations, {RL_ENVS} x {RL_STEPS} frames, seed {seed}")
print(" it   loss torch   loss kfuse   |kfuse-torch|   noise (two torch runs)")
for i, (lt, lk, d, n) in enumerate(zip(a["loss_torch"], a["loss_kfuse"], a["loss_diff"], a["loss_noise"])):
    print(f"{i:3d} {lt:12.6f} {lk:12.6f} {d:14.2e} {n:14.2e}")
print(f"losses: max difference {max(a['loss_diff']):.2e}, max noise {max(a['loss_noise']):.2e}")
print(f"weights: difference {a['weight_diff']:.2e}, noise {a['weight_noise']:.2e}, moved {a['weight_moved']:.2e}")
ok = (max(a["loss_diff"]) <= max(3 * max(a["loss_noise"]), 1e-3)
      and a["weight_diff"] <= max(3 * a["weight_noise"], 1e-3))
print("agreement within 3x the plain-PyTorch noise:", "yes" if ok else "NO")
