// A kernel that keeps the GPU busy for a given time. Timing a kernel between two CUDA events measures the GPU only if
// the host has enqueued everything before the GPU reaches the first event: with an idle GPU, a launch whose host-side
// work is slow (cuDNN's calls plan on the host) would be charged for it. Tuning enqueues this delay first.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace kfuse::kernels {

// One thread spins on the global timer for `microseconds` (asynchronous on `stream`).
cudaError_t launch_gpu_delay(cudaStream_t stream, uint32_t microseconds);

}  // namespace kfuse::kernels
