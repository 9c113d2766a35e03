// Data-gradient instance: bf16, CTA tile 128x64x32 (2 x 2 warps of 64x32x32), 4 stages = 48 KiB of shared memory.
// See dgrad_impl.cuh.
#include "kernels/conv/dgrad_impl.cuh"

KFUSE_DGRAD_DEFINE_INSTANCE(dgrad_bf16_128x64, dgrad_impl::StridedDgrad<cutlass::bfloat16_t, 128, 64, 32, 64, 32, /*Stages=*/4>)
