// GPU tests of the forward-convolution candidates (encoder/conv_selection.h): every configuration the tuner may
// choose for a FixUp convolution, kfuse's CUTLASS kernels and cuDNN's forward followed by the separate epilogue pass
// alike, against the float64 reference on random non-zero inputs with non-trivial device scalars and a NaN-poisoned
// output; plus the CPU-side naming of the cuDNN configurations.
#include "encoder/conv_selection.h"

#include <gtest/gtest.h>

#include <cmath>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "conv_reference.h"
#include "gpu_test_support.h"
#include "kernels/conv/cudnn_conv.h"
#include "kernels/conv/fixup_epilogue_pass.h"
#include "runtime/half_bits.h"

namespace {

using kfuse::ConvConfig;
using kfuse::kernels::Conv2dProblem;
using kfuse::kernels::ConvDType;
using kfuse::kernels::FixupEpilogue;
using kfuse::testing::act_elems;
using kfuse::testing::conv3x3;
using kfuse::testing::DeviceBuffer;
using kfuse::testing::dtype_name;
using kfuse::testing::filter_elems;
using kfuse::testing::grad_elems;
using kfuse::testing::random_nonzero_bits;
using kfuse::testing::rel_err;
using kfuse::testing::seed_for;
using kfuse::testing::StreamGuard;

struct Case {
  const char* name;
  Conv2dProblem p;
};
// The encoder's forward convolutions at small batches: conv2 / identity conv1, the stride-2 conv1, the 1x1 stride-2
// shortcut, down to the 2x2 maps of the last block.
const Case kCases[] = {
    {"n3_16x16_c64_k64_s1", conv3x3(3, 16, 64, 64, 1)},
    {"n2_16x16_c64_k128_s2", conv3x3(2, 16, 64, 128, 2)},
    {"n2_16x16_c64_k128_1x1_s2", Conv2dProblem{2, 16, 16, 64, 128, 1, 1, 0, 0, 2, 2}},
    {"n2_8x8_c128_k128_s1", conv3x3(2, 8, 128, 128, 1)},
    {"n2_2x2_c512_k512_s1", conv3x3(2, 2, 512, 512, 1)},
};
const ConvDType kDtypes[] = {ConvDType::kF16, ConvDType::kBF16};

// One rounding of the output to T (fp16 2^-11, bf16 2^-8) plus, for the cuDNN configurations, one more rounding of
// the convolution before the epilogue pass.
double fprop_tol(ConvDType dt) { return dt == ConvDType::kF16 ? 3e-3 : 1.2e-2; }

class ForwardCandidates : public ::testing::TestWithParam<std::tuple<int, int, bool>> {};

TEST_P(ForwardCandidates, EveryCandidateMatchesFloat64) {
  if (const std::string why = kfuse::testing::device_skip_reason(8, 9, "the forward convolutions"); !why.empty())
    GTEST_SKIP() << why;
  const Case& tc = kCases[std::get<0>(GetParam())];
  const ConvDType dt = kDtypes[std::get<1>(GetParam())];
  const bool relu = std::get<2>(GetParam());
  const Conv2dProblem& p = tc.p;
  std::string why;
  if (!kfuse::kernels::cudnn_available(&why)) std::cout << "[note] no cuDNN candidates: " << why << "\n";

  int dev = 0, major = 0, sms = 0;
  ASSERT_EQ(cudaGetDevice(&dev), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), cudaSuccess);
  const std::vector<ConvConfig> cands = kfuse::conv_candidates(p, dt, major, sms);
  ASSERT_FALSE(cands.empty());
  bool has_cudnn = false;
  for (const ConvConfig& c : cands) has_cudnn = has_cudnn || c.is_cudnn();
  EXPECT_EQ(has_cudnn, kfuse::kernels::cudnn_available()) << "cuDNN is available but offers no forward candidate";

