// FixUp conv fprop instance, CUTLASS 3.x Hopper: fp16, CTA tile 256x64x64 (two consumer warpgroups of 128 rows),
// for the 64-channel layers at the training batch. See fixup_sm90_impl.cuh.
#include "kernels/conv/fixup_sm90_impl.cuh"

KFUSE_FIXUP_DEFINE_INSTANCE(fixup_f16_sm90_256x64, fixup_sm90_impl::FixupConvSm90<256, 64>)
