"""The encoder's training step (batch 2048 per GPU, fp16, forward + backward) alone and under DistributedDataParallel
over several GPUs (one process per GPU, NCCL, NVLink multicast off), same run: what the all-reduce adds to the step
when kfuse's gradients reach DDP, with DDP's defaults, with gradient_as_bucket_view=True (the gradients are views
of DDP's buckets: no copy of each gradient into its bucket and back) and, for kfuse, with each block's gradients
released as its backward finishes (gradient_release="per_block", 2 MB buckets: the all-reduce overlaps the backward)
and with kfuse.DistributedDataParallel (the encoder's gradients averaged in one all-reduce of their buffer, not
parameter by parameter through DDP's hooks). With --timeline, rank 0 of each configuration
then prints one step's device timeline (torch.profiler): the step's span, the device's busy time, every idle gap,
the kernels per stream and when the all-reduce ran against the backward's last kernel.
Usage (GPU machine with >= 2 GPUs):
    bash scripts/gpu_run.sh --exec "python3 scripts/ddp_step.py [gpus=2] [impl=kfuse|torch-compile] [--timeline] [--short]"
"""
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kfuse
from kfuse import reference
from kfuse.bench_rl import nvlink_multicast_off

BATCH, STEPS, ROUNDS = 2048, 20, 5
MARKER = "spin_kernel"  # torch.cuda._sleep's kernel: marks where each profiled step starts on the device


def _device_events(prof) -> list:
    return sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)


def print_step_timeline(prof, label: str) -> None:
    """The device's work between the last two markers (one whole step, the host running ahead as in the timing):
    span, busy time, gaps >= 5 us, then each kernel >= 3 us (start offset, duration, stream, name)."""
    events = _device_events(prof)
    marks = [i for i, e in enumerate(events) if MARKER in e.name]
    if len(marks) < 2:
        print(f"[timeline] {label}: fewer than two step markers seen")
        return
    step = events[marks[-2] + 1:marks[-1]]
    t0 = step[0].time_range.start
    busy, end, gaps = 0.0, t0, []
    for e in step:
        a, b = e.time_range.start, e.time_range.end
        if a - end >= 5:
            gaps.append((end - t0, a - end))
        if b > end:
            busy += b - max(a, end)
            end = b
    print(f"[timeline] {label}: one step spans {end - t0:.1f} us on the device, busy {busy:.1f} us, "
          f"{len(step)} kernels/copies; gaps >= 5 us (at, length): "
          + ", ".join(f"{at:.0f}+{g:.0f}" for at, g in gaps))
    small = 0
    for e in step:
        dur = e.time_range.end - e.time_range.start
        if dur < 3 and "nccl" not in e.name.lower():
            small += 1
            continue
        stream = getattr(e, "device_resource_id", "?")
        print(f"  {e.time_range.start - t0:8.1f} {dur:7.1f} us  s{stream:<4} {e.name[:90]}")
    print(f"  (+{small} kernels shorter than 3 us)")


def _encoder(impl: str, device, release: str = "at_end"):
    if impl == "kfuse":
        enc = kfuse.ResNetEncoder.default_network(3).to(device, torch.float16).train()
        enc.gradient_release = release
        return enc
    enc = reference.ResNetEncoder(3).to(device, torch.float16).to(memory_format=torch.channels_last).train()
    return torch.compile(enc) if impl == "torch-compile" else enc


def _allreduce_alone(numel: int, device) -> float:
    """Median ms of one NCCL all-reduce of `numel` fp16 values (the gradients' size), nothing else running."""
    buf = torch.randn(numel, device=device).half()
    for _ in range(3):
        dist.all_reduce(buf)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        dist.all_reduce(buf)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _worker(rank: int, world: int, impl: str, store: str, out: str, ddp_args: dict | None = None,
            release: str = "at_end", timeline: str = "") -> None:
    nvlink_multicast_off()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    if world > 1:
        dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world, device_id=device)
    try:
        enc = _encoder(impl, device, release)
        model = enc
        if world > 1:
            ddp_args = dict(ddp_args or {})
            wrapper = kfuse.DistributedDataParallel if ddp_args.pop("kfuse_ddp", False) else \
                torch.nn.parallel.DistributedDataParallel
            model = wrapper(enc, device_ids=[rank], **ddp_args)
        x = torch.rand(BATCH, 3, 64, 64, device=device).half()
        dy = torch.randn(BATCH, 512, 2, 2, device=device).half()

        def step():
            model(x).backward(dy)

        for _ in range(5):
            step()
        times = []
        for _ in range(ROUNDS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if world > 1:
                dist.barrier()
            torch.cuda.synchronize()
            start.record()
            for _ in range(STEPS):
                step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / STEPS)
        ms = [None] * world
        if world > 1:
            numel = sum(p.numel() for p in enc.parameters())
            allreduce_ms = _allreduce_alone(numel, device)
            if rank == 0:
                print(f"[ddp step] all-reduce of the gradients alone ({numel} fp16): "
                      f"{allreduce_ms * 1e3:.1f} us", flush=True)
            dist.all_gather_object(ms, statistics.median(times))
        else:
            ms = [statistics.median(times)]
        if rank == 0:
            torch.save(ms, out)
        if timeline:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(4):
                    torch.cuda._sleep(100)
                    step()
                torch.cuda._sleep(100)
                torch.cuda.synchronize()
            if rank == 0:
                print_step_timeline(prof, timeline)
    finally:
        if world > 1:
            dist.destroy_process_group()


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    timeline = "--timeline" in sys.argv[1:]
    gpus = int(args[0]) if args else 2
    impl = args[1] if len(args) > 1 else "kfuse"
    result = {}
    views = {"gradient_as_bucket_view": True}
    configs = [("1 GPU", 1, None, "at_end"), (f"{gpus} GPUs (DDP)", gpus, {}, "at_end"),
               (f"{gpus} GPUs (DDP, gradient_as_bucket_view)", gpus, views, "at_end")]
    if impl == "kfuse":
        configs.append((f"{gpus} GPUs (DDP, bucket views, 2 MB buckets, per-block release)", gpus,
                        dict(views, bucket_cap_mb=2), "per_block"))
        configs.append((f"{gpus} GPUs (kfuse.DistributedDataParallel)", gpus, {"kfuse_ddp": True}, "at_end"))
    if "--short" in sys.argv[1:]:  # the 1-GPU step, DDP's best configuration and kfuse's wrapper
        configs = [c for c in configs if c[0] == "1 GPU" or "gradient_as_bucket_view)" in c[0] or "kfuse." in c[0]]
    for label, world, ddp_args, release in configs:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_worker, args=(world, impl, f"{tmp}/store", f"{tmp}/out.pt", ddp_args, release,
                                    label if timeline else ""), nprocs=world)
            result[label] = max(torch.load(f"{tmp}/out.pt"))
    one = result["1 GPU"]
    print(f"[ddp step] {torch.cuda.get_device_name()}, {impl}, batch {BATCH} per GPU: " + ", ".join(
        f"{label} {ms:.3f} ms ({ms / one:.3f}x)" for label, ms in result.items()))

if __name__ == "__main__":
    main()
