"""Per-kernel GPU time of kfuse's training step (forward + backward) at batch N (default 2048), C = 3, fp16, from
torch.profiler's CUDA activity: what PERF.md's training breakdown is made of; the GPU's idle gaps; the host phases of
a synchronized step. Usage: python scripts/profile_train.py [N] [--host] [--timeline] (--host: also the Python profile
of the forward and backward calls, the host work the latency pays before the GPU starts; --timeline: the kernels of
one step in start order)."""
import cProfile
import statistics
import sys
import time

import torch
from kernel_profile import PROFILED_STEPS, idle_gaps, kernel_times, print_host_profile, print_timeline, short_name

import kfuse


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    n = int(args[0]) if args else 2048
    enc = kfuse.ResNetEncoder.default_network(3).cuda().half().train()
    x = torch.rand(n, 3, 64, 64, device="cuda", dtype=torch.float16)
    dy = torch.randn(n, 512, 2, 2, device="cuda", dtype=torch.float16)
    params = list(enc.parameters())

    def step():
        return torch.autograd.grad(enc(x), params, dy)

    intervals = []
    total, rows = kernel_times(step, intervals=intervals)
    busy, gaps = idle_gaps(intervals, PROFILED_STEPS)
    # Wall time per step, back to back: below the kernel-time sum where branches of the step's graphs overlap.
    steps = 30
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    end.synchronize()
    print(f"kfuse training step N={n}: {total / 1e3:.3f} ms of kernel time per step, "
          f"{start.elapsed_time(end) / steps:.3f} ms per step back to back")
    print(f"GPU busy {busy / 1e3:.3f} ms per step (union of kernel intervals, profiled back to back); idle gaps:")
    for us, cnt, a, b in gaps[:8]:
        print(f"  {us:7.1f} us  x{cnt:<4.1f} after {a}  before {b}")
    # Host time of one synchronized step: where the latency exceeds the back-to-back time.
    phases = []
    for _ in range(200):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        y = enc(x)
        t1 = time.perf_counter()
        torch.autograd.grad(y, params, dy)
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        phases.append((t1 - t0, t2 - t1, time.perf_counter() - t2, time.perf_counter() - t0))
    med = [statistics.median(p[i] for p in phases) * 1e3 for i in range(4)]
    print(f"synchronized step (median of 200): {med[3]:.3f} ms = forward call {med[0]:.3f} + backward call "
          f"{med[1]:.3f} + wait {med[2]:.3f} (host ms)")
    if "--host" in sys.argv:
        for label, call in (("forward", lambda: enc(x)), ("backward", None)):
            prof = cProfile.Profile()
            for _ in range(100):
                torch.cuda.synchronize()
                if call is None:
                    y = enc(x)
                    prof.enable()
                    torch.autograd.grad(y, params, dy)
                    prof.disable()
                else:
                    prof.enable()
                    call()
                    prof.disable()
            torch.cuda.synchronize()
            print_host_profile(prof, f"host profile of 100 {label} calls")
    for name, us, cnt in rows[:60]:
        print(f"{us:9.1f} us  x{cnt:<3} {short_name(name)}")
    if "--timeline" in sys.argv:
        print_timeline(intervals)
    print("forward convolution choices at this batch (tuner):")
    for r in enc.tune(n, 64, 64, mode="on", verbose=False):
        print(f"  {r['shape']:<36} {r['choice']:<20} tuned {r['tuned_ms'] * 1e3 if r['tuned_ms'] else 0:8.1f} us")


if __name__ == "__main__":
    main()
