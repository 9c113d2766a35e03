#include "kernels/timing/gpu_delay.h"

namespace kfuse::kernels {
namespace {

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void gpu_delay_kernel(uint64_t ns) {
  const uint64_t start = global_ns();
  while (global_ns() - start < ns) __nanosleep(1000);
}

}  // namespace

cudaError_t launch_gpu_delay(cudaStream_t stream, uint32_t microseconds) {
  gpu_delay_kernel<<<1, 1, 0, stream>>>(uint64_t(microseconds) * 1000u);
  return cudaGetLastError();
}

}  // namespace kfuse::kernels
