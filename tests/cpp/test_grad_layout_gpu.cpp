// GPU tests of the training backward's gradient layout kernels (src/kernels/encoder/weight_layout.h, grad_layout.cu)
// against float64: launch_grad_finalize (one launch over a job table mixing every kind: KRSC sums in fp32 or T into
// PyTorch's KCRS with and without a multiplier and with the dot product of a scalar's gradient, 3x3 and 1x1; the
// pooled shortcut's 9 taps summed / 9) and launch_add_and_sum (out = a + b, in place or not, and the sum of a).
// Outputs are poisoned (NaN) before each launch; every destination has a guard after it that must stay untouched.
//
// Tolerances: layout moves of fp32 values and of T values widened to fp32 are exact; one fp32 multiply by alpha: 1 ulp
// (2^-24 relative); the pooled sum of 9 fp32 values / 9: 10 ulp of the sum of magnitudes; the dot product's fixed-order
// fp32 sum of K*R*S*C exact products: (terms) * 2^-24 of the sum of magnitudes; add: one rounding to T (u_T = 2^-11
// fp16, 2^-8 bf16) of an exact fp32 sum; sum of a: n * 2^-24 of the sum of magnitudes.
#include "kernels/encoder/weight_layout.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu_test_support.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <random>
#include <string>
#include <vector>

namespace {

using kfuse::bits_to_float;
using kfuse::float_to_bits;
using kfuse::kernels::ConvDType;
using kfuse::kernels::GradJob;
using kfuse::testing::DeviceBuffer;
using kfuse::testing::nan_bits;
using kfuse::testing::random_nonzero_bits;
using kfuse::testing::seed_for;
using kfuse::testing::StreamGuard;
using kfuse::testing::to_device;
namespace k = kfuse::kernels;

constexpr int kGuard = 16;  // floats after each destination
constexpr float kGuardValue = 12345.0f;

std::vector<float> random_floats(size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

class GradLayoutGpuTest : public ::testing::TestWithParam<ConvDType> {
 protected:
  void SetUp() override {
    if (const std::string why = kfuse::testing::device_skip_reason(8, 9, "the gradient layout kernels"); !why.empty())
      GTEST_SKIP() << why;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_.stream, cudaStreamNonBlocking), cudaSuccess);
  }
  StreamGuard stream_;
};

