// GPU tests of the training step's cuDNN graphs (src/kernels/conv/cudnn_fused.h) against float64 CPU computations
// on the same rounded inputs:
//   cudnn_fused_conv_relu:  h = relu(conv(x, w) + b1b), h2 = h + b2a;
//   cudnn_fused_dgrad_mask: d_pre = h > 0 ? scale * conv^T(dy, w) : 0 into rows of `pitch`, per-channel sums of
//                           scale * conv^T(dy, w) and of d_pre.
// The FixUp scalars sit 4 bytes apart in one device array, as in kfuse's packed weights (the graphs declare them with
// alignment 4). Outputs are poisoned with NaN first; the columns of a pitched output beyond C must keep their poison.
// Skips without a device of compute capability 8.x / 9.x, or where kfuse was built without cuDNN's graph API or
// cuDNN cannot be loaded; any other refusal to prepare an op fails.
#include "kernels/conv/cudnn_fused.h"
#include "kernels/conv/cudnn_conv.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "conv_reference.h"
#include "gpu_test_support.h"

namespace {

using kfuse::bits_to_float;
using kfuse::float_to_bits;
using kfuse::kernels::Conv2dProblem;
using kfuse::kernels::ConvDType;
using kfuse::kernels::CudnnFusedOp;
using kfuse::testing::act_elems;
using kfuse::testing::conv3x3;
using kfuse::testing::DeviceBuffer;
using kfuse::testing::dtype_name;
using kfuse::testing::filter_elems;
using kfuse::testing::grad_elems;
using kfuse::testing::rel_err;
using kfuse::testing::seed_for;
using kfuse::testing::StreamGuard;

// Normwise tolerance of one rounding to the output type (fp16: 2^-11, bf16: 2^-8 relative per element), with margin
// for fp32 accumulation in a different order.
double tolerance(ConvDType dt) { return dt == ConvDType::kF16 ? 2e-3 : 1e-2; }

std::vector<uint16_t> random_bits(size_t n, float lo, float hi, ConvDType dt, std::mt19937& rng,
                                  float zero_fraction = 0.f) {
  std::uniform_real_distribution<float> dist(lo, hi), unit(0.f, 1.f);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = float_to_bits(unit(rng) < zero_fraction ? 0.f : dist(rng), dt);
  return v;
}

template <class V>
void upload(DeviceBuffer& buf, const std::vector<V>& v) {
  ASSERT_EQ(buf.alloc(v.size() * sizeof(V)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(buf.ptr, v.data(), buf.bytes, cudaMemcpyHostToDevice), cudaSuccess);
}

void poison(DeviceBuffer& buf, size_t bytes) {
  ASSERT_EQ(buf.alloc(bytes), cudaSuccess);
  ASSERT_EQ(cudaMemset(buf.ptr, 0xff, bytes), cudaSuccess);  // NaN in fp16, bf16 and fp32
}

std::vector<double> download_t(const DeviceBuffer& buf, ConvDType dt) {
  std::vector<uint16_t> bits(buf.bytes / 2);
  EXPECT_EQ(cudaMemcpy(bits.data(), buf.ptr, buf.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  std::vector<double> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = bits_to_float(bits[i], dt);
  return out;
}

// False with `skip` set where the op cannot exist in this build or process (no graph API headers at build time, no
// loadable cuDNN); false with a test failure where cuDNN is there and refuses the op.
bool prepare_or_skip(CudnnFusedOp op, const Conv2dProblem& p, ConvDType dt, int pitch, std::string* skip) {
  std::string why;
  if (!kfuse::kernels::cudnn_available(&why)) {
    *skip = "cuDNN unavailable: " + why;
    return false;
  }
  if (kfuse::kernels::cudnn_fused_prepare(op, p, dt, pitch, &why)) return true;
  if (why.find("built without") != std::string::npos) {
    *skip = why;
    return false;
  }
  ADD_FAILURE() << "cudnn_fused_prepare refused: " << why;
  return false;
}

struct Case {
  ConvDType dt;
  int stride;
};

class CudnnConvRelu : public ::testing::TestWithParam<Case> {};

TEST_P(CudnnConvRelu, MatchesFloat64) {
  if (const std::string why = kfuse::testing::device_skip_reason(8, 9, "cuDNN's graphs"); !why.empty())
    GTEST_SKIP() << why;
  const Case c = GetParam();
  const Conv2dProblem p = conv3x3(3, 8, 16, 24, c.stride);
  std::string skip;
  if (!prepare_or_skip(CudnnFusedOp::kConvRelu, p, c.dt, 0, &skip)) {
    if (!skip.empty()) GTEST_SKIP() << skip;
    return;
  }
  std::mt19937 rng(seed_for(::testing::UnitTest::GetInstance()->current_test_info()->name()));
  const auto x = random_bits(act_elems(p), -1.f, 1.f, c.dt, rng);
  const auto w = random_bits(filter_elems(p), -0.2f, 0.2f, c.dt, rng);
  const std::vector<float> scalars{0.3f, 0.17f, -0.41f, 0.9f, 0.05f};  // b1a, b1b, b2a, scale, b2b
  DeviceBuffer dx, dw, ds, dh, dh2;
  upload(dx, x);
  upload(dw, w);
  upload(ds, scalars);
  poison(dh, grad_elems(p) * 2);
  poison(dh2, grad_elems(p) * 2);
  StreamGuard s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking), cudaSuccess);
  const float* sc = ds.as<float>();
  ASSERT_EQ(kfuse::kernels::cudnn_fused_conv_relu(p, c.dt, dx.ptr, dw.ptr, sc + 1, sc + 2, dh.ptr, dh2.ptr, s.stream),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s.stream), cudaSuccess);
  const auto h_ref = kfuse::testing::reference_fprop_fixup(p, x, w, c.dt, 1.0, 0.17, 0.0, true);
  std::vector<double> h2_ref(h_ref.size());
  for (size_t i = 0; i < h_ref.size(); ++i) h2_ref[i] = h_ref[i] - 0.41;
  size_t bad = 0;
  const auto h = download_t(dh, c.dt), h2 = download_t(dh2, c.dt);
  EXPECT_LE(rel_err(h, h_ref, &bad), tolerance(c.dt));
  EXPECT_EQ(bad, 0u) << "h has unwritten or non-finite elements";
  EXPECT_LE(rel_err(h2, h2_ref, &bad), tolerance(c.dt));
  EXPECT_EQ(bad, 0u) << "h2 has unwritten or non-finite elements";
  // The ReLU itself: an output is 0 exactly where the reference's pre-activation is clearly negative.
  size_t wrong = 0;
  for (size_t i = 0; i < h.size(); ++i)
    if (h_ref[i] == 0.0 && h[i] != 0.0 && std::fabs(h[i]) > 1e-2) ++wrong;
  EXPECT_EQ(wrong, 0u);
}

INSTANTIATE_TEST_SUITE_P(All, CudnnConvRelu,
                         ::testing::Values(Case{ConvDType::kF16, 1}, Case{ConvDType::kF16, 2},
                                           Case{ConvDType::kBF16, 1}, Case{ConvDType::kBF16, 2}),
                         [](const auto& info) {
                           return std::string(dtype_name(info.param.dt)) + "_stride" +
                                  std::to_string(info.param.stride);
                         });

class CudnnDgradMask : public ::testing::TestWithParam<std::tuple<ConvDType, bool>> {};

TEST_P(CudnnDgradMask, MatchesFloat64) {
  if (const std::string why = kfuse::testing::device_skip_reason(8, 9, "cuDNN's graphs"); !why.empty())
    GTEST_SKIP() << why;
  const auto [dt, pitched] = GetParam();
  const Conv2dProblem p = conv3x3(3, 8, 16, 16, 1);
  const int pitch = pitched ? 2 * p.c : p.c;  // the [d_pre | dz] layout of the downsampling blocks
  std::string skip;
  if (!prepare_or_skip(CudnnFusedOp::kDgradMask, p, dt, pitch, &skip)) {
    if (!skip.empty()) GTEST_SKIP() << skip;
    return;
  }
  std::mt19937 rng(seed_for(::testing::UnitTest::GetInstance()->current_test_info()->name()));
  const auto dy = random_bits(grad_elems(p), -1.f, 1.f, dt, rng);
  const auto w = random_bits(filter_elems(p), -0.2f, 0.2f, dt, rng);
  const auto h = random_bits(act_elems(p), 0.f, 1.f, dt, rng, 0.5f);  // ReLU outputs: half of them 0
  const std::vector<float> scalars{0.3f, 0.17f, -0.41f, 0.7f, 0.05f};
  DeviceBuffer ddy, dw, dh, ds, dpre, dsums;
  upload(ddy, dy);
  upload(dw, w);
  upload(dh, h);
  upload(ds, scalars);
  const size_t pixels = size_t(p.n) * p.h * p.w;
  poison(dpre, pixels * pitch * 2);
  poison(dsums, 2 * p.c * sizeof(float));
  StreamGuard s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(kfuse::kernels::cudnn_fused_dgrad_mask(p, dt, ddy.ptr, dw.ptr, ds.as<float>() + 3, dh.ptr, dpre.ptr,
                                                   pitch, dsums.as<float>(), s.stream),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s.stream), cudaSuccess);

