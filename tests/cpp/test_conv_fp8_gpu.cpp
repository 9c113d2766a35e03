// GPU tests of the e4m3 FixUp convolution (conv2d_fprop_fixup_e4m3, conv_fixup.h) against a float64 reference of
// the quantized math: the same e4m3 inputs and filters, decoded exactly, y = post + act(channel_alpha[k] * conv + pre)
// in float64. Products of two e4m3 values are exact in fp32; what differs is the tensor cores' fp32 accumulation
// (Hopper's fp8 MMA keeps fewer accumulator bits than fp32, ~2^-14 relative per add, reported by DeepSeek-V3 sec.
// 3.3.2: over the longest reduction here, C*R*S = 4608 terms in 36 k-blocks, a random walk of those errors stays
// ~1e-3 normwise) and the fp16 output's rounding (2^-11); 1e-2 normwise bounds both, while a wrong or missing channel
// scale is an O(1) error. Outputs poisoned with NaN before each launch. Skipped without a compute capability 9.x GPU.
#include "kernels/conv/conv_fixup.h"

#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "conv_reference.h"
#include "gpu_test_support.h"

namespace {

using kfuse::kernels::Conv2dProblem;
using kfuse::kernels::ConvTile;
using kfuse::kernels::FixupEpilogue;
using kfuse::testing::DeviceBuffer;
using kfuse::testing::seed_for;

double e4m3_value(uint8_t bits) {
  __nv_fp8_e4m3 v;
  v.__x = bits;
  return double(float(v));
}

// Nonzero e4m3 values drawn uniformly in [lo, hi] and rounded to e4m3.
std::vector<uint8_t> random_e4m3(size_t n, std::mt19937& rng, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<uint8_t> out(n);
  for (auto& b : out) {
    do {
      b = __nv_fp8_e4m3(dist(rng)).__x;
    } while (e4m3_value(b) == 0.0);
  }
  return out;
}

std::vector<double> reference_e4m3(const Conv2dProblem& p, const std::vector<uint8_t>& x, const std::vector<uint8_t>& w,
                                   const std::vector<float>& channel_alpha, double pre, double post, bool relu) {
  std::vector<double> xd(x.size()), wd(w.size());
  for (size_t i = 0; i < x.size(); ++i) xd[i] = e4m3_value(x[i]);
  for (size_t i = 0; i < w.size(); ++i) wd[i] = e4m3_value(w[i]);
  const std::vector<double> alpha(channel_alpha.begin(), channel_alpha.end());
  return kfuse::testing::reference_fprop_scaled(p, xd, wd, alpha, pre, post, relu);
}

struct Fp8Case {
  const char* name;
  Conv2dProblem problem;
};

// The encoder's convolution shapes at small batches (stride 1 and 2, 64 to 512 channels), and a channel count that
// fills no K tile.
const Fp8Case kCases[] = {
    {"n3_16x16_c64_k64_s1", kfuse::testing::conv3x3(3, 16, 64, 64, 1)},
    {"n2_16x16_c64_k128_s2", kfuse::testing::conv3x3(2, 16, 64, 128, 2)},
    {"n2_4x4_c256_k512_s2", kfuse::testing::conv3x3(2, 4, 256, 512, 2)},
    {"n2_2x2_c512_k512_s1", kfuse::testing::conv3x3(2, 2, 512, 512, 1)},
    {"n2_8x8_c48_k64_s1", kfuse::testing::conv3x3(2, 8, 48, 64, 1)},  // C: a partial K tile of every e4m3 tile
};

struct Fp8Tile {
  const char* name;
  ConvTile tile;
};
const Fp8Tile kTiles[] = {{"128x64", ConvTile::kSm90_128x64},
                          {"128x64_k64", ConvTile::kSm90_128x64_k64},
                          {"128x128", ConvTile::kSm90_128x128},
                          {"256x64", ConvTile::kSm90_256x64}};

struct Fp8Param {
  Fp8Tile tile;
  Fp8Case conv;
  bool relu;
};

void PrintTo(const Fp8Param& param, std::ostream* os) {
  *os << param.tile.name << "/" << param.conv.name << (param.relu ? "/relu" : "/identity");
}

class ConvFp8GpuTest : public ::testing::TestWithParam<Fp8Param> {};

TEST_P(ConvFp8GpuTest, MatchesFloat64ReferenceOfTheQuantizedMath) {
  if (const std::string why = kfuse::testing::device_skip_reason(9, 9, "the e4m3 conv (sm_90a)"); !why.empty())
    GTEST_SKIP() << why;
  const Conv2dProblem& p = GetParam().conv.problem;
  const bool relu = GetParam().relu;
  const ConvTile tile = GetParam().tile.tile;
  const std::string name = std::string("e4m3_") + GetParam().tile.name + "/" + GetParam().conv.name +
                           (relu ? "/relu" : "/identity");
  const uint32_t seed = seed_for(name);
  SCOPED_TRACE(name + " seed=" + std::to_string(seed));
  ASSERT_TRUE(kfuse::kernels::conv2d_fprop_fixup_e4m3_can_implement(p, tile));

  std::mt19937 rng(seed);
  const std::vector<uint8_t> x = random_e4m3(kfuse::testing::act_elems(p), rng, -2.0f, 2.0f);
  const std::vector<uint8_t> w = random_e4m3(kfuse::testing::filter_elems(p), rng, -1.0f, 1.0f);
  std::vector<float> channel_alpha(size_t(p.k));
  for (float& a : channel_alpha) a = std::uniform_real_distribution<float>(0.05f, 0.5f)(rng);
  const float scalars[2] = {std::uniform_real_distribution<float>(-4.0f, 4.0f)(rng),   // pre
                            std::uniform_real_distribution<float>(-2.0f, 2.0f)(rng)};  // post

  DeviceBuffer dx, dw, dy, dalpha, dscalars;
  const size_t out_elems = kfuse::testing::grad_elems(p);
  ASSERT_EQ(dx.alloc(x.size()), cudaSuccess);
  ASSERT_EQ(dw.alloc(w.size()), cudaSuccess);
  ASSERT_EQ(dy.alloc(out_elems * sizeof(uint16_t)), cudaSuccess);
  ASSERT_EQ(dalpha.alloc(channel_alpha.size() * sizeof(float)), cudaSuccess);
  ASSERT_EQ(dscalars.alloc(sizeof(scalars)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dx.ptr, x.data(), x.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dw.ptr, w.data(), w.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dalpha.ptr, channel_alpha.data(), dalpha.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dscalars.ptr, scalars, sizeof(scalars), cudaMemcpyHostToDevice), cudaSuccess);
  const std::vector<uint16_t> poison(out_elems, 0x7e00);  // fp16 NaN
  ASSERT_EQ(cudaMemcpy(dy.ptr, poison.data(), dy.bytes, cudaMemcpyHostToDevice), cudaSuccess);

  FixupEpilogue e;
  e.channel_alpha = dalpha.as<float>();
  e.pre = dscalars.as<float>() + 0;
  e.post = dscalars.as<float>() + 1;
  e.relu = relu;
  ASSERT_EQ(kfuse::kernels::conv2d_fprop_fixup_e4m3(p, tile, dx.ptr, dw.ptr, dy.ptr, e, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint16_t> out(out_elems);
  ASSERT_EQ(cudaMemcpy(out.data(), dy.ptr, dy.bytes, cudaMemcpyDeviceToHost), cudaSuccess);

  std::vector<double> got(out_elems);
  for (size_t i = 0; i < out_elems; ++i) got[i] = kfuse::bits_to_float(out[i], kfuse::kernels::ConvDType::kF16);
  const std::vector<double> ref = reference_e4m3(p, x, w, channel_alpha, scalars[0], scalars[1], relu);
  size_t bad = 0;
  const double err = kfuse::testing::rel_err(got, ref, &bad);
  EXPECT_EQ(bad, 0u) << "outputs left unwritten (NaN poison) or not finite, of " << out_elems;
  EXPECT_LE(err, 1e-2) << "normwise relative error against the float64 reference of the quantized math";
}

std::vector<Fp8Param> all_params() {
  std::vector<Fp8Param> out;
  for (const Fp8Tile& t : kTiles)
    for (const Fp8Case& c : kCases)
      for (bool relu : {false, true}) out.push_back({t, c, relu});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Kernels, ConvFp8GpuTest, ::testing::ValuesIn(all_params()));

// The scales' contract is checked before anything runs: no device needed.
TEST(ConvFp8, RefusesMissingOrMixedScales) {
  const Conv2dProblem p = kfuse::testing::conv3x3(2, 8, 64, 64, 1);
  alignas(16) static float scales[64];
  alignas(16) static unsigned char buf[3][16];
  FixupEpilogue e;
  EXPECT_EQ(kfuse::kernels::conv2d_fprop_fixup_e4m3(p, ConvTile::kSm90_128x64, buf[0], buf[1], buf[2], e, nullptr),
            cudaErrorInvalidValue)
      << "e4m3 without per-channel scales";
  e.channel_alpha = scales;
  e.alpha = scales;
  EXPECT_EQ(kfuse::kernels::conv2d_fprop_fixup_e4m3(p, ConvTile::kSm90_128x64, buf[0], buf[1], buf[2], e, nullptr),
            cudaErrorInvalidValue)
      << "a scalar alpha beside the per-channel scales";
  FixupEpilogue f16;
  f16.channel_alpha = scales;
  EXPECT_EQ(kfuse::kernels::conv2d_fprop_fixup(p, kfuse::kernels::ConvDType::kF16, ConvTile::kSm90_128x64, buf[0],
                                               buf[1], buf[2], f16, 1, nullptr, 0, nullptr),
            cudaErrorInvalidValue)
      << "fp16 launchers must not ignore per-channel scales";
}

TEST(ConvFp8CanImplement, NeedsChannelsInSixteensAndAnE4m3Tile) {
  using kfuse::kernels::conv2d_fprop_fixup_e4m3_can_implement;
  EXPECT_TRUE(conv2d_fprop_fixup_e4m3_can_implement(kfuse::testing::conv3x3(2, 8, 64, 64, 1), ConvTile::kSm90_128x64));
  EXPECT_FALSE(conv2d_fprop_fixup_e4m3_can_implement(kfuse::testing::conv3x3(2, 8, 24, 64, 1), ConvTile::kSm90_128x64))
      << "C = 24";
  EXPECT_FALSE(conv2d_fprop_fixup_e4m3_can_implement(kfuse::testing::conv3x3(2, 8, 64, 40, 1), ConvTile::kSm90_128x64))
      << "K = 40";
  EXPECT_FALSE(conv2d_fprop_fixup_e4m3_can_implement(kfuse::testing::conv3x3(2, 8, 64, 64, 1), ConvTile::k128x64))
      << "no e4m3 instance of a CUTLASS 2.x tile";
}

}  // namespace
