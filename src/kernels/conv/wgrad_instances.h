// Internal: the per-(dtype, tile) entry points of the weight-gradient convolutions, one CUTLASS instantiation per .cu
// file (wgrad_<dtype>_<tile>.cu), dispatched by conv_wgrad.cpp. Same contracts as the public wgrad functions in
// conv_backward.h. No CUTLASS header here. Hidden: only libkfuse's own objects call them.
#pragma once

#include <cstddef>

#include <cuda_runtime.h>

#include "kernels/conv/conv_backward.h"

#define KFUSE_WGRAD_DECLARE_INSTANCE(name)                                                                        \
  __attribute__((visibility("hidden"))) bool name##_can_implement(const Conv2dProblem& problem, int split_k);     \
  __attribute__((visibility("hidden"))) size_t name##_workspace_bytes(const Conv2dProblem& problem, int split_k); \
  __attribute__((visibility("hidden"))) cudaError_t name##_launch(const Conv2dProblem& problem, int split_k,      \
                                                                  const void* dy, const void* x, float* dw,       \
                                                                  void* workspace, size_t workspace_bytes,        \
                                                                  cudaStream_t stream);

namespace kfuse::kernels::detail {

KFUSE_WGRAD_DECLARE_INSTANCE(wgrad_f16_128x128)
KFUSE_WGRAD_DECLARE_INSTANCE(wgrad_f16_128x64)
KFUSE_WGRAD_DECLARE_INSTANCE(wgrad_f16_64x64)
KFUSE_WGRAD_DECLARE_INSTANCE(wgrad_bf16_128x64)

}  // namespace kfuse::kernels::detail
