"""GPU time of the training step's parameter packing alone (weight_layout.h launch_pack_params: every parameter into
the kernels' layouts in one launch) for fp32, fp16 and bf16 parameters of the default network, from torch.profiler's
CUDA activity. Runs on the GPU machine: bash scripts/gpu_run.sh --exec "python3 scripts/profile_pack.py".
Usage: python scripts/profile_pack.py [float16|bfloat16] (the network's precision: the packed layouts' dtype)."""
import sys

import torch
from kernel_profile import kernel_times

import kfuse
from kfuse import _C
from kfuse.encoder import _param_list

# Bytes of the default network's packed layouts (fp16 / bf16 filters in every form the kernels read, fp32 copies).
PACKED_BYTES = 21.85e6


def main():
    precision = sys.argv[1] if len(sys.argv) > 1 else "float16"
    model = kfuse.ResNetEncoder.default_network(3)
    stream = torch.cuda.current_stream().cuda_stream
    for dtype, name in ((torch.float32, "float32"), (torch.float16, "float16"), (torch.bfloat16, "bfloat16")):
        params = [p.detach().to("cuda", dtype).contiguous() for p in _param_list(model, model.config)]
        engine = _C.EncoderGpu(model.config, precision, 0)
        ptrs = [p.data_ptr() for p in params]
        _, rows = kernel_times(lambda: engine.set_weights_device(ptrs, name, stream))
        read = sum(p.numel() * p.element_size() for p in params)
        for kernel, us, launches in rows:
            if "pack_params" in kernel:
                print(f"[pack] {name} -> {precision}: {us:6.1f} us x{launches}  ({read / 1e6:.1f} MB of parameters, "
                      f"{PACKED_BYTES / 1e6:.1f} MB packed: {(read + PACKED_BYTES) / us / 1e6:.2f} TB/s)")


if __name__ == "__main__":
    main()
