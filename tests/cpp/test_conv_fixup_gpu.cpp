// GPU tests of the FixUp-epilogue conv launchers (src/kernels/conv/conv_fixup.h) against a float64 CPU reference
// y = post + act(alpha * conv(x, w) + pre) computed from the same rounded fp16 / bf16 inputs. Tests that need a GPU
// skip when there is none or when its compute capability is not 8.x / 9.x (the kernels' SASS), or not 9.x for the
// Hopper (kSm90) tiles, which run split_k 1 only. The parallel split-K launchers (conv2d_fprop_fixup_parallel: fp32
// partials, then the reduction pass with the epilogue) run the same cases with split_k >= 2.
#include "kernels/conv/conv_fixup.h"
#include "kernels/programmatic_launch.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "conv_reference.h"
#include "gpu_test_support.h"
#include "kernels/timing/gpu_delay.h"

#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

namespace {

using kfuse::bits_to_float;
using kfuse::float_to_bits;
using kfuse::testing::nan_bits;
using kfuse::testing::random_nonzero_bits;

using kfuse::testing::DeviceBuffer;
using kfuse::testing::seed_for;
using kfuse::testing::StreamGuard;

using kfuse::kernels::Conv2dProblem;
using kfuse::kernels::ConvDType;
using kfuse::kernels::ConvTile;
using kfuse::kernels::FixupEpilogue;

struct Variant {
  const char* name;
  ConvDType dtype;
  ConvTile tile;
  bool sm90 = false;      // CUTLASS 3.x Hopper tile: compute capability 9.x, fp16, split_k 1 only
  bool parallel = false;  // parallel split-K launcher: split_k >= 2 only
};

const Variant kVariants[] = {
    {"f16_128x64", ConvDType::kF16, ConvTile::k128x64},
    {"f16_64x64", ConvDType::kF16, ConvTile::k64x64},
    {"bf16_128x64", ConvDType::kBF16, ConvTile::k128x64},
    {"bf16_64x64", ConvDType::kBF16, ConvTile::k64x64},
    {"f16_64x64x64", ConvDType::kF16, ConvTile::k64x64x64},
    {"f16_128x64x64", ConvDType::kF16, ConvTile::k128x64x64},
    {"f16_64x128", ConvDType::kF16, ConvTile::k64x128},
    {"f16_128x128", ConvDType::kF16, ConvTile::k128x128},
    {"f16_128x64w8", ConvDType::kF16, ConvTile::k128x64w8},
};

const Variant kSm90Variants[] = {
    {"f16_sm90_128x64", ConvDType::kF16, ConvTile::kSm90_128x64, true},
    {"f16_sm90_64x64", ConvDType::kF16, ConvTile::kSm90_64x64, true},
    {"f16_sm90_64x64_c2x2", ConvDType::kF16, ConvTile::kSm90_64x64_c2x2, true},
    {"f16_sm90_128x64_s4", ConvDType::kF16, ConvTile::kSm90_128x64_s4, true},
    {"f16_sm90_128x128", ConvDType::kF16, ConvTile::kSm90_128x128, true},
    {"f16_sm90_256x64", ConvDType::kF16, ConvTile::kSm90_256x64, true},
};

const Variant kParallelVariants[] = {
    {"f16_128x128_parallel", ConvDType::kF16, ConvTile::k128x128, false, true},
    {"f16_64x128_parallel", ConvDType::kF16, ConvTile::k64x128, false, true},
    {"f16_64x64x64_parallel", ConvDType::kF16, ConvTile::k64x64x64, false, true},
    {"f16_128x64_parallel", ConvDType::kF16, ConvTile::k128x64, false, true},
    {"bf16_128x128_parallel", ConvDType::kBF16, ConvTile::k128x128, false, true},
    {"bf16_64x64_parallel", ConvDType::kBF16, ConvTile::k64x64, false, true},
};

// The three entry points of a variant: the serial launchers (conv_fixup.h's first three) or the parallel ones.
bool can_implement(const Variant& v, const Conv2dProblem& p, int split_k) {
  return v.parallel ? kfuse::kernels::conv2d_fprop_fixup_parallel_can_implement(p, v.dtype, v.tile, split_k)
                    : kfuse::kernels::conv2d_fprop_fixup_can_implement(p, v.dtype, v.tile, split_k);
}
size_t workspace_bytes(const Variant& v, const Conv2dProblem& p, int split_k) {
  return v.parallel ? kfuse::kernels::conv2d_fprop_fixup_parallel_workspace_bytes(p, v.dtype, v.tile, split_k)
                    : kfuse::kernels::conv2d_fprop_fixup_workspace_bytes(p, v.dtype, v.tile, split_k);
}
cudaError_t launch(const Variant& v, const Conv2dProblem& p, const void* x, const void* w, void* y,
                   const FixupEpilogue& e, int split_k, void* ws, size_t ws_bytes, cudaStream_t stream) {
  return v.parallel ? kfuse::kernels::conv2d_fprop_fixup_parallel(p, v.dtype, v.tile, x, w, y, e, split_k, ws,
                                                                  ws_bytes, stream)
                    : kfuse::kernels::conv2d_fprop_fixup(p, v.dtype, v.tile, x, w, y, e, split_k, ws, ws_bytes,
                                                         stream);
}

std::string device_skip_reason(const Variant& v) {
  if (v.sm90) return kfuse::testing::device_skip_reason(9, 9, "the sm90 fixup conv kernels (sm_90a)");
  return kfuse::testing::device_skip_reason(8, 9, "the fixup conv kernels");
}

using kfuse::testing::act_elems;
using kfuse::testing::filter_elems;
using kfuse::testing::grad_elems;  // the output's size (NPQK)

Conv2dProblem make_problem(int n, int h, int w, int c, int k, int r, int s, int pad, int stride) {
  Conv2dProblem p;
  p.n = n, p.h = h, p.w = w, p.c = c, p.k = k, p.r = r, p.s = s;
  p.pad_h = p.pad_w = pad;
  p.stride_h = p.stride_w = stride;
  return p;
}

// Normwise relative error ||out - ref|| / ||ref|| and NaN count of a device output against its reference.
struct Comparison {
  size_t nan_count = 0;
  double rel = 0.0;
  double ref_norm2 = 0.0;
};

Comparison compare(const std::vector<uint16_t>& out, const std::vector<double>& ref, ConvDType dt) {
  Comparison c;
  double err2 = 0.0;
  for (size_t i = 0; i < out.size(); ++i) {
    const double o = bits_to_float(out[i], dt);
    if (std::isnan(o)) {
      ++c.nan_count;
      continue;
    }
    err2 += (o - ref[i]) * (o - ref[i]);
    c.ref_norm2 += ref[i] * ref[i];
  }
  c.rel = c.ref_norm2 > 0.0 ? std::sqrt(err2 / c.ref_norm2) : 0.0;
  return c;
}

// Uploads x and w, poisons y, launches on a non-blocking stream (so that a launcher ignoring its stream argument
// races with the synchronisation), and returns y.
void run_fixup(const Variant& v, const Conv2dProblem& p, int split_k, const std::vector<uint16_t>& x,
               const std::vector<uint16_t>& w, const FixupEpilogue& epilogue, std::vector<uint16_t>* out) {
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<uint16_t> poison(grad_elems(p), nan_bits(v.dtype));
  DeviceBuffer dx, dw, dy, ws;
  ASSERT_EQ(dx.alloc(x.size() * sizeof(uint16_t)), cudaSuccess);
  ASSERT_EQ(dw.alloc(w.size() * sizeof(uint16_t)), cudaSuccess);
  ASSERT_EQ(dy.alloc(poison.size() * sizeof(uint16_t)), cudaSuccess);
  const size_t ws_bytes = workspace_bytes(v, p, split_k);
  if (v.parallel) {
    EXPECT_EQ(ws_bytes, size_t(split_k) * grad_elems(p) * sizeof(float)) << "the split_k fp32 partial outputs";
  } else if (split_k == 1) {
    EXPECT_EQ(ws_bytes, 0u);
  } else {
    EXPECT_GT(ws_bytes, 0u) << "serial split-K needs its semaphores";
  }
  ASSERT_EQ(ws.alloc(ws_bytes), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dx.ptr, x.data(), dx.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dw.ptr, w.data(), dw.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dy.ptr, poison.data(), dy.bytes, cudaMemcpyHostToDevice), cudaSuccess);

