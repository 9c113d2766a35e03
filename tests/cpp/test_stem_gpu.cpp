// GPU tests of launch_stem (src/kernels/encoder/encoder_kernels.h), the encoder's first kernel, against a float64 CPU
// computation of its documented math: v = x * in_scale[c] + in_shift[c] (x where no scale is given), read from the
// caller's layout and dtype; x0 = relu(sum over k < 16C of W[k][p] v(k)) with k = dy * 4C + dx * C + c holding pixel
// (4i + dy, 4j + dx) of channel c (space-to-depth by 4, then a 1x1 convolution); a0 = x0 + b1a. The cases cover the
// input dtypes (fp32, fp16, bf16, uint8), layouts (NCHW, channels-last, the renderer's NHWC RGBA with a fourth channel
// the stem skips), the channel counts the kernel specialises (3, 1) and the run-time one (4, 11), a last pixel tile
// and a last channel tile that are partial, and no a0. Outputs are poisoned (NaN) before each launch; a second launch
// must give the same bits. Host-only tests of the argument checks run without a device.
//
// Tolerance (normwise relative, against float64 from the same inputs; u_T = 2^-11 for fp16, 2^-8 for bf16): the
// kernel rounds v to T for the tensor cores (u_T per term of 16C; their errors add up to at most u_T of the sum of
// magnitudes, ~u_T / sqrt(16C) normwise for random signs), accumulates in fp32 and rounds the result to T once (u_T):
// 4 u_T. A pixel or channel read from the wrong place moves x0 by the size of a term, ~1 / sqrt(16C) of it, far above.
#include "kernels/encoder/encoder_kernels.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "conv_reference.h"
#include "gpu_test_support.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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
using kfuse::kernels::InputDType;
using kfuse::kernels::launch_stem;
using kfuse::kernels::StemArgs;

constexpr ConvDType kF16 = ConvDType::kF16;
constexpr ConvDType kBF16 = ConvDType::kBF16;

enum class Layout { kNchw, kChannelsLast, kRgba };

struct StemCase {
  const char* name;
  InputDType x_dtype;
  Layout layout;
  int n, c, h, w, p0;
  bool affine;  // in_scale / in_shift given
  bool a0;      // a0 written
};

const StemCase kCases[] = {
    {"c3_nchw_f16_n2_64x64", InputDType::kF16, Layout::kNchw, 2, 3, 64, 64, 64, false, true},
    {"c3_rgba_u8_n3_64x64_affine", InputDType::kU8, Layout::kRgba, 3, 3, 64, 64, 64, true, true},
    // 5 x 8 x 12 = 480 pixels: the last 128-pixel tile is partial.
    {"c1_nchw_f32_n5_32x48", InputDType::kF32, Layout::kNchw, 5, 1, 32, 48, 64, false, true},
    {"c11_channels_last_bf16_n2_16x16", InputDType::kBF16, Layout::kChannelsLast, 2, 11, 16, 16, 64, true, true},
    // C = 4 (run-time C), 72 output channels: the second 64-channel tile holds 8; no a0.
    {"c4_nchw_f16_n1_16x20_p72", InputDType::kF16, Layout::kNchw, 1, 4, 16, 20, 72, false, false},
    {"c3_channels_last_f32_n4_32x32_affine", InputDType::kF32, Layout::kChannelsLast, 4, 3, 32, 32, 64, true, true},
};

using StemParam = kfuse::testing::DtypeCase<StemCase>;

int kpad_of(int c) { return (16 * c + 63) / 64 * 64; }

// The input's element strides (n, c, h, w) in its layout; RGBA has 4 channels per pixel (the fourth unread).
void strides_of(const StemCase& c, int64_t s[4]) {
  const int64_t ch = c.layout == Layout::kRgba ? 4 : c.c;
  if (c.layout == Layout::kNchw) {
    s[3] = 1, s[2] = c.w, s[1] = int64_t(c.h) * c.w, s[0] = int64_t(c.c) * c.h * c.w;
  } else {
    s[1] = 1, s[3] = ch, s[2] = int64_t(c.w) * ch, s[0] = int64_t(c.h) * c.w * ch;
  }
}

struct Problem {
  std::vector<uint8_t> x;          // the input's bytes
  std::vector<double> xv;          // v at (n, c, h, w), float64 (after scale and shift)
  std::vector<uint16_t> weight;    // [kpad][p0] of T, zero rows past 16C
  std::vector<float> scale, shift, b1a;
  std::vector<double> x0, a0;      // [n * h/4 * w/4][p0]
};

