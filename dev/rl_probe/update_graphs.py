"""Does the rl update re-capture kfuse's training graphs (GPU; run from the repository root):
    PYTHONPATH=python python3 dev/rl_probe/update_graphs.py [impl] [iterations]

kfuse's training step replays CUDA graphs keyed by the caller's pointers (input, output, dL/dy, gradient buffer);
the update's minibatches are fresh tensors whose addresses depend on the allocator's state, which the episode pieces'
varying sizes perturb. Per update: wall time, GPU-busy time, cudaGraphInstantiate calls and their host time, and the
kfuse backward's host time (eager launches where no graph replays)."""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kfuse.bench_rl import RL_ENVS, RL_STEPS, _trainer

sys.path.insert(0, "scripts")
from profile_rl import busy_us  # noqa: E402

impl = sys.argv[1] if len(sys.argv) > 1 else "kfuse"
iterations = int(sys.argv[2]) if len(sys.argv) > 2 else 10
trainer = _trainer(impl, "cuda", RL_ENVS, RL_STEPS, seed=0)
print(f"{impl}: update wall ms, GPU busy ms, instantiations (host ms), kfuse backward host ms, graphs held")
for i in range(iterations):
    trainer.rollout()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        trainer.update()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    ev = prof.key_averages()
    inst = [e for e in ev if e.key == "cudaGraphInstantiate"]
    bwd = [e for e in ev if e.key == "_CudaTrainFunctionBackward"]
    n_inst = sum(e.count for e in inst)
    t_inst = sum(e.self_cpu_time_total for e in inst) / 1e3
    t_bwd = sum(e.self_cpu_time_total for e in bwd) / 1e3
    engines = trainer.policy.encoder.__dict__.get("_gpu_engines", {})
    held = sum(entry[0].graph_count for entry in engines.values())
    print(f"  {i}: {wall:7.1f} {busy_us(prof) / 1e3:6.1f}  {n_inst} ({t_inst:5.1f})  {t_bwd:5.1f}  {held}", flush=True)
