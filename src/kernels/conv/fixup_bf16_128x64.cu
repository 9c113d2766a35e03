// FixUp conv fprop instance: bf16, CTA tile 128x64x32 (2 x 2 warps of 64x32x32),
// 4 stages = 48 KiB of shared memory. See fixup_conv_impl.cuh.
#include "kernels/conv/fixup_conv_impl.cuh"

KFUSE_FIXUP_DEFINE_INSTANCE(fixup_bf16_128x64, fixup_impl::FixupConv<cutlass::bfloat16_t, 128, 64, 32, 64, 32, /*Stages=*/4>)
