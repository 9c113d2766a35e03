// GPU tests of the dense formulation of small convolutions (src/kernels/conv/dense_conv.h: the filter unrolled into a
// [Ho*Wo*K][H*W*C] matrix, one cuBLAS GEMM over the flattened images) against the float64 references of
// conv_reference.h: the forward (unrolling per call, and from a filter unrolled ahead with extra rows after it, as the
// squeeze projection uses them), the unroll's run flag, and the weight gradient. Host-only checks of which problems
// run densely work without a device.
//
// Tolerances (normwise relative; u_T = 2^-11 fp16, 2^-8 bf16; products of two T values are exact in fp32):
//   forward: fp32 accumulation of at most H*W*C terms (~1e-6 relative to the sum of magnitudes), then one rounding
//            to T: 2 u_T.
//   weight gradient (fp32 out): fp32 sums of N * Ho * Wo exact products, then the fold of the unrolled gradient's
//            rows (at most Ho * Wo terms) into KRSC: 1e-5.
// A wrongly placed tap, pixel or channel moves an output by a term of order one.
#include "kernels/conv/dense_conv.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "conv_reference.h"
#include "gpu_test_support.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <random>
#include <string>
#include <vector>

namespace {

using kfuse::bits_to_float;
using kfuse::kernels::Conv2dProblem;
using kfuse::kernels::ConvDType;
using kfuse::testing::decode;
using kfuse::testing::DeviceBuffer;
using kfuse::testing::nan_bits;
using kfuse::testing::random_nonzero_bits;
using kfuse::testing::rel_err;
using kfuse::testing::seed_for;
using kfuse::testing::StreamGuard;
using kfuse::testing::to_device;
namespace k = kfuse::kernels;

constexpr ConvDType kF16 = ConvDType::kF16;
constexpr ConvDType kBF16 = ConvDType::kBF16;

struct DenseCase {
  const char* name;
  Conv2dProblem p;  // {n, h, w, c, k, r, s, pad_h, pad_w, stride_h, stride_w}
  int extra_rows;  // rows after the unrolled filter (the squeeze projection's), (Ho*Wo*K + extra) % 8 == 0
};

const DenseCase kCases[] = {
    // The default network's block 4 conv2 at 64 x 64 inputs (2 x 2 maps), with the projection's 32 rows.
    {"n3_2x2_c512_k512", Conv2dProblem{3, 2, 2, 512, 512, 3, 3, 1, 1, 1, 1}, 32},
    // At 96 x 64 inputs (3 x 2 maps).
    {"n2_3x2_c256_k256", Conv2dProblem{2, 3, 2, 256, 256, 3, 3, 1, 1, 1, 1}, 16},
    // Strided: a 3 x 3 map to 2 x 2.
    {"n2_3x3_c64_k128_s2", Conv2dProblem{2, 3, 3, 64, 128, 3, 3, 1, 1, 2, 2}, 8},
};

using DenseParam = kfuse::testing::DtypeCase<DenseCase>;

class DenseConvGpuTest : public ::testing::TestWithParam<DenseParam> {
 protected:
  void SetUp() override {
    if (const std::string why = kfuse::testing::device_skip_reason(8, 9, "the dense convolutions"); !why.empty())
      GTEST_SKIP() << why;
    const Conv2dProblem& p = GetParam().c.p;
    ASSERT_TRUE(k::dense_conv_can_implement(p, GetParam().dtype));
    rng_.seed(seed_for(GetParam().label()));
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_.stream, cudaStreamNonBlocking), cudaSuccess);
  }
  std::mt19937 rng_;
  StreamGuard stream_;
};

