"""The `kfuse` command: `kfuse bench` (the benchmark; the CPU reference without a GPU), `kfuse tune` (the autotuner
over a whole network) and `kfuse info`."""

from __future__ import annotations

import argparse
import sys


def _info(_args) -> int:
    import platform

    import torch

    from . import _C, __version__

    print(f"kfuse {__version__} (kernels: {_C.compiled_architectures()})")
    print(f"python {platform.python_version()}, torch {torch.__version__}")
    n = _C.cuda_device_count()
    if n == 0:
        print("CUDA devices: none" + ("" if _C.built_with_cuda() else " (kfuse was built without CUDA)"))
    for i in range(n):
        d = _C.cuda_device_info(i)
        cc = "%d.%d" % d["compute_capability"]
        print(f"cuda:{i} {d['name']} (sm_{cc.replace('.', '')}, {d['sm_count']} SMs, "
              f"{d['memory_bytes'] / 2**30:.0f} GiB, L2 {d['l2_bytes'] / 2**20:.0f} MiB), "
              f"driver {d['driver_version']}, runtime {d['runtime_version']}")
    return 0


def _bench(args) -> int:
    from . import benchmark

    return benchmark.main(args)


def _tune(args) -> int:
    from . import benchmark

    return benchmark.tune_main(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kfuse", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("bench", help="run the benchmark (bench-protocol workloads; CPU reference without a GPU)")
    p.add_argument("--workload", default="all", choices=["resnet-infer", "resnet-train", "mlp", "rl", "all"],
                   help="which workload to run on a GPU (default: %(default)s)")
    p.add_argument("--channels", type=int, nargs="+", default=[3, 1], help="input channels to run (default: 3 1)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default: 128 on a GPU, 2 on the CPU)")
    p.add_argument("--iters", type=int, default=1000, help="timed synchronized calls per implementation (GPU)")
    p.add_argument("--train-batch", type=int, default=2048, help="resnet-train batch (default: %(default)s)")
    p.add_argument("--train-channels", type=int, nargs="+", default=[3], help="resnet-train input channels (3)")
    p.add_argument("--train-iters", type=int, default=50,
                   help="timed synchronized training steps per implementation (default: %(default)s)")
    p.add_argument("--impl", nargs="*", default=None,
                   help="only these implementations (kfuse, torch-eager-fp16, torch-jit-fp16, torch-eager-cl, "
                        "torch-cudagraph, torch-compile, torch-compile-ro, torch-compile-max)")
    p.add_argument("--max-autotune", action="store_true", help="also run torch.compile(mode='max-autotune') (slow)")
    p.add_argument("--rl-iters", type=int, default=5, help="timed DD-PPO iterations per implementation (rl)")
    p.add_argument("--rl-envs", type=int, default=128, help="environments of the rl workload (default: %(default)s)")
    p.add_argument("--gpus", type=int, default=1,
                   help="rl: also run the loop data-parallel over this many GPUs (one process each, NCCL, DDP) "
                        "beside one GPU (default: %(default)s: one GPU only)")
    p.add_argument("--out", default="bench/results", help="results folder (default: %(default)s)")
    p.add_argument("--cpu", action="store_true", help="run the CPU reference even when a GPU is present")
    p.set_defaults(func=_bench)

    p = sub.add_parser("tune", help="tune every kernel of the default network on the GPU and cache the choices")
    p.add_argument("--channels", type=int, nargs="+", default=[3], help="input channels (default: 3)")
    p.add_argument("--batch", type=int, nargs="+", default=[128], help="batch sizes to tune (default: 128)")
    p.add_argument("--train-batch", type=int, nargs="*", default=[2048],
                   help="batch sizes whose training step (forward and backward convolutions) to tune "
                        "(default: 2048; none: inference only)")
    p.add_argument("--size", type=int, nargs=2, default=[64, 64], metavar=("H", "W"), help="image size (64 64)")
    p.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    p.add_argument("--mode", choices=["retune", "on"], default="retune",
                   help="retune: time everything again; on: keep cached choices (default: %(default)s)")
    p.add_argument("--out", default="bench/results", help="results folder (default: %(default)s)")
    p.set_defaults(func=_tune)

    p = sub.add_parser("info", help="versions, build and CUDA devices")
    p.set_defaults(func=_info)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
