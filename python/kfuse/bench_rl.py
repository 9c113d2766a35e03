"""The rl workload of shared/bench-protocol.md: frames per second of one DD-PPO iteration (kfuse.rl: 32 rollout steps
of batch-128 inference on new uint8 observations, then the PPO update over two 2048-image minibatches with fp32
master weights, GradScaler and gradient clipping) for the kfuse encoder and for plain-PyTorch encoders in bps-nav's
own configuration and under torch.compile, in one process:

  kfuse           the policy with kfuse's encoder; the rollout step replayed as one CUDA graph (kfuse.rl.GraphedActor),
                  the update eager
  kfuse-compile   the policy with kfuse's encoder (its dispatcher ops), compiled as torch-compile's below
  torch-jit-fp16  bps-nav's configuration: the plain encoder, the compression conv and fc under torch.jit.script
                  (the LSTM is cuDNN's either way), fp16, NCHW, cudnn.benchmark
  torch-graph     the plain-encoder policy run as kfuse's row (rollout step as one CUDA graph, update eager): what
                  the graph alone gives
  kfuse-graphs    kfuse's row with the update as one CUDA graph too (kfuse.rl.GraphedUpdate: its LSTM stepped)
  torch-graphs    the plain-encoder policy run as kfuse-graphs
  torch-compile   the plain-encoder policy under torch.compile: mode="reduce-overhead" for the rollout, the default
                  mode for the update

Everything but the encoder (and how the policy is compiled) is the same code. Time per iteration: wall time of the
rollout and of the update, each ended by a device synchronize; frames/s = steps x environments / (rollout + update).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from .benchmark import save_results
from .rl import Actor, GraphedActor, GraphedUpdate, PPOTrainer, Policy

RL_ENVS = 128
RL_STEPS = 32
IMPLS = ("kfuse", "kfuse-compile", "torch-jit-fp16", "torch-graph", "kfuse-graphs", "torch-graphs", "torch-compile")


def _trainer(impl: str, device, num_envs: int, steps: int, seed: int, dtype=torch.float16) -> PPOTrainer:
    encoder = "kfuse" if impl.startswith("kfuse") else "torch"
    policy = Policy(encoder=encoder, seed=seed).to(device, dtype)
    return configure(PPOTrainer(policy, num_envs=num_envs, steps=steps, seed=seed), impl)


def configure(trainer: PPOTrainer, impl: str) -> PPOTrainer:
    """Scripts or compiles `trainer`'s policy as configuration `impl` does (its encoder chosen by the caller)."""
    policy = trainer.policy
    if impl == "torch-jit-fp16":
        for name in ("encoder", "compress", "fc"):  # (a scripted nn.LSTM is callable only from TorchScript)
            setattr(policy, name, torch.jit.script(getattr(policy, name)))
    elif impl in ("kfuse", "torch-graph", "kfuse-graphs", "torch-graphs") and trainer.device.type == "cuda":
        trainer.act = GraphedActor(Actor(policy))
        if impl.endswith("-graphs"):  # (refused under DistributedDataParallel: that row reports the error)
            GraphedUpdate(trainer)
    elif impl.endswith("-compile"):
        # Dynamo traces the rollout step's one-step LSTM into the graph only with its (experimental) RNN support;
        # without it every step breaks the graph in two around an eager LSTM. The update's packed LSTM stays eager.
        torch._dynamo.config.allow_rnn = True
        trainer.act = _cloned_outputs(torch.compile(Actor(policy), mode="reduce-overhead"))
        # The update's module: the DistributedDataParallel wrapper where a process group is up (its backward
        # all-reduces the gradients; Dynamo splits the graph at its buckets), else the policy.
        trainer.evaluate = torch.compile(trainer.evaluate)
    return trainer


def _cloned_outputs(fn):
    """A reduce-overhead function's outputs live in its CUDA graph's memory, rewritten by the next replay: cloned."""
    def act(*args):
        torch.compiler.cudagraph_mark_step_begin()
        action, logprob, value, (h, c) = fn(*args)
        return action.clone(), logprob.clone(), value.clone(), (h.clone(), c.clone())

    return act


