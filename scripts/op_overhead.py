"""What calling the encoder through the dispatcher's ops (what torch.compile and torch.export trace: encoder_infer
where no gradient is needed, encoder_forward with its autograd formula for training) costs against the module's
direct path, same process. Runs on the GPU machine:
    bash scripts/gpu_run.sh --exec "python3 scripts/op_overhead.py"
  latency_us        host + device time of one call with an idle GPU (synchronize before and after), median of 300
  b2b_us            GPU time per call of 200 calls back to back with the host ahead, median of 5 rounds
  train_step_us     batch-2048 forward + backward (every parameter's gradient), GPU time per step of 10, median of 7 interleaved rounds
"""
import statistics
import time

import torch

import kfuse

CFG = (3, 64, [1, 1, 1, 1])


def latency_us(fn, n=300):
    for _ in range(20):
        fn()
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def gpu_us(fn, repeats):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(40_000_000)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / repeats


def main():
    enc = kfuse.ResNetEncoder.default_network(3).cuda().half()
    params = list(enc.parameters())
    x = torch.rand(128, 3, 64, 64, device="cuda").half()
    rows = {}
    with torch.no_grad():
        calls = {"module": lambda: enc(x), "op": lambda: torch.ops.kfuse.encoder_infer(x, params, *CFG),
                 "op_fwd": lambda: torch.ops.kfuse.encoder_forward(x, params, *CFG, False)}
        for name, fn in calls.items():
            rows[name] = {"latency_us": latency_us(fn),
                          "b2b_us": statistics.median(gpu_us(fn, 200) for _ in range(5))}
    xt = torch.rand(2048, 3, 64, 64, device="cuda").half()
    dy = torch.randn(2048, 512, 2, 2, device="cuda").half()
    steps = {"module": lambda: enc(xt).backward(dy),
             "op": lambda: torch.ops.kfuse.encoder_forward(xt, params, *CFG, True).backward(dy)}
    rows["op_fwd"]["train_step_us"] = float("nan")
    for fn in steps.values():
        for _ in range(3):
            fn()
    samples = {name: [] for name in steps}
    for _ in range(7):  # interleaved rounds, so that clock and thermal drift reach both sides alike
        for name, fn in steps.items():
            samples[name].append(gpu_us(fn, 10))
    for name in steps:
        rows[name]["train_step_us"] = statistics.median(samples[name])
    print(f"[op overhead] {torch.cuda.get_device_name()}, batch 128 inference / 2048 training, fp16")
    for name, r in rows.items():
        print(f"  {name:7} " + "  ".join(f"{k} {v:8.1f}" for k, v in r.items()))
    m, o = rows["module"], rows["op"]
    print(f"  op - module: latency {o['latency_us'] - m['latency_us']:+.1f} us, back to back "
          f"{o['b2b_us'] - m['b2b_us']:+.1f} us, training step {100 * (o['train_step_us'] / m['train_step_us'] - 1):+.2f}%")


if __name__ == "__main__":
    main()