  std::vector<char> covered;
  const auto dx = kfuse::testing::reference_dgrad(p, dy, w, dt, &covered);
  std::vector<double> pre_ref(dx.size()), sum_dh(p.c, 0.0), sum_pre(p.c, 0.0);
  for (size_t i = 0; i < dx.size(); ++i) {
    const double dh_i = 0.7 * dx[i];
    pre_ref[i] = bits_to_float(h[i], dt) > 0.f ? dh_i : 0.0;
    sum_dh[i % p.c] += dh_i;
    sum_pre[i % p.c] += pre_ref[i];
  }
  const auto out = download_t(dpre, dt);
  std::vector<double> pre(dx.size());
  size_t kept_poison = 0, masked_nonzero = 0;
  for (size_t px = 0; px < pixels; ++px) {
    for (int ch = 0; ch < p.c; ++ch) pre[px * p.c + ch] = out[px * pitch + ch];
    for (int ch = p.c; ch < pitch; ++ch) kept_poison += std::isnan(out[px * pitch + ch]) ? 1 : 0;
  }
  for (size_t i = 0; i < pre.size(); ++i)
    if (pre_ref[i] == 0.0 && pre[i] != 0.0) ++masked_nonzero;
  size_t bad = 0;
  EXPECT_LE(rel_err(pre, pre_ref, &bad), tolerance(dt));
  EXPECT_EQ(bad, 0u) << "d_pre has unwritten or non-finite elements";
  EXPECT_EQ(masked_nonzero, 0u) << "d_pre is not exactly 0 where h is 0";
  EXPECT_EQ(kept_poison, pixels * size_t(pitch - p.c)) << "the graph wrote beyond C in a pitched row";
  std::vector<float> sums(2 * p.c);
  ASSERT_EQ(cudaMemcpy(sums.data(), dsums.ptr, sums.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  // The sums add fp32 values that differ from the reference by one rounding of dx: normwise over the channels.
  const std::vector<double> got_dh(sums.begin(), sums.begin() + p.c), got_pre(sums.begin() + p.c, sums.end());
  EXPECT_LE(rel_err(got_dh, sum_dh, &bad), tolerance(dt));
  EXPECT_EQ(bad, 0u);
  EXPECT_LE(rel_err(got_pre, sum_pre, &bad), tolerance(dt));
  EXPECT_EQ(bad, 0u);
}

INSTANTIATE_TEST_SUITE_P(All, CudnnDgradMask,
                         ::testing::Combine(::testing::Values(ConvDType::kF16, ConvDType::kBF16),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(dtype_name(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) ? "_pitch2c" : "_packed");
                         });

}  // namespace