TEST_P(DenseConvGpuTest, ForwardMatchesFloat64Reference) {
  const Conv2dProblem& p = GetParam().c.p;
  const ConvDType dt = GetParam().dtype;
  const std::vector<uint16_t> x = random_nonzero_bits(kfuse::testing::act_elems(p), dt, rng_);
  const float range = 2.0f / std::sqrt(float(p.r * p.s * p.c));
  const std::vector<uint16_t> w = random_nonzero_bits(kfuse::testing::filter_elems(p), dt, rng_, -range, range);
  DeviceBuffer dx, dw, dy, ws;
  ASSERT_EQ(to_device(dx, x), cudaSuccess);
  ASSERT_EQ(to_device(dw, w), cudaSuccess);
  const size_t out = kfuse::testing::grad_elems(p);
  ASSERT_EQ(to_device(dy, std::vector<uint16_t>(out, nan_bits(dt))), cudaSuccess);
  ASSERT_EQ(ws.alloc(k::dense_conv_fprop_workspace_bytes(p, dt)), cudaSuccess);
  ASSERT_EQ(k::dense_conv_fprop(p, dt, dx.ptr, dw.ptr, dy.ptr, ws.ptr, ws.bytes, stream_.stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream_.stream), cudaSuccess);
  std::vector<uint16_t> y(out);
  ASSERT_EQ(cudaMemcpy(y.data(), dy.ptr, dy.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  size_t bad = 0;
  const double u_t = kfuse::testing::unit_roundoff(dt);
  EXPECT_LE(rel_err(decode(y, dt), kfuse::testing::reference_fprop_fixup(p, x, w, dt, 1, 0, 0, false), &bad),
            2 * u_t);
  EXPECT_EQ(bad, 0u) << "outputs left unwritten (NaN poison) or not finite";
}

TEST_P(DenseConvGpuTest, UnrolledFilterWithExtraRowsAndItsRunFlag) {
  const Conv2dProblem& p = GetParam().c.p;
  const ConvDType dt = GetParam().dtype;
  const int extra = GetParam().c.extra_rows;
  const int64_t kd = int64_t(p.h) * p.w * p.c, nd = int64_t(p.p()) * p.q() * p.k, rows = nd + extra;
  const std::vector<uint16_t> x = random_nonzero_bits(kfuse::testing::act_elems(p), dt, rng_);
  const float range = 2.0f / std::sqrt(float(p.r * p.s * p.c));
  const std::vector<uint16_t> w = random_nonzero_bits(kfuse::testing::filter_elems(p), dt, rng_, -range, range);
  const std::vector<uint16_t> extra_rows = random_nonzero_bits(size_t(extra) * kd, dt, rng_, -range, range);
  DeviceBuffer dx, dw, dwd, dy, ws, flag;
  ASSERT_EQ(to_device(dx, x), cudaSuccess);
  ASSERT_EQ(to_device(dw, w), cudaSuccess);
  std::vector<uint16_t> wd_host(size_t(rows) * kd, nan_bits(dt));
  std::copy(extra_rows.begin(), extra_rows.end(), wd_host.begin() + nd * kd);
  ASSERT_EQ(to_device(dwd, wd_host), cudaSuccess);
  ASSERT_EQ(to_device(flag, std::vector<unsigned>{0u}), cudaSuccess);

  // Run flag 0: nothing written (the poison stays).
  ASSERT_EQ(k::dense_conv_unroll_filter(p, dt, dw.ptr, dwd.ptr, stream_.stream, flag.as<unsigned>()), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream_.stream), cudaSuccess);
  std::vector<uint16_t> back(wd_host.size());
  ASSERT_EQ(cudaMemcpy(back.data(), dwd.ptr, dwd.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, wd_host) << "the unroll wrote with its run flag at 0";

  // Run flag 1: the filter unrolled; the extra rows after it untouched.
  ASSERT_EQ(cudaMemcpy(flag.ptr, std::vector<unsigned>{1u}.data(), 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(k::dense_conv_unroll_filter(p, dt, dw.ptr, dwd.ptr, stream_.stream, flag.as<unsigned>()), cudaSuccess);
  const size_t out = size_t(p.n) * rows;
  ASSERT_EQ(to_device(dy, std::vector<uint16_t>(out, nan_bits(dt))), cudaSuccess);
  ASSERT_EQ(ws.alloc(k::dense_conv_fprop_unrolled_workspace_bytes(p, dt)), cudaSuccess);
  ASSERT_EQ(k::dense_conv_fprop_unrolled(p, dt, dx.ptr, dwd.ptr, dy.ptr, ws.ptr, ws.bytes, stream_.stream, extra),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream_.stream), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(back.data(), dwd.ptr, dwd.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_TRUE(std::equal(extra_rows.begin(), extra_rows.end(), back.begin() + nd * kd))
      << "the unroll wrote past its Ho*Wo*K rows";
  std::vector<uint16_t> y(out);
  ASSERT_EQ(cudaMemcpy(y.data(), dy.ptr, dy.bytes, cudaMemcpyDeviceToHost), cudaSuccess);

  // Each image's row: the convolution's NPQK outputs, then x . extra row e for each e.
  const std::vector<double> conv = kfuse::testing::reference_fprop_fixup(p, x, w, dt, 1, 0, 0, false);
  const std::vector<double> xd = decode(x, dt), ed = decode(extra_rows, dt);
  std::vector<double> got(out), want(out);
  for (int n = 0; n < p.n; ++n) {
    for (int64_t i = 0; i < rows; ++i) {
      got[size_t(n * rows + i)] = bits_to_float(y[size_t(n * rows + i)], dt);
      if (i < nd) {
        want[size_t(n * rows + i)] = conv[size_t(n * nd + i)];
      } else {
        double s = 0;
        for (int64_t j = 0; j < kd; ++j) s += xd[size_t(n * kd + j)] * ed[size_t((i - nd) * kd + j)];
        want[size_t(n * rows + i)] = s;
      }
    }
  }
  size_t bad = 0;
  const double u_t = kfuse::testing::unit_roundoff(dt);
  EXPECT_LE(rel_err(got, want, &bad), 2 * u_t);
  EXPECT_EQ(bad, 0u) << "outputs left unwritten (NaN poison) or not finite";
}

TEST_P(DenseConvGpuTest, WeightGradientMatchesFloat64Reference) {
  const Conv2dProblem& p = GetParam().c.p;
  const ConvDType dt = GetParam().dtype;
  const std::vector<uint16_t> x = random_nonzero_bits(kfuse::testing::act_elems(p), dt, rng_);
  const std::vector<uint16_t> dy = random_nonzero_bits(kfuse::testing::grad_elems(p), dt, rng_);
  DeviceBuffer dx, ddy, ddw, ws;
  ASSERT_EQ(to_device(dx, x), cudaSuccess);
  ASSERT_EQ(to_device(ddy, dy), cudaSuccess);
  ASSERT_EQ(to_device(ddw, std::vector<float>(kfuse::testing::filter_elems(p), std::nanf(""))), cudaSuccess);
  ASSERT_EQ(ws.alloc(k::dense_conv_wgrad_workspace_bytes(p, dt)), cudaSuccess);
  ASSERT_EQ(k::dense_conv_wgrad(p, dt, ddy.ptr, dx.ptr, ddw.as<float>(), ws.ptr, ws.bytes, stream_.stream),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream_.stream), cudaSuccess);
  std::vector<float> g(kfuse::testing::filter_elems(p));
  ASSERT_EQ(cudaMemcpy(g.data(), ddw.ptr, ddw.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  size_t bad = 0;
  EXPECT_LE(rel_err(std::vector<double>(g.begin(), g.end()), kfuse::testing::reference_wgrad(p, dy, x, dt), &bad),
            1e-5);
  EXPECT_EQ(bad, 0u) << "gradient elements left unwritten (NaN poison) or not finite";
}

INSTANTIATE_TEST_SUITE_P(Kernels, DenseConvGpuTest, ::testing::ValuesIn(kfuse::testing::with_both_dtypes(kCases)),
                         kfuse::testing::DtypeCaseName());

// Which problems run densely (host only): maps no larger than the filter, C and K multiples of 8.
TEST(DenseConv, CanImplementOnlyMapsNoLargerThanTheFilter) {
  EXPECT_TRUE(k::dense_conv_can_implement(Conv2dProblem{1, 2, 2, 512, 512, 3, 3, 1, 1, 1, 1}, kF16));
  EXPECT_TRUE(k::dense_conv_can_implement(Conv2dProblem{1, 3, 3, 64, 64, 3, 3, 1, 1, 2, 2}, kBF16));
  EXPECT_FALSE(k::dense_conv_can_implement(Conv2dProblem{1, 4, 4, 256, 512, 3, 3, 1, 1, 2, 2}, kF16)) << "16 > 9";
  EXPECT_FALSE(k::dense_conv_can_implement(Conv2dProblem{1, 2, 2, 12, 64, 3, 3, 1, 1, 1, 1}, kF16)) << "C % 8";
  EXPECT_FALSE(k::dense_conv_can_implement(Conv2dProblem{1, 2, 2, 64, 60, 3, 3, 1, 1, 1, 1}, kF16)) << "K % 8";
}

}  // namespace
