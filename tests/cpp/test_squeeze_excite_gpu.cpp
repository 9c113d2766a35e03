// GPU tests of launch_squeeze_excite (src/kernels/encoder/encoder_kernels.h), the squeeze-excitation and residual
// join that ends every block of the inference forward, against a float64 CPU computation of the documented math:
//   o = T(v * scale + shift) where o comes raw, else o as given;   m = mean over the image's pixels of o;
//   hidden = relu(w1 m + b1)  (with fc1 computed ahead: relu(scale * pre + shift * rowsum(w1) + b1));
//   g = sigmoid(w2 hidden + b2);   y = relu(o * g + identity);   a_next = y + next_b1a;   out = y in NCHW.
// The cases cover the launcher's paths: the fast kernel at P = 64, 128, 256 (one image per CTA), P = 512 with one
// image per CTA (fc weights as T, or fp32), with 2 or 4 images per CTA (a batch of several waves), with fc1's
// pre-activations given (o strided per image), and the generic kernel (P outside the fast set, hidden != P / 16);
// raw o with its scale and shift; every output (y, a_next, NCHW out as T or fp32). Outputs are poisoned (NaN) before
// each launch; a second launch must give the same bits. Host-only tests of the argument checks run without a device.
//
// Tolerances (normwise relative, against float64 from the same T inputs; u_T = 2^-11 for fp16, 2^-8 for bf16):
//   y, a_next, out as T: one rounding of the result to T (u_T), o's own rounding where it comes raw (u_T |o g|, g < 1)
//     and fp32 arithmetic (means, two dot products of 32-512 terms, expf: ~1e-6 relative): 4 u_T.
//   out as fp32: the fp32 arithmetic alone, plus o's rounding where raw (the reference rounds o the same way): 1e-4.
// An element read from the wrong image, channel or pixel moves y by ~|o| ~ 0.5, far above either bound.
// Exact: a_next > T(next_b1a) wherever y > 0 and a_next == T(next_b1a) wherever y == 0 (the mask the backward reads
// from a_next); no output element left NaN.
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
using kfuse::kernels::launch_squeeze_excite;
using kfuse::kernels::SqueezeExciteArgs;

constexpr ConvDType kF16 = ConvDType::kF16;
constexpr ConvDType kBF16 = ConvDType::kBF16;

struct SeCase {
  const char* name;
  int n, hw, p, hidden;
  bool raw = false;       // o holds conv2's raw output v; the kernel applies scale and shift
  bool pre = false;       // fc1's pre-activations given (pre_hidden, w1_rowsum, o strided per image); needs raw
  bool fc_t = false;      // w1 and w2 also as T
  bool out_nchw = false;  // the NCHW output
  bool out_f32 = false;   // ... as fp32
};

const SeCase kCases[] = {
    // The default network's blocks at 64 x 64 inputs: 16x16x64, 8x8x128, 4x4x256, 2x2x512; one image per CTA.
    {"p64_hw256_n3", 3, 256, 64, 4},
    {"p128_hw64_n2_raw", 2, 64, 128, 8, true},
    {"p256_hw16_n5", 5, 16, 256, 16},
    // Block 4 as the inference forward runs it at small batches: fc weights as T, the NCHW output in T and fp32.
    {"p512_hw4_n3_fc_t_nchw", 3, 4, 512, 32, false, false, true, true, false},
    {"p512_hw4_n3_nchw_f32", 3, 4, 512, 32, false, false, false, true, true},
    // A batch of several waves: 2 or 4 images per CTA (as many as the device's SM count makes the launcher choose).
    {"p512_hw4_n300", 300, 4, 512, 32},
    {"p512_hw4_n1000_raw_nchw", 1000, 4, 512, 32, true, false, false, true, false},
    // fc1's pre-activations computed ahead (the projection rows of block 4's conv2 GEMM): raw o strided per image.
    {"p512_hw4_n3_pre", 3, 4, 512, 32, true, true, true, true, true},
    // The generic kernel: P outside {64, 128, 256, 512}, and hidden != P / 16.
    {"p96_hw16_n2_generic", 2, 16, 96, 6},
    {"p64_hw64_n3_h8_generic_raw", 3, 64, 64, 8, true, false, false, true, true},
};

using SeParam = kfuse::testing::DtypeCase<SeCase>;

// The problem's inputs (host) and the float64 reference of every output.
struct Problem {
  int64_t o_stride = 0;            // elements from one image's o to the next
  std::vector<uint16_t> o, identity;  // o: n * o_stride (with pre-activations after each image's hw * p when pre)
  std::vector<float> w1, b1, w2, b2, rowsum;  // rowsum: w1's row sums (fp32), for the pre path
  std::vector<uint16_t> w1_t, w2_t;
  float scalars[3] = {1.0f, 0.0f, 0.0f};  // scale, shift, next_b1a
  std::vector<double> y;             // [n][hw][p]
};

