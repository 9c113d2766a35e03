"""The digits accuracy proxy of the fp8 work (kfuse.digits): kfuse's encoder + a linear head trained in fp16 on
scikit-learn's digits (64x64), then held-out accuracy in fp16 and with every convolution in fp8 (e4m3, calibrated),
and each block's output error against float64. With --training, also the fp8 training recipe's accuracy: the
plain-PyTorch encoder trained in float32 and under kfuse.fp8.fp8_training from one seed (digits.fp8_training_report).
Usage (a machine with scikit-learn, e.g. the GPU machine):
    bash scripts/gpu_run.sh --exec "python3 scripts/fp8_digits.py [steps=400] [seed=0] [--training]"
"""
import json
import sys

import torch

import kfuse
from kfuse import digits

args = [a for a in sys.argv[1:] if not a.startswith("--")]
steps = int(args[0]) if args else 400
seed = int(args[1]) if len(args) > 1 else 0
device = "cuda" if kfuse.cuda_available() else "cpu"
dtype = torch.float16 if device == "cuda" else torch.float32
data = digits.load(seed=seed)
torch.manual_seed(seed)
model = digits.Classifier(kfuse.ResNetEncoder(3)).to(device, dtype)
losses = digits.train(model, data, steps=steps, seed=seed)
report = digits.fp8_report(model, data)
name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
print(f"[fp8 digits] {name}, {dtype}, {steps} steps: loss {losses[0]:.3f} -> {sum(losses[-20:]) / 20:.4f} "
      f"(mean of the last 20); held-out accuracy {report['accuracy']:.4f}, fp8 convolutions "
      f"{report['accuracy_fp8']:.4f}")
for block in report["layer_error_fp8"]:
    print(f"  {block:12} error vs float64: fp8 {report['layer_error_fp8'][block]:.2e}, "
          f"{str(dtype).split('.')[-1]} {report['layer_error_own_dtype'][block]:.2e}")
print(json.dumps({"steps": steps, "seed": seed, "device": name, **report}))
if "--training" in sys.argv[1:]:
    t = digits.fp8_training_report(data, steps=steps, seed=seed, device=device)
    print(f"[fp8 digits] training from seed {seed}, {steps} steps: held-out accuracy float32 "
          f"{t['accuracy_float32']:.4f}, fp8 {t['accuracy_fp8']:.4f}; losses (mean of the last 20) "
          f"{sum(t['losses_float32'][-20:]) / 20:.4f} / {sum(t['losses_fp8'][-20:]) / 20:.4f}; largest gap of the "
          f"20-step averages {t['loss_gap_max']:.4f}")
