// The FixUp epilogue of conv_fixup.h as a separate element-wise pass over a convolution's output, for providers that
// cannot fuse it (cuDNN's forward, which takes host scalars only), and as the reduction of parallel split-K's partial
// sums (below):
//
//   y = post + act(alpha * y + pre)   in place, act = relu if `relu` else identity,
//
// with the fused epilogue's rounding rule: an active ReLU never stores T(post) (the training backward reads the
// ReLU's decision from the stored value; fixup_epilogue.h). The scalars are device pointers read by the kernel, so a
// captured CUDA graph sees their current values. Against the fused epilogue the result differs by one extra rounding
// of the convolution to T before the epilogue.
#pragma once

#include <cstddef>

#include <cuda_runtime.h>

#include "kernels/conv/conv_fixup.h"

namespace kfuse::kernels {

// Whether the epilogue changes anything (identity with no scalars: the pass can be skipped).
inline bool fixup_epilogue_is_identity(const FixupEpilogue& e) {
  return !e.relu && e.alpha == nullptr && e.pre == nullptr && e.post == nullptr;
}

// `count` elements of dtype at `y` (16-byte aligned, count % 8 == 0). Asynchronous on `stream`;
// cudaErrorInvalidValue without launching for a misaligned pointer or count.
cudaError_t fixup_epilogue_inplace(void* y, size_t count, ConvDType dtype, const FixupEpilogue& epilogue,
                                   cudaStream_t stream);

// The second half of a parallel split-K convolution (conv_fixup.h, conv2d_fprop_fixup_parallel): `slices` fp32
// partial sums of the output, `slice_stride` elements apart, summed in slice order 0, 1, ... (fixed order, no
// atomics: bitwise reproducible), then the epilogue, rounded once to dtype:
//
//   y = post + act(alpha * sum_s partials[s * slice_stride + i] + pre)   for i < count,
//
// with the fused epilogue's rounding rule. `partials` and `y` 16-byte aligned, count and slice_stride multiples of 8,
// slices >= 1. Asynchronous on `stream`; cudaErrorInvalidValue without launching otherwise.
cudaError_t fixup_epilogue_reduce(const float* partials, int slices, size_t slice_stride, void* y, size_t count,
                                  ConvDType dtype, const FixupEpilogue& epilogue, cudaStream_t stream);

}  // namespace kfuse::kernels