// Values exactly representable in T, uniform in [lo, hi] (so that fc weights given as T and as fp32 agree exactly).
std::vector<float> t_exact(size_t count, ConvDType dt, std::mt19937& rng, float lo, float hi) {
  const std::vector<uint16_t> bits = random_nonzero_bits(count, dt, rng, lo, hi);
  std::vector<float> out(count);
  for (size_t i = 0; i < count; ++i) out[i] = bits_to_float(bits[i], dt);
  return out;
}

Problem make_problem(const SeCase& c, ConvDType dt, std::mt19937& rng) {
  Problem pr;
  const size_t img = size_t(c.hw) * c.p;
  pr.o_stride = c.pre ? int64_t(img) + (c.hidden + 7) / 8 * 8 : int64_t(img);
  pr.o = random_nonzero_bits(size_t(c.n) * pr.o_stride, dt, rng);
  pr.identity = random_nonzero_bits(size_t(c.n) * img, dt, rng);
  const float fc_range = 2.0f / std::sqrt(float(c.p));  // pre-activations of order 1
  pr.w1 = t_exact(size_t(c.hidden) * c.p, dt, rng, -fc_range, fc_range);
  pr.b1 = t_exact(c.hidden, dt, rng, -0.25f, 0.25f);
  pr.w2 = t_exact(size_t(c.p) * c.hidden, dt, rng, -1.0f, 1.0f);
  pr.b2 = t_exact(c.p, dt, rng, -0.5f, 0.5f);
  for (float v : pr.w1) pr.w1_t.push_back(float_to_bits(v, dt));
  for (float v : pr.w2) pr.w2_t.push_back(float_to_bits(v, dt));
  std::uniform_real_distribution<float> scale(0.5f, 2.0f), shift(-0.5f, 0.5f);
  if (c.raw) pr.scalars[0] = scale(rng), pr.scalars[1] = shift(rng);
  pr.scalars[2] = shift(rng);

  pr.rowsum.assign(c.hidden, 0.0f);
  for (int j = 0; j < c.hidden; ++j) {
    float s = 0.0f;
    for (int k = 0; k < c.p; ++k) s += pr.w1[size_t(j) * c.p + k];
    pr.rowsum[j] = s;
  }
  pr.y.assign(size_t(c.n) * img, 0.0);
  std::vector<double> ov(img), m(c.p), h(c.hidden), g(c.p);
  for (int i = 0; i < c.n; ++i) {
    uint16_t* oi = &pr.o[size_t(i) * pr.o_stride];
    for (size_t e = 0; e < img; ++e) {
      const float v = bits_to_float(oi[e], dt);
      ov[e] = c.raw ? bits_to_float(float_to_bits(std::fmaf(v, pr.scalars[0], pr.scalars[1]), dt), dt) : v;
    }
    if (c.pre) {  // fc1's pre-activations of the raw means, as the projection would write them (rounded to T)
      for (int j = 0; j < c.hidden; ++j) {
        double s = 0;
        for (int k = 0; k < c.p; ++k) {
          double mk = 0;
          for (int q = 0; q < c.hw; ++q) mk += bits_to_float(oi[size_t(q) * c.p + k], dt);
          s += double(pr.w1[size_t(j) * c.p + k]) * mk / c.hw;
        }
        oi[img + j] = float_to_bits(float(s), dt);
        const double pre = bits_to_float(oi[img + j], dt);
        h[j] = std::max(0.0, pr.scalars[0] * pre + pr.scalars[1] * double(pr.rowsum[j]) + pr.b1[j]);
      }
    } else {
      for (int k = 0; k < c.p; ++k) {
        double s = 0;
        for (int q = 0; q < c.hw; ++q) s += ov[size_t(q) * c.p + k];
        m[k] = s / c.hw;
      }
      for (int j = 0; j < c.hidden; ++j) {
        double s = pr.b1[j];
        for (int k = 0; k < c.p; ++k) s += double(pr.w1[size_t(j) * c.p + k]) * m[k];
        h[j] = std::max(0.0, s);
      }
    }
    for (int k = 0; k < c.p; ++k) {
      double s = pr.b2[k];
      for (int j = 0; j < c.hidden; ++j) s += double(pr.w2[size_t(k) * c.hidden + j]) * h[j];
      g[k] = 1.0 / (1.0 + std::exp(-s));
    }
    for (int q = 0; q < c.hw; ++q)
      for (int k = 0; k < c.p; ++k) {
        const size_t e = size_t(q) * c.p + k;
        const double idt = bits_to_float(pr.identity[size_t(i) * img + e], dt);
        pr.y[size_t(i) * img + e] = std::max(0.0, ov[e] * g[k] + idt);
      }
  }
  return pr;
}

