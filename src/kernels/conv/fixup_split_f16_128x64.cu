// FixUp conv fprop instance with parallel split-K: half, CTA tile 128x64x32 (warps of 64x32x32), 4 stages.
// See fixup_split_impl.cuh.
#include "kernels/conv/fixup_split_impl.cuh"

KFUSE_FIXUP_DEFINE_INSTANCE(fixup_split_f16_128x64,
                            fixup_split_impl::FixupSplitConv<cutlass::half_t, 128, 64, 32, 64, 32, /*Stages=*/4>)
