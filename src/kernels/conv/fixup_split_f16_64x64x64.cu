// FixUp conv fprop instance with parallel split-K: half, CTA tile 64x64x64 (warps of 32x32x64), 4 stages.
// See fixup_split_impl.cuh.
#include "kernels/conv/fixup_split_impl.cuh"

KFUSE_FIXUP_DEFINE_INSTANCE(fixup_split_f16_64x64x64,
                            fixup_split_impl::FixupSplitConv<cutlass::half_t, 64, 64, 64, 32, 32, /*Stages=*/4>)