struct Device {
  DeviceBuffer o, identity, w1, b1, w2, b2, w1_t, w2_t, rowsum, scalars, y, a_next, out;
  StreamGuard stream;
};

void setup(const SeCase& c, const Problem& pr, Device* d) {
  ASSERT_EQ(to_device(d->o, pr.o), cudaSuccess);
  ASSERT_EQ(to_device(d->identity, pr.identity), cudaSuccess);
  ASSERT_EQ(to_device(d->w1, pr.w1), cudaSuccess);
  ASSERT_EQ(to_device(d->b1, pr.b1), cudaSuccess);
  ASSERT_EQ(to_device(d->w2, pr.w2), cudaSuccess);
  ASSERT_EQ(to_device(d->b2, pr.b2), cudaSuccess);
  ASSERT_EQ(to_device(d->w1_t, pr.w1_t), cudaSuccess);
  ASSERT_EQ(to_device(d->w2_t, pr.w2_t), cudaSuccess);
  ASSERT_EQ(to_device(d->rowsum, pr.rowsum), cudaSuccess);
  ASSERT_EQ(to_device(d->scalars, std::vector<float>(pr.scalars, pr.scalars + 3)), cudaSuccess);
  const size_t elems = size_t(c.n) * c.hw * c.p;
  ASSERT_EQ(d->y.alloc(elems * 2), cudaSuccess);
  ASSERT_EQ(d->a_next.alloc(elems * 2), cudaSuccess);
  ASSERT_EQ(d->out.alloc(elems * (c.out_f32 ? 4 : 2)), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&d->stream.stream, cudaStreamNonBlocking), cudaSuccess);
}

SqueezeExciteArgs make_args(const SeCase& c, const Problem& pr, const Device& d) {
  SqueezeExciteArgs a;
  a.o = d.o.ptr;
  a.identity = d.identity.ptr;
  a.n = c.n, a.hw = c.hw, a.p = c.p, a.hidden = c.hidden;
  a.w1 = d.w1.as<float>(), a.b1 = d.b1.as<float>(), a.w2 = d.w2.as<float>(), a.b2 = d.b2.as<float>();
  a.y = d.y.ptr;
  a.next_b1a = d.scalars.as<float>() + 2;
  a.a_next = d.a_next.ptr;
  if (c.raw) a.o_scale = d.scalars.as<float>(), a.o_shift = d.scalars.as<float>() + 1;
  if (c.fc_t) a.w1_t = d.w1_t.ptr, a.w2_t = d.w2_t.ptr;
  if (c.out_nchw) a.out_nchw = d.out.ptr, a.out_f32 = c.out_f32;
  if (c.pre) {
    a.o_stride = pr.o_stride;
    a.pre_hidden = d.o.as<uint16_t>() + size_t(c.hw) * c.p;
    a.w1_rowsum = d.rowsum.as<float>();
  }
  return a;
}

struct Outputs {
  std::vector<uint16_t> y, a_next, out16;
  std::vector<float> out32;
};

