// GPU tests of the fused identity block (the encoder's block 1: 64 -> 64 channels, stride 1) as one kernel:
// launch_fused_block (mma.sync, sm_80+) and launch_fused_block_wgmma (Hopper warpgroup MMAs, sm_90a; inference and
// the training forward's stash), against a float64 CPU computation of the documented math (encoder_kernels.h):
//   h = relu(conv3x3(a) + b1b);  h2 = h + b2a;  o = conv3x3(h2) * scale + b2b;
//   g = sigmoid(fc2(relu(fc1(mean_hw(o)))));  y = relu(o * g + identity);  a_next = y + next_b1a.
// Outputs are poisoned (NaN) before each launch; a second launch must give the same bits.
//
// Tolerances (normwise relative, float64 reference without intermediate roundings; u_T = 2^-11 for fp16, 2^-8 for
// bf16): the kernels round to T at h, h2, conv2's output (and o where the stash is written) and y: five roundings in
// a row, each at most u_T relative, carried through convolutions whose filters keep magnitudes of order one, plus
// fp32 sums (576-term dot products, means, the gate: ~1e-6), plus the faithful bumps (h2 = next_up(T(b2a)) where
// 0 < h < ulp(b2a) / 2, an absolute change of one ulp of b2a on such elements): 8 u_T for y and a_next. The stash:
// h one rounding, h2 two, v = T(conv2(h2)) three: 4 u_T. A wrong tap, channel, pixel or image moves the outputs by
// terms of order one, far above.
// Exact: the masks the backward reads: h > 0 exactly where h2 > T(b2a), y > 0 exactly where a_next > T(next_b1a),
// and a_next == T(next_b1a) where y == 0.
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
using kfuse::kernels::FusedBlockArgs;

constexpr ConvDType kF16 = ConvDType::kF16;
constexpr ConvDType kBF16 = ConvDType::kBF16;
constexpr int kP = 64, kHidden = 4;

enum class Kernel { kMmaSync, kWgmma, kWgmmaTraining };

struct BlockCase {
  const char* name;
  Kernel kernel;
  int n, h, w;
};

const BlockCase kCases[] = {
    {"mma_sync_n3_16x16", Kernel::kMmaSync, 3, 16, 16},
    {"mma_sync_n2_8x8", Kernel::kMmaSync, 2, 8, 8},
    {"wgmma_n3_16x16", Kernel::kWgmma, 3, 16, 16},
    // More images than SMs on any H100 / H200: the persistent CTAs take several images each.
    {"wgmma_n150_16x16", Kernel::kWgmma, 150, 16, 16},
    {"wgmma_training_n2_16x16", Kernel::kWgmmaTraining, 2, 16, 16},
};

using BlockParam = kfuse::testing::DtypeCase<BlockCase>;

// y[n][i][j][k] = sum over (r, s, c) of w[k][r][s][c] x[n][i + r - 1][j + s - 1][c] (zero padding), NHWC, KRSC.
std::vector<double> conv3x3(const std::vector<double>& x, const std::vector<double>& w, int n, int h, int wd) {
  std::vector<double> y(size_t(n) * h * wd * kP, 0.0);
  for (int b = 0; b < n; ++b)
    for (int i = 0; i < h; ++i)
      for (int j = 0; j < wd; ++j) {
        double* out = &y[((size_t(b) * h + i) * wd + j) * kP];
        for (int r = 0; r < 3; ++r)
          for (int s = 0; s < 3; ++s) {
            const int ii = i + r - 1, jj = j + s - 1;
            if (ii < 0 || ii >= h || jj < 0 || jj >= wd) continue;
            const double* in = &x[((size_t(b) * h + ii) * wd + jj) * kP];
            for (int k = 0; k < kP; ++k) {
              const double* f = &w[((size_t(k) * 3 + r) * 3 + s) * kP];
              double acc = 0;
              for (int c = 0; c < kP; ++c) acc += f[c] * in[c];
              out[k] += acc;
            }
          }
      }
  return y;
}

