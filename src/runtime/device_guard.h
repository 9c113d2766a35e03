// Makes a CUDA device current for a scope (its primary context, as PyTorch uses), then restores the caller's.
#pragma once

#include <cuda_runtime.h>

#include "runtime/cuda_check.h"

namespace kfuse {

class DeviceGuard {
 public:
  // init_context: also create the primary context if the runtime has not yet (driver-API calls need it).
  explicit DeviceGuard(int device, bool init_context = false) : device_(device) {
    cudaGetDevice(&previous_);
    // Always, even when the number already matches: on a thread that has made no runtime call yet (PyTorch's
    // autograd worker) no context is current, and driver-API calls need one; cudaSetDevice makes the primary
    // context current (CUDA 12+).
    check_cuda(cudaSetDevice(device), "cudaSetDevice");
    if (init_context) check_cuda(cudaFree(nullptr), "cudaFree(0) (context creation)");
  }
  ~DeviceGuard() {
    if (previous_ != device_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0, device_ = 0;
};

}  // namespace kfuse