Problem make_problem(const StemCase& c, ConvDType dt, std::mt19937& rng) {
  Problem pr;
  int64_t s[4];
  strides_of(c, s);
  const int64_t ch = c.layout == Layout::kRgba ? 4 : c.c;
  const size_t elems = size_t(c.n) * c.h * c.w * ch;
  const size_t esize = c.x_dtype == InputDType::kF32 ? 4 : c.x_dtype == InputDType::kU8 ? 1 : 2;
  pr.x.resize(elems * esize);
  std::vector<double> raw(elems);  // the stored values, by storage index
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  for (size_t i = 0; i < elems; ++i) {
    switch (c.x_dtype) {
      case InputDType::kU8: pr.x[i] = uint8_t(rng() & 0xff), raw[i] = pr.x[i]; break;
      case InputDType::kF32: {
        const float f = unit(rng);
        std::memcpy(&pr.x[4 * i], &f, 4), raw[i] = f;
        break;
      }
      default: {
        const ConvDType t = c.x_dtype == InputDType::kF16 ? kF16 : kBF16;
        const uint16_t b = float_to_bits(unit(rng), t);
        std::memcpy(&pr.x[2 * i], &b, 2), raw[i] = bits_to_float(b, t);
      }
    }
  }
  std::uniform_real_distribution<float> sc(0.5f / 255, 2.0f / 255), sh(-0.5f, 0.5f);
  for (int ci = 0; ci < c.c; ++ci) {
    pr.scale.push_back(c.affine ? (c.x_dtype == InputDType::kU8 ? sc(rng) : sc(rng) * 255) : 1.0f);
    pr.shift.push_back(c.affine ? sh(rng) : 0.0f);
  }
  pr.b1a = {sh(rng)};
  pr.xv.resize(size_t(c.n) * c.c * c.h * c.w);
  for (int n = 0; n < c.n; ++n)
    for (int ci = 0; ci < c.c; ++ci)
      for (int y = 0; y < c.h; ++y)
        for (int x = 0; x < c.w; ++x)
          pr.xv[((size_t(n) * c.c + ci) * c.h + y) * c.w + x] =
              raw[size_t(n * s[0] + ci * s[1] + y * s[2] + x * s[3])] * pr.scale[ci] + pr.shift[ci];

  const int kpad = kpad_of(c.c), k_used = 16 * c.c;
  const float range = 2.0f / std::sqrt(float(k_used));
  const std::vector<uint16_t> w = random_nonzero_bits(size_t(k_used) * c.p0, dt, rng, -range, range);
  pr.weight.assign(size_t(kpad) * c.p0, 0);
  std::copy(w.begin(), w.end(), pr.weight.begin());

  const int ho = c.h / 4, wo = c.w / 4;
  pr.x0.assign(size_t(c.n) * ho * wo * c.p0, 0.0);
  pr.a0.assign(pr.x0.size(), 0.0);
  std::vector<double> wd(size_t(k_used) * c.p0);
  for (size_t i = 0; i < wd.size(); ++i) wd[i] = bits_to_float(pr.weight[i], dt);
  for (int n = 0; n < c.n; ++n)
    for (int i = 0; i < ho; ++i)
      for (int j = 0; j < wo; ++j) {
        const size_t m = (size_t(n) * ho + i) * wo + j;
        for (int p = 0; p < c.p0; ++p) {
          double acc = 0;
          for (int dy = 0; dy < 4; ++dy)
            for (int dx = 0; dx < 4; ++dx)
              for (int ci = 0; ci < c.c; ++ci) {
                const int k = dy * 4 * c.c + dx * c.c + ci;
                acc += wd[size_t(k) * c.p0 + p] * pr.xv[((size_t(n) * c.c + ci) * c.h + 4 * i + dy) * c.w + 4 * j + dx];
              }
          pr.x0[m * c.p0 + p] = std::max(0.0, acc);
          pr.a0[m * c.p0 + p] = std::max(0.0, acc) + pr.b1a[0];
        }
      }
  return pr;
}

struct Device {
  DeviceBuffer x, weight, scale, shift, b1a, x0, a0;
  StreamGuard stream;
};

StemArgs make_args(const StemCase& c, const Device& d) {
  StemArgs a;
  a.x = d.x.ptr;
  a.x_dtype = c.x_dtype;
  int64_t s[4];
  strides_of(c, s);
  a.stride_n = s[0], a.stride_c = s[1], a.stride_h = s[2], a.stride_w = s[3];
  a.n = c.n, a.c = c.c, a.h = c.h, a.w = c.w;
  if (c.affine) a.in_scale = d.scale.as<float>(), a.in_shift = d.shift.as<float>();
  a.weight = d.weight.ptr;
  a.kpad = kpad_of(c.c), a.p0 = c.p0;
  a.b1a = d.b1a.as<float>();
  a.x0 = d.x0.ptr;
  if (c.a0) a.a0 = d.a0.ptr;
  return a;
}

class StemGpuTest : public ::testing::TestWithParam<StemParam> {};