struct Problem {
  std::vector<uint16_t> a, identity, w1_krsc, w2_krsc, w1_planes, w2_planes;
  std::vector<float> scalars;  // b1a, b1b, b2a, scale, b2b, next_b1a
  std::vector<float> fc1_w, fc1_b, fc2_w, fc2_b;
  std::vector<double> h, h2, v, y, a_next;  // float64 reference
};

// KRSC [64][3][3][64] -> tap planes [r][s][c / 8][k][c % 8] (weight_layout.h kTapPlanes).
std::vector<uint16_t> tap_planes(const std::vector<uint16_t>& krsc) {
  std::vector<uint16_t> out(krsc.size());
  for (int k = 0; k < kP; ++k)
    for (int t = 0; t < 9; ++t)
      for (int c = 0; c < kP; ++c)
        out[((size_t(t) * (kP / 8) + c / 8) * kP + k) * 8 + c % 8] = krsc[(size_t(k) * 9 + t) * kP + c];
  return out;
}

Problem make_problem(const BlockCase& c, ConvDType dt, std::mt19937& rng) {
  Problem pr;
  const size_t elems = size_t(c.n) * c.h * c.w * kP, hw = size_t(c.h) * c.w;
  pr.a = random_nonzero_bits(elems, dt, rng);
  pr.identity = random_nonzero_bits(elems, dt, rng);
  const float range = 2.0f / std::sqrt(576.0f);  // outputs of order one
  pr.w1_krsc = random_nonzero_bits(size_t(kP) * 9 * kP, dt, rng, -range, range);
  pr.w2_krsc = random_nonzero_bits(size_t(kP) * 9 * kP, dt, rng, -range, range);
  pr.w1_planes = tap_planes(pr.w1_krsc);
  pr.w2_planes = tap_planes(pr.w2_krsc);
  std::uniform_real_distribution<float> bias(-0.3f, 0.3f), scale(0.5f, 1.5f), fc(-0.25f, 0.25f);
  pr.scalars = {bias(rng), bias(rng), bias(rng), scale(rng), bias(rng), bias(rng)};
  for (int i = 0; i < kHidden * kP; ++i) pr.fc1_w.push_back(fc(rng)), pr.fc2_w.push_back(4 * fc(rng));
  for (int i = 0; i < kHidden; ++i) pr.fc1_b.push_back(fc(rng));
  for (int i = 0; i < kP; ++i) pr.fc2_b.push_back(fc(rng));
  const float b1b = pr.scalars[1], b2a = pr.scalars[2], sc = pr.scalars[3], b2b = pr.scalars[4];

  const std::vector<double> c1 = conv3x3(decode(pr.a, dt), decode(pr.w1_krsc, dt), c.n, c.h, c.w);
  pr.h.resize(elems), pr.h2.resize(elems);
  for (size_t i = 0; i < elems; ++i) pr.h[i] = std::max(0.0, c1[i] + b1b), pr.h2[i] = pr.h[i] + b2a;
  pr.v = conv3x3(pr.h2, decode(pr.w2_krsc, dt), c.n, c.h, c.w);
  pr.y.resize(elems), pr.a_next.resize(elems);
  const std::vector<double> idt = decode(pr.identity, dt);
  for (int b = 0; b < c.n; ++b) {
    const size_t base = size_t(b) * hw * kP;
    std::vector<double> mean(kP, 0.0), hid(kHidden), g(kP);
    for (size_t q = 0; q < hw; ++q)
      for (int k = 0; k < kP; ++k) mean[k] += (pr.v[base + q * kP + k] * sc + b2b) / double(hw);
    for (int j = 0; j < kHidden; ++j) {
      double s = pr.fc1_b[j];
      for (int k = 0; k < kP; ++k) s += double(pr.fc1_w[size_t(j) * kP + k]) * mean[k];
      hid[j] = std::max(0.0, s);
    }
    for (int k = 0; k < kP; ++k) {
      double s = pr.fc2_b[k];
      for (int j = 0; j < kHidden; ++j) s += double(pr.fc2_w[size_t(k) * kHidden + j]) * hid[j];
      g[k] = 1.0 / (1.0 + std::exp(-s));
    }
    for (size_t q = 0; q < hw; ++q)
      for (int k = 0; k < kP; ++k) {
        const size_t e = base + q * kP + k;
        pr.y[e] = std::max(0.0, (pr.v[e] * sc + b2b) * g[k] + idt[e]);
        pr.a_next[e] = pr.y[e] + pr.scalars[5];
      }
  }
  return pr;
}

