"""Where the time of one kfuse inference call goes (run on the GPU machine by scripts/gpu_run.sh --profile):
host time per call of the Python module and of the bare engine, and device time of the graph replay. Usage:
python scripts/profile_infer.py [N] [--timeline] (--timeline: the kernels of one replay in start order)."""
import statistics
import sys
import time

import torch

import kfuse
from kernel_profile import kernel_times, print_timeline
from kfuse import _C


def host_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        torch.cuda.synchronize()  # an empty queue: the call's own host time, not waiting behind earlier work
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    batch = int(args[0]) if args else 128
    enc = kfuse.ResNetEncoder.default_network(3).cuda().half().eval()
    x = torch.rand(batch, 3, 64, 64, device="cuda", dtype=torch.float16)
    engine = _C.EncoderGpu(enc.config, "float16", 0)
    engine.set_weights([p.detach().float().cpu() for p in enc.parameters()])
    y = torch.empty(batch, 512, 2, 2, device="cuda", dtype=torch.float16)
    stream = torch.cuda.current_stream().cuda_stream
    from kfuse.encoder import _param_list
    with torch.no_grad():
        module_us = host_us(lambda: enc(x))
        engine_us = host_us(lambda: engine.forward(x, y, stream))
        params = _param_list(enc, enc.config)
        parts = {
            "param_list": lambda: _param_list(enc, enc.config),
            "engine lookup + stamp": lambda: enc._gpu_engine(x.device, torch.float16, params),
            "torch.empty": lambda: torch.empty((batch, 512, 2, 2), dtype=torch.float16, device=x.device),
            "raw stream": lambda: torch._C._cuda_getCurrentRawStream(0),
        }
        for k, f in parts.items():
            print(f"[profile] host part {k}: {host_us(f):.1f} us")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(200):
            engine.forward(x, y, stream)
        end.record()
        torch.cuda.synchronize()
    if "--timeline" in sys.argv:
        intervals = []
        with torch.no_grad():
            total, rows = kernel_times(lambda: engine.forward(x, y, stream), intervals=intervals)
        print(f"[profile] kernel time per replay {total:.1f} us")
        print_timeline(intervals)
    print(f"[profile] batch {batch}: host time per call: module {module_us:.1f} us, engine.forward {engine_us:.1f} us; "
          f"device time per replay (back-to-back) {start.elapsed_time(end) / 200 * 1e3:.1f} us")


if __name__ == "__main__":
    main()
