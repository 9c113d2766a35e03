// FixUp conv fprop instance with parallel split-K: half, CTA tile 64x128x32 (warps of 32x64x32), 4 stages.
// See fixup_split_impl.cuh.
#include "kernels/conv/fixup_split_impl.cuh"

KFUSE_FIXUP_DEFINE_INSTANCE(fixup_split_f16_64x128,
                            fixup_split_impl::FixupSplitConv<cutlass::half_t, 64, 128, 32, 32, 64, /*Stages=*/4>)
