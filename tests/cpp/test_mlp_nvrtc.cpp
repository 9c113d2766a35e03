// CPU tier of the generated fused MLP, continued: the generated source compiling with NVRTC (PTX for compute_80 /
// compute_90 and CUBIN for sm_90; no GPU needed), user expressions that do not compile, and the disk cache of compiled
// kernels.
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
#include "kfuse/error.h"
#include "kfuse/mlp.h"
#include "mlp_test_util.h"

namespace kfuse {
namespace {

namespace fs = std::filesystem;
using mlp_test::error_of;
using mlp_test::make_spec;

// ---- generated source through NVRTC ---------------------------------------------------------------------------------

struct CompileCase {
  std::string label;
  MlpSpec spec;
  MlpVariant variant;
  std::string arch;
  MlpOptions options = {};
};

std::vector<CompileCase> compile_cases() {
  std::vector<CompileCase> cases;
  cases.push_back({"w64_relu_resident_sm80", make_spec(32, {64, 64, 64, 64}, 16), {2, 4, true, 64}, "compute_80"});
  cases.push_back({"w64_relu_resident_sm90_cubin", make_spec(32, {64, 64, 64, 64}, 16), {2, 4, true, 64}, "sm_90"});
  MlpSpec mixed = make_spec(3, {16, 48, 80}, 5, "gelu", MlpDType::kBFloat16);
  mixed.activations[1] = builtin_activation("silu");
  mixed.output_activation = builtin_activation("sigmoid");
  mixed.bias = {true, false, true, false};
  cases.push_back({"mixed_bf16_streamed_sm80", mixed, {1, 4, false, 32}, "compute_80"});
  cases.push_back({"mixed_bf16_resident_sm90", mixed, {1, 8, true, 64}, "compute_90"});
  MlpSpec acts = make_spec(17, {32, 32, 32, 32, 32}, 2);
  acts.activations = {builtin_activation("leaky_relu"), builtin_activation("tanh"), builtin_activation("softplus"),
                      Activation{"softsign", "x / (1.0f + fabsf(x))", "1.0f / ((1.0f + fabsf(x)) * (1.0f + fabsf(x)))"},
                      builtin_activation("identity")};
  cases.push_back({"all_activations_user_sm80", acts, {2, 4, true, 64}, "compute_80"});
  cases.push_back({"w256_streamed_sm90", make_spec(32, {256, 256}, 16), {1, 8, false, 64}, "sm_90"});
  // The wgmma forward with streamed weights: the bench's width 256 (its default on Hopper), and an odd bf16 network
  // with a loop over two hidden layers that stash their pre-activation (gelu), missing biases, input 3, output 5,
  // one warpgroup and 32-column chunks.
  {
    MlpVariant v{1, 8, false, 64};
    v.wgmma = true;
    cases.push_back({"wgmma_stream_w256_cubin_sm90a", make_spec(32, {256, 256, 256, 256}, 16), v, "sm_90a"});
    MlpSpec odd_stream = make_spec(3, {48, 256, 256, 256, 80}, 5, "gelu", MlpDType::kBFloat16);
    odd_stream.bias = {true, false, false, false, true, false};
    v.warps = 4;
    v.k_chunk = 32;
    cases.push_back({"wgmma_stream_odd_gelu_bf16_sm90a", odd_stream, v, "compute_90a"});
  }
  // Fused weight gradients: every width where the default takes them, odd input/output widths (zero-filled
  // padding, an input width that is no multiple of 8), layers without bias, bf16, every activation.
  for (int w : {16, 32, 48, 64}) {
    const MlpSpec s = make_spec(32, {w, w, w, w}, 16);
    const MlpVariant v = mlp_default_variant(s, 227 * 1024);
    for (const char* arch : {"compute_80", "compute_90"})
      cases.push_back({"fused_w" + std::to_string(w) + "_" + v.name() + "_" + arch, s, v, arch});
  }
  cases.push_back({"fused_w64_cubin_sm90", make_spec(32, {64, 64, 64, 64}, 16), {1, 8, true, 64, true}, "sm_90"});
  // Some weight gradients outside (cuBLAS over the dz the kernel stores), every bias inside: width 128, and width 64
  // with 4 warps (too many accumulators per thread for all layers).
  cases.push_back({"partly_fused_w128_sm90", make_spec(32, {128, 128, 128, 128}, 16), {1, 8, true, 64, true},
                   "compute_90"});
  cases.push_back({"partly_fused_w64_w4_sm80", make_spec(32, {64, 64, 64, 64}, 16), {1, 4, true, 64, true},
                   "compute_80"});
  MlpSpec odd = make_spec(3, {48, 16, 32}, 5, "silu", MlpDType::kBFloat16);
  odd.bias = {true, false, true, false};
  odd.output_activation = builtin_activation("sigmoid");
  cases.push_back({"fused_odd_io_bf16_sm80", odd, {1, 8, true, 64, true}, "compute_80"});
  cases.push_back({"fused_odd_io_bf16_mt2_sm90", odd, {2, 4, true, 64, true}, "compute_90"});
  MlpSpec in24 = make_spec(24, {32, 32}, 8, "tanh");
  cases.push_back({"fused_in24_out8_sm80", in24, {2, 4, true, 64, true}, "compute_80"});
  cases.push_back({"fused_all_activations_user_sm90", acts, {1, 8, true, 64, true}, "compute_90"});
  // The wgmma forward (sm_90a): two chains per warpgroup at the bench's width 64, one at 128, odd input/output
  // widths with bf16, a stashed pre-activation (gelu) and missing biases, beside fused weight gradients.
  cases.push_back({"wgmma_w64_mt2_cubin_sm90a", make_spec(32, {64, 64, 64, 64}, 16), {2, 8, true, 64, false, true},
                   "sm_90a"});
  // Recomputed activations (MlpVariant::recompute): all four hidden outputs at the bench's width 64 beside the wgmma
  // forward, and two of an odd, bf16 network with missing biases and a sigmoid output.
  cases.push_back({"recompute4_w64_wgmma_cubin_sm90a", make_spec(32, {64, 64, 64, 64}, 16),
                   {1, 8, true, 64, true, true, 4}, "sm_90a"});
  MlpSpec odd_tanh = make_spec(3, {48, 16, 32}, 5, "tanh", MlpDType::kBFloat16);
  odd_tanh.bias = {false, true, false, true};
  odd_tanh.output_activation = builtin_activation("sigmoid");
  cases.push_back({"recompute2_odd_bf16_sm80", odd_tanh, {1, 8, true, 64, true, false, 2}, "compute_80"});
  cases.push_back({"wgmma_w128_mt1_sm90a", make_spec(32, {128, 128, 128, 128}, 16), {1, 8, true, 64, false, true},
                   "compute_90a"});
  cases.push_back({"wgmma_mixed_bf16_sm90a", mixed, {2, 4, true, 64, false, true}, "compute_90a"});
  cases.push_back({"wgmma_fused_odd_io_bf16_sm90a", odd, {1, 8, true, 64, true, true}, "compute_90a"});
  // The wgmma backward: the bench's width 64 (a transposed output layer with a bias), and an odd bf16 network with
  // both orientations, a padded M, a layer without bias and a sigmoid output (its derivative from y).
  cases.push_back({"wgmma_backward_w64_cubin_sm90a", make_spec(32, {64, 64, 64, 64}, 16),
                   {1, 8, true, 64, true, true, 4, true}, "sm_90a"});
  MlpSpec odd_wgb = make_spec(3, {64, 48}, 5, "tanh", MlpDType::kBFloat16);
  odd_wgb.bias = {true, false, true};
  odd_wgb.output_activation = builtin_activation("sigmoid");
  cases.push_back({"wgmma_backward_odd_bf16_sm90a", odd_wgb, {1, 4, true, 64, true, true, 2, true}, "compute_90a"});
  // With external weight gradients: the bench's width 128 (three of five by cuBLAS), and a bf16 tanh network whose
  // f' of an external layer's input comes back from the stash, with an external layer without bias.
  cases.push_back({"wgmma_backward_w128_cubin_sm90a", make_spec(32, {128, 128, 128, 128}, 16),
                   {1, 8, true, 64, true, true, 4, true}, "sm_90a"});
  cases.push_back({"wgmma_backward_w128_stashed_cubin_sm90a", make_spec(32, {128, 128, 128, 128}, 16),
                   {1, 8, true, 64, true, true, 0, true}, "sm_90a"});
  // Stashed activations with a pre-activation derivative (silu: the chain reads z from the stash) beside an
  // external layer; odd widths (112, 96, output 40) with 4 warps.
  cases.push_back({"wgmma_backward_silu_stashed_sm90a", make_spec(32, {128, 128}, 16, "silu"),
                   {1, 8, true, 64, true, true, 0, true}, "compute_90a"});
  cases.push_back({"wgmma_backward_odd_widths_w4_sm90a", make_spec(20, {112, 96}, 40),
                   {1, 4, true, 64, true, true, 0, true}, "compute_90a"});
  MlpSpec ext_tanh = make_spec(32, {128, 128, 128}, 16, "tanh", MlpDType::kBFloat16);
  ext_tanh.bias = {true, false, true, true};
  cases.push_back({"wgmma_backward_external_tanh_bf16_sm90a", ext_tanh, {1, 8, true, 64, true, true, 3, true},
                   "compute_90a"});
  // Every option's alternative path (MlpOptions): the wgmma forward with ReLU on fp32 and the bias loaded into the
  // accumulators, and the mma.sync training forward storing its stash without the staging area.
  cases.push_back({"options_off_wgmma_w64_sm90a", make_spec(32, {64, 64, 64, 64}, 16), {2, 8, true, 64, false, true},
                   "compute_90a", MlpOptions{false, false, false}});
  cases.push_back({"options_off_w64_sm80", make_spec(32, {64, 64, 64, 64}, 16), {2, 4, true, 64}, "compute_80",
                   MlpOptions{false, false, false}});
  return cases;
}

class MlpSourceCompiles : public ::testing::TestWithParam<size_t> {};

TEST_P(MlpSourceCompiles, WithNvrtc) {
  const CompileCase c = compile_cases()[GetParam()];
  const std::string src = codegen::generate_mlp_source(c.spec, c.variant, codegen::MlpModulePart::kAll, c.options);
  EXPECT_EQ(src, codegen::generate_mlp_source(c.spec, c.variant, codegen::MlpModulePart::kAll, c.options))
      << "generation must be deterministic";
  codegen::CompiledProgram p;
  ASSERT_NO_THROW(p = codegen::nvrtc_compile(src, c.label + ".cu", c.arch)) << c.label;
  EXPECT_GT(p.binary.size(), 1000u);
  EXPECT_EQ(p.is_cubin, c.arch.rfind("sm_", 0) == 0);
  if (!p.is_cubin) {
    for (const char* k : {"kfuse_mlp_pack", "kfuse_mlp_forward", "kfuse_mlp_forward_train", "kfuse_mlp_backward",
                          "kfuse_mlp_backward_dx", "ldmatrix"})
      EXPECT_NE(p.binary.find(k), std::string::npos) << c.label << " lacks " << k;
    // mma.sync everywhere but in a module whose forward and backward are both wgmma.
    EXPECT_EQ(p.binary.find("mma.sync.aligned.m16n8k16") != std::string::npos, !c.variant.wgmma_backward) << c.label;
    // Fused weight gradients: the reduction kernel, and the transposed operand loads of the mma.sync backward (the
    // wgmma backward reads both operands MN-major from shared memory instead: wgmma with both transpose flags).
    EXPECT_EQ(p.binary.find("kfuse_mlp_wgrad_reduce") != std::string::npos, c.variant.fused_wgrad) << c.label;
    EXPECT_EQ(p.binary.find("ldmatrix.sync.aligned.m8n8.x4.trans") != std::string::npos,
              c.variant.fused_wgrad && !c.variant.wgmma_backward)
        << c.label;
    EXPECT_EQ(p.binary.find(", p, 1, 1, 1, 1;") != std::string::npos, c.variant.wgmma_backward) << c.label;
    EXPECT_NE(p.binary.find(c.spec.dtype == MlpDType::kBFloat16 ? ".bf16.bf16" : ".f16.f16"), std::string::npos);
    EXPECT_EQ(p.binary.find("wgmma.mma_async.sync.aligned.m64n") != std::string::npos, c.variant.wgmma) << c.label;
    if (!c.variant.weights_resident) EXPECT_NE(p.binary.find("cp.async"), std::string::npos);
    // Everything stays in registers: no local-memory arrays.
    EXPECT_EQ(p.binary.find(".local"), std::string::npos) << c.label << " spills fragment arrays to local memory";
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, MlpSourceCompiles, ::testing::Range<size_t>(0, compile_cases().size()),
                         [](const auto& info) { return compile_cases()[info.param].label; });

TEST(MlpNvrtc, VersionArchsAndTargets) {
  EXPECT_NE(codegen::nvrtc_version().find('.'), std::string::npos);
  EXPECT_FALSE(codegen::nvrtc_supported_archs().empty());
  EXPECT_EQ(codegen::nvrtc_target_for(9, 0), "sm_90");
  EXPECT_EQ(codegen::nvrtc_target_for(8, 0), "sm_80");
  EXPECT_EQ(codegen::nvrtc_target_for(99, 9).rfind("compute_", 0), 0u);  // unknown: PTX for the newest it knows
}

TEST(MlpNvrtc, CompileErrorCarriesTheLog) {
  try {
    codegen::nvrtc_compile("__global__ void k() { int a = ; }", "broken.cu", "compute_80");
    FAIL() << "no CompileError";
  } catch (const codegen::CompileError& e) {
    EXPECT_NE(std::string(e.what()).find("broken.cu"), std::string::npos);
    EXPECT_NE(e.log().find("expected an expression"), std::string::npos) << e.log();
  }
}

// ---- disk cache ------------------------------------------------------------------------------------------------------

class KernelCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("kfuse_kernel_cache_test_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  codegen::KernelCache cache() {
    return codegen::KernelCache(dir_.string(), [this](const std::string& m) { warnings_.push_back(m); });
  }
  codegen::KernelCacheKey key(const std::string& arch = "sm_90", const std::string& nvrtc = "13.0") {
    return {codegen::fnv1a64_hex("source text"), arch, nvrtc, codegen::nvrtc_options_string()};
  }
  fs::path dir_;
  std::vector<std::string> warnings_;
};

TEST_F(KernelCacheTest, MissStoreHit) {
  auto c = cache();
  EXPECT_FALSE(c.load(key()).has_value());
  std::string binary("\x7f" "ELF\0\1\2 binary with a NUL", 26);
  c.store(key(), binary);
  EXPECT_TRUE(fs::exists(c.path_for(key())));
  const auto hit = c.load(key());
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(*hit, binary);
  EXPECT_TRUE(warnings_.empty());
  // No temporary files left behind.
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir_)) files += e.is_regular_file();
  EXPECT_EQ(files, 1);
}

