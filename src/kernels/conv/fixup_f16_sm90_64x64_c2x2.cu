// FixUp conv fprop instance, CUTLASS 3.x Hopper: fp16, CTA tile 64x64x64, a 2 x 2 cluster multicasting both operands (TMA), stages as smem allows.
// See fixup_sm90_impl.cuh.
#include "kernels/conv/fixup_sm90_impl.cuh"

KFUSE_FIXUP_DEFINE_INSTANCE(fixup_f16_sm90_64x64_c2x2, fixup_sm90_impl::FixupConvSm90<64, 64, 2, 2>)
