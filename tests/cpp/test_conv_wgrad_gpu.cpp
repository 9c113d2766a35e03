// GPU tests of the weight-gradient convolutions (conv2d_wgrad*, src/kernels/conv/conv_backward.h) against a float64
// CPU reference dw[k, r, s, c] = sum over (n, p, q) of dy[n, p, q, k] * x[n, p*stride + r - pad, q*stride + s - pad, c]
// computed from the same rounded fp16 / bf16 inputs. Tests that need a GPU skip when there is none or when its compute
// capability is not 8.x / 9.x (the kernels' SASS); the ConvWgradCanImplement tests make no CUDA call and always run.
// Shares its executable with test_conv_dgrad_gpu.cpp: every helper is in this file's anonymous namespace and every
// suite name starts with ConvWgrad.
#include "kernels/conv/conv_backward.h"
#include "kernels/conv/wgrad_wgmma.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "conv_reference.h"
#include "gpu_test_support.h"

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
using kfuse::testing::random_nonzero_bits;

using kfuse::testing::DeviceBuffer;
using kfuse::testing::seed_for;
using kfuse::testing::StreamGuard;

using kfuse::kernels::BackwardTile;
using kfuse::kernels::Conv2dProblem;
using kfuse::kernels::ConvDType;

struct WgradVariant {
  const char* name;
  ConvDType dtype;
  BackwardTile tile;
};

const WgradVariant kWgradVariants[] = {
    {"f16_128x128", ConvDType::kF16, BackwardTile::k128x128},
    {"f16_128x64", ConvDType::kF16, BackwardTile::k128x64},
    {"f16_64x64", ConvDType::kF16, BackwardTile::k64x64},
    {"bf16_128x64", ConvDType::kBF16, BackwardTile::k128x64},
};

std::string wgrad_skip_reason() { return kfuse::testing::device_skip_reason(8, 9, "the wgrad conv kernels"); }

using kfuse::testing::act_elems;
using kfuse::testing::conv3x3;
using kfuse::testing::filter_elems;
using kfuse::testing::grad_elems;
using kfuse::testing::reference_wgrad;

Conv2dProblem wgrad_problem(int n, int h, int w, int c, int k, int r, int s, int pad, int stride) {
  Conv2dProblem p;
  p.n = n, p.h = h, p.w = w, p.c = c, p.k = k, p.r = r, p.s = s;
  p.pad_h = p.pad_w = pad;
  p.stride_h = p.stride_w = stride;
  return p;
}

// The encoder's convolutions are all 3x3 with padding 1.
// Normwise relative error ||out - ref|| / ||ref|| and NaN count of a device output against its reference.
struct WgradComparison {
  size_t nan_count = 0;
  double rel = 0.0;
  double ref_norm2 = 0.0;
};

