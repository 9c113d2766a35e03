// FixUp conv fprop instance, CUTLASS 3.x Hopper: fp16, CTA tile 128x64x64 with 4 stages (96 KiB: two CTAs per SM).
// See fixup_sm90_impl.cuh.
#include "kernels/conv/fixup_sm90_impl.cuh"

KFUSE_FIXUP_DEFINE_INSTANCE(fixup_f16_sm90_128x64_s4, fixup_sm90_impl::FixupConvSm90<128, 64, 1, 1, 4>)
