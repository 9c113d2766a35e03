// Internal: the per-(dtype, tile) entry points of the FixUp convolutions, one CUTLASS instantiation per .cu file
// (fixup_<dtype>_<tile>.cu), dispatched by conv_fixup.cpp. Same contracts as the public functions in conv_fixup.h.
// No CUTLASS header here. Hidden: only libkfuse's own objects call them.
#pragma once

#include <cstddef>

#include <cuda_runtime.h>

#include "kernels/conv/conv_fixup.h"

#define KFUSE_FIXUP_DECLARE_INSTANCE(name)                                                                        \
  __attribute__((visibility("hidden"))) bool name##_can_implement(const Conv2dProblem& problem, int split_k);     \
  __attribute__((visibility("hidden"))) size_t name##_workspace_bytes(const Conv2dProblem& problem, int split_k); \
  __attribute__((visibility("hidden"))) cudaError_t name##_launch(                                                \
      const Conv2dProblem& problem, const void* x, const void* w, void* y, const FixupEpilogue& epilogue,          \
      int split_k, void* workspace, size_t workspace_bytes, cudaStream_t stream);

namespace kfuse::kernels::detail {

KFUSE_FIXUP_DECLARE_INSTANCE(fixup_f16_128x64)
KFUSE_FIXUP_DECLARE_INSTANCE(fixup_f16_64x64)
KFUSE_FIXUP_DECLARE_INSTANCE(fixup_bf16_128x64)
KFUSE_FIXUP_DECLARE_INSTANCE(fixup_bf16_64x64)
KFUSE_FIXUP_DECLARE_INSTANCE(fixup_f16_64x64x64)
KFUSE_FIXUP_DECLARE_INSTANCE(fixup_f16_128x64x64)
KFUSE_FIXUP_DECLARE_INSTANCE(fixup_f16_64x128)
KFUSE_FIXUP_DECLARE_INSTANCE(fixup_f16_128x128)
KFUSE_FIXUP_DECLARE_INSTANCE(fixup_f16_128x64w8)
// CUTLASS 3.x Hopper instances (fixup_f16_sm90_<tile>.cu, fixup_sm90_impl.cuh).
KFUSE_FIXUP_DECLARE_INSTANCE(fixup_f16_sm90_128x64)
KFUSE_FIXUP_DECLARE_INSTANCE(fixup_f16_sm90_64x64)
KFUSE_FIXUP_DECLARE_INSTANCE(fixup_f16_sm90_64x64_c2x2)
KFUSE_FIXUP_DECLARE_INSTANCE(fixup_f16_sm90_128x64_s4)
KFUSE_FIXUP_DECLARE_INSTANCE(fixup_f16_sm90_128x128)
KFUSE_FIXUP_DECLARE_INSTANCE(fixup_f16_sm90_256x64)
// e4m3 operands, fp16 output (fixup_e4m3_sm90_<tile>.cu).
KFUSE_FIXUP_DECLARE_INSTANCE(fixup_e4m3_sm90_128x64)
KFUSE_FIXUP_DECLARE_INSTANCE(fixup_e4m3_sm90_128x64_k64)
KFUSE_FIXUP_DECLARE_INSTANCE(fixup_e4m3_sm90_128x128)
KFUSE_FIXUP_DECLARE_INSTANCE(fixup_e4m3_sm90_256x64)

// Parallel split-K instances (fixup_split_<dtype>_<tile>.cu, fixup_split_impl.cuh).
KFUSE_FIXUP_DECLARE_INSTANCE(fixup_split_f16_128x128)
KFUSE_FIXUP_DECLARE_INSTANCE(fixup_split_f16_64x128)
KFUSE_FIXUP_DECLARE_INSTANCE(fixup_split_f16_64x64x64)
KFUSE_FIXUP_DECLARE_INSTANCE(fixup_split_f16_128x64)
KFUSE_FIXUP_DECLARE_INSTANCE(fixup_split_bf16_128x128)
KFUSE_FIXUP_DECLARE_INSTANCE(fixup_split_bf16_64x64)

}  // namespace kfuse::kernels::detail
