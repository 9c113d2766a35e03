// FixUp conv fprop instance for Hopper: fp16, CTA tile 64x64x64, cluster 1x1x1, sm_90a only.
// See fixup_sm90_impl.cuh.
#include "kernels/conv/fixup_sm90_impl.cuh"

KFUSE_FIXUP_DEFINE_INSTANCE(fixup_f16_sm90_64x64, fixup_sm90_impl::FixupConvSm90<64, 64>)
