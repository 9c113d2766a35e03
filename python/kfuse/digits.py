"""A small real classification task for the accuracy of kfuse's low-bit paths: the handwritten digits shipped inside
scikit-learn (1,797 8x8 images, 10 classes), upscaled to the encoder's 64x64 RGB input, the encoder plus a linear
head trained on it, and held-out accuracy measured in fp16 and in fp8 (kfuse.fp8's quantized convolutions: the
numerics of fp8 tensor cores, and the reference of kfuse's fp8 kernels).

    data = digits.load()                                          # needs scikit-learn
    model = digits.Classifier(kfuse.ResNetEncoder(3)).to("cuda", torch.float16)
    digits.train(model, data, steps=300)
    report = digits.fp8_report(model, data)                       # accuracies and per-layer errors
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import fp8, reference

__all__ = ["DigitsData", "load", "Classifier", "train", "accuracy", "fp8_report", "fp8_training_report"]


@dataclass
class DigitsData:
    x_train: torch.Tensor  # (N, 3, 64, 64) in [0, 1], float32
    y_train: torch.Tensor  # (N,) int64
    x_test: torch.Tensor
    y_test: torch.Tensor


def load(size: int = 64, test_fraction: float = 0.25, seed: int = 0) -> DigitsData:
    """scikit-learn's digits, upscaled bilinearly to size x size, grey copied into 3 channels, split at random (seeded)
    into training and held-out images."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:  # the data set ships inside scikit-learn
        raise ImportError("kfuse.digits needs scikit-learn (pip install scikit-learn)") from err
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    return split(F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False).repeat(1, 3, 1, 1), y,
                 test_fraction, seed)


def split(x: torch.Tensor, y: torch.Tensor, test_fraction: float, seed: int) -> DigitsData:
    order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))
    n_test = int(round(x.shape[0] * test_fraction))
    test, train_ = order[:n_test], order[n_test:]
    return DigitsData(x[train_], y[train_], x[test], y[test])


class Classifier(nn.Module):
    """encoder -> flatten -> Linear(classes)."""

    def __init__(self, encoder: nn.Module, classes: int = 10, features: int = 512 * 2 * 2):
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(features, classes)

    def forward(self, x):
        return self.head(self.encoder(x).flatten(1))


def _batches(x, y, batch: int, gen: torch.Generator):
    while True:
        order = torch.randperm(x.shape[0], generator=gen)
        for i in range(0, x.shape[0] - batch + 1, batch):
            idx = order[i:i + batch]
            yield x[idx], y[idx]


def train(model: nn.Module, data: DigitsData, steps: int = 300, batch: int = 64, lr: float = 1e-3,
          seed: int = 0) -> list[float]:
    """Adam on fp32 master weights copied back into the model's parameters (as the RL loop does), cross-entropy in
    fp32, a GradScaler where the model is fp16. Returns the loss of every step."""
    p0 = next(model.parameters())
    device, dtype = p0.device, p0.dtype
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    opt = torch.optim.Adam(masters, lr=lr)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    model.train()
    for _, (x, y) in zip(range(steps), _batches(data.x_train, data.y_train, batch, gen)):
        loss = F.cross_entropy(model(x.to(device, dtype)).float(), y.to(device))
        for p in params:
            p.grad = None
        scaler.scale(loss).backward()
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
        scaler.step(opt)
        scaler.update()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.data.copy_(m)
        losses.append(loss.item())
    return losses


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 256) -> float:
    p0 = next(model.parameters())
    model.eval()
    right = 0
    for i in range(0, x.shape[0], batch):
        logits = model(x[i:i + batch].to(p0.device, p0.dtype))
        right += (logits.argmax(1).cpu() == y[i:i + batch]).sum().item()
    return right / x.shape[0]


def _plain(model: Classifier, dtype: torch.dtype) -> Classifier:
    """The classifier with kfuse's trained encoder weights in the plain-PyTorch encoder (same state_dict)."""
    enc = model.encoder
    c, planes, layers = enc.config
    plain = reference.ResNetEncoder(c, planes, layers).to(next(model.parameters()).device, dtype)
    plain.load_state_dict({k: v.to(dtype) for k, v in enc.state_dict().items()})
    out = Classifier(plain, model.head.out_features, model.head.in_features)
    out.head = copy.deepcopy(model.head).to(dtype)
    return out.eval()


@torch.no_grad()
def fp8_report(model: Classifier, data: DigitsData, calibration_batches: int = 8, batch: int = 64,
               percentile: float | None = None) -> dict:
    """Held-out accuracy of the trained model as it is (its own dtype) and with every convolution in fp8 (e4m3,
    calibrated on training images), and, on one held-out batch, the normwise error against float64 of each block's
    output, in fp8 and in the model's dtype."""
    device = next(model.parameters()).device
    plain = _plain(model, torch.float32)
    calib = [data.x_train[i * batch:(i + 1) * batch].to(device) for i in range(calibration_batches)]
    amax = fp8.calibrate(plain.encoder, calib, percentile)
    report = {"accuracy": accuracy(model, data.x_test, data.y_test)}
    with fp8.fp8_convolutions(plain.encoder, amax):
        report["accuracy_fp8"] = accuracy(plain, data.x_test, data.y_test)
    exact = _plain(model, torch.float64)
    x = data.x_test[:batch].to(device)
    ref = _block_outputs(exact.encoder, x.double())
    with fp8.fp8_convolutions(plain.encoder, amax):
        q = _block_outputs(plain.encoder, x)
    own = _block_outputs(_plain(model, next(model.parameters()).dtype).encoder, x.to(next(model.parameters()).dtype))
    report["layer_error_fp8"] = {k: _rel(q[k], ref[k]) for k in ref}
    report["layer_error_own_dtype"] = {k: _rel(own[k], ref[k]) for k in ref}
    return report


def fp8_training_report(data: DigitsData, steps: int = 300, seed: int = 0, device="cpu", batch: int = 64,
                        lr: float = 1e-3, window: int = 20) -> dict:
    """The plain-PyTorch encoder + head trained twice from one seed on the same batches: in float32, and with every
    convolution trained as fp8 does (fp8.fp8_training: e4m3 inputs and filters, e5m2 gradients, delayed scaling).
    Returns both held-out accuracies, both loss curves (each step's loss) and the largest gap between their moving
    averages over `window` steps: the accuracy of the fp8 training recipe, ahead of (and as the reference of) its
    kernels."""
    report = {}
    for name in ("float32", "fp8"):
        torch.manual_seed(seed)
        model = Classifier(reference.ResNetEncoder(3)).to(device)
        if name == "fp8":
            with fp8.fp8_training(model.encoder):
                losses = train(model, data, steps=steps, batch=batch, lr=lr, seed=seed)
        else:
            losses = train(model, data, steps=steps, batch=batch, lr=lr, seed=seed)
        report[f"losses_{name}"] = losses
        report[f"accuracy_{name}"] = accuracy(model, data.x_test, data.y_test)
    smooth = [torch.tensor(report[f"losses_{k}"]).unfold(0, window, 1).mean(1) for k in ("float32", "fp8")]
    report["loss_gap_max"] = (smooth[0] - smooth[1]).abs().max().item() if steps >= window else None
    return report


def _block_outputs(enc: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    outs = {}
    hooks = [m.register_forward_hook(lambda _m, _i, o, n=n: outs.__setitem__(n, o.detach()))
             for n, m in enc.named_modules() if n == "stem" or n.count(".") == 2 and n.startswith("layers.")]
    try:
        enc(x)
    finally:
        for h in hooks:
            h.remove()
    return outs


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()
