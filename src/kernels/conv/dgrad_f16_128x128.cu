// Data-gradient instance: fp16, CTA tile 128x128x32 (2 x 2 warps of 64x64x32), 3 stages = 48 KiB of shared memory
// (the configuration of CUTLASS's own strided-dgrad sm80 test). See dgrad_impl.cuh.
#include "kernels/conv/dgrad_impl.cuh"

KFUSE_DGRAD_DEFINE_INSTANCE(dgrad_f16_128x128, dgrad_impl::StridedDgrad<cutlass::half_t, 128, 128, 32, 64, 64, /*Stages=*/3>)
