// FixUp conv fprop instance for Hopper: e4m3 operands, fp16 output, per-channel multiplier, CTA tile 256x64x128 (two consumer warpgroups),
// cluster 1x1x1, sm_90a only. See fixup_sm90_impl.cuh.
#include "kernels/conv/fixup_sm90_impl.cuh"

KFUSE_FIXUP_DEFINE_INSTANCE(fixup_e4m3_sm90_256x64,
                            fixup_sm90_impl::FixupConvSm90<256, 64, 1, 1, 0, cutlass::float_e4m3_t>)