void run(const SeCase& c, ConvDType dt, const Problem& pr, Device* d, Outputs* out) {
  const size_t elems = size_t(c.n) * c.hw * c.p;
  const std::vector<uint16_t> nan16(elems, nan_bits(dt));
  ASSERT_EQ(cudaMemcpy(d->y.ptr, nan16.data(), d->y.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d->a_next.ptr, nan16.data(), d->a_next.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(d->out.ptr, 0xff, d->out.bytes), cudaSuccess);  // NaN as fp32 and as T
  ASSERT_EQ(launch_squeeze_excite(make_args(c, pr, *d), dt, d->stream.stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(d->stream.stream), cudaSuccess);
  out->y.resize(elems), out->a_next.resize(elems);
  ASSERT_EQ(cudaMemcpy(out->y.data(), d->y.ptr, d->y.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(out->a_next.data(), d->a_next.ptr, d->a_next.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  if (c.out_f32) {
    out->out32.resize(elems);
    ASSERT_EQ(cudaMemcpy(out->out32.data(), d->out.ptr, d->out.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  } else {
    out->out16.resize(elems);
    ASSERT_EQ(cudaMemcpy(out->out16.data(), d->out.ptr, d->out.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  }
}

class SqueezeExciteGpuTest : public ::testing::TestWithParam<SeParam> {};

TEST_P(SqueezeExciteGpuTest, MatchesFloat64ReferenceAndRepeatsBitExactly) {
  if (const std::string why = kfuse::testing::device_skip_reason(8, 9, "the encoder kernels"); !why.empty())
    GTEST_SKIP() << why;
  const SeCase& c = GetParam().c;
  const ConvDType dt = GetParam().dtype;
  const std::string name = GetParam().label();
  const uint32_t seed = seed_for(name);
  SCOPED_TRACE(name + " seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  const Problem pr = make_problem(c, dt, rng);
  Device d;
  ASSERT_NO_FATAL_FAILURE(setup(c, pr, &d));
  Outputs first, second;
  ASSERT_NO_FATAL_FAILURE(run(c, dt, pr, &d, &first));

  const double u_t = kfuse::testing::unit_roundoff(dt);
  size_t bad = 0;
  const std::vector<double> y = decode(first.y, dt);
  EXPECT_LE(rel_err(y, pr.y, &bad), 4 * u_t) << "y";
  EXPECT_EQ(bad, 0u) << "y elements left unwritten (NaN poison) or not finite";

  const float b1a = pr.scalars[2];
  const uint16_t b1a_t = float_to_bits(b1a, dt);
  std::vector<double> a_ref(pr.y.size());
  for (size_t i = 0; i < a_ref.size(); ++i) a_ref[i] = pr.y[i] + b1a;
  EXPECT_LE(rel_err(decode(first.a_next, dt), a_ref, &bad), 4 * u_t) << "a_next";
  EXPECT_EQ(bad, 0u) << "a_next elements left unwritten (NaN poison) or not finite";
  EXPECT_EQ(kfuse::testing::after_relu_mask_mismatches(y, decode(first.a_next, dt), bits_to_float(b1a_t, dt)), 0u)
      << "elements where a_next > T(next_b1a) does not say y > 0";

  if (c.out_nchw) {  // out[i][k][q] = y[i][q][k]
    std::vector<double> got(pr.y.size()), want(pr.y.size());
    const size_t img = size_t(c.hw) * c.p;
    for (int i = 0; i < c.n; ++i)
      for (int k = 0; k < c.p; ++k)
        for (int q = 0; q < c.hw; ++q) {
          const size_t at = size_t(i) * img + size_t(k) * c.hw + q;
          got[at] = c.out_f32 ? double(first.out32[at]) : double(bits_to_float(first.out16[at], dt));
          want[at] = pr.y[size_t(i) * img + size_t(q) * c.p + k];
        }
    EXPECT_LE(rel_err(got, want, &bad), c.out_f32 ? 1e-4 : 4 * u_t) << "NCHW out";
    EXPECT_EQ(bad, 0u) << "NCHW out elements left unwritten (NaN poison) or not finite";
  }

  ASSERT_NO_FATAL_FAILURE(run(c, dt, pr, &d, &second));
  EXPECT_EQ(first.y, second.y) << "y differs between two launches";
  EXPECT_EQ(first.a_next, second.a_next) << "a_next differs between two launches";
  EXPECT_EQ(first.out16, second.out16) << "NCHW out differs between two launches";
  ASSERT_EQ(first.out32.size(), second.out32.size());
  if (!first.out32.empty())
    EXPECT_EQ(0, std::memcmp(first.out32.data(), second.out32.data(), first.out32.size() * 4))
        << "fp32 NCHW out differs between two launches";
}

INSTANTIATE_TEST_SUITE_P(Kernels, SqueezeExciteGpuTest, ::testing::ValuesIn(kfuse::testing::with_both_dtypes(kCases)),
                         kfuse::testing::DtypeCaseName());

// A rejected call returns cudaErrorInvalidValue before any CUDA call: no device needed.
TEST(SqueezeExciteArgs, RejectsIncompleteOrInconsistentArguments) {
  alignas(16) static uint16_t buf[4096];
  alignas(16) static float f[1024];
  SqueezeExciteArgs good;
  good.o = buf, good.identity = buf, good.y = buf;
  good.n = 1, good.hw = 4, good.p = 64, good.hidden = 4;
  good.w1 = f, good.b1 = f, good.w2 = f, good.b2 = f;
  auto rejected = [](SqueezeExciteArgs a) { return launch_squeeze_excite(a, kF16, nullptr) == cudaErrorInvalidValue; };
  SqueezeExciteArgs a = good;
  a.o = nullptr;
  EXPECT_TRUE(rejected(a)) << "no o";
  a = good, a.p = 60;
  EXPECT_TRUE(rejected(a)) << "P not a multiple of 8";
  a = good, a.hidden = 0;
  EXPECT_TRUE(rejected(a)) << "no hidden units";
  a = good, a.y = nullptr;
  EXPECT_TRUE(rejected(a)) << "no output at all";
  a = good, a.a_next = buf;
  EXPECT_TRUE(rejected(a)) << "a_next without next_b1a";
  a = good, a.o_scale = f;
  EXPECT_TRUE(rejected(a)) << "o_scale without o_shift";
  a = good, a.p = 96, a.hidden = 6, a.pre_hidden = buf, a.o_stride = 96 * 4 + 8;
  EXPECT_TRUE(rejected(a)) << "pre-activations on a shape only the generic kernel runs";
}

}  // namespace
