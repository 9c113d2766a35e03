// GPU tests of the tuner's data kernels (kernels/timing/candidate_data.h): the random fill (range, spread,
// determinism) and the comparison with the reference (sums against a float64 host computation, NaN counting).
#include "kernels/timing/candidate_data.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "gpu_test_support.h"
#include "runtime/half_bits.h"

namespace {

using kfuse::kernels::ValueType;
using kfuse::testing::DeviceBuffer;

std::string skip_reason() { return kfuse::testing::device_skip_reason(8, 9, "the tuner's data kernels"); }

TEST(CandidateData, FillIsUniformInRangeAndDeterministic) {
  if (const std::string why = skip_reason(); !why.empty()) GTEST_SKIP() << why;
  const size_t n = 100003;  // odd: the tail is covered too
  DeviceBuffer a, b;
  ASSERT_EQ(a.alloc(4 * n), cudaSuccess);
  ASSERT_EQ(b.alloc(4 * n), cudaSuccess);
  ASSERT_EQ(cudaMemset(a.ptr, 0xff, a.bytes), cudaSuccess);
  ASSERT_EQ(kfuse::kernels::fill_uniform(a.ptr, n, ValueType::kF32, 0.5f, 7u, nullptr), cudaSuccess);
  ASSERT_EQ(kfuse::kernels::fill_uniform(b.ptr, n, ValueType::kF32, 0.5f, 7u, nullptr), cudaSuccess);
  std::vector<float> ha(n), hb(n);
  ASSERT_EQ(cudaMemcpy(ha.data(), a.ptr, 4 * n, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(hb.data(), b.ptr, 4 * n, cudaMemcpyDeviceToHost), cudaSuccess);
  double sum = 0, sum2 = 0;
  for (size_t i = 0; i < n; ++i) {
    ASSERT_TRUE(std::isfinite(ha[i]) && std::abs(ha[i]) <= 0.5f) << i << ": " << ha[i];
    ASSERT_EQ(ha[i], hb[i]) << "same seed, different value at " << i;
    sum += ha[i];
    sum2 += double(ha[i]) * ha[i];
  }
  EXPECT_NEAR(sum / n, 0.0, 0.01);
  EXPECT_NEAR(sum2 / n, 0.25 / 3, 0.005);  // variance of U(-a, a) = a^2 / 3
  // Another seed gives other values; fp16 fills stay in range.
  ASSERT_EQ(kfuse::kernels::fill_uniform(b.ptr, n, ValueType::kF32, 0.5f, 8u, nullptr), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(hb.data(), b.ptr, 4 * n, cudaMemcpyDeviceToHost), cudaSuccess);
  size_t same = 0;
  for (size_t i = 0; i < n; ++i) same += ha[i] == hb[i];
  EXPECT_LT(same, n / 100);
  ASSERT_EQ(kfuse::kernels::fill_uniform(a.ptr, n, ValueType::kF16, 2.0f, 9u, nullptr), cudaSuccess);
  std::vector<uint16_t> h16(n);
  ASSERT_EQ(cudaMemcpy(h16.data(), a.ptr, 2 * n, cudaMemcpyDeviceToHost), cudaSuccess);
  for (size_t i = 0; i < n; ++i)
    ASSERT_LE(std::abs(kfuse::bits_to_float(h16[i], kfuse::kernels::ConvDType::kF16)), 2.0f) << i;
}

TEST(CandidateData, ComparisonMatchesHostSumsAndCountsNaN) {
  if (const std::string why = skip_reason(); !why.empty()) GTEST_SKIP() << why;
  const size_t n = 70001;
  std::vector<float> ref(n);
  std::vector<uint16_t> out(n);
  double err = 0, norm = 0;
  for (size_t i = 0; i < n; ++i) {
    ref[i] = std::sin(0.37 * double(i)) * 3.0f;
    const float o = ref[i] + 0.01f * std::cos(1.3 * double(i));
    out[i] = kfuse::float_to_bits(o, kfuse::kernels::ConvDType::kBF16);
    const double ob = kfuse::bits_to_float(out[i], kfuse::kernels::ConvDType::kBF16);
    err += (ob - ref[i]) * (ob - ref[i]);
    norm += double(ref[i]) * ref[i];
  }
  out[5] = 0xffff;  // NaN poison left unwritten: counted, not summed
  err -= std::pow(kfuse::bits_to_float(kfuse::float_to_bits(ref[5] + 0.01f * float(std::cos(1.3 * 5.0)),
                                                            kfuse::kernels::ConvDType::kBF16),
                                       kfuse::kernels::ConvDType::kBF16) - ref[5], 2);
  norm -= double(ref[5]) * ref[5];
  DeviceBuffer d_ref, d_out, d_res;
  ASSERT_EQ(d_ref.alloc(4 * n), cudaSuccess);
  ASSERT_EQ(d_out.alloc(2 * n), cudaSuccess);
  ASSERT_EQ(d_res.alloc(3 * sizeof(double)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_ref.ptr, ref.data(), 4 * n, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_out.ptr, out.data(), 2 * n, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(kfuse::kernels::compare_with_reference(d_out.ptr, ValueType::kBF16, d_ref.as<float>(), n,
                                                   d_res.as<double>(), nullptr),
            cudaSuccess);
  double r[3];
  ASSERT_EQ(cudaMemcpy(r, d_res.ptr, sizeof(r), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_NEAR(r[0], err, 1e-9 * n + 1e-6 * err);
  EXPECT_NEAR(r[1], norm, 1e-6 * norm);
  EXPECT_EQ(r[2], 1.0);
  // The fp32 copy of a bf16 output is exact.
  DeviceBuffer d_f;
  ASSERT_EQ(d_f.alloc(4 * n), cudaSuccess);
  ASSERT_EQ(kfuse::kernels::convert_to_f32(d_out.ptr, ValueType::kBF16, n, d_f.as<float>(), nullptr), cudaSuccess);
  std::vector<float> back(n);
  ASSERT_EQ(cudaMemcpy(back.data(), d_f.ptr, 4 * n, cudaMemcpyDeviceToHost), cudaSuccess);
  for (size_t i = 0; i < n; ++i)
    if (i != 5) ASSERT_EQ(back[i], float(kfuse::bits_to_float(out[i], kfuse::kernels::ConvDType::kBF16))) << i;
}

}  // namespace