WgradComparison compare_wgrad(const std::vector<float>& out, const std::vector<double>& ref) {
  WgradComparison c;
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

// All-ones bytes: a NaN as fp32, so cudaMemset poisons float buffers.
constexpr int kPoisonByte = 0xff;

size_t count_unpoisoned(const void* device_ptr, size_t bytes) {
  std::vector<unsigned char> host(bytes);
  if (cudaMemcpy(host.data(), device_ptr, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) return bytes;
  size_t touched = 0;
  for (unsigned char b : host) touched += b != kPoisonByte;
  return touched;
}

// ---- random inputs, the encoder's geometries ------------------------------------------------------------------

struct WgradCase {
  const char* name;
  Conv2dProblem problem;
  int splits[3];  // split_k values to run; 0 ends the list
};

const WgradCase kWgradCases[] = {
    // stride 1 (GEMM K = n*p*q = 768, 128, 32, 12)
    {"n3_16x16_c64_k64_s1", conv3x3(3, 16, 64, 64, 1), {1, 5, 32}},
    {"n2_8x8_c128_k128_s1", conv3x3(2, 8, 128, 128, 1), {1, 5, 32}},
    {"n2_4x4_c256_k256_s1", conv3x3(2, 4, 256, 256, 1), {1, 5, 32}},
    {"n3_2x2_c512_k512_s1", conv3x3(3, 2, 512, 512, 1), {1, 5, 32}},
    // stride 2 (GEMM K = 128, 48, 8): with 32 slices of 32-deep K tiles most slices get no data and must store zeros.
    {"n2_16x16_c64_k256_s2", conv3x3(2, 16, 64, 256, 2), {1, 5, 32}},
    {"n3_8x8_c128_k512_s2", conv3x3(3, 8, 128, 512, 2), {1, 5, 32}},
    {"n2_4x4_c256_k1024_s2", conv3x3(2, 4, 256, 1024, 2), {1, 5, 32}},
    // odd output (3x3, GEMM K = 18), r*s*c = 288 not a multiple of any CTA tile's N.
    {"n2_6x6_c32_k64_s2", conv3x3(2, 6, 32, 64, 2), {1, 5, 32}},
    // long GEMM K (64*16*16 = 16384 = 512 K tiles): fp32 accumulation accuracy, in one slice and in 64.
    {"n64_16x16_c64_k64_s1", conv3x3(64, 16, 64, 64, 1), {1, 64, 0}},
};

struct WgradParam {
  const WgradVariant* variant;
  const WgradCase* wcase;
};

// Readable test listings (gtest would otherwise print the struct's bytes).
void PrintTo(const WgradParam& param, std::ostream* os) { *os << param.variant->name << "/" << param.wcase->name; }

// Error bound 1e-3 (normwise, relative): dy and x hold exactly the fp16 / bf16 values that the reference uses, and the
// product of two of them is exact in fp32 (11 + 11 or 8 + 8 significand bits <= 24), so the only error is the fp32
// accumulation of n*p*q terms (up to 16384 here) in the tensor cores plus the split_k partial sums. For random-sign
// terms that is ~2^-24 * sqrt(terms) ~ 1e-5; even a systematic one-ulp bias per mma step (truncating adds) stays near
// 1e-4 at 16384 terms. Any dropped, repeated or misplaced 32-deep K tile is far above the bound (losing one of the
// 512 tiles of the long case alone gives ~sqrt(1/512) ~ 0.04).
constexpr double kWgradRelTol = 1e-3;

class ConvWgradGpuTest : public ::testing::TestWithParam<WgradParam> {};

// For each split_k of the case: NaN-poisoned dw and workspace, a launch on a non-blocking stream (so that a launcher
// ignoring its stream argument races with the synchronisation), a check against the reference, then a second launch
// onto the same, now valid, dw and the first launch's leftover partials, which must reproduce the first result
// bitwise: dw is overwritten, not accumulated into, and the summation order is fixed.
TEST_P(ConvWgradGpuTest, MatchesFloat64Reference) {
  const WgradVariant& v = *GetParam().variant;
  const WgradCase& tc = *GetParam().wcase;
  const Conv2dProblem& p = tc.problem;
  if (const std::string why = wgrad_skip_reason(); !why.empty()) GTEST_SKIP() << why;

  const std::string test_name = std::string("wgrad/") + v.name + "/" + tc.name;
  const uint32_t seed = seed_for(test_name);
  SCOPED_TRACE(test_name + " seed=" + std::to_string(seed));

  std::mt19937 rng(seed);
  const std::vector<uint16_t> dy = random_nonzero_bits(grad_elems(p), v.dtype, rng);
  const std::vector<uint16_t> x = random_nonzero_bits(act_elems(p), v.dtype, rng);
  const std::vector<double> ref = reference_wgrad(p, dy, x, v.dtype);

  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  DeviceBuffer d_dy, d_x, d_dw;
  ASSERT_EQ(d_dy.alloc(dy.size() * sizeof(uint16_t)), cudaSuccess);
  ASSERT_EQ(d_x.alloc(x.size() * sizeof(uint16_t)), cudaSuccess);
  ASSERT_EQ(d_dw.alloc(filter_elems(p) * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_dy.ptr, dy.data(), d_dy.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_x.ptr, x.data(), d_x.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  StreamGuard stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream.stream, cudaStreamNonBlocking), cudaSuccess);

  for (const int split_k : tc.splits) {
    if (split_k == 0) break;
    SCOPED_TRACE("split_k=" + std::to_string(split_k));
    ASSERT_TRUE(kfuse::kernels::conv2d_wgrad_can_implement(p, v.dtype, v.tile, split_k));

    const size_t ws_bytes = kfuse::kernels::conv2d_wgrad_workspace_bytes(p, v.dtype, v.tile, split_k);
    if (split_k == 1) {
      EXPECT_EQ(ws_bytes, 0u) << "split_k 1 writes dw directly";
    } else {
      EXPECT_EQ(ws_bytes, size_t(split_k) * filter_elems(p) * sizeof(float)) << "one fp32 partial dw per slice";
    }
    DeviceBuffer ws;
    ASSERT_EQ(ws.alloc(ws_bytes), cudaSuccess);
    // Poisoned partials too: the launcher does not zero the workspace, so every partial must be written in full
    // before the reduction reads it, or NaN reaches dw.
    ASSERT_EQ(cudaMemset(d_dw.ptr, kPoisonByte, d_dw.bytes), cudaSuccess);
    if (ws_bytes > 0) {
      ASSERT_EQ(cudaMemset(ws.ptr, kPoisonByte, ws_bytes), cudaSuccess);
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the memsets ran on the legacy stream

    std::vector<float> first(filter_elems(p)), second(filter_elems(p));
    for (std::vector<float>* out : {&first, &second}) {
      ASSERT_EQ(kfuse::kernels::conv2d_wgrad(p, v.dtype, v.tile, split_k, d_dy.ptr, d_x.ptr, d_dw.as<float>(),
                                             ws.ptr, ws.bytes, stream.stream),
                cudaSuccess);
      ASSERT_EQ(cudaGetLastError(), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream.stream), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(out->data(), d_dw.ptr, d_dw.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    }

    const WgradComparison c = compare_wgrad(first, ref);
    EXPECT_EQ(c.nan_count, 0u) << "dw elements left unwritten (NaN poison) or NaN, of " << first.size();
    ASSERT_GT(c.ref_norm2, 0.0);
    EXPECT_LE(c.rel, kWgradRelTol) << "normwise relative error ||dw-ref||/||ref||";
    EXPECT_EQ(std::memcmp(first.data(), second.data(), first.size() * sizeof(float)), 0)
        << "a second launch onto the same dw changed it: accumulated into dw or the workspace, or not deterministic";
  }
}

std::vector<WgradParam> all_wgrad_params() {
  std::vector<WgradParam> params;
  for (const WgradVariant& v : kWgradVariants)
    for (const WgradCase& tc : kWgradCases) params.push_back({&v, &tc});
  return params;
}

INSTANTIATE_TEST_SUITE_P(Kernels, ConvWgradGpuTest, ::testing::ValuesIn(all_wgrad_params()),
                         [](const ::testing::TestParamInfo<WgradParam>& info) {
                           return std::string(info.param.variant->name) + "_" + info.param.wcase->name;
                         });

// ---- the error contract: cudaErrorInvalidValue, and nothing launched ------------------------------------------

class ConvWgradVariantTest : public ::testing::TestWithParam<const WgradVariant*> {};

// A rejected call returns cudaErrorInvalidValue, leaves no CUDA error and launches nothing: dw and the workspace keep
// their poison.
TEST_P(ConvWgradVariantTest, LauncherReturnsErrorWithoutLaunching) {
  const WgradVariant& v = *GetParam();
  if (const std::string why = wgrad_skip_reason(); !why.empty()) GTEST_SKIP() << why;

  const Conv2dProblem good = conv3x3(2, 8, 64, 64, 1);
  const Conv2dProblem bad = conv3x3(2, 8, 12, 64, 1);  // c = 12: not 16-byte rows
  constexpr int kSplit = 4;
  ASSERT_FALSE(kfuse::kernels::conv2d_wgrad_can_implement(bad, v.dtype, v.tile, 1));
  ASSERT_TRUE(kfuse::kernels::conv2d_wgrad_can_implement(good, v.dtype, v.tile, kSplit));
  const size_t ws_bytes = kfuse::kernels::conv2d_wgrad_workspace_bytes(good, v.dtype, v.tile, kSplit);
  ASSERT_GT(ws_bytes, 0u);

  std::mt19937 rng(seed_for(std::string("wgrad/") + v.name + "/reject"));
  const std::vector<uint16_t> dy = random_nonzero_bits(grad_elems(good), v.dtype, rng);  // covers `bad` too
  const std::vector<uint16_t> x = random_nonzero_bits(act_elems(good), v.dtype, rng);
  DeviceBuffer d_dy, d_x, d_dw, ws;
  ASSERT_EQ(d_dy.alloc(dy.size() * sizeof(uint16_t)), cudaSuccess);
  ASSERT_EQ(d_x.alloc(x.size() * sizeof(uint16_t)), cudaSuccess);
  ASSERT_EQ(d_dw.alloc(filter_elems(good) * sizeof(float)), cudaSuccess);
  ASSERT_EQ(ws.alloc(ws_bytes + 16), cudaSuccess);  // room for the misaligned-workspace call
  ASSERT_EQ(cudaMemcpy(d_dy.ptr, dy.data(), d_dy.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_x.ptr, x.data(), d_x.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(d_dw.ptr, kPoisonByte, d_dw.bytes), cudaSuccess);
  ASSERT_EQ(cudaMemset(ws.ptr, kPoisonByte, ws.bytes), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);

  const auto wgrad = [&](const Conv2dProblem& p, int split_k, const void* dy_ptr, const void* x_ptr, float* dw_ptr,
                         void* ws_ptr, size_t ws_size) {
    return kfuse::kernels::conv2d_wgrad(p, v.dtype, v.tile, split_k, dy_ptr, x_ptr, dw_ptr, ws_ptr, ws_size, nullptr);
  };
  const void* dy_ok = d_dy.ptr;
  const void* x_ok = d_x.ptr;
  float* dw_ok = d_dw.as<float>();
  EXPECT_EQ(wgrad(bad, 1, dy_ok, x_ok, dw_ok, nullptr, 0), cudaErrorInvalidValue) << "c = 12";
  EXPECT_EQ(wgrad(good, 0, dy_ok, x_ok, dw_ok, ws.ptr, ws_bytes), cudaErrorInvalidValue) << "split_k 0";
  EXPECT_EQ(wgrad(good, 257, dy_ok, x_ok, dw_ok, ws.ptr, ws.bytes), cudaErrorInvalidValue) << "split_k 257";
  for (const int split_k : {1, kSplit}) {
    SCOPED_TRACE("split_k=" + std::to_string(split_k));
    void* w = split_k == 1 ? nullptr : ws.ptr;
    const size_t wb = split_k == 1 ? 0 : ws_bytes;
    EXPECT_EQ(wgrad(good, split_k, nullptr, x_ok, dw_ok, w, wb), cudaErrorInvalidValue) << "null dy";
    EXPECT_EQ(wgrad(good, split_k, dy_ok, nullptr, dw_ok, w, wb), cudaErrorInvalidValue) << "null x";
    EXPECT_EQ(wgrad(good, split_k, dy_ok, x_ok, nullptr, w, wb), cudaErrorInvalidValue) << "null dw";
    EXPECT_EQ(wgrad(good, split_k, d_dy.as<uint16_t>() + 1, x_ok, dw_ok, w, wb), cudaErrorInvalidValue)
        << "misaligned dy";
    EXPECT_EQ(wgrad(good, split_k, dy_ok, d_x.as<uint16_t>() + 1, dw_ok, w, wb), cudaErrorInvalidValue)
        << "misaligned x";
    EXPECT_EQ(wgrad(good, split_k, dy_ok, x_ok, dw_ok + 1, w, wb), cudaErrorInvalidValue) << "misaligned dw";
  }
  EXPECT_EQ(wgrad(good, kSplit, dy_ok, x_ok, dw_ok, nullptr, ws_bytes), cudaErrorInvalidValue) << "null workspace";
  EXPECT_EQ(wgrad(good, kSplit, dy_ok, x_ok, dw_ok, ws.ptr, ws_bytes - 1), cudaErrorInvalidValue)
      << "workspace one byte short";
  EXPECT_EQ(wgrad(good, kSplit, dy_ok, x_ok, dw_ok, ws.as<unsigned char>() + 4, ws_bytes), cudaErrorInvalidValue)
      << "misaligned workspace";
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "a rejected call must not leave a CUDA error behind";
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  EXPECT_EQ(count_unpoisoned(d_dw.ptr, d_dw.bytes), 0u) << "a rejected call wrote dw, so something was launched";
  EXPECT_EQ(count_unpoisoned(ws.ptr, ws.bytes), 0u) << "a rejected call wrote the workspace";
}

INSTANTIATE_TEST_SUITE_P(Kernels, ConvWgradVariantTest,
                         ::testing::Values(&kWgradVariants[0], &kWgradVariants[1], &kWgradVariants[2],
                                           &kWgradVariants[3]),
                         [](const ::testing::TestParamInfo<const WgradVariant*>& info) {
                           return std::string(info.param->name);
                         });

// ---- host-only: can_implement and workspace_bytes make no CUDA call --------------------------------------------

TEST(ConvWgradCanImplement, AcceptsTheEncoderGeometries) {
  using kfuse::kernels::conv2d_wgrad_can_implement;
  using kfuse::kernels::conv2d_wgrad_workspace_bytes;
  // Every 3x3 conv of the encoder at its largest batch, 2048: n*p*q up to 524288.
  const Conv2dProblem encoder[] = {conv3x3(2048, 16, 64, 64, 1),  conv3x3(2048, 8, 128, 128, 1),
                                   conv3x3(2048, 4, 256, 256, 1), conv3x3(2048, 2, 512, 512, 1),
                                   conv3x3(2048, 16, 64, 256, 2), conv3x3(2048, 8, 128, 512, 2),
                                   conv3x3(2048, 4, 256, 1024, 2)};
  for (const WgradVariant& v : kWgradVariants) {
    SCOPED_TRACE(v.name);
    for (const Conv2dProblem& p : encoder) {
      SCOPED_TRACE("c=" + std::to_string(p.c) + " k=" + std::to_string(p.k) + " stride=" + std::to_string(p.stride_h));
      for (const int split_k : {1, 2, 64, 256}) {
        EXPECT_TRUE(conv2d_wgrad_can_implement(p, v.dtype, v.tile, split_k)) << "split_k " << split_k;
        EXPECT_EQ(conv2d_wgrad_workspace_bytes(p, v.dtype, v.tile, split_k),
                  split_k == 1 ? 0u : size_t(split_k) * filter_elems(p) * sizeof(float))
            << "split_k " << split_k;
      }
    }
  }
}

TEST(ConvWgradCanImplement, RejectsUnsupportedProblems) {
  using kfuse::kernels::conv2d_wgrad_can_implement;
  using kfuse::kernels::conv2d_wgrad_workspace_bytes;
  const Conv2dProblem ok = conv3x3(2, 16, 64, 64, 1);
  for (const WgradVariant& v : kWgradVariants) {
    SCOPED_TRACE(v.name);
    EXPECT_TRUE(conv2d_wgrad_can_implement(ok, v.dtype, v.tile, 1));
    EXPECT_TRUE(conv2d_wgrad_can_implement(conv3x3(2, 6, 32, 64, 2), v.dtype, v.tile, 5)) << "odd output size";
    EXPECT_FALSE(conv2d_wgrad_can_implement(conv3x3(2, 16, 12, 64, 1), v.dtype, v.tile, 1))
        << "c = 12 is not a multiple of 8";
    EXPECT_FALSE(conv2d_wgrad_can_implement(conv3x3(2, 16, 3, 64, 1), v.dtype, v.tile, 1))
        << "c = 3 is not a multiple of 8";
    EXPECT_FALSE(conv2d_wgrad_can_implement(conv3x3(2, 16, 64, 12, 1), v.dtype, v.tile, 1))
        << "k = 12 is not a multiple of 8";
    EXPECT_FALSE(conv2d_wgrad_can_implement(ok, v.dtype, v.tile, 0)) << "split_k 0";
    EXPECT_FALSE(conv2d_wgrad_can_implement(ok, v.dtype, v.tile, -1)) << "split_k -1";
    EXPECT_FALSE(conv2d_wgrad_can_implement(ok, v.dtype, v.tile, 257)) << "split_k above 256";
    EXPECT_FALSE(conv2d_wgrad_can_implement(conv3x3(0, 16, 64, 64, 1), v.dtype, v.tile, 1)) << "empty batch";
    EXPECT_FALSE(conv2d_wgrad_can_implement(conv3x3(2, 16, 64, 64, 0), v.dtype, v.tile, 1)) << "stride 0";
    EXPECT_FALSE(conv2d_wgrad_can_implement(wgrad_problem(2, 2, 2, 64, 64, 5, 5, 0, 1), v.dtype, v.tile, 1))
        << "filter larger than the input";

    EXPECT_EQ(conv2d_wgrad_workspace_bytes(ok, v.dtype, v.tile, 1), 0u);
    EXPECT_EQ(conv2d_wgrad_workspace_bytes(ok, v.dtype, v.tile, 5), 5 * filter_elems(ok) * sizeof(float));
    EXPECT_EQ(conv2d_wgrad_workspace_bytes(conv3x3(2, 16, 12, 64, 1), v.dtype, v.tile, 5), 0u)
        << "no workspace for a problem that cannot be implemented";
    EXPECT_EQ(conv2d_wgrad_workspace_bytes(ok, v.dtype, v.tile, 257), 0u) << "nor for split_k above 256";
  }
  // bf16 has the k128x64 instance only.
  for (const BackwardTile tile : {BackwardTile::k128x128, BackwardTile::k64x64}) {
    EXPECT_FALSE(conv2d_wgrad_can_implement(ok, ConvDType::kBF16, tile, 1)) << "no bf16 instance";
    EXPECT_EQ(conv2d_wgrad_workspace_bytes(ok, ConvDType::kBF16, tile, 4), 0u);
  }
  EXPECT_FALSE(conv2d_wgrad_can_implement(ok, ConvDType::kF16, static_cast<BackwardTile>(99), 1)) << "unknown tile";
  EXPECT_FALSE(conv2d_wgrad_can_implement(ok, static_cast<ConvDType>(99), BackwardTile::k128x64, 1))
      << "unknown dtype";
}

// ---- the Hopper wgmma kernel for block 1's shape (wgrad_wgmma.h) ---------------------------------------------------

struct WgmmaCase {
  const char* name;
  Conv2dProblem problem;
};
// More images than an H100 has SMs (CTAs loop over images through every shared-memory stage), a wide non-square
// image, a number of 16-pixel K steps per image that is not a multiple of four (h = 5, w = 16: the kernel's step
// groups), fewer than four steps (h = 3: a stage is released at its image's end, not during the next image), and one
// image.
const WgmmaCase kWgmmaCases[] = {
    {"n300_16x16", conv3x3(300, 16, 64, 64, 1)},
    {"n7_8x32", wgrad_problem(7, 8, 32, 64, 64, 3, 3, 1, 1)},
    {"n137_5x16", wgrad_problem(137, 5, 16, 64, 64, 3, 3, 1, 1)},
    {"n400_3x16", wgrad_problem(400, 3, 16, 64, 64, 3, 3, 1, 1)},
    {"n1_16x16", conv3x3(1, 16, 64, 64, 1)},
};

class ConvWgradWgmmaTest : public ::testing::TestWithParam<std::tuple<int, int>> {};

// Poisoned dw and workspace, two launches (the second must reproduce the first bitwise), against float64. The bound
// is kWgradRelTol's: exact products, fp32 sums (per CTA over its images, then over the CTAs in order).
TEST_P(ConvWgradWgmmaTest, MatchesFloat64Reference) {
  const WgmmaCase& tc = kWgmmaCases[std::get<0>(GetParam())];
  const ConvDType dt = std::get<1>(GetParam()) == 0 ? ConvDType::kF16 : ConvDType::kBF16;
  const Conv2dProblem& p = tc.problem;
  std::string why;
  if (!kfuse::kernels::wgrad_wgmma_can_implement(p, dt, &why)) GTEST_SKIP() << why;
  const std::string test_name = std::string("wgrad-wgmma/") + tc.name + (dt == ConvDType::kF16 ? "/f16" : "/bf16");
  std::mt19937 rng(seed_for(test_name));
  const std::vector<uint16_t> dy = random_nonzero_bits(grad_elems(p), dt, rng);
  const std::vector<uint16_t> x = random_nonzero_bits(act_elems(p), dt, rng);
  const std::vector<double> ref = reference_wgrad(p, dy, x, dt);
  DeviceBuffer d_dy, d_x, d_dw, ws;
  ASSERT_EQ(d_dy.alloc(dy.size() * sizeof(uint16_t)), cudaSuccess);
  ASSERT_EQ(d_x.alloc(x.size() * sizeof(uint16_t)), cudaSuccess);
  ASSERT_EQ(d_dw.alloc(filter_elems(p) * sizeof(float)), cudaSuccess);
  const size_t ws_bytes = kfuse::kernels::wgrad_wgmma_workspace_bytes(p, dt);
  ASSERT_GE(ws_bytes, filter_elems(p) * sizeof(float));
  ASSERT_EQ(ws.alloc(ws_bytes), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_dy.ptr, dy.data(), d_dy.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_x.ptr, x.data(), d_x.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(d_dw.ptr, kPoisonByte, d_dw.bytes), cudaSuccess);
  ASSERT_EQ(cudaMemset(ws.ptr, kPoisonByte, ws.bytes), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  StreamGuard stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream.stream, cudaStreamNonBlocking), cudaSuccess);
  std::vector<float> first(filter_elems(p)), second(filter_elems(p));
  for (std::vector<float>* out : {&first, &second}) {
    ASSERT_EQ(kfuse::kernels::wgrad_wgmma(p, dt, d_dy.ptr, d_x.ptr, d_dw.as<float>(), ws.ptr, ws.bytes,
                                          stream.stream),
              cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream.stream), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(out->data(), d_dw.ptr, d_dw.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  }
  const WgradComparison c = compare_wgrad(first, ref);
  EXPECT_EQ(c.nan_count, 0u) << "dw elements left unwritten (NaN poison) or NaN";
  ASSERT_GT(c.ref_norm2, 0.0);
  EXPECT_LE(c.rel, kWgradRelTol) << "normwise relative error ||dw-ref||/||ref||";
  EXPECT_EQ(std::memcmp(first.data(), second.data(), first.size() * sizeof(float)), 0) << "not reproducible";
  // Rejected calls launch nothing: a too-small workspace, a misaligned pointer.
  ASSERT_EQ(cudaMemset(d_dw.ptr, kPoisonByte, d_dw.bytes), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(kfuse::kernels::wgrad_wgmma(p, dt, d_dy.ptr, d_x.ptr, d_dw.as<float>(), ws.ptr, ws_bytes - 16,
                                        stream.stream),
            cudaErrorInvalidValue);
  EXPECT_EQ(kfuse::kernels::wgrad_wgmma(p, dt, static_cast<char*>(d_dy.ptr) + 2, d_x.ptr, d_dw.as<float>(), ws.ptr,
                                        ws.bytes, stream.stream),
            cudaErrorInvalidValue);
  ASSERT_EQ(cudaStreamSynchronize(stream.stream), cudaSuccess);
  EXPECT_EQ(count_unpoisoned(d_dw.ptr, d_dw.bytes), 0u) << "a rejected call wrote dw";
}

INSTANTIATE_TEST_SUITE_P(Kernels, ConvWgradWgmmaTest,
                         ::testing::Combine(::testing::Range(0, int(std::size(kWgmmaCases))), ::testing::Range(0, 2)),
                         [](const ::testing::TestParamInfo<std::tuple<int, int>>& info) {
                           return std::string(kWgmmaCases[std::get<0>(info.param)].name) +
                                  (std::get<1>(info.param) == 0 ? "_f16" : "_bf16");
                         });

// No CUDA call for a shape the kernel does not take: the reason names it (runs on any machine).
TEST(ConvWgradWgmmaCanImplement, RefusesOtherShapesWithAReason) {
  using kfuse::kernels::wgrad_wgmma_can_implement;
  const struct {
    Conv2dProblem p;
    const char* expect;
  } cases[] = {
      {conv3x3(2, 16, 128, 128, 1), "64 input and 64 output channels"},
      {conv3x3(2, 16, 64, 64, 2), "stride 1"},
      {wgrad_problem(2, 16, 16, 64, 64, 1, 1, 0, 1), "3x3"},
      {conv3x3(2, 8, 64, 64, 1), "multiple of 16"},
      {conv3x3(0, 16, 64, 64, 1), "empty batch"},
      {conv3x3(2, 64, 64, 64, 1), "too large"},
  };
  for (const auto& c : cases) {
    std::string why;
    EXPECT_FALSE(wgrad_wgmma_can_implement(c.p, ConvDType::kF16, &why));
    EXPECT_NE(why.find(c.expect), std::string::npos) << why;
  }
  std::string why;
  EXPECT_FALSE(wgrad_wgmma_can_implement(conv3x3(2, 16, 64, 64, 1), static_cast<ConvDType>(99), &why));
  EXPECT_NE(why.find("fp16 or bf16"), std::string::npos) << why;
  EXPECT_EQ(kfuse::kernels::wgrad_wgmma_workspace_bytes(conv3x3(2, 16, 128, 128, 1), ConvDType::kF16), 0u);
}

}  // namespace