def time_iterations(trainer: PPOTrainer, iterations: int, warmup: int, barrier=None) -> dict:
    """Median rollout and update wall times (ms) over `iterations` after `warmup` (compilation, tuning, capture), and
    each timed iteration's rollout and rollout + update (`rollouts_ms`, `iterations_ms`). `barrier` (data-parallel
    runs): called before each iteration so that every rank starts it together; otherwise a rank whose rollout ended
    first would count its wait for the others' rollouts (the update's first all-reduce) as update time."""
    sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
    rollout, update = [], []
    for i in range(warmup + iterations):
        sync()
        if barrier is not None:
            barrier()
            sync()
        t0 = time.perf_counter()
        trainer.rollout()
        sync()
        t1 = time.perf_counter()
        trainer.update()
        sync()
        t2 = time.perf_counter()
        if i >= warmup:
            rollout.append((t1 - t0) * 1e3)
            update.append((t2 - t1) * 1e3)
    r, u = statistics.median(rollout), statistics.median(update)
    frames = trainer.steps * trainer.n
    return {"fps": round(frames / ((r + u) / 1e3), 1), "rollout_ms": round(r, 3), "update_ms": round(u, 3),
            "frames_per_iteration": frames, "gpus": 1,
            "rollouts_ms": [round(a, 3) for a in rollout],
            "iterations_ms": [round(a + b, 3) for a, b in zip(rollout, update)]}


def fixed_seed_run(encoder: str, other_algorithms: bool, iterations: int, num_envs: int, steps: int, seed: int,
                   device="cuda") -> tuple[list[float], torch.Tensor]:
    """Losses of `iterations` PPO iterations from `seed` (fp16 policy) and the fp32 master weights after them.
    other_algorithms: the plain encoder's convolutions in channels-last layout with cudnn.benchmark on, so that cuDNN
    runs other kernels (other summation orders) than the NCHW run with its heuristics' choice."""
    previous = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = other_algorithms
    try:
        policy = Policy(encoder=encoder, seed=seed).to(device, torch.float16)
        if other_algorithms:
            for name in ("encoder", "compress"):
                getattr(policy, name).to(memory_format=torch.channels_last)
        trainer = PPOTrainer(policy, num_envs=num_envs, steps=steps, seed=seed)
        losses = [trainer.iteration()["loss"] for _ in range(iterations)]
        return losses, torch.cat([m.detach().flatten() for m in trainer.masters])
    finally:
        torch.backends.cudnn.benchmark = previous


def agreement(iterations: int, num_envs: int, steps: int, seed: int, device="cuda") -> dict:
    """kfuse's run against plain PyTorch's, with the noise of two plain runs that differ only in cuDNN's algorithms
    (NCHW with cuDNN's heuristics; channels-last with cudnn.benchmark) as the yardstick: per-iteration loss
    differences relative to max(1, |loss|) and the normwise difference of the weights after the run."""
    (la, wa), (lb, wb), (lk, wk) = (fixed_seed_run(e, other, iterations, num_envs, steps, seed, device)
                                    for e, other in (("torch", False), ("torch", True), ("kfuse", False)))
    rel = lambda x, y: abs(x - y) / max(1.0, abs(y))  # noqa: E731
    start = torch.cat([p.detach().float().flatten() for p in Policy(encoder="torch", seed=seed).parameters()])
    return {"loss_torch": la, "loss_kfuse": lk,
            "loss_noise": [rel(b, a) for a, b in zip(la, lb)], "loss_diff": [rel(k, a) for a, k in zip(la, lk)],
            "weight_noise": ((wb - wa).norm() / wa.norm()).item(), "weight_diff": ((wk - wa).norm() / wa.norm()).item(),
            "weight_moved": ((wa.cpu() - start).norm() / start.norm()).item()}


def _write(path: Path, meta: dict, rows: list[dict], title: str) -> None:
    plt = save_results(path, meta, rows)
    if plt is None:
        return
    rows = [r for r in rows if "fps" in r]
    if not rows:
        return
    names = [r["impl"] for r in rows]
    fps = [r["fps"] for r in rows]
    ref = max((r["fps"] for r in rows if r["impl"].startswith("kfuse") and r.get("gpus", 1) == 1), default=None)
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(rows) + 1.6))
    ys = range(len(rows))
    ax.barh(list(ys), fps, height=0.5, color="#4c72b0")
    for y, r in zip(ys, rows):
        label = f" {r['fps']:.0f} frames/s (rollout {r['rollout_ms']:.1f} + update {r['update_ms']:.1f} ms)"
        if ref and not r["impl"].startswith("kfuse"):
            label += f"  kfuse {ref / r['fps']:.2f}x"
        ax.text(r["fps"], y, label, va="center", fontsize=8)
    ax.set_yticks(list(ys), names)
    ax.invert_yaxis()
    ax.set_xlabel("frames per second (higher is better)")
    ax.set_title(f"{title}\n{meta.get('device')}, torch {meta.get('torch')}", fontsize=9)
    ax.set_xlim(0, max(fps) * 1.9)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    plt.close(fig)


