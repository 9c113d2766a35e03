"""The encoder's training step (batch 2048 per GPU, fp16, forward + backward) alone and under DistributedDataParallel
over several GPUs (one process per GPU, NCCL, NVLink multicast off), same run: what the all-reduce adds to the step
when kfuse's gradients reach DDP, with DDP's defaults and with gradient_as_bucket_view=True (the gradients are views
of DDP's buckets: no copy of each gradient into its bucket and back). Usage (GPU machine with >= 2 GPUs):
    bash scripts/gpu_run.sh --exec "python3 scripts/ddp_step.py [gpus=2] [impl=kfuse|torch-compile]"
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


def _encoder(impl: str, device):
    if impl == "kfuse":
        return kfuse.ResNetEncoder.default_network(3).to(device, torch.float16).train()
    enc = reference.ResNetEncoder(3).to(device, torch.float16).to(memory_format=torch.channels_last).train()
    return torch.compile(enc) if impl == "torch-compile" else enc


def _worker(rank: int, world: int, impl: str, store: str, out: str, bucket_view: bool = False) -> None:
    nvlink_multicast_off()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    if world > 1:
        dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world, device_id=device)
    try:
        enc = _encoder(impl, device)
        model = enc
        if world > 1:
            model = torch.nn.parallel.DistributedDataParallel(enc, device_ids=[rank],
                                                              gradient_as_bucket_view=bucket_view)
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
            dist.all_gather_object(ms, statistics.median(times))
        else:
            ms = [statistics.median(times)]
        if rank == 0:
            torch.save(ms, out)
    finally:
        if world > 1:
            dist.destroy_process_group()


def main():
    gpus = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    impl = sys.argv[2] if len(sys.argv) > 2 else "kfuse"
    result = {}
    for label, world, view in (("1 GPU", 1, False), (f"{gpus} GPUs (DDP)", gpus, False),
                               (f"{gpus} GPUs (DDP, gradient_as_bucket_view)", gpus, True)):
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_worker, args=(world, impl, f"{tmp}/store", f"{tmp}/out.pt", view), nprocs=world)
            result[label] = max(torch.load(f"{tmp}/out.pt"))
    one = result["1 GPU"]
    print(f"[ddp step] {torch.cuda.get_device_name()}, {impl}, batch {BATCH} per GPU: " + ", ".join(
        f"{label} {ms:.3f} ms ({ms / one:.3f}x)" for label, ms in result.items()))

if __name__ == "__main__":
    main()