  StreamGuard stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream.stream, cudaStreamNonBlocking), cudaSuccess);
  if (v.parallel) {  // poison the partials too: a slice left unwritten must show
    ASSERT_EQ(cudaMemset(ws.ptr, 0xff, ws.bytes), cudaSuccess);
  }
  ASSERT_EQ(launch(v, p, dx.ptr, dw.ptr, dy.ptr, epilogue, split_k, ws.ptr, ws.bytes, stream.stream), cudaSuccess);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream.stream), cudaSuccess);

  out->assign(poison.size(), 0);
  ASSERT_EQ(cudaMemcpy(out->data(), dy.ptr, dy.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
}

// ---- random inputs and scalars, encoder-like shapes ------------------------------------------------------------

struct FixupCase {
  const char* name;
  Conv2dProblem problem;
  int split_k;
};

const FixupCase kCases[] = {
    {"n3_16x16_c64_k64_s1", make_problem(3, 16, 16, 64, 64, 3, 3, 1, 1), 1},
    {"n3_16x16_c64_k64_s1_split2", make_problem(3, 16, 16, 64, 64, 3, 3, 1, 1), 2},
    {"n2_16x16_c64_k128_s2", make_problem(2, 16, 16, 64, 128, 3, 3, 1, 2), 1},
    {"n2_4x4_c256_k512_s2", make_problem(2, 4, 4, 256, 512, 3, 3, 1, 2), 1},
    // C / split_k not a multiple of the 32-channel K tile: uneven slices, the last one partly out of range.
    {"n2_4x4_c256_k512_s2_split3", make_problem(2, 4, 4, 256, 512, 3, 3, 1, 2), 3},
    {"n2_2x2_c512_k512_s1", make_problem(2, 2, 2, 512, 512, 3, 3, 1, 1), 1},
    {"n2_2x2_c512_k512_s1_split4", make_problem(2, 2, 2, 512, 512, 3, 3, 1, 1), 4},
    {"n2_2x2_c512_k512_s1_split9", make_problem(2, 2, 2, 512, 512, 3, 3, 1, 1), 9},
};

struct GpuParam {
  const Variant* variant;
  FixupCase conv;
  bool relu;
};

// Readable test listings (gtest would otherwise print the struct's bytes).
void PrintTo(const GpuParam& param, std::ostream* os) {
  *os << param.variant->name << "/" << param.conv.name << "/split" << param.conv.split_k
      << (param.relu ? "/relu" : "/identity");
}

class ConvFixupGpuTest : public ::testing::TestWithParam<GpuParam> {};

TEST_P(ConvFixupGpuTest, MatchesFloat64Reference) {
  const Variant& v = *GetParam().variant;
  const FixupCase& tc = GetParam().conv;
  const bool relu = GetParam().relu;
  const Conv2dProblem& p = tc.problem;
  if (const std::string why = device_skip_reason(v); !why.empty()) GTEST_SKIP() << why;

  const std::string test_name = std::string(v.name) + "/" + tc.name + (relu ? "/relu" : "/identity");
  const uint32_t seed = seed_for(test_name);
  SCOPED_TRACE(test_name + " seed=" + std::to_string(seed));
  ASSERT_TRUE(can_implement(v, p, tc.split_k));

  std::mt19937 rng(seed);
  const std::vector<uint16_t> x = random_nonzero_bits(act_elems(p), v.dtype, rng);
  const std::vector<uint16_t> w = random_nonzero_bits(filter_elems(p), v.dtype, rng);
  // conv outputs have a spread of ~8 to ~22 here: pre in [-4, 4] moves the relu threshold without clipping all.
  const float scalars[3] = {std::uniform_real_distribution<float>(0.25f, 1.5f)(rng),
                            std::uniform_real_distribution<float>(-4.0f, 4.0f)(rng),
                            std::uniform_real_distribution<float>(-2.0f, 2.0f)(rng)};

  DeviceBuffer dscalars;  // alpha, pre, post: device scalars, as the encoder keeps them
  ASSERT_EQ(dscalars.alloc(sizeof(scalars)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dscalars.ptr, scalars, sizeof(scalars), cudaMemcpyHostToDevice), cudaSuccess);
  FixupEpilogue epilogue;
  epilogue.alpha = dscalars.as<float>() + 0;
  epilogue.pre = dscalars.as<float>() + 1;
  epilogue.post = dscalars.as<float>() + 2;
  epilogue.relu = relu;

  std::vector<uint16_t> out;
  ASSERT_NO_FATAL_FAILURE(run_fixup(v, p, tc.split_k, x, w, epilogue, &out));

  const std::vector<double> ref =
      kfuse::testing::reference_fprop_fixup(p, x, w, v.dtype, scalars[0], scalars[1], scalars[2], relu);
  const Comparison c = compare(out, ref, v.dtype);
  EXPECT_EQ(c.nan_count, 0u) << "output elements left unwritten (NaN poison) or NaN, of " << out.size();
  ASSERT_GT(c.ref_norm2, 0.0);
  EXPECT_LE(c.rel, 1e-2) << "normwise relative error ||out-ref||/||ref||, alpha=" << scalars[0]
                         << " pre=" << scalars[1] << " post=" << scalars[2];
}

std::vector<GpuParam> all_gpu_params() {
  std::vector<GpuParam> params;
  for (const Variant& v : kVariants)
    for (const FixupCase& tc : kCases)
      for (bool relu : {false, true}) params.push_back({&v, tc, relu});
  for (const Variant& v : kSm90Variants)
    for (const FixupCase& tc : kCases)
      if (tc.split_k == 1)
        for (bool relu : {false, true}) params.push_back({&v, tc, relu});
  for (const Variant& v : kParallelVariants)
    for (const FixupCase& tc : kCases)
      if (tc.split_k >= 2)
        for (bool relu : {false, true}) params.push_back({&v, tc, relu});
  return params;
}

INSTANTIATE_TEST_SUITE_P(Kernels, ConvFixupGpuTest, ::testing::ValuesIn(all_gpu_params()),
                         [](const ::testing::TestParamInfo<GpuParam>& info) {
                           return std::string(info.param.variant->name) + "_" + info.param.conv.name +
                                  (info.param.relu ? "_relu" : "_identity");
                         });

// ---- programmatic dependent launch (kernels/programmatic_launch.h) ----------------------------------------------

// Three dependent convolutions x -> y1 -> y2 -> y3 on one stream, behind a 200 us delay kernel (so that every launch
// is queued while its predecessor still runs), each output poisoned first. Under a PdlScope each conv may start
// before the previous one ends: a kernel that touched its input before griddepcontrol.wait would read poison or a
// partial result. Returns y1 and y3.
void run_chain(const Variant& v, const Conv2dProblem& p, int split_k, const std::vector<uint16_t>& x,
               const std::vector<uint16_t>& w, const FixupEpilogue& e, bool programmatic, std::vector<uint16_t>* y1,
               std::vector<uint16_t>* y3) {
  const std::vector<uint16_t> poison(grad_elems(p), nan_bits(v.dtype));
  DeviceBuffer dx, dw, dy[3], ws;
  ASSERT_EQ(dx.alloc(x.size() * sizeof(uint16_t)), cudaSuccess);
  ASSERT_EQ(dw.alloc(w.size() * sizeof(uint16_t)), cudaSuccess);
  for (auto& d : dy) {
    ASSERT_EQ(d.alloc(poison.size() * sizeof(uint16_t)), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d.ptr, poison.data(), d.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  }
  ASSERT_EQ(ws.alloc(workspace_bytes(v, p, split_k)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dx.ptr, x.data(), dx.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dw.ptr, w.data(), dw.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  StreamGuard stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream.stream, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(kfuse::kernels::launch_gpu_delay(stream.stream, 200), cudaSuccess);
  {
    kfuse::kernels::PdlScope scope(programmatic);
    const void* in = dx.ptr;
    for (auto& d : dy) {
      ASSERT_EQ(launch(v, p, in, dw.ptr, d.ptr, e, split_k, ws.ptr, ws.bytes, stream.stream), cudaSuccess);
      in = d.ptr;
    }
  }
  ASSERT_EQ(cudaStreamSynchronize(stream.stream), cudaSuccess);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  y1->assign(poison.size(), 0);
  y3->assign(poison.size(), 0);
  ASSERT_EQ(cudaMemcpy(y1->data(), dy[0].ptr, dy[0].bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(y3->data(), dy[2].ptr, dy[2].bytes, cudaMemcpyDeviceToHost), cudaSuccess);
}

class ConvFixupProgrammaticTest : public ::testing::TestWithParam<const Variant*> {};

// The chain with programmatic launches gives the bits of the chain without them (serial split-K included: its
// semaphore memset makes that conv launch normally), and its first output matches the float64 reference.
TEST_P(ConvFixupProgrammaticTest, ChainGivesTheSameBits) {
  const Variant& v = *GetParam();
  if (const std::string why = device_skip_reason(v); !why.empty()) GTEST_SKIP() << why;
  // 64 -> 64 channels keeps the chain's shapes equal; 8 images of 16x16 give every tile a few CTAs.
  const Conv2dProblem p = make_problem(8, 16, 16, 64, 64, 3, 3, 1, 1);
  for (int split_k : {1, 2, 3}) {
    if (!can_implement(v, p, split_k)) continue;  // sm90: split_k 1 only; parallel: >= 2
    const std::string test_name = std::string(v.name) + "/pdl_chain/split" + std::to_string(split_k);
    const uint32_t seed = seed_for(test_name);
    SCOPED_TRACE(test_name + " seed=" + std::to_string(seed));
    std::mt19937 rng(seed);
    const std::vector<uint16_t> x = random_nonzero_bits(act_elems(p), v.dtype, rng);
    // Small weights keep the three chained outputs in range: |conv| ~ sqrt(576) * 0.05 * |in|.
    const std::vector<uint16_t> w = random_nonzero_bits(filter_elems(p), v.dtype, rng, -0.05f, 0.05f);
    const float scalars[3] = {1.25f, 0.125f, -0.5f};
    DeviceBuffer dscalars;
    ASSERT_EQ(dscalars.alloc(sizeof(scalars)), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dscalars.ptr, scalars, sizeof(scalars), cudaMemcpyHostToDevice), cudaSuccess);
    const FixupEpilogue e{dscalars.as<float>(), dscalars.as<float>() + 1, dscalars.as<float>() + 2, true};

    std::vector<uint16_t> plain1, plain3, pdl1, pdl3;
    ASSERT_NO_FATAL_FAILURE(run_chain(v, p, split_k, x, w, e, false, &plain1, &plain3));
    ASSERT_NO_FATAL_FAILURE(run_chain(v, p, split_k, x, w, e, true, &pdl1, &pdl3));
    EXPECT_EQ(pdl1, plain1);
    EXPECT_EQ(pdl3, plain3);
    const Comparison c = compare(plain1, kfuse::testing::reference_fprop_fixup(p, x, w, v.dtype, scalars[0],
                                                                              scalars[1], scalars[2], true),
                                 v.dtype);
    EXPECT_EQ(c.nan_count, 0u);
    ASSERT_GT(c.ref_norm2, 0.0);
    EXPECT_LE(c.rel, 1e-2);
    size_t nan3 = 0;
    for (uint16_t b : plain3) nan3 += std::isnan(bits_to_float(b, v.dtype)) ? 1 : 0;
    EXPECT_EQ(nan3, 0u) << "the chain's last output has NaNs (poison left or overflow)";
  }
}

std::vector<const Variant*> all_variants() {
  std::vector<const Variant*> out;
  for (const Variant& v : kVariants) out.push_back(&v);
  for (const Variant& v : kSm90Variants) out.push_back(&v);
  for (const Variant& v : kParallelVariants) out.push_back(&v);
  return out;
}

INSTANTIATE_TEST_SUITE_P(Kernels, ConvFixupProgrammaticTest, ::testing::ValuesIn(all_variants()),
                         [](const ::testing::TestParamInfo<const Variant*>& info) { return info.param->name; });

// Host only: the scope nests and restores; without a device there is no programmatic launch. (The developer switch
// KFUSE_PDL is an encoder option override now: tests/cpp/test_dev_overrides.cpp.)
TEST(ProgrammaticLaunch, ScopeNestsAndRestores) {
  EXPECT_FALSE(kfuse::kernels::pdl_requested());
  {
    kfuse::kernels::PdlScope on(true);
    EXPECT_TRUE(kfuse::kernels::pdl_requested());
    {
      kfuse::kernels::PdlScope off(false);
      EXPECT_FALSE(kfuse::kernels::pdl_requested());
    }
    EXPECT_TRUE(kfuse::kernels::pdl_requested());
  }
  EXPECT_FALSE(kfuse::kernels::pdl_requested());
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    EXPECT_FALSE(kfuse::kernels::pdl_supported(0)) << "no device: no programmatic launch";
  }
}

// ---- nullptr scalars mean alpha = 1, pre = 0, post = 0 ---------------------------------------------------------

class ConvFixupVariantTest : public ::testing::TestWithParam<const Variant*> {};

TEST_P(ConvFixupVariantTest, NullScalarsMeanIdentity) {
  const Variant& v = *GetParam();
  if (const std::string why = device_skip_reason(v); !why.empty()) GTEST_SKIP() << why;

  const Conv2dProblem p = make_problem(2, 8, 8, 64, 64, 3, 3, 1, 1);
  for (int split_k : {1, 2}) {
    if (v.sm90 && split_k != 1) continue;    // no split-K on the Hopper tiles
    if (v.parallel && split_k == 1) continue;  // parallel split-K needs two slices
    for (bool relu : {false, true}) {
      const std::string test_name =
          std::string(v.name) + "/null_scalars/split" + std::to_string(split_k) + (relu ? "/relu" : "/identity");
      const uint32_t seed = seed_for(test_name);
      SCOPED_TRACE(test_name + " seed=" + std::to_string(seed));
      ASSERT_TRUE(can_implement(v, p, split_k));

      std::mt19937 rng(seed);
      const std::vector<uint16_t> x = random_nonzero_bits(act_elems(p), v.dtype, rng);
      const std::vector<uint16_t> w = random_nonzero_bits(filter_elems(p), v.dtype, rng);
      FixupEpilogue epilogue;  // all three pointers nullptr
      epilogue.relu = relu;

      std::vector<uint16_t> out;
      ASSERT_NO_FATAL_FAILURE(run_fixup(v, p, split_k, x, w, epilogue, &out));
      const std::vector<double> ref = kfuse::testing::reference_fprop_fixup(p, x, w, v.dtype, 1.0, 0.0, 0.0, relu);
      const Comparison c = compare(out, ref, v.dtype);
      EXPECT_EQ(c.nan_count, 0u) << "output elements left unwritten (NaN poison) or NaN, of " << out.size();
      ASSERT_GT(c.ref_norm2, 0.0);
      EXPECT_LE(c.rel, 1e-2) << "normwise relative error ||out-ref||/||ref||";
    }
  }
}

// A rejected call returns cudaErrorInvalidValue and launches nothing (the poisoned output stays untouched).
TEST_P(ConvFixupVariantTest, LauncherReturnsErrorWithoutLaunching) {
  const Variant& v = *GetParam();
  if (const std::string why = device_skip_reason(v); !why.empty()) GTEST_SKIP() << why;
  // The smallest split each launcher accepts (parallel split-K needs two slices) and a workspace that fits it, so
  // that each call below is rejected for the one fault it has.
  const int split = v.parallel ? 2 : 1;

  const Conv2dProblem bad = make_problem(1, 8, 8, 3, 64, 3, 3, 1, 1);  // C = 3: not 16-byte rows
  ASSERT_FALSE(can_implement(v, bad, split));
  const Conv2dProblem good = make_problem(1, 8, 8, 64, 64, 3, 3, 1, 1);
  ASSERT_TRUE(can_implement(v, good, split));
  if (v.sm90) {  // split_k 4 is then rejected by can_implement rather than for its missing workspace
    ASSERT_FALSE(can_implement(v, good, 4));
    ASSERT_EQ(workspace_bytes(v, good, 4), 0u);
  } else {
    ASSERT_TRUE(can_implement(v, good, 4));
    ASSERT_GT(workspace_bytes(v, good, 4), 0u);
  }

  std::mt19937 rng(seed_for(std::string(v.name) + "/reject"));
  const std::vector<uint16_t> x = random_nonzero_bits(act_elems(good), v.dtype, rng);  // covers both problems' inputs
  const std::vector<uint16_t> w = random_nonzero_bits(filter_elems(good), v.dtype, rng);
  const std::vector<uint16_t> poison(grad_elems(good), nan_bits(v.dtype));
  DeviceBuffer dx, dw, dy, ws;
  ASSERT_EQ(dx.alloc(x.size() * sizeof(uint16_t)), cudaSuccess);
  ASSERT_EQ(dw.alloc(w.size() * sizeof(uint16_t)), cudaSuccess);
  ASSERT_EQ(dy.alloc(poison.size() * sizeof(uint16_t)), cudaSuccess);
  const size_t ws_bytes = workspace_bytes(v, good, split);
  ASSERT_EQ(ws.alloc(ws_bytes), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dx.ptr, x.data(), dx.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dw.ptr, w.data(), dw.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dy.ptr, poison.data(), dy.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);

  const FixupEpilogue e;
  EXPECT_EQ(launch(v, bad, dx.ptr, dw.ptr, dy.ptr, e, split, ws.ptr, ws_bytes, nullptr), cudaErrorInvalidValue);
  // Misaligned x, null y, split-K without its workspace, and split_k 0 are rejected the same way.
  EXPECT_EQ(launch(v, good, dx.as<uint16_t>() + 1, dw.ptr, dy.ptr, e, split, ws.ptr, ws_bytes, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(launch(v, good, dx.ptr, dw.ptr, nullptr, e, split, ws.ptr, ws_bytes, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(launch(v, good, dx.ptr, dw.ptr, dy.ptr, e, 4, nullptr, 0, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(launch(v, good, dx.ptr, dw.ptr, dy.ptr, e, 0, ws.ptr, ws_bytes, nullptr), cudaErrorInvalidValue);
  if (v.parallel) {  // a workspace one byte short of the partials
    EXPECT_EQ(launch(v, good, dx.ptr, dw.ptr, dy.ptr, e, split, ws.ptr, ws_bytes - 1, nullptr), cudaErrorInvalidValue);
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "a rejected call must not leave a CUDA error behind";
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  std::vector<uint16_t> out(poison.size());
  ASSERT_EQ(cudaMemcpy(out.data(), dy.ptr, dy.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  size_t touched = 0;
  for (uint16_t bits : out) touched += bits != nan_bits(v.dtype);
  EXPECT_EQ(touched, 0u) << "a rejected call wrote to the output, so something was launched";
}

INSTANTIATE_TEST_SUITE_P(Kernels, ConvFixupVariantTest,
                         ::testing::Values(&kVariants[0], &kVariants[1], &kVariants[2], &kVariants[3],
                                           &kVariants[4], &kVariants[5], &kVariants[6], &kVariants[7],
                                           &kVariants[8], &kSm90Variants[0], &kSm90Variants[1],
                                           &kSm90Variants[2], &kSm90Variants[3], &kParallelVariants[0],
                                           &kParallelVariants[4]),
                         [](const ::testing::TestParamInfo<const Variant*>& info) {
                           return std::string(info.param->name);
                         });

// ---- host-only: can_implement and workspace_bytes need no device ------------------------------------------------

TEST(ConvFixupCanImplement, RejectsUnsupportedProblems) {
  using kfuse::kernels::conv2d_fprop_fixup_can_implement;
  using kfuse::kernels::conv2d_fprop_fixup_workspace_bytes;
  for (const Variant& v : kVariants) {
    SCOPED_TRACE(v.name);
    const Conv2dProblem ok = make_problem(2, 16, 16, 64, 64, 3, 3, 1, 1);
    EXPECT_TRUE(conv2d_fprop_fixup_can_implement(ok, v.dtype, v.tile));
    EXPECT_TRUE(conv2d_fprop_fixup_can_implement(make_problem(2, 2, 2, 512, 512, 3, 3, 1, 1), v.dtype, v.tile, 9));
    EXPECT_FALSE(conv2d_fprop_fixup_can_implement(make_problem(2, 16, 16, 3, 64, 3, 3, 1, 1), v.dtype, v.tile))
        << "C = 3 is not a multiple of 8";
    EXPECT_FALSE(conv2d_fprop_fixup_can_implement(make_problem(2, 16, 16, 64, 12, 3, 3, 1, 1), v.dtype, v.tile))
        << "K = 12 is not a multiple of 8";
    EXPECT_FALSE(conv2d_fprop_fixup_can_implement(make_problem(2, 16, 16, 64, 64, 3, 3, 1, 0), v.dtype, v.tile))
        << "stride 0";
    EXPECT_FALSE(conv2d_fprop_fixup_can_implement(make_problem(2, 2, 2, 64, 64, 5, 5, 0, 1), v.dtype, v.tile))
        << "filter larger than input";
    EXPECT_FALSE(conv2d_fprop_fixup_can_implement(make_problem(0, 16, 16, 64, 64, 3, 3, 1, 1), v.dtype, v.tile))
        << "empty batch";
    EXPECT_FALSE(conv2d_fprop_fixup_can_implement(ok, v.dtype, v.tile, 0)) << "split_k 0";
    EXPECT_FALSE(conv2d_fprop_fixup_can_implement(ok, v.dtype, v.tile, 65)) << "split_k above 64";

    EXPECT_EQ(conv2d_fprop_fixup_workspace_bytes(ok, v.dtype, v.tile, 1), 0u);
    EXPECT_GT(conv2d_fprop_fixup_workspace_bytes(ok, v.dtype, v.tile, 4), 0u);
    EXPECT_EQ(conv2d_fprop_fixup_workspace_bytes(make_problem(2, 16, 16, 3, 64, 3, 3, 1, 1), v.dtype, v.tile, 4), 0u)
        << "no workspace for a problem that cannot be implemented";
  }
  EXPECT_FALSE(conv2d_fprop_fixup_can_implement(make_problem(2, 16, 16, 64, 64, 3, 3, 1, 1), ConvDType::kF16,
                                                static_cast<ConvTile>(99)))
      << "unknown tile";
}

TEST(ConvFixupCanImplement, Sm90TilesNeedF16AndNoSplitK) {
  using kfuse::kernels::conv2d_fprop_fixup_can_implement;
  using kfuse::kernels::conv2d_fprop_fixup_workspace_bytes;
  for (const Variant& v : kSm90Variants) {
    SCOPED_TRACE(v.name);
    const Conv2dProblem ok = make_problem(2, 16, 16, 64, 64, 3, 3, 1, 1);
    EXPECT_TRUE(conv2d_fprop_fixup_can_implement(ok, ConvDType::kF16, v.tile));
    EXPECT_TRUE(conv2d_fprop_fixup_can_implement(make_problem(2, 16, 16, 64, 128, 3, 3, 1, 2), ConvDType::kF16,
                                                 v.tile))
        << "stride 2";
    EXPECT_FALSE(conv2d_fprop_fixup_can_implement(ok, ConvDType::kBF16, v.tile)) << "no bf16 instance";
    EXPECT_FALSE(conv2d_fprop_fixup_can_implement(ok, ConvDType::kF16, v.tile, 2)) << "split_k 2";
    EXPECT_FALSE(conv2d_fprop_fixup_can_implement(ok, ConvDType::kF16, v.tile, 0)) << "split_k 0";
    EXPECT_FALSE(conv2d_fprop_fixup_can_implement(make_problem(2, 16, 16, 3, 64, 3, 3, 1, 1), ConvDType::kF16,
                                                  v.tile))
        << "C = 3 is not a multiple of 8";
    EXPECT_FALSE(conv2d_fprop_fixup_can_implement(make_problem(2, 16, 16, 64, 12, 3, 3, 1, 1), ConvDType::kF16,
                                                  v.tile))
        << "K = 12 is not a multiple of 8";
    EXPECT_FALSE(conv2d_fprop_fixup_can_implement(make_problem(2, 16, 16, 64, 64, 3, 3, 1, 0), ConvDType::kF16,
                                                  v.tile))
        << "stride 0";
    EXPECT_FALSE(conv2d_fprop_fixup_can_implement(make_problem(2, 32, 32, 64, 64, 3, 3, 1, 9), ConvDType::kF16,
                                                  v.tile))
        << "stride 9: above TMA im2col's limit of 8";
    EXPECT_EQ(conv2d_fprop_fixup_workspace_bytes(ok, ConvDType::kF16, v.tile, 1), 0u);
    EXPECT_EQ(conv2d_fprop_fixup_workspace_bytes(ok, ConvDType::kF16, v.tile, 2), 0u);
    EXPECT_EQ(conv2d_fprop_fixup_workspace_bytes(ok, ConvDType::kBF16, v.tile, 1), 0u);
  }
}

TEST(ConvFixupCanImplement, ParallelSplitNeedsTwoSlicesAndHoldsFp32Partials) {
  using kfuse::kernels::conv2d_fprop_fixup_parallel_can_implement;
  using kfuse::kernels::conv2d_fprop_fixup_parallel_workspace_bytes;
  const Conv2dProblem late = make_problem(128, 2, 2, 512, 512, 3, 3, 1, 1);  // block 4's conv2 at N = 128
  for (const Variant& v : kParallelVariants) {
    SCOPED_TRACE(v.name);
    EXPECT_FALSE(conv2d_fprop_fixup_parallel_can_implement(late, v.dtype, v.tile, 1)) << "one slice";
    EXPECT_FALSE(conv2d_fprop_fixup_parallel_can_implement(late, v.dtype, v.tile, 65)) << "split_k above 64";
    EXPECT_FALSE(conv2d_fprop_fixup_parallel_can_implement(make_problem(2, 16, 16, 64, 12, 3, 3, 1, 1), v.dtype,
                                                           v.tile, 2))
        << "K = 12 is not a multiple of 8";
    for (int split : {2, 8, 9}) {
      EXPECT_TRUE(conv2d_fprop_fixup_parallel_can_implement(late, v.dtype, v.tile, split)) << split;
      EXPECT_EQ(conv2d_fprop_fixup_parallel_workspace_bytes(late, v.dtype, v.tile, split),
                size_t(split) * 128 * 2 * 2 * 512 * sizeof(float))
          << split;
    }
    EXPECT_EQ(conv2d_fprop_fixup_parallel_workspace_bytes(late, v.dtype, v.tile, 1), 0u);
  }
  EXPECT_FALSE(conv2d_fprop_fixup_parallel_can_implement(late, ConvDType::kF16, ConvTile::k64x64, 2))
      << "no fp16 64x64x32 parallel instance";
  EXPECT_FALSE(conv2d_fprop_fixup_parallel_can_implement(late, ConvDType::kF16, ConvTile::kSm90_64x64, 2))
      << "no Hopper parallel instance";
}

// On a device other than 9.x the Hopper launch refuses with cudaErrorInvalidDevice and leaves no CUDA error.
TEST(ConvFixupSm90, LaunchOnOtherDeviceReturnsInvalidDevice) {
  int count = 0, dev = 0, major = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    GTEST_SKIP() << "no CUDA device";
  }
  ASSERT_EQ(cudaGetDevice(&dev), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), cudaSuccess);
  if (major == 9) GTEST_SKIP() << "compute capability 9.x: the sm90 tiles run here";

  const Conv2dProblem p = make_problem(1, 8, 8, 64, 64, 3, 3, 1, 1);
  DeviceBuffer dx, dw, dy;
  ASSERT_EQ(dx.alloc(act_elems(p) * sizeof(uint16_t)), cudaSuccess);
  ASSERT_EQ(dw.alloc(filter_elems(p) * sizeof(uint16_t)), cudaSuccess);
  ASSERT_EQ(dy.alloc(grad_elems(p) * sizeof(uint16_t)), cudaSuccess);
  for (const Variant& v : kSm90Variants) {
    SCOPED_TRACE(v.name);
    EXPECT_EQ(kfuse::kernels::conv2d_fprop_fixup(p, v.dtype, v.tile, dx.ptr, dw.ptr, dy.ptr, FixupEpilogue{}, 1,
                                                 nullptr, 0, nullptr),
              cudaErrorInvalidDevice);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  }
}

}  // namespace
