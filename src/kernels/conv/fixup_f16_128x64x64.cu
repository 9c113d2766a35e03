// FixUp conv fprop instance: fp16, CTA tile 128x64x64 (2 x 2 warps of 64x32x64), 3 stages = 72 KiB.
// See fixup_conv_impl.cuh.
#include "kernels/conv/fixup_conv_impl.cuh"

KFUSE_FIXUP_DEFINE_INSTANCE(fixup_f16_128x64x64, fixup_impl::FixupConv<cutlass::half_t, 128, 64, 64, 64, 32, /*Stages=*/3>)