def run_rl(args, meta_dev: dict, out_dir: Path) -> list:
    """The rl workload on the current CUDA device; returns [(title, rows)] for the summary table."""
    iterations = getattr(args, "rl_iters", None) or 5
    envs = getattr(args, "rl_envs", None) or RL_ENVS
    torch.backends.cudnn.benchmark = True  # bps-nav's setting; kfuse's own kernels do not use it
    rows = []
    for impl in (args.impl or IMPLS):
        if impl not in IMPLS:
            continue
        t0 = time.perf_counter()
        try:
            trainer = _trainer(impl, "cuda", envs, RL_STEPS, seed=0)
            r = {"impl": impl, **time_iterations(trainer, iterations, warmup=3)}
        except Exception as err:  # a baseline that fails to compile is reported, not fatal to the run
            r = {"impl": impl, "error": f"{type(err).__name__}: {err}"[:300]}
            print(f"[bench] rl {impl}: failed: {r['error']}", flush=True)
        else:
            print(f"[bench] rl {impl}: {r['fps']:.0f} frames/s (rollout {r['rollout_ms']:.1f} ms, update "
                  f"{r['update_ms']:.1f} ms; {time.perf_counter() - t0:.0f} s)", flush=True)
        rows.append(r)
        trainer = None
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    meta = dict(meta_dev, workload="rl", channels=3, num_envs=envs, steps=RL_STEPS, minibatches=2,
                input="uint8 RGBA 64x64, fp16 policy", dynamo_allow_rnn=torch._dynamo.config.allow_rnn)
    path = out_dir / "rl-c3.json"
    _write(path, meta, rows, "rl: one DD-PPO iteration (32 x 128 frames, 2 minibatches)")
    return [(f"rl ({path})", rows)]


def spawn_with_deadline(fn, args: tuple, nprocs: int, timeout_s: float) -> None:
    """torch.multiprocessing.spawn(fn, args, nprocs), with a deadline: processes still running after `timeout_s`
    are terminated and a TimeoutError says so (a collective that waits for a dead peer must not hang the caller)."""
    import torch.multiprocessing as mp

    context = mp.spawn(fn, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=2):  # raises if a process failed
        if time.monotonic() > deadline:
            for p in context.processes:
                if p.is_alive():
                    p.terminate()
            raise TimeoutError(f"{nprocs} processes of {getattr(fn, '__name__', fn)} still ran after {timeout_s} s "
                               "(terminated)")


def nvlink_multicast_off() -> None:
    """NCCL and PyTorch without NVLink multicast (the shared GPU machines require it; a program that uses it can take
    the host's GPUs out of service), unless the environment already says otherwise."""
    import os

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")


