#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "kfuse/encoder_config.h"
#include "kfuse/encoder_params.h"

namespace kfuse {
namespace {

TEST(EncoderConfig, SeedNetworkHasTheSpecifiedParameterCount) {
  EncoderConfig c;  // se_resnet9_fixup, C = 3
  EXPECT_EQ(c.num_parameters(), 4938256);
  EXPECT_EQ(c.out_channels(), 512);
  EXPECT_EQ(c.spatial_divisor(), 32);
  EXPECT_EQ(c.output_shape({128, 3, 64, 64}), (Shape{128, 512, 2, 2}));
}

TEST(EncoderConfig, NamesFollowBpsNav) {
  EncoderConfig c;
  const auto specs = c.parameter_specs();
  ASSERT_EQ(specs.front().name, "stem.1.weight");
  EXPECT_EQ(specs.front().shape, (Shape{64, 48, 1, 1}));
  std::vector<std::string> names;
  for (const auto& s : specs) names.push_back(s.name);
  auto has = [&](const std::string& n) { return std::find(names.begin(), names.end(), n) != names.end(); };
  EXPECT_TRUE(has("layers.0.0.fixup_bias1a"));
  EXPECT_TRUE(has("layers.0.0.se.excite.2.bias"));
  EXPECT_FALSE(has("layers.0.0.downsample.1.weight"));  // block 1 keeps the identity shortcut
  for (int i = 1; i < 4; ++i) EXPECT_TRUE(has("layers." + std::to_string(i) + ".0.downsample.1.weight"));
  // 1 stem + 4 blocks x (5 scalars + 2 convs + 4 SE) + 3 shortcuts
  EXPECT_EQ(specs.size(), 1u + 4 * 11 + 3);
}

TEST(EncoderConfig, DepthInputAndDeeperStages) {
  EncoderConfig c{11, 64, {1, 1, 2, 2}};
  EXPECT_EQ(c.parameter_specs().front().shape, (Shape{64, 176, 1, 1}));
  const auto blocks = c.blocks();
  ASSERT_EQ(blocks.size(), 6u);
  EXPECT_EQ(blocks[3].prefix, "layers.2.1.");
  EXPECT_EQ(blocks[3].stride, 1);
  EXPECT_FALSE(blocks[3].has_downsample);
}

TEST(EncoderConfig, RejectsInvalidConfigurationsWithTheirName) {
  EXPECT_THROW((EncoderConfig{0, 64, {1, 1, 1, 1}}.validate()), InvalidArgument);
  EXPECT_THROW((EncoderConfig{3, 8, {1, 1, 1, 1}}.validate()), InvalidArgument);
  EXPECT_THROW((EncoderConfig{3, 64, {}}.validate()), InvalidArgument);
  try {
    EncoderConfig{3, 64, {1, 0, 1, 1}}.validate();
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("layers[1]"), std::string::npos) << e.what();
  }
}

TEST(EncoderConfig, RejectsMisfitInputsNamingTheProblem) {
  EncoderConfig c;
  auto message = [&](const Shape& s) {
    try {
      c.output_shape(s);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message({3, 64, 64}).find("rank 4"), std::string::npos);
  EXPECT_NE(message({2, 4, 64, 64}).find("4 channels"), std::string::npos);
  EXPECT_NE(message({2, 3, 64, 48}).find("multiples of 32"), std::string::npos);
  EXPECT_NE(message({0, 3, 64, 64}).find("batch"), std::string::npos);
  EXPECT_EQ(message({2, 3, 32, 96}), "no error");
}

TEST(EncoderConfig, InferRoundTrips) {
  for (const EncoderConfig& c : {EncoderConfig{}, EncoderConfig{1, 32, {1, 2}}, EncoderConfig{11, 64, {2, 1, 1, 3}}})
    EXPECT_EQ(EncoderConfig::infer(c.parameter_specs()), c) << c.to_string();
}

TEST(EncoderParams, FixupInitMatchesBpsNav) {
  EncoderConfig c;
  auto p = EncoderParams<double>::fixup_init(c, 7);
  for (const auto& b : c.blocks()) {
    EXPECT_EQ(p.scalar(b.prefix + "fixup_scale"), 1.0);
    EXPECT_EQ(p.scalar(b.prefix + "fixup_bias1a"), 0.0);
    for (double v : p.at(b.prefix + "conv2.weight").values()) ASSERT_EQ(v, 0.0);
    // conv1 std = sqrt(2 / (P * 9)) / sqrt(4)
    const auto& w = p.at(b.prefix + "conv1.weight").values();
    double ss = 0;
    for (double v : w) ss += v * v;
    const double expected = std::sqrt(2.0 / (b.planes * 9.0)) / 2.0;
    EXPECT_NEAR(std::sqrt(ss / w.size()), expected, 0.05 * expected) << b.prefix;
  }
  // Deterministic per seed, different across seeds.
  EXPECT_EQ(EncoderParams<double>::fixup_init(c, 7).at("stem.1.weight").values(), p.at("stem.1.weight").values());
  EXPECT_NE(EncoderParams<double>::fixup_init(c, 8).at("stem.1.weight").values(), p.at("stem.1.weight").values());
}

TEST(EncoderParams, UnknownNameIsAnError) {
  EncoderParams<float> p(EncoderConfig{});
  EXPECT_THROW(p.at("layers.9.0.conv1.weight"), InvalidArgument);
}

}  // namespace
}  // namespace kfuse
