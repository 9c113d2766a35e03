// FixUp conv fprop instance: fp16, CTA tile 64x64x64 (2 x 2 warps of 32x32x64), 4 stages = 64 KiB.
// See fixup_conv_impl.cuh.
#include "kernels/conv/fixup_conv_impl.cuh"

KFUSE_FIXUP_DEFINE_INSTANCE(fixup_f16_64x64x64, fixup_impl::FixupConv<cutlass::half_t, 64, 64, 64, 32, 32, /*Stages=*/4>)
