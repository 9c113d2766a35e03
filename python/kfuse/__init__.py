"""kfuse: fused, autotuned and run-time generated kernels for small networks on NVIDIA tensor cores.

``kfuse.ResNetEncoder`` is bps-nav's SE-ResNet-FixUp visual encoder (``se_resnet9_fixup`` by default) as an
nn.Module; ``kfuse.reference`` is the same network in plain PyTorch.
"""

from __future__ import annotations

try:
    from . import _C
except ImportError as e:  # pragma: no cover - only without a build
    raise ImportError(
        "kfuse's extension kfuse._C is not built. From a source checkout run `bash scripts/test.sh` (or "
        "`pip install .`); see README.md") from e

from . import reference
from ._C import CheckpointError
from .distributed import DistributedDataParallel
from .encoder import ResNetEncoder
from .mlp import Activation, FusedMLP

__version__ = "0.1.0"
__all__ = ["ResNetEncoder", "DistributedDataParallel", "FusedMLP", "Activation", "CheckpointError", "reference", "device_info", "cuda_available"]


def cuda_available() -> bool:
    """True when kfuse was built with its CUDA kernels and a CUDA device is present."""
    return _C.built_with_cuda() and _C.cuda_device_count() > 0


def device_info(index: int = 0) -> dict:
    """Name, compute capability, SM count, L2 and memory size, driver and runtime versions of a CUDA device."""
    return _C.cuda_device_info(index)
