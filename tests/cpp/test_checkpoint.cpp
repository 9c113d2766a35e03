#include <gtest/gtest.h>

#include <filesystem>

#include "kfuse/checkpoint.h"
#include "kfuse/safetensors.h"

namespace kfuse {
namespace {

namespace fs = std::filesystem;

class Checkpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("kfuse_ckpt_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // Writes `params` with one edit applied to the file's tensor map.
  template <class Edit>
  std::string write_edited(const std::string& name, const EncoderParams<float>& params, Edit edit,
                           const std::string& prefix = "") {
    SafetensorsFile f;
    for (size_t i = 0; i < params.size(); ++i)
      f.tensors[prefix + params.specs()[i].name] = make_safetensors_tensor(params.at(i));
    edit(f.tensors);
    write_safetensors(path(name), f);
    return path(name);
  }
  static std::string error_of(const std::string& p, const LoadOptions& o = {}) {
    try {
      load_encoder_checkpoint<float>(p, o);
    } catch (const CheckpointError& e) {
      return e.what();
    }
    return "no error";
  }
  fs::path dir_;
};

TEST_F(Checkpoint, SaveLoadRoundTripInfersTheNetwork) {
  const EncoderConfig c{11, 32, {1, 1, 2, 1}};
  const auto p = EncoderParams<float>::perturbed_init(c, 5);
  save_encoder_checkpoint(path("enc.safetensors"), p);
  const auto q = load_encoder_checkpoint<float>(path("enc.safetensors"));
  EXPECT_EQ(q.config(), c);
  for (size_t i = 0; i < p.size(); ++i) EXPECT_EQ(q.at(i).values(), p.at(i).values()) << p.specs()[i].name;
  const auto d = load_encoder_checkpoint<double>(path("enc.safetensors"));
  EXPECT_EQ(d.at("layers.2.1.fixup_scale")[0], double(p.at("layers.2.1.fixup_scale")[0]));
}

TEST_F(Checkpoint, PrefixSelectsTheEncoderInsideABiggerStateDict) {
  const auto p = EncoderParams<float>::perturbed_init(EncoderConfig{}, 1);
  const std::string file = write_edited("policy", p, [](auto& t) { t["critic.fc.weight"] = t.begin()->second; },
                                        "net.visual_encoder.backbone.");
  LoadOptions o;
  o.prefix = "net.visual_encoder.backbone.";
  EXPECT_EQ(load_encoder_checkpoint<float>(file, o).config(), EncoderConfig{});
  EXPECT_NE(error_of(file).find("stem.1.weight"), std::string::npos);  // without the prefix: nothing to infer from
}

TEST_F(Checkpoint, MissingExtraMisshapenAndMistypedTensorsAreNamed) {
  const auto p = EncoderParams<float>::perturbed_init(EncoderConfig{}, 2);
  EXPECT_EQ(error_of(write_edited("ok", p, [](auto&) {})), "no error");

  const std::string missing = error_of(write_edited("missing", p, [](auto& t) { t.erase("layers.2.0.fixup_scale"); }));
  EXPECT_NE(missing.find("lacks 1 tensor"), std::string::npos) << missing;
  EXPECT_NE(missing.find("layers.2.0.fixup_scale"), std::string::npos) << missing;

  const std::string extra = error_of(write_edited("extra", p, [](auto& t) { t["layers.0.0.bn.weight"] = t["stem.1.weight"]; }));
  EXPECT_NE(extra.find("layers.0.0.bn.weight"), std::string::npos) << extra;

  const std::string shape = error_of(write_edited("shape", p, [](auto& t) {
    t["layers.1.0.conv2.weight"] = make_safetensors_tensor(HostTensor<float>({128, 128, 3, 1}));
  }));
  EXPECT_NE(shape.find("layers.1.0.conv2.weight"), std::string::npos) << shape;
  EXPECT_NE(shape.find("[128, 128, 3, 1]"), std::string::npos) << shape;

  const std::string dtype = error_of(write_edited("dtype", p, [](auto& t) {
    SafetensorsTensor& s = t["layers.0.0.fixup_bias1a"];
    s.dtype = DType::I32;
  }));
  EXPECT_NE(dtype.find("layers.0.0.fixup_bias1a"), std::string::npos) << dtype;
  EXPECT_NE(dtype.find("I32"), std::string::npos) << dtype;

  LoadOptions expect_c1;
  expect_c1.expect = EncoderConfig{1, 64, {1, 1, 1, 1}};
  const std::string wrong_net = error_of(path("ok"), expect_c1);
  EXPECT_NE(wrong_net.find("stem.1.weight"), std::string::npos) << wrong_net;
}

TEST_F(Checkpoint, InconsistentStagesAreRejected) {
  const auto p = EncoderParams<float>::perturbed_init(EncoderConfig{}, 3);
  const std::string gap = error_of(write_edited("gap", p, [](auto& t) {
    for (auto it = t.begin(); it != t.end();) it = it->first.rfind("layers.1.", 0) == 0 ? t.erase(it) : std::next(it);
  }));
  EXPECT_NE(gap.find("stage 1"), std::string::npos) << gap;
}

}  // namespace
}  // namespace kfuse
