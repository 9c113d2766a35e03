// FixUp conv fprop instance with parallel split-K: bfloat16, CTA tile 128x128x32 (warps of 64x64x32), 4 stages.
// See fixup_split_impl.cuh.
#include "kernels/conv/fixup_split_impl.cuh"

KFUSE_FIXUP_DEFINE_INSTANCE(fixup_split_bf16_128x128,
                            fixup_split_impl::FixupSplitConv<cutlass::bfloat16_t, 128, 128, 32, 64, 64, /*Stages=*/4>)
