// Support shared by the C++ GPU tests: skipping without a fitting device, owning device memory and streams, and
// deterministic per-test seeds.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "runtime/half_bits.h"  // float_to_bits / bits_to_float: fp16 / bf16 bit patterns on the host

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

// Quiet NaN of each 16-bit dtype: poisons outputs before each launch.
inline uint16_t nan_bits(kernels::ConvDType dt) { return dt == kernels::ConvDType::kF16 ? 0x7e00 : 0x7fc0; }

// n elements uniform in [lo, hi] as fp16 / bf16 bit patterns, never zero after rounding (a zero would hide a wrongly
// indexed or skipped operand).
inline std::vector<uint16_t> random_nonzero_bits(size_t n, kernels::ConvDType dt, std::mt19937& rng, float lo = -1.0f,
                                                 float hi = 1.0f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<uint16_t> v(n);
  for (auto& x : v) {
    do {
      x = float_to_bits(dist(rng), dt);
    } while ((x & 0x7fffu) == 0);
  }
  return v;
}

// A device copy of `host` (allocated to its size).
template <class V>
cudaError_t to_device(DeviceBuffer& d, const std::vector<V>& host) {
  if (const cudaError_t e = d.alloc(host.size() * sizeof(V)); e != cudaSuccess) return e;
  return cudaMemcpy(d.ptr, host.data(), d.bytes, cudaMemcpyHostToDevice);
}

// fp16 / bf16 bit patterns as float64 values.
inline std::vector<double> decode(const std::vector<uint16_t>& bits, kernels::ConvDType dt) {
  std::vector<double> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = bits_to_float(bits[i], dt);
  return out;
}

// fp16's or bf16's unit roundoff: 2^-11, 2^-8.
inline double unit_roundoff(kernels::ConvDType dt) {
  return dt == kernels::ConvDType::kF16 ? 1.0 / 2048 : 1.0 / 256;
}

// The mask the backward reads from a ReLU's output y through v = y + post (numeric.cuh, faithful rounding): v > T(post)
// exactly where y > 0, and v == T(post) where y == 0. Returns how many elements break it (post_t: T(post) decoded).
inline size_t after_relu_mask_mismatches(const std::vector<double>& y, const std::vector<double>& v, double post_t) {
  size_t wrong = 0;
  for (size_t i = 0; i < y.size(); ++i) wrong += y[i] > 0 ? !(v[i] > post_t) : !(v[i] == post_t);
  return wrong;
}

// A kernel test's case (anything with a `name`) crossed with the two 16-bit types: the parameter, its label
// ("<name>/f16", also the seed's name), gtest's name for it ("<name>_f16") and the list of every case in both types.
template <class Case>
struct DtypeCase {
  Case c;
  kernels::ConvDType dtype;
  std::string label() const { return std::string(c.name) + (dtype == kernels::ConvDType::kF16 ? "/f16" : "/bf16"); }
};
template <class Case>
void PrintTo(const DtypeCase<Case>& p, std::ostream* os) {
  *os << p.label();
}
struct DtypeCaseName {
  template <class Info>
  std::string operator()(const Info& info) const {
    std::string name = info.param.label();
    name[name.find('/')] = '_';
    return name;
  }
};
template <class Case, size_t N>
std::vector<DtypeCase<Case>> with_both_dtypes(const Case (&cases)[N]) {
  std::vector<DtypeCase<Case>> out;
  for (const Case& c : cases)
    for (kernels::ConvDType dt : {kernels::ConvDType::kF16, kernels::ConvDType::kBF16}) out.push_back({c, dt});
  return out;
}

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
