"""Per-kernel GPU time of a step, from torch.profiler's CUDA activity, and the printout of a host (cProfile) profile:
shared by scripts/profile_train.py and scripts/profile_mlp.py (run as `python scripts/<name>.py`, so this folder is
on the import path)."""
import io
import pstats

import torch
from torch.profiler import ProfilerActivity, profile


PROFILED_STEPS = 10


def kernel_times(step, warmup: int = 5, steps: int = PROFILED_STEPS, intervals: list | None = None):
    """Runs `step` warmup times, then `steps` times under the profiler. Returns (kernel microseconds per step,
    [(kernel name, microseconds per step, launches per step)], slowest first). `intervals`, if given, receives
    (start us, end us, name) of every GPU activity."""
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
            if intervals is not None:
                intervals.append((e.time_range.start, e.time_range.end, e.name))
    total = sum(v[0] for v in rows.values()) / steps
    ranked = sorted(((name, us / steps, cnt // steps) for name, (us, cnt) in rows.items()), key=lambda r: -r[1])
    return total, ranked


def idle_gaps(intervals: list, steps: int, min_us: float = 3.0):
    """Where the GPU had nothing to run: (busy microseconds per step, [(gap us per step, count per step, kernel
    before, kernel after)] largest first), from the union of the activity intervals."""
    iv = sorted(intervals)
    if not iv:
        return 0.0, []
    busy, gaps = 0.0, {}
    cur_s, cur_e, cur_name = iv[0][0], iv[0][1], iv[0][2]
    for s_, e_, name in iv[1:]:
        if s_ > cur_e:
            busy += cur_e - cur_s
            if s_ - cur_e >= min_us:
                g = gaps.setdefault((cur_name[:60], name[:60]), [0.0, 0])
                g[0] += s_ - cur_e
                g[1] += 1
            cur_s, cur_e, cur_name = s_, e_, name
        elif e_ > cur_e:
            cur_e, cur_name = e_, name
    busy += cur_e - cur_s
    ranked = sorted(((us / steps, cnt / steps, a, b) for (a, b), (us, cnt) in gaps.items()), key=lambda r: -r[0])
    return busy / steps, ranked


def short_name(name: str) -> str:
    """A kernel name short enough for a table: CUTLASS kernels differ only deep in their mangled names, so they keep
    their tile shapes and operator."""
    if "cutlass" not in name:
        return name[:110]
    import re
    return " ".join(re.findall(r"GemmShapeILi\d+ELi\d+ELi\d+E|Strided|Wgrad|Dgrad|Fprop|ConvUniversal|ReduceSplitK|"
                               r"Sm90|Shape<[^>]{0,40}>", name)[:6])[:110]


def print_timeline(intervals: list, steps: int = PROFILED_STEPS):
    """The kernels of the last profiled step in start order: start offset from the step's first kernel, duration,
    name. Shows the critical path of a graph replay: which kernels run side by side and where the GPU waits."""
    iv = sorted(intervals)
    if not iv:
        return
    per_step = len(iv) // steps
    last = iv[-per_step:]
    t0 = last[0][0]
    print(f"--- timeline of one step ({per_step} kernels; start us, duration us) ---")
    for s_, e_, name in last:
        print(f"{s_ - t0:8.1f} {e_ - s_:7.1f}  {short_name(name)}")


def print_host_profile(prof, title: str, lines: int = 12):
    """The `lines` functions of most own time in a cProfile profile, under a title line."""
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(lines)
    print(f"--- {title} (tottime, cProfile's overhead included) ---")
    print("\n".join(line for line in out.getvalue().splitlines()[4:] if line.strip()))