  std::mt19937 rng(seed_for(std::string("fprop-candidates/") + tc.name + dtype_name(dt) + (relu ? "relu" : "id")));
  const auto x = random_nonzero_bits(act_elems(p), dt, rng);
  const auto w = random_nonzero_bits(filter_elems(p), dt, rng);
  // Conv outputs spread ~10-30 here: pre in [-4, 4] moves the ReLU threshold without clipping everything.
  const float scalars[3] = {std::uniform_real_distribution<float>(0.25f, 1.5f)(rng),
                            std::uniform_real_distribution<float>(-4.0f, 4.0f)(rng),
                            std::uniform_real_distribution<float>(-2.0f, 2.0f)(rng)};
  const std::vector<double> ref =
      kfuse::testing::reference_fprop_fixup(p, x, w, dt, scalars[0], scalars[1], scalars[2], relu);
  DeviceBuffer d_x, d_w, d_y, d_s;
  ASSERT_EQ(d_x.alloc(2 * x.size()), cudaSuccess);
  ASSERT_EQ(d_w.alloc(2 * w.size()), cudaSuccess);
  ASSERT_EQ(d_y.alloc(2 * grad_elems(p)), cudaSuccess);
  ASSERT_EQ(d_s.alloc(sizeof(scalars)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_x.ptr, x.data(), d_x.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_w.ptr, w.data(), d_w.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_s.ptr, scalars, sizeof(scalars), cudaMemcpyHostToDevice), cudaSuccess);
  const FixupEpilogue e{d_s.as<float>(), d_s.as<float>() + 1, d_s.as<float>() + 2, relu};
  StreamGuard stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream.stream, cudaStreamNonBlocking), cudaSuccess);
  for (const ConvConfig& c : cands) {
    SCOPED_TRACE(c.name());
    DeviceBuffer ws;
    ASSERT_EQ(ws.alloc(std::max<size_t>(kfuse::fixup_conv_workspace_bytes(c, p, dt), 256)), cudaSuccess);
    ASSERT_EQ(cudaMemset(d_y.ptr, 0xff, d_y.bytes), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    // A configuration that runs from a prepared filter gets it made from the KRSC filter first.
    DeviceBuffer prepared;
    const void* filter = d_w.ptr;
    if (const size_t bytes = kfuse::prepared_filter_bytes(c, p, dt); bytes > 0) {
      ASSERT_EQ(prepared.alloc(bytes), cudaSuccess);
      ASSERT_EQ(cudaMemset(prepared.ptr, 0xff, prepared.bytes), cudaSuccess);
      ASSERT_EQ(kfuse::prepare_conv_filter(c, p, dt, d_w.ptr, prepared.ptr, stream.stream), cudaSuccess);
      filter = prepared.ptr;
    }
    ASSERT_EQ(kfuse::run_fixup_conv(c, p, dt, d_x.ptr, filter, d_y.ptr, e, ws.ptr, ws.bytes, stream.stream),
              cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream.stream), cudaSuccess);
    std::vector<uint16_t> bits(grad_elems(p));
    ASSERT_EQ(cudaMemcpy(bits.data(), d_y.ptr, 2 * bits.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    std::vector<double> out(bits.size());
    for (size_t i = 0; i < out.size(); ++i) out[i] = kfuse::bits_to_float(bits[i], dt);
    size_t bad = 0;
    const double err = rel_err(out, ref, &bad);
    EXPECT_EQ(bad, 0u) << "unwritten (NaN-poisoned) or non-finite outputs";
    EXPECT_LE(err, fprop_tol(dt)) << "normwise relative error, alpha=" << scalars[0] << " pre=" << scalars[1]
                                  << " post=" << scalars[2];
    if (relu) {  // the ReLU's decision stays readable from the stored value (the training backward's mask)
      // Outside a band around the threshold as wide as the allowed error: there the kernel's own pre-activation has
      // the reference's sign (split-K rounds its partial sums to T, which can move values near 0 across it).
      double rms = 0;
      for (double r : ref) rms += r * r;
      rms = std::sqrt(rms / double(ref.size()));
      const double band = 2 * fprop_tol(dt) * rms;
      const double post_t = kfuse::bits_to_float(kfuse::float_to_bits(scalars[2], dt), dt);
      size_t unreadable = 0;
      for (size_t i = 0; i < out.size(); ++i)
        if (ref[i] - scalars[2] > band && !(out[i] > post_t)) ++unreadable;
      EXPECT_EQ(unreadable, 0u) << "active ReLU outputs stored as T(post) or below";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Encoder, ForwardCandidates,
                         ::testing::Combine(::testing::Range(0, int(std::size(kCases))), ::testing::Range(0, 2),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<int, int, bool>>& info) {
                           return std::string(kCases[std::get<0>(info.param)].name) + "_" +
                                  dtype_name(kDtypes[std::get<1>(info.param)]) +
                                  (std::get<2>(info.param) ? "_relu" : "_identity");
                         });

// The epilogue pass on its own: misuse is reported, not launched.
TEST(FixupEpiloguePass, RejectsMisalignedInput) {
  if (const std::string why = kfuse::testing::device_skip_reason(8, 9, "the epilogue pass"); !why.empty())
    GTEST_SKIP() << why;
  DeviceBuffer y;
  ASSERT_EQ(y.alloc(64), cudaSuccess);
  const FixupEpilogue e{nullptr, nullptr, nullptr, true};
  EXPECT_EQ(kfuse::kernels::fixup_epilogue_inplace(y.as<uint8_t>() + 2, 8, ConvDType::kF16, e, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(kfuse::kernels::fixup_epilogue_inplace(y.ptr, 12, ConvDType::kF16, e, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(kfuse::kernels::fixup_epilogue_inplace(nullptr, 8, ConvDType::kF16, e, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// ---- naming (CPU) -------------------------------------------------------------------------------------------------

TEST(ForwardSelection, CudnnConfigurationsAreNamedAndComparedByAlgorithm) {
  ConvConfig a;
  a.cudnn_algo = 1;
  EXPECT_TRUE(a.is_cudnn());
  EXPECT_EQ(a.name(), "cudnn_a1");
  ConvConfig b = a;
  b.tile = kfuse::kernels::ConvTile::k128x64;  // ignored for cuDNN configurations
  EXPECT_TRUE(a == b);
  b.cudnn_algo = 6;
  EXPECT_FALSE(a == b);
  EXPECT_FALSE(a == ConvConfig{});
  EXPECT_TRUE(kfuse::kernels::fixup_epilogue_is_identity(FixupEpilogue{}));
  EXPECT_FALSE(kfuse::kernels::fixup_epilogue_is_identity(FixupEpilogue{nullptr, nullptr, nullptr, true}));
}

}  // namespace
