// FixUp conv fprop instance for Hopper: e4m3 operands, fp16 output, per-channel multiplier, CTA tile 128x64x64 (64-channel layers),
// cluster 1x1x1, sm_90a only. See fixup_sm90_impl.cuh.
#include "kernels/conv/fixup_sm90_impl.cuh"

KFUSE_FIXUP_DEFINE_INSTANCE(fixup_e4m3_sm90_128x64_k64,
                            fixup_sm90_impl::FixupConvSm90<128, 64, 1, 1, 0, cutlass::float_e4m3_t, 64>)
