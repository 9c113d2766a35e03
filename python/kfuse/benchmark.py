"""`kfuse bench`: the workloads of shared/bench-protocol.md, kfuse beside PyTorch baselines in one process.

Without a CUDA GPU it says so and runs the embedded default network through the CPU reference instead (time and a
checksum), so that the main job does something meaningful on any machine.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable

import torch

from . import _C, reference
from .encoder import ResNetEncoder
from .tuning_table import tuning_verdict

GPU_REQUIREMENT = "kfuse's fast paths need an NVIDIA GPU with compute capability 8.0 or newer (sm_80+)"


# --------------------------------------------------------------------------------------------------------------
# environment

def _commit() -> str:
    if os.environ.get("KFUSE_COMMIT"):
        return os.environ["KFUSE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment_meta(batch: int, dtype: str) -> dict:
    meta = {
        "kfuse_commit": _commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "batch": batch,
        "dtype": dtype,
    }
    if torch.cuda.is_available():
        meta.update({
            "device": torch.cuda.get_device_name(),
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            # kfuse's A/B switches in effect (programmatic dependent launch is on by default on sm_90+).
            "kfuse_env": {k: v for k, v in os.environ.items() if k.startswith("KFUSE_")},
        })
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, check=True).stdout.strip()
            meta["driver"] = out.splitlines()[0] if out else None
        except (OSError, subprocess.CalledProcessError):
            meta["driver"] = None
    else:
        meta["device"] = "cpu"
    return meta


def device_slug(name: str) -> str:
    n = name.lower()
    for key in ("h100", "h200", "a100", "l40s", "l4", "rtx 4090", "rtx 3090", "rtx 3070"):
        if key in n:
            return key.replace(" ", "")
    return "".join(c if c.isalnum() else "-" for c in n).strip("-") or "gpu"


# --------------------------------------------------------------------------------------------------------------
# timing (METHOD.md / bench-protocol.md: warm-up, median of synchronized calls, back-to-back with events)

def time_gpu(fn: Callable[[], object], iters: int, warmup: int = 20, rounds: int = 5, per_round: int = 200) -> dict:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    lat = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        lat.append((time.perf_counter() - t0) * 1e3)
    b2b = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(per_round):
            fn()
        end.record()
        torch.cuda.synchronize()
        b2b.append(start.elapsed_time(end) / per_round)
    return {"latency_ms": statistics.median(lat), "back_to_back_ms": statistics.median(b2b),
            "min_ms": min(lat), "max_ms": max(lat)}


# --------------------------------------------------------------------------------------------------------------
# resnet-infer baselines

def _cuda_graph(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable[[], torch.Tensor]:
    static_x = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(static_x)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = fn(static_x)

    def replay():
        graph.replay()
        return static_y

    return replay


def resnet_infer_impls(model: torch.nn.Module, x: torch.Tensor, names: list[str] | None,
                       max_autotune: bool) -> dict[str, Callable[[], torch.Tensor]]:
    """name -> zero-argument callable computing the encoder on x; model is a float32 reference.ResNetEncoder."""
    wanted = lambda n: names is None or n in names  # noqa: E731
    impls: dict[str, Callable[[], torch.Tensor]] = {}
    half = reference.ResNetEncoder(*model.config).cuda().half().eval()
    half.load_state_dict(model.state_dict())
    xh = x.cuda().half()
    xcl = xh.contiguous(memory_format=torch.channels_last)
    cl = reference.ResNetEncoder(*model.config).cuda().half().eval().to(memory_format=torch.channels_last)
    cl.load_state_dict(model.state_dict())

    if wanted("kfuse") and _C.cuda_device_count() > 0:
        enc = ResNetEncoder.from_torch(half)
        try:
            with torch.no_grad():
                enc(xh)
            impls["kfuse"] = lambda: enc(xh)
        except NotImplementedError as e:
            print(f"[bench] kfuse: skipped ({e})")
    if wanted("torch-eager-fp16"):
        impls["torch-eager-fp16"] = lambda: half(xh)
    if wanted("torch-jit-fp16"):
        try:
            jit = torch.jit.script(half)
            impls["torch-jit-fp16"] = lambda: jit(xh)
        except Exception as e:  # noqa: BLE001 - report and go on with the other baselines
            print(f"[bench] torch-jit-fp16: torch.jit.script failed ({type(e).__name__}: {e}); skipped")
    torch.backends.cudnn.benchmark = True
    if wanted("torch-eager-cl"):
        impls["torch-eager-cl"] = lambda: cl(xcl)
    if wanted("torch-cudagraph"):
        impls["torch-cudagraph"] = _cuda_graph(cl, xcl)
    if wanted("torch-compile"):
        c = torch.compile(cl)
        impls["torch-compile"] = lambda: c(xcl)
    if wanted("torch-compile-ro"):
        cro = torch.compile(cl, mode="reduce-overhead")
        impls["torch-compile-ro"] = lambda: cro(xcl)
    if max_autotune and wanted("torch-compile-max"):
        cmax = torch.compile(cl, mode="max-autotune")
        impls["torch-compile-max"] = lambda: cmax(xcl)
    return impls


# --------------------------------------------------------------------------------------------------------------
# resnet-train baselines: forward + backward, every parameter's gradient (torch.autograd.grad: no accumulation
# into .grad, the same work for everyone)

def resnet_train_impls(model: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor,
                       names: list[str] | None) -> dict[str, Callable[[], object]]:
    """name -> zero-argument callable running one training step's forward and backward on x with dL/dy = dy;
    model is a float32 reference.ResNetEncoder. Everyone trains fp16 parameters on fp16 inputs."""
    wanted = lambda n: names is None or n in names  # noqa: E731
    impls: dict[str, Callable[[], object]] = {}
    xh = x.cuda().half()
    xcl = xh.contiguous(memory_format=torch.channels_last)
    dyh = dy.cuda().half()

    def step(module, inp):
        params = [p for p in module.parameters()]

        def run():
            y = module(inp)
            return torch.autograd.grad(y, params, dyh)
        return run

    if wanted("kfuse") and _C.cuda_device_count() > 0:
        enc = ResNetEncoder.from_torch(model).cuda().half().train()
        run = step(enc, xh)
        try:
            run()
            impls["kfuse"] = run
        except NotImplementedError as e:
            print(f"[bench] kfuse: skipped ({e})")
    half = reference.ResNetEncoder(*model.config).cuda().half().train()
    half.load_state_dict(model.state_dict())
    cl = reference.ResNetEncoder(*model.config).cuda().half().train().to(memory_format=torch.channels_last)
    cl.load_state_dict(model.state_dict())
    if wanted("torch-eager-fp16"):
        impls["torch-eager-fp16"] = step(half, xh)
    if wanted("torch-jit-fp16"):
        try:
            impls["torch-jit-fp16"] = step(torch.jit.script(half), xh)
        except Exception as e:  # noqa: BLE001 - report and go on with the other baselines
            print(f"[bench] torch-jit-fp16: torch.jit.script failed ({type(e).__name__}: {e}); skipped")
    torch.backends.cudnn.benchmark = True
    if wanted("torch-eager-cl"):
        impls["torch-eager-cl"] = step(cl, xcl)
    if wanted("torch-compile"):
        compiled = torch.compile(cl)
        params = list(cl.parameters())

        def run_compiled():
            y = compiled(xcl)
            return torch.autograd.grad(y, params, dyh)
        impls["torch-compile"] = run_compiled
    return impls


# --------------------------------------------------------------------------------------------------------------
# results

def save_results(path: Path, meta: dict, rows: list[dict]):
    """Writes a workload's JSON (bench-protocol.md's `meta` and `rows`); returns matplotlib's pyplot for its barplot,
    or None where matplotlib is missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench] matplotlib missing: no barplot")
        return None
    return plt


