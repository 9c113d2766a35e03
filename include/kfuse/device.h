// What this build and this machine offer: CUDA devices, their architecture, and whether kfuse's kernels run there.
#pragma once

#include <string>

namespace kfuse {

struct DeviceInfo {
  int index = -1;
  std::string name;
  int major = 0, minor = 0;  // compute capability
  int sm_count = 0;
  long long l2_bytes = 0;
  long long memory_bytes = 0;
  int driver_version = 0;   // e.g. 13000
  int runtime_version = 0;
};

// True when libkfuse was built with its CUDA kernels.
bool built_with_cuda();
// Number of usable CUDA devices: 0 without a GPU, without a driver or in a CPU-only build. Never throws.
int cuda_device_count();
// Throws Unsupported when there is no such device.
DeviceInfo cuda_device_info(int index);
// The architectures the kernels were compiled for, e.g. "sm_90a (CUTLASS 3.x), sm_80/sm_90 (CUTLASS 2.x)".
std::string compiled_architectures();

}  // namespace kfuse
