// The tuner's persistent cache: keys, persistence across instances (as across processes), corrupt and foreign files,
// and concurrent writers in separate processes.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "kfuse/error.h"
#include "kfuse/tuning_cache.h"

namespace kfuse {
namespace {

namespace fs = std::filesystem;

TuningKey key(const std::string& shape = "n128_h16_w16_c64_k64") {
  return {"NVIDIA H100 80GB HBM3", 132, 13000, 13000, "conv2d_fprop_fixup", shape, "f16", "nhwc",
          candidate_set_checksum({"sm80_128x64", "sm80_64x64", "sm90_128x64", "cudnn"})};
}

class TuningCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("kfuse_tune_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    path_ = (dir_ / "tuning.json").string();
  }
  void TearDown() override { fs::remove_all(dir_); }
  TuningCache open() {
    return TuningCache(path_, [this](const std::string& m) { warnings_.push_back(m); });
  }
  void write(const std::string& text) { std::ofstream(path_, std::ios::binary | std::ios::trunc) << text; }

  fs::path dir_;
  std::string path_;
  std::vector<std::string> warnings_;
};

TEST(TuningKey, EveryFieldMatters) {
  const TuningKey base = key();
  std::vector<TuningKey> variants(9, base);
  variants[0].device = "NVIDIA H200";
  variants[1].sm_count = 114;
  variants[2].cuda_runtime = 12080;
  variants[3].driver = 12000;
  variants[4].op = "conv2d_dgrad";
  variants[5].shape = "n7_h16_w16_c64_k64";
  variants[6].dtype = "bf16";
  variants[7].layout = "nchw";
  variants[8].candidates = candidate_set_checksum({"sm80_128x64"});
  for (const TuningKey& v : variants) EXPECT_NE(v.str(), base.str());
  EXPECT_EQ(key().str(), base.str());
}

TEST(TuningKey, CandidateChecksumSeesNamesAndOrder) {
  EXPECT_EQ(candidate_set_checksum({"a", "b"}), candidate_set_checksum({"a", "b"}));
  EXPECT_NE(candidate_set_checksum({"a", "b"}), candidate_set_checksum({"b", "a"}));
  EXPECT_NE(candidate_set_checksum({"ab"}), candidate_set_checksum({"a", "b"}));
  EXPECT_NE(candidate_set_checksum({"a"}), candidate_set_checksum({"a", "b"}));
}

TEST_F(TuningCacheTest, ChoicesPersistAcrossInstances) {
  {
    TuningCache c = open();
    EXPECT_EQ(c.size(), 0u);
    EXPECT_FALSE(c.get(key()).has_value());
    c.put(key(), {"sm90_128x64", 0.0123, 0.0004, 0.02});
    c.save();
  }
  TuningCache again = open();
  const auto choice = again.get(key());
  ASSERT_TRUE(choice.has_value());
  EXPECT_EQ(choice->candidate, "sm90_128x64");
  EXPECT_DOUBLE_EQ(choice->median_ms, 0.0123);
  EXPECT_DOUBLE_EQ(choice->spread_ms, 0.0004);
  EXPECT_DOUBLE_EQ(choice->default_ms, 0.02);
  EXPECT_FALSE(again.get(key("other")).has_value());
  EXPECT_TRUE(warnings_.empty());
  // No temporary or stray files beside the cache and its lock.
  for (const auto& e : fs::directory_iterator(dir_))
    EXPECT_TRUE(e.path().filename() == "tuning.json" || e.path().filename() == "tuning.json.lock") << e.path();
}

TEST_F(TuningCacheTest, SaveKeepsEntriesOfOtherWriters) {
  TuningCache a = open(), b = open();
  a.put(key("a"), {"x", 1, 0, 1});
  b.put(key("b"), {"y", 2, 0, 2});
  a.save();
  b.save();  // b read the file before a saved: the merge under the lock keeps a's entry
  TuningCache c = open();
  EXPECT_EQ(c.size(), 2u);
  EXPECT_EQ(c.get(key("a"))->candidate, "x");
  EXPECT_EQ(c.get(key("b"))->candidate, "y");
}

TEST_F(TuningCacheTest, CorruptAndForeignFilesAreIgnoredWithAWarningAndRebuilt) {
  const std::vector<std::string> bad = {
      "{\"format\": \"kfuse-tuning-cache\", \"version\": 1, \"entries\": {\"k\": {\"candidate\": \"x\", \"med",  // torn
      "\x00\x01garbage",
      "[1, 2, 3]",
      "{\"format\": \"something-else\", \"version\": 1, \"entries\": {}}",
      "{\"format\": \"kfuse-tuning-cache\", \"version\": 99, \"entries\": {}}",
      "{\"format\": \"kfuse-tuning-cache\", \"version\": 1, \"entries\": {\"k\": {\"candidate\": 3}}}",
  };
  for (const std::string& text : bad) {
    write(text);
    warnings_.clear();
    TuningCache c = open();
    EXPECT_EQ(c.size(), 0u) << text;
    ASSERT_EQ(warnings_.size(), 1u) << text;
    EXPECT_NE(warnings_[0].find(path_), std::string::npos) << warnings_[0];
    c.put(key(), {"sm80_64x64", 0.5, 0.01, 0.6});
    c.save();
    warnings_.clear();
    EXPECT_EQ(open().get(key())->candidate, "sm80_64x64") << text;
    EXPECT_TRUE(warnings_.empty());
  }
}

TEST_F(TuningCacheTest, ConcurrentWriterProcessesNeitherTearNorLose) {
  constexpr int kWriters = 6, kEntries = 15;
  std::vector<pid_t> pids;
  for (int w = 0; w < kWriters; ++w) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      int rc = 0;
      try {
        TuningCache c(path_, [](const std::string&) {});
        for (int e = 0; e < kEntries; ++e) {
          c.put(key("w" + std::to_string(w) + "_e" + std::to_string(e)), {"c" + std::to_string(w), 1.0 * e, 0, 0});
          c.save();  // many interleaved saves
        }
      } catch (...) {
        rc = 1;
      }
      std::_Exit(rc);
    }
    pids.push_back(pid);
  }
  for (pid_t pid : pids) {
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  TuningCache c = open();
  EXPECT_TRUE(warnings_.empty());
  EXPECT_EQ(c.size(), size_t(kWriters * kEntries));
  for (int w = 0; w < kWriters; ++w)
    for (int e = 0; e < kEntries; ++e)
      EXPECT_EQ(c.get(key("w" + std::to_string(w) + "_e" + std::to_string(e)))->candidate, "c" + std::to_string(w));
}

TEST_F(TuningCacheTest, DefaultPathFollowsTheEnvironment) {
  const char* old = std::getenv("KFUSE_CACHE_DIR");
  const std::string saved = old ? old : "";
  ::setenv("KFUSE_CACHE_DIR", dir_.c_str(), 1);
  EXPECT_EQ(TuningCache::default_path(), (dir_ / "tuning.json").string());
  ::unsetenv("KFUSE_CACHE_DIR");
  ::setenv("XDG_CACHE_HOME", "/tmp/xdg-test", 1);
  EXPECT_EQ(TuningCache::default_path(), "/tmp/xdg-test/kfuse/tuning.json");
  ::unsetenv("XDG_CACHE_HOME");
  if (old) ::setenv("KFUSE_CACHE_DIR", saved.c_str(), 1);
}

TEST_F(TuningCacheTest, UnwritableFolderIsAClearError) {
  write("");  // a file where the folder should be
  TuningCache c((fs::path(path_) / "tuning.json").string(), [](const std::string&) {});
  c.put(key(), {"x", 1, 0, 1});
  EXPECT_THROW(c.save(), Error);
}

}  // namespace
}  // namespace kfuse
