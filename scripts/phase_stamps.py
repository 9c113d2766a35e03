"""The fused kernels' phase times (kernels/phase_stamps.cuh), on the GPU machine, from a build whose kernel objects
were compiled with the stamps on:
    KFUSE_CMAKE_ARGS=-DKFUSE_PHASE_STAMPS=ON bash scripts/device_bundle.sh       # here; OFF again afterwards
    bash scripts/gpu_run.sh --exec "python3 scripts/phase_stamps.py 128"        # there
The core's kernels (the squeeze-excite), which the GPU machine compiles, need the option there instead:
    KFUSE_CMAKE_ARGS=-DKFUSE_PHASE_STAMPS=ON bash scripts/gpu_run.sh --exec "python3 scripts/phase_stamps.py 128"
Runs the default network eagerly a few times per input channel count (the first call of each is cold) and prints the
kernels' "[phases] <kernel> cta <c> <phase> <us>" lines, then the median per (kernel, phase) over the warm calls.
Usage: python scripts/phase_stamps.py [N] [calls]"""
import collections
import os
import statistics
import subprocess
import sys


def run_calls(batch, calls):
    import torch

    import kfuse

    for c in (3, 1):
        model = kfuse.ResNetEncoder.default_network(c).cuda().half().eval()
        x = torch.randn(batch, c, 64, 64, device="cuda").half()
        with torch.no_grad():
            for i in range(calls):
                print(f"[call] C={c} {i}", flush=True)
                model(x)
                torch.cuda.synchronize()  # flushes the kernels' printf output


def main():
    args = sys.argv[1:]
    if args and args[0] == "--child":
        run_calls(int(args[1]), int(args[2]))
        return
    batch = int(args[0]) if args else 128
    calls = int(args[1]) if len(args) > 1 else 4
    # Device printf goes to the process's stdout at synchronization: run the calls in a child and parse its output.
    out = subprocess.run([sys.executable, __file__, "--child", str(batch), str(calls)], capture_output=True, text=True,
                         env=os.environ)
    sys.stdout.write(out.stdout)
    sys.stderr.write(out.stderr[-4000:])
    times = collections.defaultdict(list)
    channels = None
    for line in out.stdout.splitlines():
        parts = line.split()
        if parts[:1] == ["[call]"]:
            channels = parts[1]
            continue
        if parts[:1] == ["[phases]"] and len(parts) == 6:
            times[(channels, parts[1], parts[4])].append(float(parts[5]))
    if not times:
        print("[phase_stamps] no [phases] lines: were the kernel objects built with -DKFUSE_PHASE_STAMPS=ON?")
        return
    print("--- median phase times (us) over the calls after each C's first ---")
    for (channels, kernel, phase), values in times.items():
        warm = values[2:] if len(values) > 2 else values  # two CTAs print per call: skip the first call's
        print(f"{str(channels):>4} {kernel:>10} {phase:>14} {statistics.median(warm):7.2f}")


if __name__ == "__main__":
    main()
