// GPU tests of the data-gradient convolution (src/kernels/conv/conv_backward.h) against a float64 CPU reference
// dx[n, y, x, c] = sum over (k, r, s) with y = p*stride_h + r - pad_h, x = q*stride_w + s - pad_w of
// dy[n, p, q, k] * w[k, r, s, c], computed from the same rounded fp16 / bf16 inputs. Tests that need a GPU skip when
// there is none or when its compute capability is not 8.x / 9.x (the kernels' SASS); the can_implement /
// workspace_bytes tests are host-only and run everywhere.
#include "kernels/conv/conv_backward.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "conv_reference.h"
#include "gpu_test_support.h"
#include "runtime/half_bits.h"

#include <cmath>
#include <cstdint>
#include <ostream>
#include <random>
#include <string>
#include <vector>

namespace {

using kfuse::testing::nan_bits;
using kfuse::testing::random_nonzero_bits;

using kfuse::testing::DeviceBuffer;
using kfuse::testing::seed_for;
using kfuse::testing::StreamGuard;

using kfuse::kernels::BackwardTile;
using kfuse::kernels::Conv2dProblem;
using kfuse::kernels::ConvDType;

struct DgradVariant {
  const char* name;
  ConvDType dtype;
  BackwardTile tile;
};

const DgradVariant kDgradVariants[] = {
    {"f16_128x128", ConvDType::kF16, BackwardTile::k128x128},
    {"f16_128x64", ConvDType::kF16, BackwardTile::k128x64},
    {"f16_64x64", ConvDType::kF16, BackwardTile::k64x64},
    {"bf16_128x64", ConvDType::kBF16, BackwardTile::k128x64},
};

// Normwise relative error bounds: output rounding (2^-11 / 2^-8 relative) dominates fp32 accumulation.
double dgrad_tolerance(ConvDType dt) { return dt == ConvDType::kF16 ? 5e-3 : 2e-2; }

std::string dgrad_skip_reason() { return kfuse::testing::device_skip_reason(8, 9, "the dgrad conv kernels"); }

size_t dx_elems(const Conv2dProblem& p) { return kfuse::testing::act_elems(p); }
size_t w_elems(const Conv2dProblem& p) { return kfuse::testing::filter_elems(p); }
size_t dy_elems(const Conv2dProblem& p) { return kfuse::testing::grad_elems(p); }
using kfuse::testing::reference_dgrad;

Conv2dProblem make_dgrad_problem(int n, int h, int w, int c, int k, int r, int s, int pad, int stride) {
  Conv2dProblem p;
  p.n = n, p.h = h, p.w = w, p.c = c, p.k = k, p.r = r, p.s = s;
  p.pad_h = p.pad_w = pad;
  p.stride_h = p.stride_w = stride;
  return p;
}

// Normwise relative error ||out - ref|| / ||ref||, NaN count (poison left behind), and the number of pixels that no
// tap reaches but whose output is not exactly 0.
struct DgradComparison {
  size_t nan_count = 0;
  size_t uncovered_nonzero = 0;
  double rel = 0.0;
  double ref_norm2 = 0.0;
};

DgradComparison compare_dgrad(const Conv2dProblem& p, const std::vector<uint16_t>& out,
                              const std::vector<double>& ref, const std::vector<char>& covered, ConvDType dt) {
  DgradComparison cmp;
  double err2 = 0.0;
  for (size_t i = 0; i < out.size(); ++i) {
    const double o = kfuse::bits_to_float(out[i], dt);
    if (std::isnan(o)) {
      ++cmp.nan_count;
      continue;
    }
    if (!covered[i / p.c] && o != 0.0) ++cmp.uncovered_nonzero;
    err2 += (o - ref[i]) * (o - ref[i]);
    cmp.ref_norm2 += ref[i] * ref[i];
  }
  cmp.rel = cmp.ref_norm2 > 0.0 ? std::sqrt(err2 / cmp.ref_norm2) : 0.0;
  return cmp;
}

// Elements of poison after dx: a store past the end of dx shows up there.
constexpr size_t kDgradGuardElems = 256;

// Uploads dy and w, poisons dx (and a guard region after it), launches on a non-blocking stream (so that a launcher
// ignoring its stream argument races with the synchronisation), and returns dx and the guard region.
void run_dgrad(const DgradVariant& v, const Conv2dProblem& p, const std::vector<uint16_t>& dy,
               const std::vector<uint16_t>& w, std::vector<uint16_t>* out, std::vector<uint16_t>* guard) {
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<uint16_t> poison(dx_elems(p) + kDgradGuardElems, nan_bits(v.dtype));
  DeviceBuffer ddy, dw, ddx, ws;
  ASSERT_EQ(ddy.alloc(dy.size() * sizeof(uint16_t)), cudaSuccess);
  ASSERT_EQ(dw.alloc(w.size() * sizeof(uint16_t)), cudaSuccess);
  ASSERT_EQ(ddx.alloc(poison.size() * sizeof(uint16_t)), cudaSuccess);
  const size_t ws_bytes = kfuse::kernels::conv2d_dgrad_workspace_bytes(p, v.dtype, v.tile);
  EXPECT_EQ(ws_bytes, 0u) << "no split-K: the dgrad needs no workspace";
  ASSERT_EQ(ws.alloc(ws_bytes), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(ddy.ptr, dy.data(), ddy.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dw.ptr, w.data(), dw.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(ddx.ptr, poison.data(), ddx.bytes, cudaMemcpyHostToDevice), cudaSuccess);

  StreamGuard stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream.stream, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(kfuse::kernels::conv2d_dgrad(p, v.dtype, v.tile, ddy.ptr, dw.ptr, ddx.ptr, ws.ptr, ws.bytes,
                                         stream.stream),
            cudaSuccess);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream.stream), cudaSuccess);

