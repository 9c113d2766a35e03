// Weight-gradient instance: fp16, CTA tile 64x64x32 (2 x 2 warps of 32x32x32), 4 stages = 32 KiB of shared memory.
// See wgrad_impl.cuh.
#include "kernels/conv/wgrad_impl.cuh"

KFUSE_WGRAD_DEFINE_INSTANCE(wgrad_f16_64x64, wgrad_impl::WgradConv<cutlass::half_t, 64, 64, 32, 32, /*Stages=*/4>)
