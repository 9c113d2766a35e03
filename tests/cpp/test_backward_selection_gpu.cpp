// GPU tests of the training step's backward-convolution candidates (encoder/backward_conv_selection.h): every
// candidate the tuner may choose, kfuse's CUTLASS kernels and cuDNN's alike, against the float64 reference on random
// non-zero inputs with a NaN-poisoned output; plus the CPU-side selection rules (no GPU needed).
#include "encoder/backward_conv_selection.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "conv_reference.h"
#include "gpu_test_support.h"
#include "kernels/conv/cudnn_conv.h"
#include "runtime/half_bits.h"

namespace {

using kfuse::DgradChoice;
using kfuse::WgradChoice;
using kfuse::kernels::Conv2dProblem;
using kfuse::kernels::ConvDType;
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
// The encoder's kinds of backward convolution at small batches: stride-1 conv2 / identity conv1, and the stride-2
// conv1 with its shortcut (k = 2P), down to the 2x2 maps of the last block.
const Case kCases[] = {
    {"n3_16x16_c64_k64_s1", conv3x3(3, 16, 64, 64, 1)},
    {"n2_16x16_c64_k256_s2", conv3x3(2, 16, 64, 256, 2)},
    {"n2_8x8_c128_k128_s1", conv3x3(2, 8, 128, 128, 1)},
    {"n3_4x4_c256_k1024_s2", conv3x3(3, 4, 256, 1024, 2)},
    {"n2_2x2_c512_k512_s1", conv3x3(2, 2, 512, 512, 1)},
};
const ConvDType kDtypes[] = {ConvDType::kF16, ConvDType::kBF16};

std::string skip_reason() { return kfuse::testing::device_skip_reason(8, 9, "the backward convolutions"); }

// Normwise bounds: fp32 accumulation (~1e-5) plus, for outputs stored in T, one rounding (fp16 2^-11, bf16 2^-8).
double wgrad_tol(const WgradChoice& c, ConvDType dt) {
  return !c.writes_t() ? 1e-3 : dt == ConvDType::kF16 ? 2e-3 : 8e-3;
}
double dgrad_tol(ConvDType dt) { return dt == ConvDType::kF16 ? 2e-3 : 8e-3; }

// The cuDNN candidates are part of the GPU tier: say so when they are missing rather than pass silently.
void note_cudnn() {
  std::string why;
  if (!kfuse::kernels::cudnn_available(&why)) std::cout << "[note] no cuDNN candidates: " << why << "\n";
}

class BackwardCandidates : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(BackwardCandidates, EveryWgradCandidateMatchesFloat64) {
  if (const std::string why = skip_reason(); !why.empty()) GTEST_SKIP() << why;
  const Case& tc = kCases[std::get<0>(GetParam())];
  const ConvDType dt = kDtypes[std::get<1>(GetParam())];
  const Conv2dProblem& p = tc.p;
  note_cudnn();
  std::mt19937 rng(seed_for(std::string("wgrad-candidates/") + tc.name + dtype_name(dt)));
  const auto dy = random_nonzero_bits(grad_elems(p), dt, rng);
  const auto x = random_nonzero_bits(act_elems(p), dt, rng);
  const std::vector<double> ref = kfuse::testing::reference_wgrad(p, dy, x, dt);
  DeviceBuffer d_dy, d_x, d_dw;
  ASSERT_EQ(d_dy.alloc(2 * dy.size()), cudaSuccess);
  ASSERT_EQ(d_x.alloc(2 * x.size()), cudaSuccess);
  ASSERT_EQ(d_dw.alloc(4 * filter_elems(p)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_dy.ptr, dy.data(), d_dy.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_x.ptr, x.data(), d_x.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  StreamGuard stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream.stream, cudaStreamNonBlocking), cudaSuccess);
  const auto cands = kfuse::wgrad_candidates(p, dt, 132);
  ASSERT_FALSE(cands.empty());
  EXPECT_EQ(cands[0].name(), kfuse::wgrad_heuristic(p, dt, 132).name());
  for (const WgradChoice& c : cands) {
    SCOPED_TRACE(c.name());
    DeviceBuffer ws;
    ASSERT_EQ(ws.alloc(std::max<size_t>(kfuse::wgrad_workspace_bytes(c, p, dt), 256)), cudaSuccess);
    ASSERT_EQ(cudaMemset(d_dw.ptr, 0xff, d_dw.bytes), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(kfuse::run_wgrad(c, p, dt, d_dy.ptr, d_x.ptr, d_dw.ptr, ws.ptr, ws.bytes, stream.stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream.stream), cudaSuccess);
    std::vector<double> out(filter_elems(p));
    if (c.writes_t()) {
      std::vector<uint16_t> bits(out.size());
      ASSERT_EQ(cudaMemcpy(bits.data(), d_dw.ptr, 2 * bits.size(), cudaMemcpyDeviceToHost), cudaSuccess);
      for (size_t i = 0; i < out.size(); ++i) out[i] = kfuse::bits_to_float(bits[i], dt);
    } else {
      std::vector<float> f(out.size());
      ASSERT_EQ(cudaMemcpy(f.data(), d_dw.ptr, 4 * f.size(), cudaMemcpyDeviceToHost), cudaSuccess);
      out.assign(f.begin(), f.end());
    }
    size_t bad = 0;
    const double err = rel_err(out, ref, &bad);
    EXPECT_EQ(bad, 0u) << "unwritten (NaN-poisoned) or non-finite dw elements";
    EXPECT_LE(err, wgrad_tol(c, dt)) << "normwise relative error";
  }
}

TEST_P(BackwardCandidates, EveryDgradCandidateMatchesFloat64) {
  if (const std::string why = skip_reason(); !why.empty()) GTEST_SKIP() << why;
  const Case& tc = kCases[std::get<0>(GetParam())];
  const ConvDType dt = kDtypes[std::get<1>(GetParam())];
  const Conv2dProblem& p = tc.p;
  note_cudnn();
  std::mt19937 rng(seed_for(std::string("dgrad-candidates/") + tc.name + dtype_name(dt)));
  const auto dy = random_nonzero_bits(grad_elems(p), dt, rng);
  const auto w = random_nonzero_bits(filter_elems(p), dt, rng);
  const std::vector<uint16_t> w_flip = kfuse::flip_filters(p, w);
  std::vector<char> covered;
  const std::vector<double> ref = kfuse::testing::reference_dgrad(p, dy, w, dt, &covered);
  DeviceBuffer d_dy, d_w, d_wf, d_dx;
  ASSERT_EQ(d_dy.alloc(2 * dy.size()), cudaSuccess);
  ASSERT_EQ(d_w.alloc(2 * w.size()), cudaSuccess);
  ASSERT_EQ(d_wf.alloc(2 * w.size()), cudaSuccess);
  ASSERT_EQ(d_dx.alloc(2 * act_elems(p)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_dy.ptr, dy.data(), d_dy.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_w.ptr, w.data(), d_w.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_wf.ptr, w_flip.data(), d_wf.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  StreamGuard stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream.stream, cudaStreamNonBlocking), cudaSuccess);
  const kfuse::ConvConfig fprop = kfuse::conv_heuristic(kfuse::flipped_forward_problem(p), 132, dt);
  auto cands = kfuse::dgrad_candidates(p, dt, fprop);
  ASSERT_FALSE(cands.empty());
  // The flipped forward as one dense GEMM, where the forward tuner may choose it (2x2 maps).
  kfuse::ConvConfig dense;
  dense.dense = true;
  DgradChoice flipped_dense;
  flipped_dense.fprop = dense;
  if (kfuse::dgrad_can_implement(flipped_dense, p, dt)) cands.push_back(flipped_dense);
  for (const DgradChoice& c : cands) {
    SCOPED_TRACE(c.name());
    DeviceBuffer ws;
    ASSERT_EQ(ws.alloc(std::max<size_t>(kfuse::dgrad_workspace_bytes(c, p, dt), 256)), cudaSuccess);
    ASSERT_EQ(cudaMemset(d_dx.ptr, 0xff, d_dx.bytes), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(kfuse::run_dgrad(c, p, dt, d_dy.ptr, d_w.ptr, d_wf.ptr, d_dx.ptr, ws.ptr, ws.bytes, stream.stream),
              cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream.stream), cudaSuccess);
    std::vector<uint16_t> bits(act_elems(p));
    ASSERT_EQ(cudaMemcpy(bits.data(), d_dx.ptr, 2 * bits.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    std::vector<double> out(bits.size());
    for (size_t i = 0; i < out.size(); ++i) out[i] = kfuse::bits_to_float(bits[i], dt);
    size_t bad = 0;
    const double err = rel_err(out, ref, &bad);
    EXPECT_EQ(bad, 0u) << "unwritten (NaN-poisoned) or non-finite dx elements";
    EXPECT_LE(err, dgrad_tol(dt)) << "normwise relative error";
  }
}

INSTANTIATE_TEST_SUITE_P(Encoder, BackwardCandidates,
                         ::testing::Combine(::testing::Range(0, int(std::size(kCases))), ::testing::Range(0, 2)),
                         [](const ::testing::TestParamInfo<std::tuple<int, int>>& info) {
                           return std::string(kCases[std::get<0>(info.param)].name) + "_" +
                                  dtype_name(kDtypes[std::get<1>(info.param)]);
                         });

// ---- selection rules (CPU) --------------------------------------------------------------------------------------

TEST(BackwardSelection, HeuristicsAndNames) {
  const Conv2dProblem s1 = conv3x3(2048, 16, 64, 64, 1), s2 = conv3x3(2048, 16, 64, 256, 2);
  const WgradChoice w = kfuse::wgrad_heuristic(s1, ConvDType::kF16, 132);
  EXPECT_FALSE(w.cudnn);
  EXPECT_EQ(w.name(), "sm80_64x64_k" + std::to_string(w.split_k));  // k = 64: 64x64 tiles
  EXPECT_EQ(kfuse::wgrad_heuristic(s2, ConvDType::kBF16, 132).tile, kfuse::kernels::BackwardTile::k128x64);
  WgradChoice cudnn;
  cudnn.cudnn = true;
  cudnn.algo = 1;
  EXPECT_EQ(cudnn.name(), "cudnn_a1");
  EXPECT_TRUE(cudnn.writes_t());
  WgradChoice wgmma;
  wgmma.wgmma = true;
  EXPECT_EQ(wgmma.name(), "sm90_wgmma");
  EXPECT_FALSE(wgmma.writes_t());

  const kfuse::ConvConfig fprop{kfuse::kernels::ConvTile::k128x64, 1};
  EXPECT_EQ(kfuse::dgrad_heuristic(s1, ConvDType::kF16, fprop).kind, DgradChoice::Kind::kFlippedForward);
  EXPECT_EQ(kfuse::dgrad_heuristic(s1, ConvDType::kF16, fprop).name(), "fwd_sm80_128x64_k1");
  EXPECT_EQ(kfuse::dgrad_heuristic(s2, ConvDType::kF16, fprop).kind, DgradChoice::Kind::kStrided);
  const Conv2dProblem f = kfuse::flipped_forward_problem(conv3x3(4, 8, 32, 96, 1));
  EXPECT_EQ(f.c, 96);
  EXPECT_EQ(f.k, 32);
  // Without cuDNN (CPU machines) the candidates are kfuse's own, heuristic first; names are unique.
  const auto cands = kfuse::wgrad_candidates(s2, ConvDType::kF16, 132);
  ASSERT_GE(cands.size(), 3u);
  for (size_t i = 0; i < cands.size(); ++i)
    for (size_t j = i + 1; j < cands.size(); ++j) EXPECT_NE(cands[i].name(), cands[j].name());
}

TEST(BackwardSelection, CudnnUnavailableIsReportedNotFatal) {
  std::string why;
  if (kfuse::kernels::cudnn_available(&why)) GTEST_SKIP() << "cuDNN is available here";
  EXPECT_FALSE(why.empty());
  EXPECT_TRUE(kfuse::kernels::cudnn_conv_algorithms(kfuse::kernels::CudnnConvOp::kWgrad, conv3x3(2, 8, 64, 64, 1),
                                                    ConvDType::kF16)
                  .empty());
  EXPECT_EQ(kfuse::kernels::cudnn_conv_dgrad(conv3x3(2, 8, 64, 64, 1), ConvDType::kF16, 1, nullptr, nullptr, nullptr,
                                             nullptr, 0, nullptr),
            cudaErrorInvalidValue);
}

}  // namespace
