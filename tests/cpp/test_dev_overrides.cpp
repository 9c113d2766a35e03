// The developer A/B overrides (src/core/dev_overrides.h): unset variables keep the caller's options, each variable
// overrides its field, and a malformed value throws InvalidArgument naming the variable.
#include "core/dev_overrides.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "kfuse/error.h"

namespace {

using kfuse::EncoderOptions;

const std::vector<std::string> kEncoderVars = {"KFUSE_PDL",          "KFUSE_FUSED_BLOCK",  "KFUSE_FUSED_STEM",
                                               "KFUSE_WGMMA_BLOCK",  "KFUSE_FUSED_DOWN",
                                               "KFUSE_SE_WEIGHTS_T", "KFUSE_SE_PROJECTION", "KFUSE_WGRAD_BRANCH",
                                               "KFUSE_CUDNN_FUSED"};
const std::vector<std::string> kMlpVars = {"KFUSE_MLP_PACKED_RELU", "KFUSE_MLP_STAGED_STORES", "KFUSE_MLP_MMA_BIAS"};

class DevOverrides : public ::testing::Test {
 protected:
  void SetUp() override { clear(); }
  void TearDown() override { clear(); }
  static void clear() {
    for (const auto& v : kEncoderVars) unsetenv(v.c_str());
    for (const auto& v : kMlpVars) unsetenv(v.c_str());
  }
};

TEST_F(DevOverrides, UnsetOrEmptyKeepsTheCallersOptions) {
  EncoderOptions given;
  given.programmatic_launch = 1;
  given.fused_blocks = false;
  given.cudnn_fused = 2;
  setenv("KFUSE_FUSED_STEM", "", 1);  // empty: unset
  const EncoderOptions o = kfuse::with_dev_overrides(given);
  EXPECT_EQ(o.programmatic_launch, 1);
  EXPECT_FALSE(o.fused_blocks);
  EXPECT_TRUE(o.fused_stem);
  EXPECT_EQ(o.cudnn_fused, 2);
  kfuse::MlpOptions mlp;
  mlp.staged_stores = false;
  const kfuse::MlpOptions m = kfuse::with_dev_overrides(mlp);
  EXPECT_TRUE(m.packed_relu && m.mma_bias);
  EXPECT_FALSE(m.staged_stores);
}

TEST_F(DevOverrides, EachVariableOverridesItsField) {
  setenv("KFUSE_PDL", "0", 1);
  setenv("KFUSE_FUSED_BLOCK", "0", 1);
  setenv("KFUSE_FUSED_STEM", "0", 1);
  setenv("KFUSE_WGMMA_BLOCK", "0", 1);
  setenv("KFUSE_FUSED_DOWN", "2", 1);
  setenv("KFUSE_SE_WEIGHTS_T", "0", 1);
  setenv("KFUSE_SE_PROJECTION", "0", 1);
  setenv("KFUSE_WGRAD_BRANCH", "0", 1);
  setenv("KFUSE_CUDNN_FUSED", "all", 1);
  const EncoderOptions o = kfuse::with_dev_overrides(EncoderOptions{});
  EXPECT_EQ(o.programmatic_launch, 0);
  EXPECT_FALSE(o.fused_blocks);
  EXPECT_FALSE(o.fused_stem);
  EXPECT_FALSE(o.wgmma_blocks);
  EXPECT_EQ(o.fused_down, 2);
  EXPECT_FALSE(o.se_weights_t);
  EXPECT_FALSE(o.se_projection);
  EXPECT_FALSE(o.wgrad_branch);
  EXPECT_EQ(o.cudnn_fused, 2);
  for (const auto& v : kMlpVars) setenv(v.c_str(), "0", 1);
  const kfuse::MlpOptions m = kfuse::with_dev_overrides(kfuse::MlpOptions{});
  EXPECT_FALSE(m.packed_relu || m.staged_stores || m.mma_bias);
  // 1 turns an option the caller turned off back on.
  for (const auto& v : kMlpVars) setenv(v.c_str(), "1", 1);
  const kfuse::MlpOptions on = kfuse::with_dev_overrides(kfuse::MlpOptions{false, false, false});
  EXPECT_TRUE(on.packed_relu && on.staged_stores && on.mma_bias);
}

TEST_F(DevOverrides, MalformedValuesNameTheVariable) {
  for (const auto& v : kEncoderVars) {
    clear();
    setenv(v.c_str(), "yes", 1);
    try {
      kfuse::with_dev_overrides(EncoderOptions{});
      ADD_FAILURE() << v << "=yes was accepted";
    } catch (const kfuse::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(v), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("'yes'"), std::string::npos) << e.what();
    }
  }
  for (const auto& v : kMlpVars) {
    clear();
    setenv(v.c_str(), "2", 1);
    EXPECT_THROW(kfuse::with_dev_overrides(kfuse::MlpOptions{}), kfuse::InvalidArgument) << v;
  }
}

}  // namespace
