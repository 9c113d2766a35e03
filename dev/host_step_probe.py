"""Where the host's time goes in the encoder's training step (batch 2048, fp16), alone and under a one-process
DistributedDataParallel (NCCL, world size 1: the reducer's hooks and buckets, no second GPU needed), for each
gradient release: the host time of the forward call and of the backward call (launches only, the device runs
behind), the device time per step, then the CPU operators with the most self time (torch.profiler).
A step whose host time exceeds its device time leaves the device idle: that is what DDP's 2-GPU step showed.
Usage (GPU machine): bash scripts/gpu_run.sh --exec "python3 dev/host_step_probe.py [batch=2048]" """
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import kfuse


def probe(label, model, enc, x, dy, zero):
    def step():
        if zero:
            enc.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        y = model(x)
        t1 = time.perf_counter()
        y.backward(dy)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    for _ in range(8):
        step()
    torch.cuda.synchronize()
    host_f, host_b = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        f, b = step()
        host_f.append(f)
        host_b.append(b)
    end.record()
    end.synchronize()
    device_ms = start.elapsed_time(end) / 20
    print(f"[host] {label}: forward call {statistics.median(host_f) * 1e3:.3f} ms, backward call "
          f"{statistics.median(host_b) * 1e3:.3f} ms (host), step {device_ms:.3f} ms (device, 20 back to back)",
          flush=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60)
    print("\n".join("[host]   " + line for line in table.splitlines()), flush=True)


def main():
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    store = tempfile.mktemp()
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1, device_id=device)
    x = torch.rand(batch, 3, 64, 64, device=device).half()
    dy = torch.randn(batch, 512, 2, 2, device=device).half()
    for release in ("at_end", "per_block"):
        for zero in (False, True):
            enc = kfuse.ResNetEncoder.default_network(3).to(device, torch.float16).train()
            enc.gradient_release = release
            probe(f"{release}, alone, zero_grad={zero}", enc, enc, x, dy, zero)
            ddp = torch.nn.parallel.DistributedDataParallel(enc, device_ids=[0], gradient_as_bucket_view=True)
            probe(f"{release}, DDP world 1 (bucket views), zero_grad={zero}", ddp, enc, x, dy, zero)
    dist.destroy_process_group()
    os.unlink(store)


if __name__ == "__main__":
    main()
