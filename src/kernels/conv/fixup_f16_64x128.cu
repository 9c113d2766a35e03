// FixUp conv fprop instance: fp16, CTA tile 64x128x32 (2 x 2 warps of 32x64x32), 4 stages = 48 KiB.
// See fixup_conv_impl.cuh.
#include "kernels/conv/fixup_conv_impl.cuh"

KFUSE_FIXUP_DEFINE_INSTANCE(fixup_f16_64x128, fixup_impl::FixupConv<cutlass::half_t, 64, 128, 32, 32, 64, /*Stages=*/4>)
