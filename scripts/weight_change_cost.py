"""GPU time of the encoder's hot paths and of a weight change, through the public modules only (so that one script
times two builds of kfuse on the same machine). Runs on the GPU machine:
    PYTHONPATH=python python3 scripts/weight_change_cost.py [--json FILE]

Each figure is GPU time between two events with the host far ahead (torch.cuda._sleep first), so launch gaps inside
the GPU's work count and the host's Python does not:
  infer_b2b_us       batch-128 inference, 64 x 64, fp16: per call of 200 back-to-back calls (median of 5 rounds)
  after_write_us     the first batch-128 inference after every parameter was written through p.data.copy_ from fp32
                     master weights (the RL optimizer pattern), median of 30
  steady_us          the inference right after that one (no write in between), median of 30
  train_step_us      batch-2048 forward + backward (no optimizer), per step of 10 (median of 3 rounds)
  train_write_us     the same with every parameter written through .data.copy_ before each step
  mlp_infer_us       FusedMLP 64 -> 4 x 64 -> 64, fp16, batch 2^18: per call of 100 back to back (median of 5)
"""
import argparse
import json
import statistics

import torch

import kfuse

SLEEP = 40_000_000  # cycles of torch.cuda._sleep: ~20 ms, far more than the host needs to queue a round


def gpu_us(fn, repeats: int = 1) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / repeats


def write_all(params, masters, gen):
    with torch.no_grad():
        for p, m in zip(params, masters):
            m.add_(torch.randn(m.shape, device=m.device, generator=gen), alpha=1e-3)
            p.data.copy_(m)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {"device": torch.cuda.get_device_name(), "kfuse_commit": kfuse.__dict__.get("__commit__", "?")}

    enc = kfuse.ResNetEncoder.default_network(3).cuda().half()
    params = list(enc.parameters())
    masters = [p.detach().float().clone() for p in params]
    x = torch.randn(128, 3, 64, 64, device="cuda", generator=gen).half()
    with torch.no_grad():
        for _ in range(5):
            enc(x)
        out["infer_b2b_us"] = statistics.median(gpu_us(lambda: enc(x), 200) for _ in range(5))
        changed, steady = [], []
        for _ in range(30):
            write_all(params, masters, gen)
            changed.append(gpu_us(lambda: enc(x)))
            steady.append(gpu_us(lambda: enc(x)))
        out["after_write_us"] = statistics.median(changed)
        out["steady_us"] = statistics.median(steady)

    xt = torch.randn(2048, 3, 64, 64, device="cuda", generator=gen).half()
    dy = torch.randn(2048, 512, 2, 2, device="cuda", generator=gen).half()

    def step():
        enc(xt).backward(dy)

    def step_write():
        write_all(params, masters, gen)
        step()

    for _ in range(3):
        step()
    out["train_step_us"] = statistics.median(gpu_us(step, 10) for _ in range(3))
    out["train_write_us"] = statistics.median(gpu_us(step_write, 10) for _ in range(3))

    mlp = kfuse.FusedMLP(64, 64, (64,) * 4).cuda().half()
    xm = torch.randn(1 << 18, 64, device="cuda", generator=gen).half()
    with torch.no_grad():
        for _ in range(3):
            mlp(xm)
        out["mlp_infer_us"] = statistics.median(gpu_us(lambda: mlp(xm), 100) for _ in range(5))

    print(json.dumps(out))
    for k, v in out.items():
        print(f"  {k:16} {v if isinstance(v, str) else f'{v:9.1f}'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
