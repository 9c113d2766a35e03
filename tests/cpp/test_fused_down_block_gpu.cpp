// GPU tests of the fused downsampling blocks (launch_fused_down_block_wgmma, sm_90a: block 2, 64 -> 128 channels at
// 16 x 16, one CTA per image; block 3, 128 -> 256 at 8 x 8, groups of 4 CTAs per 4 images exchanging h2 and the
// squeeze's partial sums) against a float64 CPU computation of the documented math (encoder_kernels.h):
//   idt = conv1x1(avgpool3x3/2(a)) (zero padding counted, as nn.AvgPool2d's default);
//   h = relu(conv3x3/2(a) + b1b);  h2 = h + b2a;  o = conv3x3(h2) * scale + b2b;
//   g = sigmoid(fc2(relu(fc1(mean_hw(o)))));  y = relu(o * g + idt);  a_next = y + next_b1a.
// The filters come as the kernels' filter stream (tap planes per output-channel slice), packed here from PyTorch's
// layouts. Block 3's exchange buffer h2 holds exactly n images: a guard after it must stay untouched (a partial last
// group of images among the cases). Outputs are poisoned (NaN) before each launch; a second launch (which reuses the
// synchronization counters the first left) must give the same bits.
//
// Tolerance (normwise relative, float64 reference without intermediate roundings; u_T = 2^-11 fp16, 2^-8 bf16): as
// for the identity block (test_fused_block_gpu.cpp: five roundings to T in a row, fp32 sums, faithful bumps) plus the
// shortcut's own rounding: 8 u_T. Exact: y > 0 exactly where a_next > T(next_b1a), a_next == T(next_b1a) where y == 0.
#include "kernels/encoder/encoder_kernels.h"

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
using kfuse::float_to_bits;
using kfuse::testing::decode;
using kfuse::testing::DeviceBuffer;
using kfuse::testing::nan_bits;
using kfuse::testing::random_nonzero_bits;
using kfuse::testing::rel_err;
using kfuse::testing::seed_for;
using kfuse::testing::StreamGuard;
using kfuse::testing::to_device;

using kfuse::kernels::ConvDType;
using kfuse::kernels::FusedDownBlockArgs;

constexpr ConvDType kF16 = ConvDType::kF16;
constexpr ConvDType kBF16 = ConvDType::kBF16;
constexpr uint16_t kGuardBits = 0x1234;
constexpr int kGuard = 256;  // T elements after h2

struct DownCase {
  const char* name;
  int cin, p, hidden, n, h, w;
};

const DownCase kCases[] = {
    {"block2_n3", 64, 128, 8, 3, 16, 16},
    {"block2_n150", 64, 128, 8, 150, 16, 16},
    {"block3_n4", 128, 256, 16, 4, 8, 8},
    {"block3_n5_partial_group", 128, 256, 16, 5, 8, 8},
    {"block3_n12", 128, 256, 16, 12, 8, 8},
};

using DownParam = kfuse::testing::DtypeCase<DownCase>;

// NHWC x [n][h][w][cin], KCRS w [k][cin][r][s] (r = s = 3, or 1 for a 1x1 filter), stride `st`, zero padding of
// (r - 1) / 2: y NHWC [n][h / st][w / st][k].
std::vector<double> conv(const std::vector<double>& x, const std::vector<double>& w, int n, int h, int wd, int cin,
                         int k_out, int r, int st) {
  const int ho = h / st, wo = wd / st, pad = (r - 1) / 2;
  std::vector<double> y(size_t(n) * ho * wo * k_out, 0.0);
  for (int b = 0; b < n; ++b)
    for (int i = 0; i < ho; ++i)
      for (int j = 0; j < wo; ++j)
        for (int k = 0; k < k_out; ++k) {
          double acc = 0;
          for (int dr = 0; dr < r; ++dr)
            for (int ds = 0; ds < r; ++ds) {
              const int ii = i * st + dr - pad, jj = j * st + ds - pad;
              if (ii < 0 || ii >= h || jj < 0 || jj >= wd) continue;
              const double* in = &x[((size_t(b) * h + ii) * wd + jj) * cin];
              for (int c = 0; c < cin; ++c) acc += w[((size_t(k) * cin + c) * r + dr) * r + ds] * in[c];
            }
          y[((size_t(b) * ho + i) * wo + j) * k_out + k] = acc;
        }
  return y;
}

