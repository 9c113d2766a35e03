// FixUp conv fprop instance: fp16, CTA tile 128x64x32 (4 x 2 warps of 32x32x32: 8 warps to hide latency), 4 stages = 48 KiB.
// See fixup_conv_impl.cuh.
#include "kernels/conv/fixup_conv_impl.cuh"

KFUSE_FIXUP_DEFINE_INSTANCE(fixup_f16_128x64w8, fixup_impl::FixupConv<cutlass::half_t, 128, 64, 32, 32, 32, /*Stages=*/4>)
