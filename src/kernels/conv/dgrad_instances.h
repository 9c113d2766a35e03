// Internal: the per-(dtype, tile) entry points of the data-gradient convolution, one CUTLASS instantiation per .cu
// file (dgrad_<dtype>_<tile>.cu), dispatched by conv_dgrad.cpp. Same contracts as the public functions in
// conv_backward.h. No CUTLASS header here. Hidden: only libkfuse's own objects call them.
#pragma once

#include <cstddef>

#include <cuda_runtime.h>

#include "kernels/conv/conv_problem.h"

#define KFUSE_DGRAD_DECLARE_INSTANCE(name)                                                                     \
  __attribute__((visibility("hidden"))) bool name##_can_implement(const Conv2dProblem& problem);               \
  __attribute__((visibility("hidden"))) size_t name##_workspace_bytes(const Conv2dProblem& problem);           \
  __attribute__((visibility("hidden"))) cudaError_t name##_launch(const Conv2dProblem& problem, const void* dy, \
                                                                  const void* w, void* dx, void* workspace,      \
                                                                  size_t workspace_bytes, cudaStream_t stream);

namespace kfuse::kernels::detail {

KFUSE_DGRAD_DECLARE_INSTANCE(dgrad_f16_128x128)
KFUSE_DGRAD_DECLARE_INSTANCE(dgrad_f16_128x64)
KFUSE_DGRAD_DECLARE_INSTANCE(dgrad_f16_64x64)
KFUSE_DGRAD_DECLARE_INSTANCE(dgrad_bf16_128x64)

}  // namespace kfuse::kernels::detail
