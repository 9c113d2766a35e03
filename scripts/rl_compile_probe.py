"""Where the rl benchmark's torch-compile configuration spends its first iterations (it had not finished compiling
after 390 s on an H200, where kfuse-compile compiles in ~15 s): times the rollout and the update of its first
iterations separately, prints Dynamo's compile-time breakdown, and dumps every thread's Python stack every
`stack_every` seconds meanwhile (a hang shows where it waits). Usage (GPU machine):
    python3 scripts/rl_compile_probe.py [impl=torch-compile] [iterations=2] [stack_every=120]"""
import faulthandler
import sys
import time

import torch

from kfuse.bench_rl import RL_ENVS, RL_STEPS, _trainer


def main():
    impl = sys.argv[1] if len(sys.argv) > 1 else "torch-compile"
    iterations = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    faulthandler.dump_traceback_later(float(sys.argv[3]) if len(sys.argv) > 3 else 120, repeat=True)
    torch.backends.cudnn.benchmark = True
    trainer = _trainer(impl, torch.device("cuda"), RL_ENVS, RL_STEPS, seed=0)
    for i in range(iterations):
        for phase in ("rollout", "update"):
            t0 = time.perf_counter()
            getattr(trainer, phase)()
            torch.cuda.synchronize()
            print(f"[probe] {impl} iteration {i} {phase}: {time.perf_counter() - t0:.1f} s", flush=True)
    faulthandler.cancel_dump_traceback_later()
    print(torch._dynamo.utils.compile_times(repr="str", aggregate=True))


if __name__ == "__main__":
    main()
