#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "kfuse/safetensors.h"

namespace kfuse {
namespace {

namespace fs = std::filesystem;

class Safetensors : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("kfuse_st_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
                                        "_" + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // A file from a raw header and data section.
  std::string raw(const std::string& name, const std::string& header, size_t data_bytes, int64_t size_field = -1) {
    const std::string p = path(name);
    std::ofstream out(p, std::ios::binary);
    const uint64_t n = size_field >= 0 ? uint64_t(size_field) : header.size();
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>(n >> (8 * i)));
    out << header << std::string(data_bytes, '\x01');
    return p;
  }
  static std::string error_of(const std::string& p) {
    try {
      read_safetensors(p);
    } catch (const CheckpointError& e) {
      return e.what();
    }
    return "no error";
  }

  fs::path dir_;
};

TEST_F(Safetensors, RoundTripKeepsValuesShapesAndMetadata) {
  HostTensor<float> a({2, 3});
  for (int i = 0; i < 6; ++i) a[i] = 0.5f * i - 1.0f;
  HostTensor<double> b({4});
  for (int i = 0; i < 4; ++i) b[i] = 1e-300 * i;
  SafetensorsFile f;
  f.tensors["a"] = make_safetensors_tensor(a);
  f.tensors["b.weight"] = make_safetensors_tensor(b);
  f.metadata["format"] = "pt";
  write_safetensors(path("x.safetensors"), f);
  const SafetensorsFile g = read_safetensors(path("x.safetensors"));
  ASSERT_EQ(g.tensors.size(), 2u);
  EXPECT_EQ(g.metadata.at("format"), "pt");
  EXPECT_EQ(g.tensors.at("a").shape, (Shape{2, 3}));
  EXPECT_EQ(g.tensors.at("a").to_floats<float>("a"), a.values());
  EXPECT_EQ(g.tensors.at("b.weight").dtype, DType::F64);
  EXPECT_EQ(g.tensors.at("b.weight").to_floats<double>("b"), b.values());
  // No temporary file is left behind.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator{}), 1);
}

TEST_F(Safetensors, ConvertsHalfAndBfloat16) {
  SafetensorsTensor t;
  t.dtype = DType::F16;
  t.shape = {4};
  const uint16_t h[4] = {0x3c00, 0xc000, 0x0001, 0x7c00};  // 1, -2, 2^-24, inf
  t.bytes.assign(reinterpret_cast<const uint8_t*>(h), reinterpret_cast<const uint8_t*>(h) + 8);
  const auto v = t.to_floats<double>("t");
  EXPECT_EQ(v[0], 1.0);
  EXPECT_EQ(v[1], -2.0);
  EXPECT_EQ(v[2], std::ldexp(1.0, -24));
  EXPECT_TRUE(std::isinf(v[3]));
  t.dtype = DType::BF16;
  const uint16_t bf[4] = {0x3f80, 0xc040, 0x0000, 0x7fc0};  // 1, -3, 0, nan
  t.bytes.assign(reinterpret_cast<const uint8_t*>(bf), reinterpret_cast<const uint8_t*>(bf) + 8);
  const auto w = t.to_floats<float>("t");
  EXPECT_EQ(w[0], 1.0f);
  EXPECT_EQ(w[1], -3.0f);
  EXPECT_TRUE(std::isnan(w[3]));
  t.dtype = DType::I32;
  EXPECT_THROW(t.to_floats<float>("t"), CheckpointError);
}

TEST_F(Safetensors, MissingFileNamesThePath) {
  EXPECT_NE(error_of(path("nope.safetensors")).find("nope.safetensors"), std::string::npos);
}

TEST_F(Safetensors, CorruptFilesGiveClearErrors) {
  const std::string ok = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  EXPECT_EQ(error_of(raw("ok", ok, 8)), "no error");
  EXPECT_NE(error_of(raw("empty_header", "", 0)).find("not a JSON object"), std::string::npos);
  {  // fewer than 8 bytes
    std::ofstream(path("tiny"), std::ios::binary) << "abc";
    EXPECT_NE(error_of(path("tiny")).find("shorter than the 8-byte"), std::string::npos);
  }
  EXPECT_NE(error_of(raw("huge", ok, 8, int64_t{1} << 40)).find("header size"), std::string::npos);
  EXPECT_NE(error_of(raw("trunc_header", ok, 0, ok.size() + 100)).find("truncated"), std::string::npos);
  EXPECT_NE(error_of(raw("trunc_data", ok, 4)).find("truncated"), std::string::npos);
  EXPECT_NE(error_of(raw("json", "{not json", 0)).find("not a JSON object"), std::string::npos);
  EXPECT_NE(error_of(raw("size", R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8)).find("expected 12"),
            std::string::npos);
  EXPECT_NE(error_of(raw("dtype", R"({"a":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", 8)).find("'Q7'"),
            std::string::npos);
  EXPECT_NE(error_of(raw("hole", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8)).find("hole"),
            std::string::npos);
  EXPECT_NE(error_of(raw("tail", ok, 12)).find("belong to none"), std::string::npos);
  EXPECT_NE(error_of(raw("neg", R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8)).find("non-negative"),
            std::string::npos);
  EXPECT_NE(error_of(raw("fields", R"({"a":{"dtype":"F32"}})", 0)).find("lacks"), std::string::npos);
}

}  // namespace
}  // namespace kfuse