TEST_P(GradLayoutGpuTest, FinalizeEveryJobKindInOneLaunch) {
  const ConvDType dt = GetParam();
  std::mt19937 rng(seed_for(std::string("grad_finalize/") + (dt == ConvDType::kF16 ? "f16" : "bf16")));
  struct Spec {
    int kind, k, c, r, s;
    bool g_is_t, alpha, dot;
  };
  const Spec specs[] = {
      {0, 64, 32, 3, 3, false, false, false},  // fp32 KRSC sums -> KCRS
      {0, 48, 40, 3, 3, true, true, true},     // T sums, times alpha, and the scale's dot product
      {0, 32, 24, 1, 1, false, true, false},   // a 1x1 filter
      {1, 40, 16, 3, 3, false, false, false},  // the pooled shortcut: 9 taps / 9
  };
  const int count = int(std::size(specs));
  std::vector<DeviceBuffer> g(count), dst(count), dot_w(count), dst_dot(count);
  std::vector<std::vector<double>> want(count);
  std::vector<double> want_dot(count, 0.0), dot_mag(count, 0.0);
  std::vector<GradJob> jobs(count);
  DeviceBuffer alpha;
  const float alpha_value = 0.625f;
  ASSERT_EQ(to_device(alpha, std::vector<float>{alpha_value}), cudaSuccess);
  for (int j = 0; j < count; ++j) {
    const Spec& sp = specs[j];
    const size_t elems = size_t(sp.k) * sp.r * sp.s * sp.c, taps = size_t(sp.r) * sp.s;
    std::vector<double> gv(elems);
    if (sp.g_is_t) {
      const std::vector<uint16_t> bits = random_nonzero_bits(elems, dt, rng);
      for (size_t i = 0; i < elems; ++i) gv[i] = bits_to_float(bits[i], dt);
      ASSERT_EQ(to_device(g[j], bits), cudaSuccess);
    } else {
      const std::vector<float> f = random_floats(elems, rng);
      for (size_t i = 0; i < elems; ++i) gv[i] = f[i];
      ASSERT_EQ(to_device(g[j], f), cudaSuccess);
    }
    const size_t out = sp.kind == 1 ? size_t(sp.k) * sp.c : elems;
    std::vector<float> poison(out + kGuard, std::nanf(""));
    std::fill(poison.end() - kGuard, poison.end(), kGuardValue);
    ASSERT_EQ(to_device(dst[j], poison), cudaSuccess);
    want[j].assign(out, 0.0);
    for (int kk = 0; kk < sp.k; ++kk)
      for (int ci = 0; ci < sp.c; ++ci)
        for (size_t t = 0; t < taps; ++t) {
          const double v = gv[(size_t(kk) * taps + t) * sp.c + ci];  // KRSC
          if (sp.kind == 1)
            want[j][size_t(kk) * sp.c + ci] += v / 9;
          else
            want[j][(size_t(kk) * sp.c + ci) * taps + t] = sp.alpha ? double(float(v) * alpha_value) : v;
        }
    GradJob& job = jobs[j];
    job.g = g[j].ptr, job.g_is_t = sp.g_is_t, job.dst = dst[j].as<float>();
    job.alpha = sp.alpha ? alpha.as<float>() : nullptr;
    job.kind = sp.kind, job.k = sp.k, job.c = sp.c, job.r = sp.r, job.s = sp.s;
    if (sp.dot) {
      const std::vector<uint16_t> w = random_nonzero_bits(elems, dt, rng);
      for (size_t i = 0; i < elems; ++i) {
        const double term = bits_to_float(w[i], dt) * gv[i];
        want_dot[j] += term, dot_mag[j] += std::fabs(term);
      }
      ASSERT_EQ(to_device(dot_w[j], w), cudaSuccess);
      ASSERT_EQ(to_device(dst_dot[j], std::vector<float>{std::nanf("")}), cudaSuccess);
      job.dot_w = dot_w[j].ptr, job.dst_dot = dst_dot[j].as<float>();
    }
  }
  DeviceBuffer djobs, ws;
  ASSERT_EQ(to_device(djobs, jobs), cudaSuccess);
  ASSERT_EQ(ws.alloc(k::grad_finalize_workspace_bytes(count)), cudaSuccess);
  ASSERT_EQ(k::launch_grad_finalize(djobs.as<GradJob>(), count, dt, ws.ptr, stream_.stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream_.stream), cudaSuccess);

  for (int j = 0; j < count; ++j) {
    SCOPED_TRACE("job " + std::to_string(j));
    const size_t out = want[j].size();
    std::vector<float> got(out + kGuard);
    ASSERT_EQ(cudaMemcpy(got.data(), dst[j].ptr, dst[j].bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    size_t wrong = 0;
    for (size_t i = 0; i < out; ++i) {
      // pooled: 9 values of magnitude <= 1 summed in fp32, then / 9: within 10 ulp of 1 (absolute); else exact
      const double tol = specs[j].kind == 1 ? 10 * std::ldexp(1.0, -24) : 0.0;
      if (!(std::fabs(got[i] - want[j][i]) <= tol)) ++wrong;
    }
    EXPECT_EQ(wrong, 0u) << "elements off (or left NaN) of " << out;
    EXPECT_TRUE(std::all_of(got.begin() + out, got.end(), [](float v) { return v == kGuardValue; }))
        << "written past the destination";
    if (specs[j].dot) {
      float d = 0;
      ASSERT_EQ(cudaMemcpy(&d, dst_dot[j].ptr, 4, cudaMemcpyDeviceToHost), cudaSuccess);
      const double n_terms = double(want[j].size());
      EXPECT_LE(std::fabs(d - want_dot[j]), n_terms * std::ldexp(1.0, -24) * dot_mag[j]) << "dot product";
    }
  }
}

TEST_P(GradLayoutGpuTest, AddAndSumInPlaceAndNot) {
  const ConvDType dt = GetParam();
  std::mt19937 rng(seed_for(std::string("add_and_sum/") + (dt == ConvDType::kF16 ? "f16" : "bf16")));
  const int64_t n = 8 * 12345;
  const std::vector<uint16_t> a = random_nonzero_bits(size_t(n), dt, rng), b = random_nonzero_bits(size_t(n), dt, rng);
  double sum = 0, mag = 0;
  for (uint16_t v : a) sum += bits_to_float(v, dt), mag += std::fabs(bits_to_float(v, dt));
  const double u_t = dt == ConvDType::kF16 ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
  for (bool in_place : {false, true}) {
    SCOPED_TRACE(in_place ? "in place (out is a)" : "out of place");
    DeviceBuffer da, db, dout, dsum, ws;
    ASSERT_EQ(to_device(da, a), cudaSuccess);
    ASSERT_EQ(to_device(db, b), cudaSuccess);
    std::vector<uint16_t> poison(size_t(n) + 8 * kGuard, nan_bits(dt));
    std::fill(poison.begin() + n, poison.end(), uint16_t(0x1234));
    ASSERT_EQ(to_device(dout, poison), cudaSuccess);
    ASSERT_EQ(to_device(dsum, std::vector<float>{std::nanf("")}), cudaSuccess);
    ASSERT_EQ(ws.alloc(k::add_and_sum_workspace_bytes(n)), cudaSuccess);
    void* out = in_place ? da.ptr : dout.ptr;
    ASSERT_EQ(k::launch_add_and_sum(da.ptr, db.ptr, out, n, dsum.as<float>(), dt, ws.ptr, stream_.stream),
              cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream_.stream), cudaSuccess);
    std::vector<uint16_t> got(static_cast<size_t>(n));
    ASSERT_EQ(cudaMemcpy(got.data(), out, size_t(n) * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    size_t wrong = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double want = double(bits_to_float(a[i], dt)) + bits_to_float(b[i], dt);
      const double v = bits_to_float(got[i], dt);
      if (!(std::fabs(v - want) <= u_t * std::fabs(want) + 1e-7)) ++wrong;
    }
    EXPECT_EQ(wrong, 0u) << "sums off by more than one rounding (or left NaN)";
    if (!in_place) {
      std::vector<uint16_t> guard(8 * kGuard);
      ASSERT_EQ(cudaMemcpy(guard.data(), dout.as<uint16_t>() + n, guard.size() * 2, cudaMemcpyDeviceToHost),
                cudaSuccess);
      EXPECT_TRUE(std::all_of(guard.begin(), guard.end(), [](uint16_t v) { return v == 0x1234; }))
          << "written past n";
    }
    float s = 0;
    ASSERT_EQ(cudaMemcpy(&s, dsum.ptr, 4, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_LE(std::fabs(s - sum), double(n) * std::ldexp(1.0, -24) * mag) << "sum of a";
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, GradLayoutGpuTest, ::testing::Values(ConvDType::kF16, ConvDType::kBF16),
                         [](const ::testing::TestParamInfo<ConvDType>& info) {
                           return std::string(info.param == ConvDType::kF16 ? "f16" : "bf16");
                         });

}  // namespace
