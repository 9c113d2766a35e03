// FixUp conv fprop instance, CUTLASS 3.x Hopper: fp16, CTA tile 128x128x64, stages and schedule as CUTLASS picks
// (the training batch's large GEMMs). See fixup_sm90_impl.cuh.
#include "kernels/conv/fixup_sm90_impl.cuh"

KFUSE_FIXUP_DEFINE_INSTANCE(fixup_f16_sm90_128x128, fixup_sm90_impl::FixupConvSm90<128, 128>)