def write_results(path: Path, meta: dict, rows: list[dict], title: str) -> None:
    plt = save_results(path, meta, rows)
    if plt is None:
        return
    names = [r["impl"] for r in rows]
    lat = [r["latency_ms"] for r in rows]
    b2b = [r["back_to_back_ms"] for r in rows]
    ref = next((r["latency_ms"] for r in rows if r["impl"] == "kfuse"), None)
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(rows) + 1.6))
    ys = range(len(rows))
    ax.barh([y + 0.2 for y in ys], lat, height=0.4, label="latency (call + sync, median)", color="#4c72b0")
    ax.barh([y - 0.2 for y in ys], b2b, height=0.4, label="back-to-back", color="#dd8452")
    for y, v in zip(ys, lat):
        label = f"{v:.3f} ms" + (f"  ({v / ref:.1f}x kfuse)" if ref and names[y] != "kfuse" else "")
        ax.text(v, y + 0.2, " " + label, va="center", fontsize=8)
    ax.set_yticks(list(ys), names)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(f"{title}\n{meta.get('device')}, torch {meta.get('torch')}, batch {meta.get('batch')}", fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_xlim(0, max(lat + b2b) * 1.45)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    plt.close(fig)


def print_table(title: str, rows: list[dict]) -> None:
    best = min((r for r in rows if r["impl"] != "kfuse"), key=lambda r: r["latency_ms"], default=None)
    print(f"\n{title}")
    print(f"{'impl':<20}{'latency ms':>12}{'b2b ms':>10}{'min':>9}{'max':>9}{'vs best torch':>15}")
    for r in rows:
        ratio = f"{best['latency_ms'] / r['latency_ms']:.2f}x" if best else ""
        print(f"{r['impl']:<20}{r['latency_ms']:>12.4f}{r['back_to_back_ms']:>10.4f}{r['min_ms']:>9.3f}"
              f"{r['max_ms']:>9.3f}{ratio:>15}")


# --------------------------------------------------------------------------------------------------------------
# entry points

def run_cpu(args) -> int:
    batch = args.batch or 2
    print(f"No CUDA GPU in use: {GPU_REQUIREMENT}.")
    print(f"Running the embedded default network (se_resnet9_fixup, perturbed FixUp init) through kfuse's CPU "
          f"reference instead: batch {batch}, 64x64, float32.")
    for c in args.channels:
        enc = ResNetEncoder.default_network(in_channels=c)
        gen = torch.Generator().manual_seed(1234 + c)
        x = torch.rand(batch, c, 64, 64, generator=gen)
        times = []
        with torch.no_grad():
            for _ in range(3):
                t0 = time.perf_counter()
                y = enc(x)
                times.append(time.perf_counter() - t0)
            plain = reference.ResNetEncoder(c)
            plain.load_state_dict(enc.state_dict())
            t0 = time.perf_counter()
            y_torch = plain(x)
            t_torch = time.perf_counter() - t0
        rel = ((y - y_torch).norm() / y_torch.norm()).item()
        print(f"C={c}: output {tuple(y.shape)}, kfuse CPU reference {statistics.median(times) * 1e3:.1f} ms "
              f"(median of 3), plain PyTorch float32 {t_torch * 1e3:.1f} ms; checksum sum={y.double().sum().item():.6f} "
              f"sum|y|={y.double().abs().sum().item():.6f}; relative difference to PyTorch {rel:.2e}")
    return 0


def _free_workload_state() -> None:
    # Leave nothing of a workload's compiled graphs and CUDA graphs behind for the next one: a manual CUDA graph
    # captured while torch.compile's cudagraph trees of an earlier model were alive hit an illegal address on the
    # H100 (each alone ran clean).
    torch.compiler.reset()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def run_train(args, meta_dev: dict, out_dir: Path) -> list:
    """The resnet-train workload: forward + backward at batch 2048 (16 x 128), C = 3."""
    batch = args.train_batch
    summaries = []
    for c in args.train_channels:
        model = ResNetEncoder.default_network(in_channels=c)
        plain = reference.ResNetEncoder(c)
        plain.load_state_dict(model.state_dict())
        gen = torch.Generator().manual_seed(8765 + c)
        x = torch.rand(batch, c, 64, 64, generator=gen)
        dy = torch.randn(batch, plain.out_channels, 2, 2, generator=gen)
        impls = resnet_train_impls(plain, x, dy, args.impl)
        rows = []
        for name, fn in impls.items():
            t0 = time.perf_counter()
            r = time_gpu(fn, args.train_iters, warmup=5, rounds=5, per_round=20)
            r = {"impl": name, **{k: round(v, 5) for k, v in r.items()}}
            rows.append(r)
            print(f"[bench] train C={c} {name}: latency {r['latency_ms']:.3f} ms, back-to-back "
                  f"{r['back_to_back_ms']:.3f} ms ({time.perf_counter() - t0:.0f} s)", flush=True)
        del impls, fn
        _free_workload_state()
        meta = dict(meta_dev, batch=batch, channels=c, workload="resnet-train",
                    input="NCHW/channels_last fp16 parameters and inputs, 64x64; torch.autograd.grad of all parameters")
        path = out_dir / f"resnet-train-c{c}.json"
        write_results(path, meta, rows, f"resnet-train C={c} N={batch}")
        summaries.append((f"resnet-train C={c} N={batch} ({path})", rows))
    return summaries


def run_gpu(args) -> int:
    batch = args.batch or 128
    meta_dev = environment_meta(batch, "fp16")
    slug = device_slug(meta_dev["device"])
    out_dir = Path(args.out) / slug
    print(f"[bench] {meta_dev['device']}, torch {meta_dev['torch']}, CUDA {meta_dev['cuda']}, "
          f"cuDNN {meta_dev['cudnn']}, driver {meta_dev.get('driver')}")
    summaries = []
    for c in (args.channels if args.workload in ("resnet-infer", "all") else []):
        model = ResNetEncoder.default_network(in_channels=c)
        plain = reference.ResNetEncoder(c)
        plain.load_state_dict(model.state_dict())
        gen = torch.Generator().manual_seed(4321 + c)
        x = torch.rand(batch, c, 64, 64, generator=gen)
        with torch.no_grad():
            impls = resnet_infer_impls(plain, x, args.impl, args.max_autotune)
            rows = []
            for name, fn in impls.items():
                t0 = time.perf_counter()
                r = time_gpu(fn, args.iters)
                r = {"impl": name, **{k: round(v, 5) for k, v in r.items()}}
                rows.append(r)
                print(f"[bench] C={c} {name}: latency {r['latency_ms']:.4f} ms, back-to-back "
                      f"{r['back_to_back_ms']:.4f} ms ({time.perf_counter() - t0:.0f} s)", flush=True)
            del impls, fn
            _free_workload_state()
        meta = dict(meta_dev, channels=c, workload="resnet-infer", input="NCHW/channels_last fp16, 64x64")
        path = out_dir / f"resnet-infer-c{c}.json"
        write_results(path, meta, rows, f"resnet-infer C={c}")
        summaries.append((f"resnet-infer C={c} N={batch} ({path})", rows))
    if args.workload in ("resnet-train", "all"):
        summaries += run_train(args, meta_dev, out_dir)
    if args.workload in ("mlp", "all"):
        from .bench_mlp import run_mlp  # the fused-MLP workload (bench-protocol.md: mlp)

        summaries += run_mlp(args, meta_dev, out_dir)
    rl = []
    if args.workload in ("rl", "all"):
        from .bench_rl import run_rl  # the DD-PPO loop (bench-protocol.md: rl)

        rl = run_rl(args, meta_dev, out_dir)
        gpus = getattr(args, "gpus", 1) or 1
        if gpus > 1:
            if torch.cuda.device_count() < gpus:
                raise SystemExit(f"--gpus {gpus}: this machine has {torch.cuda.device_count()} CUDA device(s)")
            from .bench_rl import run_rl_ddp

            rl += run_rl_ddp(args, meta_dev, out_dir, gpus)
    for title, rows in summaries:
        print_table(title, rows)
    for title, rows in rl:
        print_rl_table(title, rows)
    return 0


def print_rl_table(title: str, rows: list[dict]) -> None:
    # against the fastest kfuse configuration (eager, or compiled around the encoder) on one GPU
    kfuse = max((r for r in rows if r["impl"].startswith("kfuse") and "fps" in r and r.get("gpus", 1) == 1),
                key=lambda r: r["fps"], default=None)
    print(f"\n{title}")
    print(f"{'impl':<20}{'frames/s':>10}{'rollout ms':>12}{'update ms':>11}{'kfuse vs':>10}")
    for r in rows:
        if "fps" not in r:
            print(f"{r['impl']:<20}  failed: {r.get('error', '?')}")
            continue
        ratio = f"{kfuse['fps'] / r['fps']:.2f}x" if kfuse and not r["impl"].startswith("kfuse") else ""
        print(f"{r['impl']:<20}{r['fps']:>10.0f}{r['rollout_ms']:>12.2f}{r['update_ms']:>11.2f}{ratio:>10}")


def tune_main(args) -> int:
    """`kfuse tune`: tunes every convolution of the default network per (channels, batch), prints the table and
    writes bench/results/<device>/tune-resnet-c<C>.json (bench-protocol.md's tuning file)."""
    if not torch.cuda.is_available() or _C.cuda_device_count() == 0:
        print(f"[tune] no CUDA device: {GPU_REQUIREMENT}; nothing to tune")
        return 1
    dtype = getattr(torch, args.dtype)
    h, w = args.size
    for c in args.channels:
        enc = ResNetEncoder.default_network(in_channels=c).cuda().to(dtype).eval()
        meta = dict(environment_meta(args.batch[0], args.dtype), channels=c, network=f"resnet-c{c}",
                    mode=args.mode, batches=args.batch, train_batches=getattr(args, "train_batch", []), size=[h, w])
        rows = []
        t0 = time.perf_counter()
        runs = [(n, False) for n in args.batch] + [(n, True) for n in getattr(args, "train_batch", [])]
        for n, training in runs:
            print(f"[tune] resnet C={c} N={n} {h}x{w} {args.dtype}{' training step' if training else ''}")
            for r in enc.tune(n, h, w, mode=args.mode, training=training):
                rows.append({k: r[k] for k in ("op", "shape", "default_ms", "cudnn_ms", "tuned_ms", "spread_ms")} |
                            {"choice": r["choice"], "default": r["default"], "from_cache": r["from_cache"],
                             "candidates": r["candidates"]})
        total = time.perf_counter() - t0
        cached = sum(1 for r in rows if r["from_cache"])
        print(f"[tune] C={c}: {len(rows)} convolutions in {total:.1f} s ({cached} from the cache)")
        print(f"[tune] {tuning_verdict(rows)}")
        path = Path(args.out) / device_slug(meta["device"]) / f"tune-resnet-c{c}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"meta": meta, "total_s": round(total, 3), "rows": rows}, indent=1) + "\n")
        print(f"[tune] wrote {path}")
    return 0


def main(args) -> int:
    if args.cpu or not torch.cuda.is_available():
        if args.workload == "rl":
            from .bench_rl import run_rl_cpu

            print(f"No CUDA GPU in use: {GPU_REQUIREMENT}. Running a small DD-PPO loop on the CPU instead.")
            run_rl_cpu()
            return 0
        return run_cpu(args)
    return run_gpu(args)
