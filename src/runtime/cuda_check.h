// CUDA runtime errors as kfuse::Error naming the failed step.
#pragma once

#include <string>

#include <cuda_runtime.h>

#include "kfuse/error.h"

namespace kfuse {

inline void check_cuda(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) throw Error("kfuse: " + what + " failed: " + cudaGetErrorString(e));
}

}  // namespace kfuse