  std::vector<uint16_t> all(poison.size());
  ASSERT_EQ(cudaMemcpy(all.data(), ddx.ptr, ddx.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  out->assign(all.begin(), all.begin() + dx_elems(p));
  guard->assign(all.begin() + dx_elems(p), all.end());
}

// ---- random inputs, encoder-like and edge geometries ------------------------------------------------------------

struct DgradCase {
  const char* name;
  Conv2dProblem problem;
};

const DgradCase kDgradCases[] = {
    // The encoder's stride-2 3x3 pad-1 downsampling convs (forward x [n, h, w, c] -> y [n, h/2, w/2, k]).
    {"n3_16x16_c64_k256_s2", make_dgrad_problem(3, 16, 16, 64, 256, 3, 3, 1, 2)},
    {"n2_8x8_c128_k512_s2", make_dgrad_problem(2, 8, 8, 128, 512, 3, 3, 1, 2)},
    {"n2_4x4_c256_k1024_s2", make_dgrad_problem(2, 4, 4, 256, 1024, 3, 3, 1, 2)},
    // Odd extents: phases of unequal size (h = 7: 4 even rows, 3 odd ones), partial CTA tiles in every phase.
    {"n2_10x10_c32_k64_s2", make_dgrad_problem(2, 10, 10, 32, 64, 3, 3, 1, 2)},
    {"n2_7x7_c32_k64_s2", make_dgrad_problem(2, 7, 7, 32, 64, 3, 3, 1, 2)},
    // h != w, c and k not multiples of the 32-wide tiles (masked channels in both operands and the epilogue).
    {"n2_6x10_c48_k40_s2", make_dgrad_problem(2, 6, 10, 48, 40, 3, 3, 1, 2)},
    // pad 0: the last row and column (y = 7) are read by no tap and must come out 0.
    {"n2_8x8_c32_k64_s2_pad0", make_dgrad_problem(2, 8, 8, 32, 64, 3, 3, 0, 2)},
    // stride > filter: three of the four phases have no tap at all (CTAs that skip the main loop and store 0).
    {"n2_8x8_c64_k128_1x1_s2", make_dgrad_problem(2, 8, 8, 64, 128, 1, 1, 0, 2)},
    // stride 1 (one phase, all nine taps).
    {"n2_12x12_c64_k64_s1", make_dgrad_problem(2, 12, 12, 64, 64, 3, 3, 1, 1)},
    {"n2_5x5_c32_k96_s1", make_dgrad_problem(2, 5, 5, 32, 96, 3, 3, 1, 1)},
};

struct DgradParam {
  const DgradVariant* variant;
  DgradCase conv;
};

// Readable test listings (gtest would otherwise print the struct's bytes).
void PrintTo(const DgradParam& param, std::ostream* os) { *os << param.variant->name << "/" << param.conv.name; }

class ConvDgradGpuTest : public ::testing::TestWithParam<DgradParam> {};

TEST_P(ConvDgradGpuTest, MatchesFloat64Reference) {
  const DgradVariant& v = *GetParam().variant;
  const DgradCase& tc = GetParam().conv;
  const Conv2dProblem& p = tc.problem;
  if (const std::string why = dgrad_skip_reason(); !why.empty()) GTEST_SKIP() << why;

  const std::string test_name = std::string("dgrad/") + v.name + "/" + tc.name;
  const uint32_t seed = seed_for(test_name);
  SCOPED_TRACE(test_name + " seed=" + std::to_string(seed));
  ASSERT_TRUE(kfuse::kernels::conv2d_dgrad_can_implement(p, v.dtype, v.tile));

  std::mt19937 rng(seed);
  const std::vector<uint16_t> dy = random_nonzero_bits(dy_elems(p), v.dtype, rng);
  const std::vector<uint16_t> w = random_nonzero_bits(w_elems(p), v.dtype, rng);

  std::vector<uint16_t> out, guard;
  ASSERT_NO_FATAL_FAILURE(run_dgrad(v, p, dy, w, &out, &guard));

  std::vector<char> covered;
  const std::vector<double> ref = reference_dgrad(p, dy, w, v.dtype, &covered);
  const DgradComparison cmp = compare_dgrad(p, out, ref, covered, v.dtype);
  EXPECT_EQ(cmp.nan_count, 0u) << "dx elements left unwritten (NaN poison) or NaN, of " << out.size();
  EXPECT_EQ(cmp.uncovered_nonzero, 0u) << "dx elements that no filter tap reaches are not 0";
  ASSERT_GT(cmp.ref_norm2, 0.0);
  EXPECT_LE(cmp.rel, dgrad_tolerance(v.dtype)) << "normwise relative error ||dx-ref||/||ref||";
  size_t guard_touched = 0;
  for (uint16_t bits : guard) guard_touched += bits != nan_bits(v.dtype);
  EXPECT_EQ(guard_touched, 0u) << "stores past the end of dx";
}

std::vector<DgradParam> all_dgrad_params() {
  std::vector<DgradParam> params;
  for (const DgradVariant& v : kDgradVariants)
    for (const DgradCase& tc : kDgradCases) params.push_back({&v, tc});
  return params;
}

INSTANTIATE_TEST_SUITE_P(Kernels, ConvDgradGpuTest, ::testing::ValuesIn(all_dgrad_params()),
                         [](const ::testing::TestParamInfo<DgradParam>& info) {
                           return std::string(info.param.variant->name) + "_" + info.param.conv.name;
                         });

// ---- a rejected call returns cudaErrorInvalidValue and launches nothing -----------------------------------------

class ConvDgradLauncherTest : public ::testing::TestWithParam<const DgradVariant*> {};

TEST_P(ConvDgradLauncherTest, ReturnsErrorWithoutLaunching) {
  const DgradVariant& v = *GetParam();
  if (const std::string why = dgrad_skip_reason(); !why.empty()) GTEST_SKIP() << why;

  const Conv2dProblem good = make_dgrad_problem(1, 8, 8, 64, 64, 3, 3, 1, 2);
  const Conv2dProblem bad = make_dgrad_problem(1, 8, 8, 12, 64, 3, 3, 1, 2);  // c = 12: not 16-byte rows
  ASSERT_TRUE(kfuse::kernels::conv2d_dgrad_can_implement(good, v.dtype, v.tile));
  ASSERT_FALSE(kfuse::kernels::conv2d_dgrad_can_implement(bad, v.dtype, v.tile));

  std::mt19937 rng(seed_for(std::string("dgrad/") + v.name + "/reject"));
  const std::vector<uint16_t> dy = random_nonzero_bits(dy_elems(good), v.dtype, rng);  // covers `bad` too
  const std::vector<uint16_t> w = random_nonzero_bits(w_elems(good), v.dtype, rng);
  const std::vector<uint16_t> poison(dx_elems(good), nan_bits(v.dtype));
  DeviceBuffer ddy, dw, ddx;
  ASSERT_EQ(ddy.alloc(dy.size() * sizeof(uint16_t)), cudaSuccess);
  ASSERT_EQ(dw.alloc(w.size() * sizeof(uint16_t)), cudaSuccess);
  ASSERT_EQ(ddx.alloc(poison.size() * sizeof(uint16_t)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(ddy.ptr, dy.data(), ddy.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dw.ptr, w.data(), dw.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(ddx.ptr, poison.data(), ddx.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);

  using kfuse::kernels::conv2d_dgrad;
  const cudaError_t invalid = cudaErrorInvalidValue;
  EXPECT_EQ(conv2d_dgrad(bad, v.dtype, v.tile, ddy.ptr, dw.ptr, ddx.ptr, nullptr, 0, nullptr), invalid)
      << "problem that can_implement rejects";
  // Pointers offset by one element: 2-byte, not 16-byte aligned.
  EXPECT_EQ(conv2d_dgrad(good, v.dtype, v.tile, ddy.as<uint16_t>() + 1, dw.ptr, ddx.ptr, nullptr, 0, nullptr), invalid)
      << "misaligned dy";
  EXPECT_EQ(conv2d_dgrad(good, v.dtype, v.tile, ddy.ptr, dw.as<uint16_t>() + 1, ddx.ptr, nullptr, 0, nullptr), invalid)
      << "misaligned w";
  EXPECT_EQ(conv2d_dgrad(good, v.dtype, v.tile, ddy.ptr, dw.ptr, ddx.as<uint16_t>() + 1, nullptr, 0, nullptr), invalid)
      << "misaligned dx";
  EXPECT_EQ(conv2d_dgrad(good, v.dtype, v.tile, nullptr, dw.ptr, ddx.ptr, nullptr, 0, nullptr), invalid) << "null dy";
  EXPECT_EQ(conv2d_dgrad(good, v.dtype, v.tile, ddy.ptr, nullptr, ddx.ptr, nullptr, 0, nullptr), invalid) << "null w";
  EXPECT_EQ(conv2d_dgrad(good, v.dtype, v.tile, ddy.ptr, dw.ptr, nullptr, nullptr, 0, nullptr), invalid) << "null dx";
  EXPECT_EQ(conv2d_dgrad(good, v.dtype, static_cast<BackwardTile>(99), ddy.ptr, dw.ptr, ddx.ptr, nullptr, 0, nullptr),
            invalid)
      << "unknown tile";
  if (v.dtype == ConvDType::kBF16) {
    EXPECT_EQ(conv2d_dgrad(good, v.dtype, BackwardTile::k128x128, ddy.ptr, dw.ptr, ddx.ptr, nullptr, 0, nullptr),
              invalid)
        << "bf16 has no 128x128 instance";
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "a rejected call must not leave a CUDA error behind";
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  std::vector<uint16_t> out(poison.size());
  ASSERT_EQ(cudaMemcpy(out.data(), ddx.ptr, ddx.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  size_t touched = 0;
  for (uint16_t bits : out) touched += bits != nan_bits(v.dtype);
  EXPECT_EQ(touched, 0u) << "a rejected call wrote to dx, so something was launched";
}

INSTANTIATE_TEST_SUITE_P(Kernels, ConvDgradLauncherTest,
                         ::testing::Values(&kDgradVariants[0], &kDgradVariants[1], &kDgradVariants[2],
                                           &kDgradVariants[3]),
                         [](const ::testing::TestParamInfo<const DgradVariant*>& info) {
                           return std::string(info.param->name);
                         });

// ---- host-only: can_implement and workspace_bytes need no device ------------------------------------------------

TEST(ConvDgradCanImplement, AcceptsTheEncoderProblems) {
  using kfuse::kernels::conv2d_dgrad_can_implement;
  using kfuse::kernels::conv2d_dgrad_workspace_bytes;
  for (const DgradVariant& v : kDgradVariants) {
    SCOPED_TRACE(v.name);
    // The three downsampling convs at the largest batch, stride 1, and every test geometry above.
    const Conv2dProblem encoder[] = {make_dgrad_problem(2048, 16, 16, 64, 256, 3, 3, 1, 2),
                                     make_dgrad_problem(2048, 8, 8, 128, 512, 3, 3, 1, 2),
                                     make_dgrad_problem(2048, 4, 4, 256, 1024, 3, 3, 1, 2),
                                     make_dgrad_problem(2048, 16, 16, 64, 64, 3, 3, 1, 1)};
    for (const Conv2dProblem& p : encoder) {
      EXPECT_TRUE(conv2d_dgrad_can_implement(p, v.dtype, v.tile)) << "n=" << p.n << " h=" << p.h << " c=" << p.c;
      EXPECT_EQ(conv2d_dgrad_workspace_bytes(p, v.dtype, v.tile), 0u);
    }
    for (const DgradCase& tc : kDgradCases) {
      EXPECT_TRUE(conv2d_dgrad_can_implement(tc.problem, v.dtype, v.tile)) << tc.name;
      EXPECT_EQ(conv2d_dgrad_workspace_bytes(tc.problem, v.dtype, v.tile), 0u) << tc.name;
    }
  }
}

TEST(ConvDgradCanImplement, RejectsUnsupportedProblems) {
  using kfuse::kernels::conv2d_dgrad_can_implement;
  using kfuse::kernels::conv2d_dgrad_workspace_bytes;
  for (const DgradVariant& v : kDgradVariants) {
    SCOPED_TRACE(v.name);
    EXPECT_FALSE(conv2d_dgrad_can_implement(make_dgrad_problem(2, 16, 16, 12, 64, 3, 3, 1, 2), v.dtype, v.tile))
        << "c = 12 is not a multiple of 8";
    EXPECT_FALSE(conv2d_dgrad_can_implement(make_dgrad_problem(2, 16, 16, 3, 64, 3, 3, 1, 2), v.dtype, v.tile))
        << "c = 3 is not a multiple of 8";
    EXPECT_FALSE(conv2d_dgrad_can_implement(make_dgrad_problem(2, 16, 16, 64, 12, 3, 3, 1, 2), v.dtype, v.tile))
        << "k = 12 is not a multiple of 8";
    EXPECT_FALSE(conv2d_dgrad_can_implement(make_dgrad_problem(0, 16, 16, 64, 64, 3, 3, 1, 2), v.dtype, v.tile))
        << "empty batch";
    EXPECT_FALSE(conv2d_dgrad_can_implement(make_dgrad_problem(2, 16, 16, 64, 64, 3, 3, 1, 0), v.dtype, v.tile))
        << "stride 0";
    EXPECT_FALSE(conv2d_dgrad_can_implement(make_dgrad_problem(2, 2, 2, 64, 64, 5, 5, 0, 1), v.dtype, v.tile))
        << "filter larger than the input: empty dy";
    EXPECT_FALSE(conv2d_dgrad_can_implement(make_dgrad_problem(2, 16, 16, 64, 64, 3, 3, -1, 2), v.dtype, v.tile))
        << "negative padding";
    EXPECT_FALSE(conv2d_dgrad_can_implement(make_dgrad_problem(1, 40, 40, 8, 8, 33, 33, 0, 1), v.dtype, v.tile))
        << "filter above CUTLASS's 32 x 32 limit for the optimized iterators";
    EXPECT_EQ(conv2d_dgrad_workspace_bytes(make_dgrad_problem(2, 16, 16, 12, 64, 3, 3, 1, 2), v.dtype, v.tile), 0u)
        << "no workspace for a problem that cannot be implemented";
  }
  const Conv2dProblem ok = make_dgrad_problem(2, 16, 16, 64, 256, 3, 3, 1, 2);
  EXPECT_FALSE(conv2d_dgrad_can_implement(ok, ConvDType::kBF16, BackwardTile::k128x128)) << "no bf16 128x128";
  EXPECT_FALSE(conv2d_dgrad_can_implement(ok, ConvDType::kBF16, BackwardTile::k64x64)) << "no bf16 64x64";
  EXPECT_EQ(conv2d_dgrad_workspace_bytes(ok, ConvDType::kBF16, BackwardTile::k64x64), 0u);
  EXPECT_FALSE(conv2d_dgrad_can_implement(ok, ConvDType::kF16, static_cast<BackwardTile>(99))) << "unknown tile";
  EXPECT_FALSE(conv2d_dgrad_can_implement(ok, static_cast<ConvDType>(7), BackwardTile::k128x64)) << "unknown dtype";
}

}  // namespace
