// CPU tier of the generated fused MLP: spec validation, the activation table, variant selection (fused weight
// gradients where their accumulators fit), the weight-gradient split among warps and the code-path options
// (MlpOptions). The generated source through NVRTC and the disk cache: test_mlp_nvrtc.cpp.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "mlp/codegen/kernel_cache.h"
#include "mlp/codegen/mlp_codegen.h"
#include "mlp/codegen/mlp_layout.h"
#include "mlp/codegen/mlp_wgmma_backward.h"
#include "mlp/codegen/mlp_wgrad_plan.h"
#include "mlp/codegen/nvrtc_compiler.h"
#include "core/dev_overrides.h"
#include "kfuse/error.h"
#include "kfuse/mlp.h"
#include "mlp_test_util.h"

namespace kfuse {
namespace {

using mlp_test::error_of;
using mlp_test::make_spec;

// ---- spec validation ---------------------------------------------------------------------------------------------

TEST(MlpSpec, AcceptsTheIssueShapes) {
  for (int w : {16, 32, 48, 64, 80, 128, 256}) EXPECT_NO_THROW(make_spec(32, {w, w, w, w}, 16).validate()) << w;
  EXPECT_NO_THROW(make_spec(3, {64, 128, 32}, 1).validate());
  EXPECT_EQ(make_spec(3, {64}, 5).num_parameters(), 64 * 3 + 64 + 5 * 64 + 5);
}

TEST(MlpSpec, RejectsBadWidthsNamingTheProblem) {
  EXPECT_NE(error_of([] { make_spec(32, {64, 40}, 16).validate(); }).find("hidden width 1 is 40"), std::string::npos);
  EXPECT_NE(error_of([] { make_spec(32, {64, 40}, 16).validate(); }).find("multiples of 16"), std::string::npos);
  EXPECT_NE(error_of([] { make_spec(32, {272}, 16).validate(); }).find("at most 256"), std::string::npos);
  EXPECT_NE(error_of([] { make_spec(0, {64}, 16).validate(); }).find("input width"), std::string::npos);
  EXPECT_NE(error_of([] { make_spec(32, {64}, 300).validate(); }).find("output width"), std::string::npos);
  EXPECT_NE(error_of([] { make_spec(32, {}, 16).validate(); }).find("at least one hidden layer"), std::string::npos);
  MlpSpec s = make_spec(32, {64, 64}, 16);
  s.activations.pop_back();
  EXPECT_NE(error_of([&] { s.validate(); }).find("one activation per hidden layer"), std::string::npos);
  s = make_spec(32, {64, 64}, 16);
  s.bias = {true, false};
  EXPECT_NE(error_of([&] { s.validate(); }).find("one bias flag per layer (3)"), std::string::npos);
}

TEST(MlpActivations, TableAndDerivativeInputs) {
  for (const std::string& n : builtin_activation_names()) EXPECT_EQ(builtin_activation(n).name, n);
  EXPECT_NE(error_of([] { builtin_activation("swish2"); }).find("unknown activation 'swish2'"), std::string::npos);
  EXPECT_TRUE(builtin_activation("relu").derivative_uses_y());
  EXPECT_FALSE(builtin_activation("relu").derivative_uses_x());
  EXPECT_TRUE(builtin_activation("silu").derivative_uses_x());
  EXPECT_TRUE(builtin_activation("gelu").derivative_uses_x());
  EXPECT_FALSE(builtin_activation("identity").derivative_uses_x());
  EXPECT_FALSE(builtin_activation("identity").derivative_uses_y());
  // "exp" and "max" contain x but are not x.
  Activation a{"my", "expf(x)", "expf(fmaxf(y, 0.0f))"};
  EXPECT_FALSE(a.derivative_uses_x());
  EXPECT_TRUE(a.derivative_uses_y());
  EXPECT_EQ(builtin_activation("leaky_relu", 0.2).expression, "(x > 0.0f ? x : 0.2f * x)");
  EXPECT_TRUE(builtin_activation("leaky_relu", -0.5).derivative_uses_x());  // y's sign no longer tells x's
  EXPECT_NE(builtin_activation("softplus", 2.0).expression.find("2.0f"), std::string::npos);
}

TEST(MlpActivations, UserSyntaxChecks) {
  EXPECT_NE(error_of([] { Activation{"bad", "x; x", "1.0f"}.check_syntax(); }).find("single CUDA expression"),
            std::string::npos);
  EXPECT_NE(error_of([] { Activation{"bad name", "x", "1.0f"}.check_syntax(); }).find("letters, digits"),
            std::string::npos);
  EXPECT_NE(error_of([] { Activation{"f", "y * x", "1.0f"}.check_syntax(); }).find("may use x only"),
            std::string::npos);
}

TEST(MlpActivations, UserExpressionThatDoesNotCompileQuotesNvrtc) {
  const std::string msg = error_of([] { user_activation("mine", "x / (1.0f + fabsf(x)", "1.0f"); });
  EXPECT_NE(msg.find("activation 'mine' does not compile"), std::string::npos) << msg;
  EXPECT_NE(msg.find("x / (1.0f + fabsf(x)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("NVRTC's log"), std::string::npos) << msg;
  EXPECT_NE(msg.find("error"), std::string::npos) << msg;  // the log itself
  const std::string msg2 = error_of([] { user_activation("mine", "x", "undefined_function(x)"); });
  EXPECT_NE(msg2.find("undefined_function"), std::string::npos) << msg2;
  EXPECT_NO_THROW(user_activation("softsign", "x / (1.0f + fabsf(x))",
                                  "1.0f / ((1.0f + fabsf(x)) * (1.0f + fabsf(x)))"));
}

// ---- layout and variants -------------------------------------------------------------------------------------------

TEST(MlpLayout, RegionsAlignedAndStashOnlyWhatBackwardNeeds) {
  MlpSpec s = make_spec(3, {64, 48}, 5);
  s.activations[1] = builtin_activation("silu");  // needs its pre-activation
  const codegen::MlpLayout m = codegen::mlp_layout(s);
  EXPECT_EQ(m.bwd_region_byte_offset % 16, 0);
  EXPECT_EQ(m.bias_byte_offset % 16, 0);
  EXPECT_EQ(m.packed_bytes % 16, 0);
  EXPECT_EQ(m.fwd_region_halves, 64 * (16 + 8) + 48 * (64 + 8) + 16 * (48 + 8));
  EXPECT_EQ(m.stash_h_offset, (std::vector<int64_t>{0, 64, -1}));
  EXPECT_EQ(m.stash_z_offset, (std::vector<int64_t>{-1, 112, -1}));
  EXPECT_EQ(m.stash_elements_per_row, 64 + 48 + 48);
  EXPECT_EQ(m.dz_elements_per_row, 64 + 48 + 16);
}

TEST(MlpVariants, DefaultFitsAndStreamsWhenWeightsDoNot) {
  const MlpSpec small = make_spec(32, {64, 64, 64, 64}, 16);
  const MlpVariant v = mlp_default_variant(small, 227 * 1024);
  EXPECT_TRUE(v.weights_resident);
  EXPECT_TRUE(v.fused_wgrad);
  EXPECT_EQ(v.m_tiles, 1);  // two 16-row tiles beside the gradient accumulators would spill at width 64
  EXPECT_EQ(mlp_default_variant(make_spec(32, {128, 128}, 16), 227 * 1024).m_tiles, 1);
  const MlpSpec big = make_spec(32, {256, 256, 256, 256}, 16);
  const MlpVariant b = mlp_default_variant(big, 227 * 1024);
  EXPECT_FALSE(b.weights_resident);  // 4 x 128 KiB of weights
  EXPECT_LE(mlp_forward_smem_bytes(big, b), 227u * 1024);
  EXPECT_LE(mlp_backward_smem_bytes(big, b), 227u * 1024);
  EXPECT_FALSE(b.wgmma);
  for (const MlpVariant& c : mlp_candidate_variants(big, 227 * 1024, true))
    EXPECT_LE(std::max(mlp_forward_smem_bytes(big, c), mlp_backward_smem_bytes(big, c)), 227u * 1024) << c.name();
  EXPECT_GE(mlp_candidate_variants(small, 227 * 1024).size(), 4u);
  // On Hopper the streamed default is the wgmma forward; resident weights stay the mma.sync default.
  const MlpVariant h = mlp_default_variant(big, 227 * 1024, true);
  EXPECT_EQ(h.name(), "mt1_w8_stream64_wg");
  EXPECT_EQ(mlp_candidate_variants(big, 227 * 1024, true).front(), h);
  EXPECT_EQ(mlp_default_variant(small, 227 * 1024, true), v);
  // Less shared memory than it needs: 32-column chunks.
  EXPECT_EQ(mlp_default_variant(big, mlp_forward_smem_bytes(big, h) - 1, true).k_chunk, 32);
}

TEST(MlpVariants, NamesAreStable) {
  EXPECT_EQ((MlpVariant{2, 4, true, 64}).name(), "mt2_w4_resident");
  EXPECT_EQ((MlpVariant{1, 8, false, 32}).name(), "mt1_w8_stream32");
  EXPECT_EQ((MlpVariant{1, 8, true, 64, true}).name(), "mt1_w8_resident_fw");
  EXPECT_NE((MlpVariant{1, 8, true, 64, true}), (MlpVariant{1, 8, true, 64, false}));
  EXPECT_EQ((MlpVariant{2, 8, true, 64, false, true}).name(), "mt2_w8_resident_wg");
  EXPECT_EQ((MlpVariant{1, 8, true, 64, true, true}).name(), "mt1_w8_resident_fw_wg");
  EXPECT_EQ((MlpVariant{1, 8, true, 64, true, false, 4}).name(), "mt1_w8_resident_fw_rc4");
  EXPECT_EQ((MlpVariant{1, 8, true, 64, true, true, 4, true}).name(), "mt1_w8_resident_fw_wg_rc4_wgb");
}

// How often `what` occurs in `text`.
int count_of(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(MlpVariants, WgmmaBackwardPlanAndWhatItNeeds) {
  const MlpSpec s = make_spec(32, {64, 64, 64, 64}, 16);
  const MlpVariant v{1, 8, true, 64, true, true, 4, true};
  EXPECT_NO_THROW(validate_variant(s, v));
  const codegen::WgmmaBackwardPlan p = codegen::wgmma_backward_plan(s, v);
  // Layer 0 (32 -> 64): dz^T [x 1], N = 40; the hidden layers: N = 72; the 16-wide output layer transposed
  // (h^T dz, N = 16) with its bias from 16 / 4 row sums per thread.
  ASSERT_EQ(p.layers.size(), 5u);
  EXPECT_FALSE(p.layers[0].transposed);
  EXPECT_EQ(p.layers[0].n, 40);
  EXPECT_EQ(p.layers[2].n, 72);
  EXPECT_TRUE(p.layers[4].transposed);
  EXPECT_EQ(p.layers[4].n, 16);
  EXPECT_EQ(p.layers[4].bias_floats, 4);
  EXPECT_EQ(p.accumulator_floats, 20 + 3 * 36 + 8 + 4);
  EXPECT_EQ(p.warpgroups, 2);
  EXPECT_EQ(p.dz_units, 8);
  EXPECT_EQ(p.x_units, 5);
  EXPECT_EQ(p.h_units, (std::vector<int>{9, 9, 9, 9}));
  // Every layer's weights once (the chain reads the forward's core matrices MN-major), then per warpgroup two x,
  // four h and two dz tiles.
  EXPECT_EQ(p.warpgroup_offset, (64 * 32 + 3 * 64 * 64 + 16 * 64) * 2);
  for (const auto& l : p.layers) EXPECT_FALSE(l.external);
  EXPECT_TRUE(codegen::mlp_wgrad_plan(s, v).all_weights());
  EXPECT_EQ(p.warpgroup_bytes, 64 * 16 * (2 * 5 + 4 * 9 + 2 * 8));
  EXPECT_EQ(mlp_backward_smem_bytes(s, v), size_t(p.warpgroup_offset + 2 * p.warpgroup_bytes));
  EXPECT_LE(mlp_backward_smem_bytes(s, v), 227u * 1024);
  // What it needs, named.
  auto problem = [&](MlpVariant x) { return error_of([&] { validate_variant(s, x); }); };
  MlpVariant x = v;
  x.wgmma = false;
  EXPECT_NE(problem(x).find("needs the wgmma forward"), std::string::npos);
  // Any number of recomputed hidden outputs: the rest come from the stash (their tiles by cp.async, the next row
  // block's once the tile's last reader, the next layer's weight gradient, is done).
  x = v;
  x.recompute = 0;
  EXPECT_EQ(problem(x), "<no InvalidArgument>");
  const std::string src0 = codegen::generate_mlp_source(s, x, codegen::MlpModulePart::kTraining);
  EXPECT_EQ(count_of(src0, "// recompute layer"), 0);
  EXPECT_EQ(count_of(src0, "cp_async_commit();  // the next row block's h"), 2 * 4);  // h0..h3, both kernels
  x.recompute = 2;
  EXPECT_EQ(problem(x), "<no InvalidArgument>");
  const std::string src2 = codegen::generate_mlp_source(s, x, codegen::MlpModulePart::kTraining);
  EXPECT_EQ(count_of(src2, "// recompute layer"), 2 * 2);
  EXPECT_EQ(count_of(src2, "cp_async_commit();  // the next row block's h"), 2 * 2);  // h2, h3
  x = v;
  x.m_tiles = 2;
  EXPECT_NE(problem(x).find("needs m_tiles = 1"), std::string::npos);
  x = v;
  x.fused_wgrad = false;
  EXPECT_NE(problem(x).find("needs fused weight gradients"), std::string::npos);
  const MlpSpec w256 = make_spec(32, {256, 256}, 16);
  EXPECT_NE(error_of([&] { validate_variant(w256, {1, 8, true, 64, true, true, 2, true}); })
                .find("does not fit even with every weight gradient outside the kernel"),
            std::string::npos);
  // Width 128: the three 128 x 128 weight gradients are external (cuBLAS; the kernel keeps their biases, N = 8 on
  // the x tile's ones unit), the first and the output layer's stay inside; only h3 (the output layer's input) keeps
  // a tile, h0..h2 go to their stash arrays, dz1..dz3 to the workspace.
  const MlpSpec w128 = make_spec(32, {128, 128, 128, 128}, 16);
  const codegen::WgmmaBackwardPlan p128 = codegen::wgmma_backward_plan(w128, v);
  EXPECT_NO_THROW(validate_variant(w128, v));
  for (int l = 0; l < 5; ++l) EXPECT_EQ(p128.layers[l].external, l >= 1 && l <= 3) << l;
  EXPECT_EQ(p128.layers[2].n, 8);
  EXPECT_EQ(p128.accumulator_floats, 40 + 3 * 8 + 16 + 4);
  for (int j = 0; j < 4; ++j) EXPECT_EQ(p128.has_h_tile(j), j == 3) << j;
  EXPECT_LE(p128.smem_bytes, 227 * 1024);
  const codegen::WgradPlan wg128 = codegen::mlp_wgrad_plan(w128, v);
  for (int l = 0; l < 5; ++l) EXPECT_EQ(wg128.layers[l].weight, !p128.layers[l].external) << l;
  const codegen::MlpLayout m128 = codegen::mlp_layout(w128);
  const std::string src128 = codegen::generate_mlp_source(w128, v, codegen::MlpModulePart::kTraining);
  for (int l = 1; l <= 3; ++l) {
    // (two kernels: with and without dx)
    EXPECT_EQ(count_of(src128, "copy_units_out<16, 16, 128>(p.dz + " + std::to_string(m128.dz_offset[l]) +
                                   " * p.batch"),
              2)
        << l;
    EXPECT_EQ(count_of(src128, "copy_units_out<16, 16, 128>(const_cast<u16*>(p.stash) + " +
                                   std::to_string(m128.stash_h_offset[l - 1]) + " * p.batch"),
              2)
        << l;
  }
  EXPECT_EQ(count_of(src128, "(p.dz + " + std::to_string(m128.dz_offset[0])), 0);
  // f' of h0..h2 (no tiles) from their stash arrays, read before the wait for the MMAs that need it.
  EXPECT_EQ(count_of(src128, "load_pairs<128>("), 6);
  // Candidates: Hopper only, one and two warpgroups at width 64; none at 256.
  auto count_wgb = [](const std::vector<MlpVariant>& c) {
    return std::count_if(c.begin(), c.end(), [](const MlpVariant& x) { return x.wgmma_backward; });
  };
  EXPECT_EQ(count_wgb(mlp_candidate_variants(s, 227 * 1024)), 0);
  EXPECT_EQ(count_wgb(mlp_candidate_variants(s, 227 * 1024, true)), 4);  // 4 and 8 warps, recompute 4 and 0
  EXPECT_EQ(count_wgb(mlp_candidate_variants(w128, 227 * 1024, true)), 4);
  EXPECT_EQ(count_wgb(mlp_candidate_variants(make_spec(32, {256, 256, 256, 256}, 16), 227 * 1024, true)), 0);
}

TEST(MlpVariants, RecomputedActivationsAreNotStashed) {
  const MlpSpec s = make_spec(32, {64, 64, 64, 64}, 16);
  const MlpVariant v{1, 8, true, 64, true, false, 2};
  EXPECT_NO_THROW(validate_variant(s, v));
  // The training forward stores the stash arrays of hidden outputs 2 and 3 only; the backward reads neither 0 nor 1.
  const codegen::MlpLayout m = codegen::mlp_layout(s);
  const std::string src = codegen::generate_mlp_source(s, v);
  for (int l = 0; l < 4; ++l) {
    const std::string arr = "p.stash + " + std::to_string(m.stash_h_offset[l]) + " * p.batch";
    EXPECT_EQ(src.find(arr) != std::string::npos, l >= 2) << "hidden output " << l;
  }
  EXPECT_NE(src.find("recompute the first 2 hidden outputs"), std::string::npos);
  const codegen::WgradPlan plan = codegen::mlp_wgrad_plan(s, v);
  EXPECT_EQ(plan.fwd_weight_bytes, m.fwd_weight_offset[2] * 2);
  EXPECT_LE(plan.smem_bytes, codegen::kWgradSmemBudget);
  // What cannot be recomputed is named.
  EXPECT_NE(error_of([&] { validate_variant(s, {1, 8, true, 64, false, false, 2}); })
                .find("recomputed activations need the fused weight gradients"),
            std::string::npos);
  EXPECT_NE(error_of([&] { validate_variant(s, {1, 8, true, 64, true, false, 5}); })
                .find("recompute must be in [0, 4] (the hidden layers), got 5"),
            std::string::npos);
  EXPECT_NE(error_of([&] { validate_variant(s, {1, 8, true, 64, true, false, -1000000}); })
                .find("recompute must be in [0, 4] (the hidden layers), got -1000000"),
            std::string::npos);
  // The plan never indexes outside the layers, even for a variant validate_variant rejects.
  EXPECT_EQ(codegen::mlp_wgrad_plan(s, {1, 8, true, 64, true, false, -1}).fwd_weight_bytes, 0);
  EXPECT_NE(error_of([&] { validate_variant(make_spec(32, {64, 64}, 16, "gelu"), {1, 8, true, 64, true, false, 1}); })
                .find("layer 0's activation 'gelu' needs its pre-activation"),
            std::string::npos);
  // Width 128 keeps the first layer's weight gradient inside and the others outside: nothing past layer 0 can be
  // recomputed.
  const MlpSpec w128 = make_spec(32, {128, 128, 128, 128}, 16);
  EXPECT_NE(error_of([&] { validate_variant(w128, {1, 8, true, 64, true, false, 1}); })
                .find("layer 1's weight gradient does not fit the kernel's register or shared-memory budget and is a "
                      "cuBLAS GEMM over the stashed input, so layer 0's output cannot be recomputed; use recompute <= 0"),
            std::string::npos);
  // Candidates: recompute 2 and 4 beside the fused variants at width 64.
  int rc2 = 0, rc4 = 0;
  for (const MlpVariant& c : mlp_candidate_variants(s, 227 * 1024, true)) {
    rc2 += c.recompute == 2, rc4 += c.recompute == 4;
    if (c.recompute) EXPECT_LE(mlp_backward_smem_bytes(s, c), 227u * 1024) << c.name();
  }
  EXPECT_GE(rc2, 1);
  EXPECT_GE(rc4, 1);
}

TEST(MlpVariants, WgmmaNeedsWholeWarpgroupsAndStreamsOneChain) {
  const MlpSpec s = make_spec(32, {64, 64, 64, 64}, 16);
  EXPECT_NO_THROW(validate_variant(s, {1, 4, true, 64, false, true}));
  // An invalid spec is named before any variant check indexes its layers.
  MlpSpec short_bias = s;
  short_bias.bias = {true, true, true};
  EXPECT_NE(error_of([&] { validate_variant(short_bias, {1, 8, true, 64, true, true, 0, true}); })
                .find("expected one bias flag per layer (5), got 3"),
            std::string::npos);
  EXPECT_NO_THROW(validate_variant(s, {1, 4, false, 64, false, true}));
  EXPECT_NE(error_of([&] { validate_variant(s, {2, 4, false, 64, false, true}); })
                .find("wgmma forward with streamed weights needs m_tiles 1, got 2"),
            std::string::npos);
  EXPECT_NE(error_of([&] { validate_variant(s, {1, 6, true, 64, false, true}); })
                .find("whole warpgroups (warps a multiple of 4), got 6"),
            std::string::npos);
  // Candidates: wgmma forwards only for Hopper; with streamed weights only where the weights do not fit (width 256:
  // one or two warpgroups, 32 or 64 columns per chunk).
  auto count_wgmma = [](const std::vector<MlpVariant>& c) {
    return std::count_if(c.begin(), c.end(), [](const MlpVariant& v) { return v.wgmma && !v.fused_wgrad; });
  };
  EXPECT_EQ(count_wgmma(mlp_candidate_variants(s, 227 * 1024)), 0);
  EXPECT_EQ(count_wgmma(mlp_candidate_variants(s, 227 * 1024, true)), 5);
  EXPECT_EQ(count_wgmma(mlp_candidate_variants(make_spec(32, {256, 256, 256, 256}, 16), 227 * 1024, true)), 4);
  for (const MlpVariant& v : mlp_candidate_variants(s, 227 * 1024, true))
    if (v.wgmma) EXPECT_TRUE(v.weights_resident) << v.name();
  const MlpSpec w128 = make_spec(32, {128, 128, 128, 128}, 16);
  EXPECT_EQ(count_wgmma(mlp_candidate_variants(w128, 227 * 1024, true)), 2) << "one chain per warpgroup past 64";
  for (const MlpVariant& v : mlp_candidate_variants(w128, 227 * 1024, true))
    EXPECT_LE(mlp_forward_smem_bytes(w128, v), 227u * 1024) << v.name();
  // Its shared memory: unpadded weights with a 16-column bias slice each, then per warp an x tile and a staging area.
  const codegen::WgmmaForwardLayout w = codegen::wgmma_forward_layout(s, {2, 8, true, 64, false, true}, {});
  ASSERT_EQ(w.bias_k, 16);
  EXPECT_EQ(w.weight_offset, (std::vector<int64_t>{0, 64 * 48 * 2, 64 * 48 * 2 + 64 * 80 * 2,
                                                   64 * 48 * 2 + 2 * 64 * 80 * 2, 64 * 48 * 2 + 3 * 64 * 80 * 2}));
  EXPECT_EQ(w.x_tile_offset, 64 * 48 * 2 + 3 * 64 * 80 * 2 + 16 * 80 * 2);
  EXPECT_EQ(w.x_tile_bytes_per_warp, 32 * (32 + 8) * 2);
  EXPECT_EQ(w.smem_bytes, w.x_tile_offset + 8 * 32 * 40 * 2 + 8 * 32 * 72 * 2);
  EXPECT_EQ(mlp_forward_smem_bytes(s, {2, 8, true, 64, false, true}), size_t(w.smem_bytes));
}

TEST(MlpVariants, WgmmaStreamLayout) {
  // The bench's width 256: 64-column chunks of 256 x 64 halves (32 KiB), the output layer's 16 x 256 in one chunk,
  // four stages; per warpgroup a 64-row x tile (input 32) and h tile (width 256).
  const MlpSpec s = make_spec(32, {256, 256, 256, 256}, 16);
  MlpVariant v{1, 8, false, 64};
  v.wgmma = true;
  const codegen::WgmmaStreamLayout w = codegen::wgmma_stream_layout(s, v);
  EXPECT_EQ(w.stage_bytes, 256 * 64 * 2);
  ASSERT_EQ(w.chunks.size(), 1u + 3 * 4 + 1);
  EXPECT_EQ(w.chunks.front().kc, 32);
  EXPECT_EQ(w.chunks.back().layer, 4);
  EXPECT_EQ(w.chunks.back().kc, 256);
  EXPECT_EQ(w.chunks[3].layer, 1);
  EXPECT_EQ(w.chunks[3].k0, 128);
  EXPECT_EQ(w.lookahead, 2);
  EXPECT_EQ(w.stages, 4);
  EXPECT_EQ(w.x_tile_offset, 4 * 32768);
  EXPECT_EQ(w.x_tile_bytes, 64 * 32 * 2);
  EXPECT_EQ(w.h_tile_offset, 4 * 32768 + 2 * 64 * 32 * 2);
  EXPECT_EQ(w.h_tile_bytes, 64 * 256 * 2);
  EXPECT_EQ(mlp_forward_smem_bytes(s, v), size_t(w.h_tile_offset + 2 * w.h_tile_bytes));
  // The three hidden layers of one shape run as one loop (r); layers 0 and 4 are written out.
  const std::string src = codegen::generate_mlp_source(s, v, codegen::MlpModulePart::kForward);
  EXPECT_EQ(count_of(src, "for (int r = 0; r < 3; ++r)"), 1);
  EXPECT_EQ(count_of(src, "wgmma_chunk_ss<"), 1 + 4 + 1);
  // Layers of one shape with a stashed pre-activation (gelu), no bias: a loop over layers 2 and 3 whose stash
  // arrays (h, then z) are 2 x 256 elements per row apart.
  MlpSpec gelu = make_spec(3, {48, 256, 256, 256, 80}, 5, "gelu");
  gelu.bias = {true, false, false, false, true, false};
  const std::string g = codegen::generate_mlp_source(gelu, v, codegen::MlpModulePart::kForward);
  EXPECT_EQ(count_of(g, "for (int r = 0; r < 2; ++r)"), 1);
  const codegen::MlpLayout gm = codegen::mlp_layout(gelu);
  EXPECT_EQ(count_of(g, "p.stash + (" + std::to_string(gm.stash_z_offset[2]) + " + r * 512) * p.batch"), 1);
  EXPECT_EQ(count_of(g, "p.stash + (" + std::to_string(gm.stash_h_offset[2]) + " + r * 512) * p.batch"), 1);
  // A network of two chunks per row block: one ahead, three stages.
  v.k_chunk = 256;
  const codegen::WgmmaStreamLayout two = codegen::wgmma_stream_layout(make_spec(32, {16}, 16), v);
  EXPECT_EQ(two.chunks.size(), 2u);
  EXPECT_EQ(two.lookahead, 2);
  EXPECT_EQ(two.stages, 4);
}

TEST(MlpVariants, FusedWeightGradientsWhereTheAccumulatorsFit) {
  const size_t optin = 227 * 1024;
  const std::vector<std::pair<int, std::string>> expected{
      {16, "mt2_w4_resident_fw"}, {32, "mt2_w4_resident_fw"}, {48, "mt1_w8_resident_fw"},
      {64, "mt1_w8_resident_fw"}, {80, "mt1_w8_resident_fw"},   {128, "mt1_w8_resident_fw"},
      {256, "mt1_w8_stream64"}};
  for (const auto& [w, name] : expected) {
    const MlpSpec s = make_spec(32, {w, w, w, w}, 16);
    const MlpVariant v = mlp_default_variant(s, optin);
    EXPECT_EQ(v.name(), name) << "width " << w;
    EXPECT_EQ(v.fused_wgrad, mlp_fused_wgrad_fits(s, v, optin)) << "width " << w;
    if (v.fused_wgrad)
      EXPECT_LE(codegen::mlp_wgrad_plan(s, v).accumulator_floats, codegen::kMaxWgradAccumulatorFloats) << w;
  }
  // Accumulators for every layer do not fit: the widest layers' weight gradients go outside (cuBLAS), the biases
  // and the rest stay inside.
  const MlpSpec deep = make_spec(32, std::vector<int>(12, 64), 16);
  const codegen::WgradPlan dp = codegen::mlp_wgrad_plan(deep, {1, 8, true, 64, true});
  EXPECT_TRUE(mlp_default_variant(deep, optin).fused_wgrad);
  EXPECT_LE(dp.accumulator_floats, codegen::kMaxWgradAccumulatorFloats);
  EXPECT_FALSE(dp.all_weights());
  EXPECT_TRUE(dp.layers.front().weight) << "the narrow first layer (32 inputs) stays inside";
  // Width 128: the accumulators leave the first and last layers inside, and the last layer's 128-wide input tiles
  // would take the shared memory past 227 KiB: only the first layer's weight gradient stays inside.
  const codegen::WgradPlan p128 = codegen::mlp_wgrad_plan(make_spec(32, {128, 128, 128, 128}, 16), {1, 8, true, 64, true});
  std::vector<bool> inside;
  for (const auto& lp : p128.layers) inside.push_back(lp.weight);
  EXPECT_EQ(inside, (std::vector<bool>{true, false, false, false, false}));
  EXPECT_LE(p128.smem_bytes, codegen::kWgradSmemBudget);
  const MlpSpec w64 = make_spec(32, {64, 64, 64, 64}, 16);
  EXPECT_TRUE(codegen::mlp_wgrad_plan(w64, {1, 8, true, 64, true}).all_weights()) << "84 accumulators fit";
  EXPECT_FALSE(mlp_fused_wgrad_fits(w64, {1, 8, false, 64}, optin)) << "streamed weights";
  EXPECT_FALSE(mlp_fused_wgrad_fits(w64, {2, 8, true, 64}, optin)) << "two row tiles at width 64";
  EXPECT_TRUE(mlp_fused_wgrad_fits(w64, {1, 4, true, 64}, optin)) << "4 warps: 140 accumulators, some go outside";
  EXPECT_FALSE(codegen::mlp_wgrad_plan(w64, {1, 4, true, 64, true}).all_weights());
  EXPECT_FALSE(mlp_fused_wgrad_fits(w64, {1, 8, true, 64}, 64 * 1024)) << "shared memory";
  // The candidates offer both backward paths where both work, each once.
  const std::vector<MlpVariant> c = mlp_candidate_variants(w64, optin);
  int fused = 0, plain = 0;
  for (size_t i = 0; i < c.size(); ++i) {
    (c[i].fused_wgrad ? fused : plain) += 1;
    if (c[i].fused_wgrad) EXPECT_TRUE(mlp_fused_wgrad_fits(w64, c[i], optin)) << c[i].name();
    for (size_t j = 0; j < i; ++j) EXPECT_NE(c[i], c[j]) << c[i].name();
  }
  EXPECT_GE(fused, 1);
  EXPECT_GE(plain, 4);
  EXPECT_EQ(c.front(), mlp_default_variant(w64, optin));
}

TEST(MlpVariants, FusedWeightGradientsRejectedWhereTheyCannotWork) {
  const MlpSpec w64 = make_spec(32, {64, 64, 64, 64}, 16);
  EXPECT_NE(error_of([&] { codegen::generate_mlp_source(w64, {1, 8, false, 64, true}); }).find("resident weights"),
            std::string::npos);
  // Two row tiles per warp beside the accumulators would spill: the variant does not fit (the default avoids it).
  EXPECT_FALSE(mlp_fused_wgrad_fits(w64, {2, 4, true, 64}, 227 * 1024));
}

// validate_variant runs before anything divides by a variant's fields (FusedMlp's constructor calls it first): a
// zero warp count is an error naming the field, not a division by zero.
TEST(MlpVariants, InvalidFieldsAreNamed) {
  const MlpSpec w64 = make_spec(32, {64, 64, 64, 64}, 16);
  EXPECT_NO_THROW(kfuse::validate_variant(w64, {2, 4, true, 64, false}));
  EXPECT_NE(error_of([&] { kfuse::validate_variant(w64, {1, 0, true, 64, false}); }).find("warps must be in [1, 16]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { kfuse::validate_variant(w64, {1, 0, true, 64, true}); }).find("warps"), std::string::npos);
  EXPECT_NE(error_of([&] { kfuse::validate_variant(w64, {3, 4, true, 64, false}); }).find("m_tiles"),
            std::string::npos);
  EXPECT_NE(error_of([&] { kfuse::validate_variant(w64, {1, 4, false, 24, false}); }).find("k_chunk"),
            std::string::npos);
}

// Every out-tile x in-pair block of every layer belongs to exactly one warp, and the accounting (registers, shared
// memory, gradient offsets) matches the spec.
TEST(MlpWgradPlan, EveryBlockHasOneOwnerAndSizesAddUp) {
  MlpSpec odd = make_spec(3, {48, 16, 32}, 5);
  odd.bias = {true, false, true, false};
  for (const auto& [spec, variant] : std::vector<std::pair<MlpSpec, MlpVariant>>{
           {make_spec(32, {64, 64, 64, 64}, 16), {1, 8, true, 64, true}},
           {make_spec(32, {48, 48, 48, 48}, 16), {1, 8, true, 64, true}},
           {make_spec(32, {16, 32, 16}, 16), {2, 4, true, 64, true}},
           {odd, {1, 8, true, 64, true}},
           {odd, {2, 4, true, 64, true}}}) {
    const codegen::WgradPlan p = codegen::mlp_wgrad_plan(spec, variant);
    ASSERT_EQ(static_cast<int>(p.layers.size()), spec.num_layers());
    EXPECT_EQ(p.k_steps, variant.rows_per_cta() / 16);
    int floats = 0;
    int64_t offset = 0;
    for (int l = 0; l < spec.num_layers(); ++l) {
      const codegen::WgradLayerPlan& lp = p.layers[l];
      EXPECT_EQ(lp.out_tiles, spec.layer_out_padded(l) / 16);
      EXPECT_EQ(lp.in_pairs, spec.layer_in_padded(l) / 16);
      EXPECT_EQ(lp.warps_out * lp.warps_in, variant.warps);
      EXPECT_EQ(p.k_steps % lp.warps_in, 0) << "bias k-steps split evenly";
      EXPECT_EQ(lp.bias, spec.has_bias(l));
      std::vector<int> owners(lp.out_tiles * lp.in_pairs, 0);
      for (int w = 0; w < variant.warps; ++w)
        for (int i = 0; i < lp.out_tiles_per_warp; ++i)
          for (int j = 0; j < lp.in_pairs_per_warp; ++j) {
            const int ot = w % lp.warps_out + i * lp.warps_out, ip = w / lp.warps_out + j * lp.warps_in;
            if (ot < lp.out_tiles && ip < lp.in_pairs) ++owners[ot * lp.in_pairs + ip];
          }
      for (int o : owners) EXPECT_EQ(o, 1) << spec.to_string() << " layer " << l;
      floats += lp.accumulator_floats();
      EXPECT_EQ(p.grad_weight_offset[l], offset);  // nn.Sequential order, true widths
      offset += int64_t(spec.layer_out(l)) * spec.layer_in(l);
      EXPECT_EQ(p.grad_bias_offset[l], spec.has_bias(l) ? offset : -1);
      if (spec.has_bias(l)) offset += spec.layer_out(l);
    }
    EXPECT_EQ(p.accumulator_floats, floats);
    EXPECT_EQ(p.grad_floats, spec.num_parameters());
    EXPECT_EQ(p.partial_stride_floats % 32, 0);
    EXPECT_GE(p.partial_stride_floats, p.grad_floats);
    EXPECT_EQ(p.dz_tile_offset % 16, 0);
    EXPECT_EQ(p.h_tile_offset, p.dz_tile_offset + 2 * p.dz_tile_bytes);
    EXPECT_EQ(p.smem_bytes, static_cast<int64_t>(mlp_backward_smem_bytes(spec, variant)));
    EXPECT_GE(p.smem_bytes, p.h_tile_offset + 2 * p.h_tile_bytes);
  }
  // The bench shape: 84 accumulators per thread with 8 warps (ptxas: about 210 registers, no spills).
  EXPECT_EQ(codegen::mlp_wgrad_plan(make_spec(32, {64, 64, 64, 64}, 16), {1, 8, true, 64, true}).accumulator_floats,
            84);
}

// ---- options -----------------------------------------------------------------------------------------------------

// One option turned off, the others at their defaults.
MlpOptions without(bool MlpOptions::*field) {
  MlpOptions o;
  o.*field = false;
  return o;
}

// Each option's kernel (the wgmma forward for packed_relu and mma_bias, the mma.sync training forward's stash for
// staged_stores): its source with the option off is what the environment override gives (applied when FusedMlp is
// made) and not the default's; the source writer itself never reads the environment.
TEST(MlpOptions, EachOptionGivesItsOverridesSource) {
  const MlpSpec s = make_spec(32, {64, 64, 64}, 16, "relu");
  MlpVariant wgmma{1, 4, true, 64};
  wgmma.wgmma = true;
  const struct {
    const char* var;
    bool MlpOptions::*field;
    MlpVariant variant;
  } cases[] = {{"KFUSE_MLP_PACKED_RELU", &MlpOptions::packed_relu, wgmma},
               {"KFUSE_MLP_STAGED_STORES", &MlpOptions::staged_stores, {1, 4, true, 64}},
               {"KFUSE_MLP_MMA_BIAS", &MlpOptions::mma_bias, wgmma}};
  for (const auto& c : cases) {
    for (auto part : {codegen::MlpModulePart::kForward, codegen::MlpModulePart::kTraining}) {
      const std::string fallback = codegen::generate_mlp_source(s, c.variant, part);
      const std::string off = codegen::generate_mlp_source(s, c.variant, part, without(c.field));
      setenv(c.var, "0", 1);
      const MlpOptions from_env = with_dev_overrides(MlpOptions{});
      const std::string default_with_env = codegen::generate_mlp_source(s, c.variant, part);
      unsetenv(c.var);
      EXPECT_EQ(from_env, without(c.field)) << c.var;
      EXPECT_EQ(codegen::generate_mlp_source(s, c.variant, part, from_env), off) << c.var;
      EXPECT_EQ(default_with_env, fallback) << c.var << ": the source writer read the environment";
      EXPECT_NE(off, fallback) << c.var;
    }
  }
  EXPECT_EQ(codegen::generate_mlp_source(s, wgmma, codegen::MlpModulePart::kAll, MlpOptions{}),
            codegen::generate_mlp_source(s, wgmma));
}

// The bias slice is part of the wgmma forward's shared memory, hence of which variants fit.
TEST(MlpOptions, MmaBiasSizesTheWgmmaForward) {
  const MlpSpec s = make_spec(32, {128, 128, 128}, 16);
  MlpVariant v{1, 8, true, 64};
  v.wgmma = true;
  const MlpOptions no_bias_k = without(&MlpOptions::mma_bias);
  // One 16-column slice per layer: (128 + 128 + 128 + 16) rows x 16 halves.
  EXPECT_EQ(mlp_forward_smem_bytes(s, v) - mlp_forward_smem_bytes(s, v, no_bias_k), size_t(400 * 16 * 2));
  EXPECT_EQ(mlp_forward_smem_bytes(s, v), mlp_forward_smem_bytes(s, v, MlpOptions{}));
  const size_t optin = mlp_forward_smem_bytes(s, v) - 1;  // fits only without the bias slices
  const auto has = [&](const std::vector<MlpVariant>& c) { return std::find(c.begin(), c.end(), v) != c.end(); };
  EXPECT_FALSE(has(mlp_candidate_variants(s, optin, true)));
  EXPECT_TRUE(has(mlp_candidate_variants(s, optin, true, no_bias_k)));
}

// The environment still overrides what the caller chose, both ways.
TEST(MlpOptions, EnvironmentOverridesApplyOnTop) {
  setenv("KFUSE_MLP_MMA_BIAS", "0", 1);
  setenv("KFUSE_MLP_PACKED_RELU", "1", 1);
  const MlpOptions o = with_dev_overrides(without(&MlpOptions::packed_relu));
  unsetenv("KFUSE_MLP_MMA_BIAS");
  unsetenv("KFUSE_MLP_PACKED_RELU");
  EXPECT_TRUE(o.packed_relu);
  EXPECT_TRUE(o.staged_stores);
  EXPECT_FALSE(o.mma_bias);
  EXPECT_EQ(with_dev_overrides(without(&MlpOptions::staged_stores)), without(&MlpOptions::staged_stores));
}

}  // namespace
}  // namespace kfuse