// avgpool 3x3, stride 2, padding 1, the padding counted (divide by 9): NHWC.
std::vector<double> avgpool3s2(const std::vector<double>& x, int n, int h, int wd, int c) {
  std::vector<double> ones(size_t(c) * c * 9, 0.0);  // a per-channel 3x3 filter of 1/9
  for (int k = 0; k < c; ++k)
    for (int t = 0; t < 9; ++t) ones[(size_t(k) * c + k) * 9 + t] = 1.0 / 9;
  return conv(x, ones, n, h, wd, c, c, 3, 2);
}

// KCRS filter [k][c][taps] -> tap planes [taps][c / 8][kr][8] of output channels k0 .. k0 + kr - 1, at out.
void put_tap_planes(const std::vector<uint16_t>& kcrs, int c, int taps, int k0, int kr, uint16_t* out) {
  for (int k = 0; k < kr; ++k)
    for (int ci = 0; ci < c; ++ci)
      for (int t = 0; t < taps; ++t)
        out[((size_t(t) * (c / 8) + ci / 8) * kr + k) * 8 + ci % 8] = kcrs[(size_t(k0 + k) * c + ci) * taps + t];
}

struct Problem {
  std::vector<uint16_t> a, filters;
  std::vector<float> scalars;  // b1a, b1b, b2a, scale, b2b, next_b1a
  std::vector<float> fc1_w, fc1_b, fc2_w, fc2_b;
  std::vector<double> y, a_next;
};

Problem make_problem(const DownCase& c, ConvDType dt, std::mt19937& rng) {
  Problem pr;
  pr.a = random_nonzero_bits(size_t(c.n) * c.h * c.w * c.cin, dt, rng);
  auto filter = [&](int k, int cin, int taps) {
    const float range = 2.0f / std::sqrt(float(cin * taps));
    return random_nonzero_bits(size_t(k) * cin * taps, dt, rng, -range, range);
  };
  const std::vector<uint16_t> wsc = filter(c.p, c.cin, 1), w1 = filter(c.p, c.cin, 9), w2 = filter(c.p, c.p, 9);
  const int ranks = kfuse::kernels::fused_down_block_filter_ranks(c.cin, c.p, c.hidden);
  const int kr = ranks > 0 ? c.p / ranks : c.p;
  const size_t sc = size_t(kr) * c.cin, c1 = 9 * sc, c2 = size_t(kr) * 9 * c.p, rank_elems = sc + c1 + c2;
  pr.filters.assign(std::max(ranks, 1) * rank_elems, 0);
  for (int r = 0; r < ranks; ++r) {
    uint16_t* at = &pr.filters[r * rank_elems];
    put_tap_planes(wsc, c.cin, 1, r * kr, kr, at);
    put_tap_planes(w1, c.cin, 9, r * kr, kr, at + sc);
    put_tap_planes(w2, c.p, 9, r * kr, kr, at + sc + c1);
  }
  std::uniform_real_distribution<float> bias(-0.3f, 0.3f), scale(0.5f, 1.5f), fc(-0.25f, 0.25f);
  pr.scalars = {bias(rng), bias(rng), bias(rng), scale(rng), bias(rng), bias(rng)};
  for (int i = 0; i < c.hidden * c.p; ++i) pr.fc1_w.push_back(fc(rng)), pr.fc2_w.push_back(4 * fc(rng));
  for (int i = 0; i < c.hidden; ++i) pr.fc1_b.push_back(fc(rng));
  for (int i = 0; i < c.p; ++i) pr.fc2_b.push_back(fc(rng));

  const std::vector<double> a = decode(pr.a, dt);
  const int ho = c.h / 2, wo = c.w / 2;
  const std::vector<double> idt = conv(avgpool3s2(a, c.n, c.h, c.w, c.cin), decode(wsc, dt), c.n, ho, wo, c.cin,
                                       c.p, 1, 1);
  std::vector<double> h2 = conv(a, decode(w1, dt), c.n, c.h, c.w, c.cin, c.p, 3, 2);
  for (double& v : h2) v = std::max(0.0, v + pr.scalars[1]) + pr.scalars[2];
  const std::vector<double> v = conv(h2, decode(w2, dt), c.n, ho, wo, c.p, c.p, 3, 1);
  pr.y.resize(v.size()), pr.a_next.resize(v.size());
  const size_t hw = size_t(ho) * wo;
  for (int b = 0; b < c.n; ++b) {
    const size_t base = size_t(b) * hw * c.p;
    std::vector<double> mean(c.p, 0.0), hid(c.hidden), g(c.p);
    for (size_t q = 0; q < hw; ++q)
      for (int k = 0; k < c.p; ++k) mean[k] += (v[base + q * c.p + k] * pr.scalars[3] + pr.scalars[4]) / double(hw);
    for (int j = 0; j < c.hidden; ++j) {
      double s = pr.fc1_b[j];
      for (int k = 0; k < c.p; ++k) s += double(pr.fc1_w[size_t(j) * c.p + k]) * mean[k];
      hid[j] = std::max(0.0, s);
    }
    for (int k = 0; k < c.p; ++k) {
      double s = pr.fc2_b[k];
      for (int j = 0; j < c.hidden; ++j) s += double(pr.fc2_w[size_t(k) * c.hidden + j]) * hid[j];
      g[k] = 1.0 / (1.0 + std::exp(-s));
    }
    for (size_t q = 0; q < hw; ++q)
      for (int k = 0; k < c.p; ++k) {
        const size_t e = base + q * c.p + k;
        pr.y[e] = std::max(0.0, (v[e] * pr.scalars[3] + pr.scalars[4]) * g[k] + idt[e]);
        pr.a_next[e] = pr.y[e] + pr.scalars[5];
      }
  }
  return pr;
}

