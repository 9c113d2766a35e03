// FixUp conv fprop instance with parallel split-K: bfloat16, CTA tile 64x64x32 (warps of 32x32x32), 4 stages.
// See fixup_split_impl.cuh.
#include "kernels/conv/fixup_split_impl.cuh"

KFUSE_FIXUP_DEFINE_INSTANCE(fixup_split_bf16_64x64,
                            fixup_split_impl::FixupSplitConv<cutlass::bfloat16_t, 64, 64, 32, 32, 32, /*Stages=*/4>)
