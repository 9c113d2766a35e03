// Data-gradient instance: fp16, CTA tile 64x64x32 (2 x 2 warps of 32x32x32), 4 stages = 32 KiB of shared memory.
// See dgrad_impl.cuh.
#include "kernels/conv/dgrad_impl.cuh"

KFUSE_DGRAD_DEFINE_INSTANCE(dgrad_f16_64x64, dgrad_impl::StridedDgrad<cutlass::half_t, 64, 64, 32, 32, 32, /*Stages=*/4>)