def quiesce_process_group() -> None:
    """Call with the DistributedDataParallel wrappers already released, before destroy_process_group: a barrier (every
    earlier collective done and freed by the group's worker thread), then a collection. Avoids a deadlock seen with
    gloo (torch 2.11): where DDP's reducer held the group's last reference, its deallocation (holding the GIL) ran the
    group's destructor, which waited for the worker thread while that thread, freeing an all-gather's tensors, waited
    for the GIL. Released first, the reducer drops a reference that is not the last; destroy_process_group then
    destroys an idle group."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.barrier()


def _ddp_worker(rank: int, world: int, impl: str, envs: int, steps: int, iterations: int, store: str, out: str,
                device_type: str) -> None:
    """One process of the data-parallel loop: on GPUs one per GPU with NCCL (NVLink multicast off, as the machines
    require), on the CPU gloo (float32, the tests' small runs); DDP inside PPOTrainer. Rank 0 writes every rank's
    timings to `out`."""
    import torch.distributed as dist

    nvlink_multicast_off()
    cuda = device_type == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(rank)
        torch.backends.cudnn.benchmark = True
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world, device_id=device if cuda else None)
    try:
        trainer = _trainer(impl, device, envs, steps, seed=0, dtype=torch.float16 if cuda else torch.float32)
        barrier = None
        if world > 1:
            barrier = (lambda: dist.barrier(device_ids=[rank])) if cuda else dist.barrier
        r = time_iterations(trainer, iterations, warmup=3 if cuda else 1, barrier=barrier)
        rows = [r]
        if world > 1:
            rows = [None] * world
            dist.all_gather_object(rows, r)
        if rank == 0:
            torch.save(rows, out)
        trainer = None
        if world > 1:
            quiesce_process_group()
    finally:
        if world > 1:
            dist.destroy_process_group()


def combine_ranks(ranks: list[dict]) -> dict:
    """One row from every rank's time_iterations of a data-parallel run whose ranks start each iteration together: an
    iteration lasts as long as its slowest rank's, its update is what it takes after the slowest rollout; frames/s
    counts every rank's frames over the median iteration."""
    whole = [max(t) for t in zip(*(r["iterations_ms"] for r in ranks))]
    rollouts = [max(t) for t in zip(*(r["rollouts_ms"] for r in ranks))]
    iteration = statistics.median(whole)
    frames = sum(r["frames_per_iteration"] for r in ranks)
    return {"fps": round(frames / (iteration / 1e3), 1), "iteration_ms": iteration,
            "rollout_ms": round(statistics.median(rollouts), 3),
            "update_ms": round(statistics.median(w - r for w, r in zip(whole, rollouts)), 3),
            "frames_per_iteration": frames}


def run_rl_ddp(args, meta_dev: dict, out_dir: Path, gpus: int, device_type: str = "cuda",
               steps: int = RL_STEPS) -> list:
    """Weak scaling of the loop: `gpus` processes of `envs` environments each (one per GPU, NCCL, DDP) against one
    process on one GPU, same run. The ranks start each iteration together (a barrier); frames/s of several GPUs: all
    of their frames over the median iteration's slowest rank's time."""
    import tempfile

    iterations = getattr(args, "rl_iters", None) or 5
    envs = getattr(args, "rl_envs", None) or RL_ENVS
    rows = []
    for impl in (args.impl or ("kfuse",)):
        for world in (1, gpus):
            with tempfile.TemporaryDirectory() as tmp:
                out = f"{tmp}/rows.pt"
                worker_args = (world, impl, envs, steps, iterations, f"{tmp}/store", out, device_type)
                if world == 1:  # the baseline in this process
                    _ddp_worker(0, *worker_args)
                    torch.cuda.empty_cache() if device_type == "cuda" else None
                else:
                    spawn_with_deadline(_ddp_worker, worker_args, world, timeout_s=900)
                ranks = torch.load(out)
            row = {"impl": f"{impl} x{world}", **combine_ranks(ranks), "gpus": world}
            rows.append(row)
            print(f"[bench] rl {row['impl']}: {row['fps']:.0f} frames/s (rollout {row['rollout_ms']:.1f} ms, update "
                  f"{row['update_ms']:.1f} ms)", flush=True)
        one, many = rows[-2], rows[-1]
        many["scaling"] = round(many["fps"] / one["fps"], 3)
        many["update_vs_one"] = round(many["update_ms"] / one["update_ms"], 3)
        print(f"[bench] rl {impl}: {gpus} processes {many['scaling']:.2f}x the frames/s of one; update "
              f"{many['update_vs_one']:.3f}x one's", flush=True)
    meta = dict(meta_dev, workload="rl-ddp", channels=3, num_envs_per_gpu=envs, steps=steps, minibatches=2,
                gpus=gpus, backend="nccl" if device_type == "cuda" else "gloo", nvls="off",
                input="uint8 RGBA 64x64, fp16 policy" if device_type == "cuda" else "uint8 RGBA 64x64, fp32 policy")
    path = out_dir / f"rl-ddp{gpus}-c3.json"
    _write(path, meta, rows, f"rl: DD-PPO weak scaling over {gpus} GPUs (DDP)")
    return [(f"rl-ddp ({path})", rows)]


def run_rl_cpu(num_envs: int = 4, steps: int = 4) -> None:
    """Without a GPU: a few iterations of a small loop with each encoder on the CPU (float32), to show it runs."""
    for encoder in ("kfuse", "torch"):
        policy = Policy(encoder=encoder, seed=0).float()
        trainer = PPOTrainer(policy, num_envs=num_envs, steps=steps, seed=0)
        t0 = time.perf_counter()
        stats = [trainer.iteration() for _ in range(2)]
        dt = (time.perf_counter() - t0) / 2
        print(f"rl on the CPU, {encoder} encoder: {num_envs} environments x {steps} steps per iteration, "
              f"{dt * 1e3:.0f} ms per iteration, loss {stats[-1]['loss']:.6f}")
