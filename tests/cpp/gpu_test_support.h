// Support shared by the C++ GPU tests: skipping without a fitting device, owning device memory and streams, and
// deterministic per-test seeds.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace kfuse::testing {

// Empty when the current device's compute capability major is in [min_major, max_major] (where `what` has SASS),
// otherwise why the test must skip.
inline std::string device_skip_reason(int min_major, int max_major, const std::string& what) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return std::string("no usable CUDA device: ") + cudaGetErrorString(err);
  }
  if (count == 0) return "no CUDA device";
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return "cannot query the CUDA device";
  }
  if (major < min_major || major > max_major)
    return what + " has no code for compute capability " + std::to_string(major) + "." + std::to_string(minor);
  return {};
}

// Owns one device allocation.
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr != nullptr) (void)cudaFree(ptr);
  }
  cudaError_t alloc(size_t n) {
    bytes = n;
    return n == 0 ? cudaSuccess : cudaMalloc(&ptr, n);
  }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
};

struct StreamGuard {
  cudaStream_t stream = nullptr;
  ~StreamGuard() {
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
  }
};

// Deterministic per-test seed (FNV-1a of the test's name).
inline uint32_t seed_for(const std::string& name) {
  uint32_t h = 2166136261u;
  for (const unsigned char c : name) {
    h ^= c;
    h *= 16777619u;
  }
  return h;
}

}  // namespace kfuse::testing
