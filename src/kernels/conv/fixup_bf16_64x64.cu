// FixUp conv fprop instance: bf16, CTA tile 64x64x32 (2 x 2 warps of 32x32x32),
// 4 stages = 32 KiB of shared memory. See fixup_conv_impl.cuh.
#include "kernels/conv/fixup_conv_impl.cuh"

KFUSE_FIXUP_DEFINE_INSTANCE(fixup_bf16_64x64, fixup_impl::FixupConv<cutlass::bfloat16_t, 64, 64, 32, 32, 32, /*Stages=*/4>)
