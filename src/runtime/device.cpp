#include "kfuse/device.h"

#include "kfuse/error.h"

#if KFUSE_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace kfuse {

bool built_with_cuda() { return KFUSE_WITH_CUDA != 0; }

int cuda_device_count() {
#if KFUSE_WITH_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device / no driver" error
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

DeviceInfo cuda_device_info(int index) {
  const int n = cuda_device_count();
  KFUSE_CHECK(index >= 0 && index < n, Unsupported, "no CUDA device ", index, " (", n, " device(s) found",
              built_with_cuda() ? "" : "; kfuse was built without CUDA", ")");
  DeviceInfo d;
#if KFUSE_WITH_CUDA
  cudaDeviceProp p{};
  KFUSE_CHECK(cudaGetDeviceProperties(&p, index) == cudaSuccess, Error, "cudaGetDeviceProperties(", index,
              ") failed");
  d.index = index;
  d.name = p.name;
  d.major = p.major;
  d.minor = p.minor;
  d.sm_count = p.multiProcessorCount;
  d.l2_bytes = p.l2CacheSize;
  d.memory_bytes = static_cast<long long>(p.totalGlobalMem);
  cudaDriverGetVersion(&d.driver_version);
  cudaRuntimeGetVersion(&d.runtime_version);
#endif
  return d;
}

std::string compiled_architectures() {
  return built_with_cuda() ? "sm_90a (CUTLASS 3.x), sm_80 and sm_90 (CUTLASS 2.x)" : "none (CPU-only build)";
}

}  // namespace kfuse