class FusedDownBlockGpuTest : public ::testing::TestWithParam<DownParam> {};

TEST_P(FusedDownBlockGpuTest, MatchesFloat64ReferenceAndRepeatsBitExactly) {
  if (const std::string why = kfuse::testing::device_skip_reason(9, 9, "the fused downsampling blocks (sm_90a)");
      !why.empty())
    GTEST_SKIP() << why;
  const DownCase& c = GetParam().c;
  const ConvDType dt = GetParam().dtype;
  const std::string name = GetParam().label();
  const uint32_t seed = seed_for(name);
  SCOPED_TRACE(name + " seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  const Problem pr = make_problem(c, dt, rng);
  const size_t out_elems = pr.y.size();
  const int groups = kfuse::kernels::fused_down_block_groups(c.n);

  DeviceBuffer a, filters, scalars, fc1_w, fc1_b, fc2_w, fc2_b, y, a_next, h2, partials, sync;
  ASSERT_EQ(to_device(a, pr.a), cudaSuccess);
  ASSERT_EQ(to_device(filters, pr.filters), cudaSuccess);
  ASSERT_EQ(to_device(scalars, pr.scalars), cudaSuccess);
  ASSERT_EQ(to_device(fc1_w, pr.fc1_w), cudaSuccess);
  ASSERT_EQ(to_device(fc1_b, pr.fc1_b), cudaSuccess);
  ASSERT_EQ(to_device(fc2_w, pr.fc2_w), cudaSuccess);
  ASSERT_EQ(to_device(fc2_b, pr.fc2_b), cudaSuccess);
  ASSERT_EQ(y.alloc(out_elems * 2), cudaSuccess);
  ASSERT_EQ(a_next.alloc(out_elems * 2), cudaSuccess);
  ASSERT_EQ(to_device(h2, std::vector<uint16_t>(out_elems + kGuard, kGuardBits)), cudaSuccess);
  ASSERT_EQ(partials.alloc(size_t(groups) * 1024), cudaSuccess);
  ASSERT_EQ(to_device(sync, std::vector<unsigned>(1 + 2 * size_t(groups), 0u)), cudaSuccess);
  StreamGuard stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream.stream, cudaStreamNonBlocking), cudaSuccess);

  FusedDownBlockArgs args;
  args.a = a.ptr, args.filters = filters.ptr, args.scalars = scalars.as<float>();
  args.fc1_w = fc1_w.as<float>(), args.fc1_b = fc1_b.as<float>();
  args.fc2_w = fc2_w.as<float>(), args.fc2_b = fc2_b.as<float>();
  args.in_planes = c.cin, args.planes = c.p, args.hidden = c.hidden, args.n = c.n, args.h = c.h, args.w = c.w;
  args.y = y.ptr, args.next_b1a = scalars.as<float>() + 5, args.a_next = a_next.ptr;
  args.h2 = h2.ptr, args.partials = partials.as<float>(), args.sync = sync.as<unsigned>();

  auto run = [&](std::vector<uint16_t>* yo, std::vector<uint16_t>* ao) {
    const std::vector<uint16_t> nan(out_elems, nan_bits(dt));
    ASSERT_EQ(cudaMemcpy(y.ptr, nan.data(), y.bytes, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(a_next.ptr, nan.data(), a_next.bytes, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(kfuse::kernels::launch_fused_down_block_wgmma(args, dt, stream.stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream.stream), cudaSuccess);
    yo->resize(out_elems), ao->resize(out_elems);
    ASSERT_EQ(cudaMemcpy(yo->data(), y.ptr, y.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(ao->data(), a_next.ptr, a_next.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  };
  std::vector<uint16_t> y1, a1, y2, a2;
  ASSERT_NO_FATAL_FAILURE(run(&y1, &a1));

  const double u_t = kfuse::testing::unit_roundoff(dt);
  size_t bad = 0;
  const std::vector<double> yv = decode(y1, dt), av = decode(a1, dt);
  EXPECT_LE(rel_err(yv, pr.y, &bad), 8 * u_t) << "y";
  EXPECT_EQ(bad, 0u) << "y elements left unwritten (NaN poison) or not finite";
  EXPECT_LE(rel_err(av, pr.a_next, &bad), 8 * u_t) << "a_next";
  EXPECT_EQ(bad, 0u) << "a_next elements left unwritten (NaN poison) or not finite";
  const double nb1a = bits_to_float(float_to_bits(pr.scalars[5], dt), dt);
  EXPECT_EQ(kfuse::testing::after_relu_mask_mismatches(yv, av, nb1a), 0u)
      << "elements where a_next > T(next_b1a) does not say y > 0";
  std::vector<uint16_t> guard(kGuard);
  ASSERT_EQ(cudaMemcpy(guard.data(), h2.as<uint16_t>() + out_elems, kGuard * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_TRUE(std::all_of(guard.begin(), guard.end(), [](uint16_t b) { return b == kGuardBits; }))
      << "written past the n images of the h2 exchange buffer";

  ASSERT_NO_FATAL_FAILURE(run(&y2, &a2));
  EXPECT_EQ(y1, y2) << "y differs between two launches";
  EXPECT_EQ(a1, a2) << "a_next differs between two launches";
}

INSTANTIATE_TEST_SUITE_P(Kernels, FusedDownBlockGpuTest, ::testing::ValuesIn(kfuse::testing::with_both_dtypes(kCases)),
                         kfuse::testing::DtypeCaseName());

// The kernels' shapes, as the host sees them (no device needed).
TEST(FusedDownBlockShapes, OnlyTheTwoBlockShapesOnCompute90) {
  EXPECT_EQ(kfuse::kernels::fused_down_block_filter_ranks(64, 128, 8), 1);
  EXPECT_EQ(kfuse::kernels::fused_down_block_filter_ranks(128, 256, 16), 4);
  EXPECT_EQ(kfuse::kernels::fused_down_block_filter_ranks(256, 512, 32), 0);
  EXPECT_GT(kfuse::kernels::fused_down_block_smem_bytes(64, 128, 8, 16, 16, 9, 0), 0u);
  EXPECT_GT(kfuse::kernels::fused_down_block_smem_bytes(128, 256, 16, 8, 8, 9, 0), 0u);
  EXPECT_EQ(kfuse::kernels::fused_down_block_smem_bytes(64, 128, 8, 32, 32, 9, 0), 0u) << "another input size";
  EXPECT_EQ(kfuse::kernels::fused_down_block_smem_bytes(64, 128, 8, 16, 16, 8, 0), 0u) << "compute capability 8.0";
  EXPECT_EQ(kfuse::kernels::fused_down_block_groups(5), 2);
}

}  // namespace
