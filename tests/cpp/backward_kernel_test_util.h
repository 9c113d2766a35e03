// What the GPU tests of the encoder's non-GEMM backward kernels share (test_relu_mask_backward_gpu.cpp,
// test_stem_backward_gpu.cpp): random rounded inputs, device copies, the normwise comparison, the skip rule.
#pragma once

#include "kernels/encoder/backward_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu_test_support.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

namespace kfuse::testing::backward_kernels {

using kfuse::bits_to_float;
using kfuse::float_to_bits;

using kfuse::testing::DeviceBuffer;
using kfuse::testing::seed_for;
using kfuse::testing::StreamGuard;

using kfuse::kernels::ConvDType;
using kfuse::kernels::InputDType;
using kfuse::kernels::ReluMaskBackwardArgs;
using kfuse::kernels::StemBackwardArgs;

inline const ConvDType kDtypes[] = {ConvDType::kF16, ConvDType::kBF16};

inline const char* dtype_name(ConvDType dt) { return dt == ConvDType::kF16 ? "f16" : "bf16"; }

inline std::string gpu_skip_reason() { return kfuse::testing::device_skip_reason(8, 9, "the encoder backward kernels"); }

inline float round_t(float f, ConvDType dt) { return bits_to_float(float_to_bits(f, dt), dt); }

inline std::vector<uint16_t> random_bits(size_t n, float lo, float hi, ConvDType dt, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = float_to_bits(dist(rng), dt);
  return v;
}

template <class V>
void upload(DeviceBuffer& buf, const std::vector<V>& v) {
  ASSERT_EQ(buf.alloc(v.size() * sizeof(V)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(buf.ptr, v.data(), buf.bytes, cudaMemcpyHostToDevice), cudaSuccess);
}

template <class V>
void download(std::vector<V>* v, const DeviceBuffer& buf) {
  v->assign(buf.bytes / sizeof(V), V{});
  ASSERT_EQ(cudaMemcpy(v->data(), buf.ptr, buf.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
}

// Normwise relative error ||out - ref|| / ||ref|| over the non-NaN outputs, and the NaN count.
struct Comparison {
  size_t nan_count = 0;
  double rel = 0.0;
  double ref_norm2 = 0.0;
};

inline Comparison compare(const std::vector<double>& out, const std::vector<double>& ref) {
  Comparison c;
  double err2 = 0.0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (std::isnan(out[i])) {
      ++c.nan_count;
      continue;
    }
    err2 += (out[i] - ref[i]) * (out[i] - ref[i]);
    c.ref_norm2 += ref[i] * ref[i];
  }
  c.rel = c.ref_norm2 > 0.0 ? std::sqrt(err2 / c.ref_norm2) : 0.0;
  return c;
}

inline double rel_diff(double out, double ref) { return std::abs(out - ref) / std::max(std::abs(ref), 1e-30); }

// An address no kernel is launched with: the argument checks return before any CUDA call.
inline void* fake_ptr(uintptr_t offset = 0) { return reinterpret_cast<void*>(uintptr_t(0x100000) + offset); }

}  // namespace kfuse::testing::backward_kernels
