// Weight-gradient instance: fp16, CTA tile 128x128x32 (2 x 2 warps of 64x64x32), 4 stages = 64 KiB of shared memory.
// See wgrad_impl.cuh.
#include "kernels/conv/wgrad_impl.cuh"

KFUSE_WGRAD_DEFINE_INSTANCE(wgrad_f16_128x128, wgrad_impl::WgradConv<cutlass::half_t, 128, 128, 64, 64, /*Stages=*/4>)
