// Host-only tests of the convolution candidates and heuristic (src/encoder/conv_selection.h): what the tuner may
// choose from, per device generation and dtype. No GPU needed (can_implement is a host check).
#include <gtest/gtest.h>

#include <set>

#include "kernels/conv/dense_conv.h"
#include "encoder/conv_selection.h"

namespace {

using kfuse::ConvConfig;
using kfuse::kernels::Conv2dProblem;
using kfuse::kernels::ConvDType;
using kfuse::kernels::ConvTile;

Conv2dProblem problem(int n, int hw, int c, int k, int stride) {
  Conv2dProblem p;
  p.n = n;
  p.h = p.w = hw;
  p.c = c;
  p.k = k;
  p.r = p.s = 3;
  p.pad_h = p.pad_w = 1;
  p.stride_h = p.stride_w = stride;
  return p;
}

bool has_sm90(const std::vector<ConvConfig>& v) {
  for (const ConvConfig& c : v)
    if (c.name().rfind("sm90_", 0) == 0) return true;
  return false;
}

TEST(ConvSelection, HeuristicComesFirstAndNamesAreUnique) {
  for (const Conv2dProblem& p : {problem(128, 16, 64, 64, 1), problem(128, 16, 64, 128, 2),
                                 problem(128, 4, 256, 512, 2), problem(128, 2, 512, 512, 1), problem(1, 2, 512, 512, 1)}) {
    SCOPED_TRACE(kfuse::conv_shape_key(p));
    const auto cands = kfuse::conv_candidates(p, ConvDType::kF16, 9, 132);
    ASSERT_FALSE(cands.empty());
    EXPECT_EQ(cands[0].name(), kfuse::conv_heuristic(p, 132).name());
    std::set<std::string> names;
    for (const ConvConfig& c : cands) EXPECT_TRUE(names.insert(c.name()).second) << c.name();
    EXPECT_TRUE(has_sm90(cands)) << "Hopper tiles are candidates on compute capability 9.x";
  }
}

TEST(ConvSelection, HopperTilesOnlyOnHopperAndInFp16) {
  const Conv2dProblem p = problem(128, 8, 128, 128, 1);
  EXPECT_FALSE(has_sm90(kfuse::conv_candidates(p, ConvDType::kF16, 8, 108)));
  EXPECT_FALSE(has_sm90(kfuse::conv_candidates(p, ConvDType::kBF16, 9, 132)));
  // bf16 has the two serial CUTLASS 2.x tiles and the two parallel split-K ones only (fp16-only tiles are not
  // offered).
  for (const ConvConfig& c : kfuse::conv_candidates(p, ConvDType::kBF16, 9, 132)) {
    if (c.is_cudnn()) continue;
    if (c.parallel)
      EXPECT_TRUE(c.tile == ConvTile::k128x128 || c.tile == ConvTile::k64x64) << c.name();
    else
      EXPECT_TRUE(c.tile == ConvTile::k128x64 || c.tile == ConvTile::k64x64) << c.name();
  }
}

TEST(ConvSelection, NoSerialSplitKInBf16) {
  // Serial split-K rounds partial sums to the output type: too coarse in bf16 (see conv_heuristic). Parallel
  // split-K keeps them in fp32, so bf16 may split that way.
  const Conv2dProblem p = problem(1, 2, 512, 512, 1);  // one tile: fp16 splits it
  EXPECT_GT(kfuse::conv_heuristic(p, 132, ConvDType::kF16).split_k, 1);
  EXPECT_EQ(kfuse::conv_heuristic(p, 132, ConvDType::kBF16).split_k, 1);
  bool any_parallel = false;
  for (const ConvConfig& c : kfuse::conv_candidates(p, ConvDType::kBF16, 9, 132)) {
    if (c.split_k > 1) EXPECT_TRUE(c.parallel) << c.name();
    any_parallel = any_parallel || c.parallel;
  }
  EXPECT_TRUE(any_parallel);
}

TEST(ConvSelection, ParallelSplitOnlyWhereTilesLeaveSmsIdle) {
  // Block 4's conv2 at N = 128: 512 x 512 x 4608, 16 tiles of 128 x 128; at N = 2048, 256 of them.
  bool any_parallel = false;
  for (const ConvConfig& c : kfuse::conv_candidates(problem(128, 2, 512, 512, 1), ConvDType::kF16, 9, 132)) {
    if (!c.parallel) continue;
    any_parallel = true;
    EXPECT_GE(c.split_k, 2) << c.name();
    EXPECT_GE(512 * 9 / c.split_k, 128) << c.name();
    EXPECT_NE(c.name().find("_p"), std::string::npos) << c.name();
  }
  EXPECT_TRUE(any_parallel);
  for (const ConvConfig& c : kfuse::conv_candidates(problem(2048, 2, 512, 512, 1), ConvDType::kF16, 9, 132))
    EXPECT_FALSE(c.parallel && c.tile == ConvTile::k128x128) << c.name() << ": 256 tiles already fill 132 SMs";
}

TEST(ConvSelection, DenseGemmOnlyWhereItSkipsPaddingTaps) {
  // 2x2 maps under a 3x3 filter: 4 of 9 taps are real, so the dense GEMM does 4/9 of the implicit GEMM's work; at
  // 4x4 (16 pixels > 9 taps) it would do more.
  // Both forms: the filter unrolled per call, and unrolled ahead of time (a prepared filter).
  auto dense_count = [](const Conv2dProblem& p) {
    int n = 0;
    for (const ConvConfig& c : kfuse::conv_candidates(p, ConvDType::kF16, 9, 132)) n += c.dense;
    return n;
  };
  EXPECT_EQ(dense_count(problem(2048, 2, 512, 512, 1)), 2);
  EXPECT_EQ(dense_count(problem(1, 2, 512, 512, 1)), 2);
  EXPECT_EQ(dense_count(problem(2048, 4, 256, 256, 1)), 0);
  EXPECT_EQ(dense_count(problem(2048, 4, 256, 512, 2)), 0);
  ConvConfig dense;
  dense.dense = true;
  EXPECT_EQ(dense.name(), "dense_gemm");
  EXPECT_TRUE(dense.is_library());
  EXPECT_FALSE(dense == ConvConfig{});
  const Conv2dProblem p = problem(128, 2, 512, 512, 1);
  EXPECT_EQ(kfuse::prepared_filter_bytes(dense, p, ConvDType::kF16), 0u);
  ConvConfig unrolled = dense;
  unrolled.unrolled = true;
  EXPECT_EQ(unrolled.name(), "dense_unrolled");
  EXPECT_FALSE(unrolled == dense);
  EXPECT_TRUE(unrolled.unprepared() == dense);
  // [Ho*Wo*K][H*W*C] of fp16: 2048 x 2048 for block 4's conv2.
  EXPECT_EQ(kfuse::prepared_filter_bytes(unrolled, p, ConvDType::kF16), size_t(2048) * 2048 * 2);
  // The per-call form's workspace holds that filter too; the prepared form's only cuBLAS's.
  EXPECT_EQ(kfuse::fixup_conv_workspace_bytes(dense, p, ConvDType::kF16) -
                kfuse::fixup_conv_workspace_bytes(unrolled, p, ConvDType::kF16),
            size_t(2048) * 2048 * 2);
  EXPECT_EQ(kfuse::prepare_conv_filter(dense, p, ConvDType::kF16, nullptr, nullptr, nullptr), cudaErrorInvalidValue);
  EXPECT_FALSE(kfuse::kernels::dense_conv_can_implement(problem(4, 2, 12, 512, 1), ConvDType::kF16));  // C % 8
}

TEST(ConvSelection, SplitKKeepsSlicesDeepAndGridsBounded) {
  const Conv2dProblem p = problem(128, 2, 512, 512, 1);  // K = 4608: split-K candidates exist
  bool any_split = false;
  for (const ConvConfig& c : kfuse::conv_candidates(p, ConvDType::kF16, 9, 132)) {
    EXPECT_GE(512 * 9 / c.split_k, 128) << c.name();
    any_split = any_split || c.split_k > 1;
  }
  EXPECT_TRUE(any_split);
  // A tiny problem (K = 72) gets no split-K candidate.
  Conv2dProblem small = problem(2, 8, 8, 64, 1);
  for (const ConvConfig& c : kfuse::conv_candidates(small, ConvDType::kF16, 9, 132)) EXPECT_EQ(c.split_k, 1);
}

TEST(ConvSelection, ProblemsNoKernelRunsHaveNoCandidates) {
  EXPECT_TRUE(kfuse::conv_candidates(problem(2, 8, 3, 64, 1), ConvDType::kF16, 9, 132).empty())
      << "C = 3 breaks the 16-byte alignment every kernel needs";
}

TEST(ConvSelection, ShapeKeyIsStable) {
  EXPECT_EQ(kfuse::conv_shape_key(problem(128, 16, 64, 128, 2)), "n128_h16_w16_c64_k128_r3_s3_p1_u2");
  EXPECT_EQ((ConvConfig{ConvTile::k64x64, 2}).name(), "sm80_64x64_k2");
  EXPECT_EQ((ConvConfig{ConvTile::kSm90_128x64, 1}).name(), "sm90_128x64");
  ConvConfig parallel{ConvTile::k128x128, 8};
  parallel.parallel = true;
  EXPECT_EQ(parallel.name(), "sm80_128x128_p8");
  EXPECT_FALSE(parallel == (ConvConfig{ConvTile::k128x128, 8})) << "serial and parallel split-K differ";
}

}  // namespace