TEST_P(StemGpuTest, MatchesFloat64ReferenceAndRepeatsBitExactly) {
  if (const std::string why = kfuse::testing::device_skip_reason(8, 9, "the encoder kernels"); !why.empty())
    GTEST_SKIP() << why;
  const StemCase& c = GetParam().c;
  const ConvDType dt = GetParam().dtype;
  const std::string name = GetParam().label();
  const uint32_t seed = seed_for(name);
  SCOPED_TRACE(name + " seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  const Problem pr = make_problem(c, dt, rng);

  Device d;
  ASSERT_EQ(to_device(d.x, pr.x), cudaSuccess);
  ASSERT_EQ(to_device(d.weight, pr.weight), cudaSuccess);
  ASSERT_EQ(to_device(d.scale, pr.scale), cudaSuccess);
  ASSERT_EQ(to_device(d.shift, pr.shift), cudaSuccess);
  ASSERT_EQ(to_device(d.b1a, pr.b1a), cudaSuccess);
  ASSERT_EQ(d.x0.alloc(pr.x0.size() * 2), cudaSuccess);
  ASSERT_EQ(d.a0.alloc(pr.a0.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&d.stream.stream, cudaStreamNonBlocking), cudaSuccess);

  auto run = [&](std::vector<uint16_t>* x0, std::vector<uint16_t>* a0) {
    const std::vector<uint16_t> nan(pr.x0.size(), nan_bits(dt));
    ASSERT_EQ(cudaMemcpy(d.x0.ptr, nan.data(), d.x0.bytes, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d.a0.ptr, nan.data(), d.a0.bytes, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(launch_stem(make_args(c, d), dt, d.stream.stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(d.stream.stream), cudaSuccess);
    x0->resize(pr.x0.size()), a0->resize(pr.a0.size());
    ASSERT_EQ(cudaMemcpy(x0->data(), d.x0.ptr, d.x0.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(a0->data(), d.a0.ptr, d.a0.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  };
  std::vector<uint16_t> x0, a0, x0_again, a0_again;
  ASSERT_NO_FATAL_FAILURE(run(&x0, &a0));

  const double tol = 4 * kfuse::testing::unit_roundoff(dt);
  size_t bad = 0;
  EXPECT_LE(rel_err(decode(x0, dt), pr.x0, &bad), tol) << "x0";
  EXPECT_EQ(bad, 0u) << "x0 elements left unwritten (NaN poison) or not finite";
  if (c.a0) {
    EXPECT_LE(rel_err(decode(a0, dt), pr.a0, &bad), tol) << "a0";
    EXPECT_EQ(bad, 0u) << "a0 elements left unwritten (NaN poison) or not finite";
  } else {
    EXPECT_TRUE(std::all_of(a0.begin(), a0.end(), [&](uint16_t b) { return b == nan_bits(dt); }))
        << "a0 written although not asked for";
  }
  ASSERT_NO_FATAL_FAILURE(run(&x0_again, &a0_again));
  EXPECT_EQ(x0, x0_again) << "x0 differs between two launches";
  EXPECT_EQ(a0, a0_again) << "a0 differs between two launches";
}

INSTANTIATE_TEST_SUITE_P(Kernels, StemGpuTest, ::testing::ValuesIn(kfuse::testing::with_both_dtypes(kCases)),
                         kfuse::testing::DtypeCaseName());

// A rejected call returns cudaErrorInvalidValue before any CUDA call: no device needed.
TEST(StemArgs, RejectsInconsistentArguments) {
  alignas(16) static uint16_t buf[64];
  alignas(16) static float f[4];
  StemArgs good;
  good.x = buf, good.weight = buf, good.x0 = buf;
  good.n = 1, good.c = 3, good.h = 4, good.w = 4, good.kpad = 64, good.p0 = 64;
  good.stride_n = 48, good.stride_c = 16, good.stride_h = 4, good.stride_w = 1;
  auto rejected = [](const StemArgs& a) { return launch_stem(a, kF16, nullptr) == cudaErrorInvalidValue; };
  StemArgs a = good;
  a.x = nullptr;
  EXPECT_TRUE(rejected(a)) << "no input";
  a = good, a.h = 6;
  EXPECT_TRUE(rejected(a)) << "height not a multiple of 4";
  a = good, a.p0 = 60;
  EXPECT_TRUE(rejected(a)) << "output channels not a multiple of 8";
  a = good, a.c = 5;  // 16 * 5 = 80 rows > kpad 64
  EXPECT_TRUE(rejected(a)) << "kpad below 16C";
  a = good, a.kpad = 96;
  EXPECT_TRUE(rejected(a)) << "kpad not a multiple of 64";
  a = good, a.in_scale = f;
  EXPECT_TRUE(rejected(a)) << "a scale without a shift";
}

}  // namespace
