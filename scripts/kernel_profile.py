"""Per-kernel GPU time of a step, from torch.profiler's CUDA activity: shared by scripts/profile_train.py and
scripts/profile_mlp.py (run as `python scripts/<name>.py`, so this folder is on the import path)."""
import torch
from torch.profiler import ProfilerActivity, profile


def kernel_times(step, warmup: int = 5, steps: int = 10):
    """Runs `step` warmup times, then `steps` times under the profiler. Returns (kernel microseconds per step,
    [(kernel name, microseconds per step, launches per step)], slowest first)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            r = rows.setdefault(e.name, [0.0, 0])
            r[0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            r[1] += 1
    total = sum(v[0] for v in rows.values()) / steps
    ranked = sorted(((name, us / steps, cnt // steps) for name, (us, cnt) in rows.items()), key=lambda r: -r[1])
    return total, ranked
