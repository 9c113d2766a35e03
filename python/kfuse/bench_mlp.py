"""The `mlp` workload of shared/bench-protocol.md: a fully fused MLP (batch 2^21, input 32, four hidden layers of
width 64 / 128 / 256, ReLU, output 16, fp16), forward and forward + backward (every parameter's gradient), kfuse
beside PyTorch eager fp16 and torch.compile in one process, on the same weights and inputs.

Writes bench/results/<device>/mlp-w<width>.json (and a barplot beside it). Rows: `impl`, `fwd_ms` and `fwd_bwd_ms`
(back-to-back medians, the protocol's figures), `fwd_latency_ms` / `fwd_bwd_latency_ms` (median of synchronized
calls), and, so that the shared table printer can show them, `latency_ms` / `back_to_back_ms` / `min_ms` /
`max_ms` of forward + backward.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from . import _C
from .benchmark import save_results, time_gpu
from .tuning_table import format_tuning_table
from .mlp import FusedMLP

MLP_WIDTHS = (64, 128, 256)
MLP_BATCH = 2 ** 21
MLP_IN, MLP_OUT, MLP_HIDDEN_LAYERS = 32, 16, 4


def _sequential(width: int, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    widths = [MLP_IN] + [width] * MLP_HIDDEN_LAYERS
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    layers.append(nn.Linear(widths[-1], MLP_OUT))
    return nn.Sequential(*layers)


def _build_child(width: int) -> None:
    """In a fresh process (its KFUSE_CACHE_DIR set by the parent): a new MLP of the workload's shape. Prints one JSON
    line: the forward module's compile (or cache) + load time (`s`), the time until a first training step on 256
    rows has completed (`train_s`: the training module too), and the forward engine's build info."""
    torch.cuda.init()
    model = _sequential(width, seed=1000 + width).cuda().half()
    x = torch.randn(256, MLP_IN, device="cuda", dtype=torch.float16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    m = FusedMLP.from_torch(model)
    e = m.engine(next(m.parameters()).device, torch.float16)
    fwd_s = time.perf_counter() - t0
    torch.autograd.grad(m(x).float().sum(), list(m.parameters()))
    torch.cuda.synchronize()
    print(json.dumps({"s": round(fwd_s, 4), "train_s": round(time.perf_counter() - t0, 4), "info": e.build_info}))


def _build_times(width: int) -> dict:
    """Compile + load of a new MLP (empty kernel cache) and load from the cache, each in a fresh process (a process
    that tuned before may still be compiling backward modules on helper threads, and NVRTC serializes them):
    `compile_load_s` / `cache_load_s` for the forward module, `*_train_s` until a first training step has run."""
    out = {}
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, KFUSE_CACHE_DIR=d)
        for label in ("compile_load", "cache_load"):
            r = subprocess.run([sys.executable, "-c", f"from kfuse.bench_mlp import _build_child; _build_child({width})"],
                               env=env, capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                print(f"[bench] mlp w={width}: build timing failed: {r.stderr.strip()[-500:]}")
                return out
            child = json.loads(r.stdout.strip().splitlines()[-1])
            out[f"{label}_s"], out[f"{label}_train_s"], out[f"{label}_info"] = child["s"], child["train_s"], child["info"]
    return out


def mlp_impls(model: nn.Sequential, x: torch.Tensor, dy: torch.Tensor, names: list[str] | None,
              max_autotune: bool = False) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """name -> (forward, forward + backward) zero-argument callables on fp16 weights and inputs; the backward
    computes every parameter's gradient with torch.autograd.grad (no accumulation: the same work for everyone)."""
    wanted = lambda n: names is None or n in names  # noqa: E731
    impls = {}

    def pair(module, fwd):
        params = [p for p in module.parameters()]

        def forward():
            with torch.no_grad():
                return fwd(x)

        def train():
            return torch.autograd.grad(fwd(x), params, dy)
        return forward, train

    half = model.cuda().half()
    if wanted("kfuse") and _C.cuda_device_count() > 0:
        try:
            fused = FusedMLP.from_torch(half)
            # The autotuner's variants for this batch (cached across runs; `kfuse tune` semantics).
            rows = fused.tune(x.shape[0])
            print("[bench] kfuse variants (autotuned):\n" + format_tuning_table(rows))
            f, t = pair(fused, fused)
            f(), t()
            impls["kfuse"] = (f, t)
        except NotImplementedError as e:
            print(f"[bench] kfuse: skipped ({e})")
    if wanted("torch-eager-fp16"):
        impls["torch-eager-fp16"] = pair(half, half)
    if wanted("torch-compile"):
        compiled = torch.compile(half)
        impls["torch-compile"] = pair(half, compiled)
    if max_autotune and wanted("torch-compile-max"):
        cmax = torch.compile(half, mode="max-autotune")
        impls["torch-compile-max"] = pair(half, cmax)
    return impls


def _write(path: Path, meta: dict, rows: list[dict], title: str) -> None:
    plt = save_results(path, meta, rows)
    if plt is None:
        return
    names = [r["impl"] for r in rows]
    fwd = [r["fwd_ms"] for r in rows]
    both = [r["fwd_bwd_ms"] for r in rows]
    eager = next((r for r in rows if r["impl"] == "torch-eager-fp16"), None)
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(rows) + 1.6))
    ys = range(len(rows))
    ax.barh([y - 0.2 for y in ys], fwd, height=0.4, label="forward (back-to-back)", color="#4c72b0")
    ax.barh([y + 0.2 for y in ys], both, height=0.4, label="forward + backward (back-to-back)", color="#dd8452")
    for y, a, b in zip(ys, fwd, both):
        sa = f" {a:.3f} ms" + (f" ({eager['fwd_ms'] / a:.1f}x eager)" if eager else "")
        sb = f" {b:.3f} ms" + (f" ({eager['fwd_bwd_ms'] / b:.1f}x eager)" if eager else "")
        ax.text(a, y - 0.2, sa, va="center", fontsize=8)
        ax.text(b, y + 0.2, sb, va="center", fontsize=8)
    ax.set_yticks(list(ys), names)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(f"{title}\n{meta.get('device')}, torch {meta.get('torch')}", fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_xlim(0, max(fwd + both) * 1.6)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    plt.close(fig)


def run_mlp(args, meta_dev: dict, out_dir: Path) -> list:
    """The mlp workload for every width in args.mlp_widths (default 64 128 256); returns [(title, rows)]."""
    widths = getattr(args, "mlp_widths", None) or MLP_WIDTHS
    iters = getattr(args, "mlp_iters", None) or 100
    batch = getattr(args, "mlp_batch", None) or MLP_BATCH
    summaries = []
    for width in widths:
        model = _sequential(width, seed=1000 + width)
        gen = torch.Generator().manual_seed(77 + width)
        x = torch.randn(batch, MLP_IN, generator=gen).cuda().half()
        dy = torch.randn(batch, MLP_OUT, generator=gen).cuda().half()
        build = _build_times(width) if args.impl is None or "kfuse" in args.impl else {}
        if "cache_load_s" in build:
            print(f"[bench] mlp w={width} kfuse build (fresh processes): compile + load {build['compile_load_s']:.3f} s "
                  f"({build['compile_load_train_s']:.3f} s to a first training step), from the cache "
                  f"{build['cache_load_s'] * 1e3:.1f} ms ({build['cache_load_train_s'] * 1e3:.1f} ms)", flush=True)
        impls = mlp_impls(model, x, dy, args.impl, getattr(args, "max_autotune", False))
        rows = []
        for name, (fwd, train) in impls.items():
            t0 = time.perf_counter()
            rf = time_gpu(fwd, iters, warmup=10, rounds=5, per_round=20)
            rt = time_gpu(train, iters, warmup=10, rounds=5, per_round=20)
            r = {"impl": name, "fwd_ms": rf["back_to_back_ms"], "fwd_bwd_ms": rt["back_to_back_ms"],
                 "fwd_latency_ms": rf["latency_ms"], "fwd_bwd_latency_ms": rt["latency_ms"],
                 "fwd_min_ms": rf["min_ms"], "fwd_max_ms": rf["max_ms"],
                 "latency_ms": rt["latency_ms"], "back_to_back_ms": rt["back_to_back_ms"],
                 "min_ms": rt["min_ms"], "max_ms": rt["max_ms"]}
            r = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()}
            rows.append(r)
            print(f"[bench] mlp w={width} {name}: fwd {r['fwd_ms']:.4f} ms, fwd+bwd {r['fwd_bwd_ms']:.4f} ms "
                  f"(back-to-back; {time.perf_counter() - t0:.0f} s)", flush=True)
        eager = next((r for r in rows if r["impl"] == "torch-eager-fp16"), None)
        if eager:
            for r in rows:
                r["fwd_speedup_vs_eager"] = round(eager["fwd_ms"] / r["fwd_ms"], 3)
                r["fwd_bwd_speedup_vs_eager"] = round(eager["fwd_bwd_ms"] / r["fwd_bwd_ms"], 3)
        del impls
        torch.compiler.reset()
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        meta = dict(meta_dev, batch=batch, dtype="fp16", workload="mlp", width=width,
                    input=f"in {MLP_IN}, {MLP_HIDDEN_LAYERS} hidden layers of width {width}, ReLU, out {MLP_OUT}; "
                          f"fwd+bwd = torch.autograd.grad of every parameter",
                    kfuse_build=build)
        path = out_dir / f"mlp-w{width}.json"
        _write(path, meta, rows, f"mlp width {width}, batch {batch}")
        summaries.append((f"mlp w={width} N={batch} ({path}) [latency/b2b columns: fwd+bwd]", rows))
    return summaries