struct Outputs {
  std::vector<uint16_t> y, a_next, h, h2, v;
};

class FusedBlockGpuTest : public ::testing::TestWithParam<BlockParam> {};

TEST_P(FusedBlockGpuTest, MatchesFloat64ReferenceAndRepeatsBitExactly) {
  const BlockCase& c = GetParam().c;
  const ConvDType dt = GetParam().dtype;
  const bool wgmma = c.kernel != Kernel::kMmaSync, training = c.kernel == Kernel::kWgmmaTraining;
  if (const std::string why = wgmma ? kfuse::testing::device_skip_reason(9, 9, "the wgmma fused block (sm_90a)")
                                    : kfuse::testing::device_skip_reason(8, 9, "the fused block");
      !why.empty())
    GTEST_SKIP() << why;
  const std::string name = GetParam().label();
  const uint32_t seed = seed_for(name);
  SCOPED_TRACE(name + " seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  const Problem pr = make_problem(c, dt, rng);
  const size_t elems = pr.y.size();

  DeviceBuffer a, identity, w1, w2, scalars, fc1_w, fc1_b, fc2_w, fc2_b, y, a_next, h, h2, v;
  ASSERT_EQ(to_device(a, pr.a), cudaSuccess);
  ASSERT_EQ(to_device(identity, pr.identity), cudaSuccess);
  ASSERT_EQ(to_device(w1, wgmma ? pr.w1_planes : pr.w1_krsc), cudaSuccess);
  ASSERT_EQ(to_device(w2, wgmma ? pr.w2_planes : pr.w2_krsc), cudaSuccess);
  ASSERT_EQ(to_device(scalars, pr.scalars), cudaSuccess);
  ASSERT_EQ(to_device(fc1_w, pr.fc1_w), cudaSuccess);
  ASSERT_EQ(to_device(fc1_b, pr.fc1_b), cudaSuccess);
  ASSERT_EQ(to_device(fc2_w, pr.fc2_w), cudaSuccess);
  ASSERT_EQ(to_device(fc2_b, pr.fc2_b), cudaSuccess);
  for (DeviceBuffer* b : {&y, &a_next, &h, &h2, &v}) ASSERT_EQ(b->alloc(elems * 2), cudaSuccess);
  StreamGuard stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream.stream, cudaStreamNonBlocking), cudaSuccess);
  int dev = 0, sms = 0;
  ASSERT_EQ(cudaGetDevice(&dev), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), cudaSuccess);

  FusedBlockArgs args;
  args.a = a.ptr, args.identity = identity.ptr, args.w1 = w1.ptr, args.w2 = w2.ptr;
  args.scalars = scalars.as<float>();
  args.fc1_w = fc1_w.as<float>(), args.fc1_b = fc1_b.as<float>();
  args.fc2_w = fc2_w.as<float>(), args.fc2_b = fc2_b.as<float>();
  args.planes = kP, args.hidden = kHidden, args.n = c.n, args.h = c.h, args.w = c.w;
  args.y = y.ptr, args.next_b1a = scalars.as<float>() + 5, args.a_next = a_next.ptr;
  if (training) args.h_out = h.ptr, args.h2_out = h2.ptr, args.v_out = v.ptr;

  auto run = [&](Outputs* out) {
    const std::vector<uint16_t> nan(elems, nan_bits(dt));
    for (DeviceBuffer* b : {&y, &a_next, &h, &h2, &v})
      ASSERT_EQ(cudaMemcpy(b->ptr, nan.data(), b->bytes, cudaMemcpyHostToDevice), cudaSuccess);
    const cudaError_t e = wgmma ? kfuse::kernels::launch_fused_block_wgmma(args, dt, sms, stream.stream)
                                : kfuse::kernels::launch_fused_block(args, dt, stream.stream);
    ASSERT_EQ(e, cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream.stream), cudaSuccess);
    std::vector<uint16_t>* dst[] = {&out->y, &out->a_next, &out->h, &out->h2, &out->v};
    DeviceBuffer* src[] = {&y, &a_next, &h, &h2, &v};
    for (int i = 0; i < 5; ++i) {
      dst[i]->resize(elems);
      ASSERT_EQ(cudaMemcpy(dst[i]->data(), src[i]->ptr, src[i]->bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    }
  };
  Outputs first, second;
  ASSERT_NO_FATAL_FAILURE(run(&first));

  const double u_t = kfuse::testing::unit_roundoff(dt);
  size_t bad = 0;
  const std::vector<double> yv = decode(first.y, dt), av = decode(first.a_next, dt);
  EXPECT_LE(rel_err(yv, pr.y, &bad), 8 * u_t) << "y";
  EXPECT_EQ(bad, 0u) << "y elements left unwritten (NaN poison) or not finite";
  EXPECT_LE(rel_err(av, pr.a_next, &bad), 8 * u_t) << "a_next";
  EXPECT_EQ(bad, 0u) << "a_next elements left unwritten (NaN poison) or not finite";
  const double nb1a = bits_to_float(float_to_bits(pr.scalars[5], dt), dt);
  EXPECT_EQ(kfuse::testing::after_relu_mask_mismatches(yv, av, nb1a), 0u)
      << "elements where a_next > T(next_b1a) does not say y > 0";

  if (training) {
    const std::vector<double> hv = decode(first.h, dt), h2v = decode(first.h2, dt);
    EXPECT_LE(rel_err(hv, pr.h, &bad), 4 * u_t) << "h";
    EXPECT_EQ(bad, 0u) << "h elements left unwritten or not finite";
    EXPECT_LE(rel_err(h2v, pr.h2, &bad), 4 * u_t) << "h2";
    EXPECT_EQ(bad, 0u) << "h2 elements left unwritten or not finite";
    EXPECT_LE(rel_err(decode(first.v, dt), pr.v, &bad), 4 * u_t) << "v (conv2's raw output)";
    EXPECT_EQ(bad, 0u) << "v elements left unwritten or not finite";
    const double b2a = bits_to_float(float_to_bits(pr.scalars[2], dt), dt);
    size_t wrong = 0;
    for (size_t i = 0; i < elems; ++i) wrong += (hv[i] > 0) != (h2v[i] > b2a);
    EXPECT_EQ(wrong, 0u) << "elements where h2 > T(b2a) does not say h > 0";
  }

  ASSERT_NO_FATAL_FAILURE(run(&second));
  EXPECT_EQ(first.y, second.y) << "y differs between two launches";
  EXPECT_EQ(first.a_next, second.a_next) << "a_next differs between two launches";
  if (training) {
    EXPECT_EQ(first.h, second.h) << "h differs between two launches";
    EXPECT_EQ(first.h2, second.h2) << "h2 differs between two launches";
    EXPECT_EQ(first.v, second.v) << "v differs between two launches";
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, FusedBlockGpuTest, ::testing::ValuesIn(kfuse::testing::with_both_dtypes(kCases)),
                         kfuse::testing::DtypeCaseName());

// Shapes the kernels do not take are refused before anything runs (host-only: no device needed for these).
TEST(FusedBlockArgs, RefusesOtherShapes) {
  EXPECT_EQ(kfuse::kernels::fused_block_smem_bytes(32, 32), 0u) << "more than 256 pixels";
  EXPECT_EQ(kfuse::kernels::fused_block_smem_bytes(5, 5), 0u) << "a pixel count not a multiple of 16";
  EXPECT_GT(kfuse::kernels::fused_block_smem_bytes(16, 16), 0u);
  EXPECT_EQ(kfuse::kernels::fused_block_wgmma_smem_bytes(8, 8, 9, 0), 0u) << "16 x 16 images only";
  EXPECT_EQ(kfuse::kernels::fused_block_wgmma_smem_bytes(16, 16, 8, 0), 0u) << "compute capability 9.0 only";
  FusedBlockArgs a;  // everything null
  a.planes = kP, a.hidden = kHidden, a.n = 1, a.h = 16, a.w = 16;
  EXPECT_EQ(kfuse::kernels::launch_fused_block(a, kF16, nullptr), cudaErrorInvalidValue) << "no input";
}

}  // namespace
