// FixUp conv fprop instance: fp16, CTA tile 128x128x32 (2 x 2 warps of 64x64x32), 4 stages = 64 KiB.
// See fixup_conv_impl.cuh.
#include "kernels/conv/fixup_conv_impl.cuh"

KFUSE_FIXUP_DEFINE_INSTANCE(fixup_f16_128x128, fixup_impl::FixupConv<cutlass::half_t, 128, 128, 32, 64, 64, /*Stages=*/4>)