TEST_F(KernelCacheTest, KeyIncludesArchitectureAndNvrtcVersion) {
  auto c = cache();
  c.store(key("sm_90", "13.0"), "A");
  EXPECT_NE(key("sm_90", "13.0").file_name(), key("sm_80", "13.0").file_name());
  EXPECT_NE(key("sm_90", "13.0").file_name(), key("sm_90", "13.1").file_name());
  EXPECT_FALSE(c.load(key("sm_80", "13.0")).has_value());
  EXPECT_FALSE(c.load(key("sm_90", "13.1")).has_value());
  EXPECT_TRUE(c.load(key("sm_90", "13.0")).has_value());
}

TEST_F(KernelCacheTest, CorruptFileIsIgnoredWithAWarningAndRebuilt) {
  auto c = cache();
  const std::string binary(5000, 'b');
  c.store(key(), binary);
  const std::string path = c.path_for(key());
  {  // flip a payload byte
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-10, std::ios::end);
    f.put('X');
  }
  EXPECT_FALSE(c.load(key()).has_value());
  ASSERT_EQ(warnings_.size(), 1u);
  EXPECT_NE(warnings_[0].find("corrupt"), std::string::npos) << warnings_[0];
  // Truncated.
  fs::resize_file(path, 100);
  EXPECT_FALSE(c.load(key()).has_value());
  EXPECT_EQ(warnings_.size(), 2u);
  // Garbage.
  std::ofstream(path, std::ios::binary | std::ios::trunc) << "not a cache file";
  EXPECT_FALSE(c.load(key()).has_value());
  EXPECT_EQ(warnings_.size(), 3u);
  // Rebuilt: a store replaces it and it loads again.
  c.store(key(), binary);
  EXPECT_EQ(c.load(key()).value_or(""), binary);
  EXPECT_EQ(warnings_.size(), 3u);
}

TEST_F(KernelCacheTest, FileOfAnotherKeyUnderTheSameNameIsNotLoaded) {
  auto c = cache();
  c.store(key(), "payload");
  codegen::KernelCacheKey other = key();
  other.options = "--other";
  fs::copy_file(c.path_for(key()), c.path_for(other));
  EXPECT_FALSE(c.load(other).has_value());
  ASSERT_EQ(warnings_.size(), 1u);
  EXPECT_NE(warnings_[0].find("another key"), std::string::npos);
}

TEST_F(KernelCacheTest, DefaultFolderFollowsKfuseCacheDir) {
  const char* old = std::getenv("KFUSE_CACHE_DIR");
  const std::string saved = old ? old : "";
  ::setenv("KFUSE_CACHE_DIR", dir_.c_str(), 1);
  EXPECT_EQ(codegen::KernelCache::default_dir(), (dir_ / "kernels").string());
  if (old) ::setenv("KFUSE_CACHE_DIR", saved.c_str(), 1);
  else ::unsetenv("KFUSE_CACHE_DIR");
}

}  // namespace
}  // namespace kfuse
