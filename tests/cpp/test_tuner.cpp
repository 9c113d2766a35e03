// The tuner's protocol with synthetic candidates (no GPU): choice by median, interleaving, rejection of wrong
// outputs, and the cache round trip that gives a second process zero tuning time.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include "kfuse/error.h"
#include "kfuse/tuner.h"

namespace kfuse {
namespace {

namespace fs = std::filesystem;

TEST(Tuner, ChoosesTheSmallestMedianNotTheSmallestMinimum) {
  // b has the best single run but a worse median; c has one huge outlier but the best median.
  std::vector<std::vector<double>> series = {{3, 3, 3, 3, 3}, {0.5, 4, 4, 4, 4}, {2, 2, 2, 2, 90}};
  std::vector<size_t> calls(3, 0);
  auto measure = [&](size_t i) { return series[i][calls[i]++ % series[i].size()]; };
  TunerOptions o;
  o.warmup = 0;
  o.repeats = 5;
  const TuningResult r = select_candidate({"a", "b", "c"}, measure, [](size_t) { return true; }, 0, o);
  EXPECT_EQ(r.chosen, 2u);
  EXPECT_DOUBLE_EQ(r.candidates[2].median_ms, 2);
  EXPECT_DOUBLE_EQ(r.candidates[2].max_ms, 90);
  EXPECT_DOUBLE_EQ(r.candidates[1].min_ms, 0.5);
}

TEST(Tuner, InterleavesWithARotatingStart) {
  std::vector<size_t> order;
  TunerOptions o;
  o.warmup = 1;
  o.repeats = 3;
  select_candidate({"a", "b", "c"}, [&](size_t i) { order.push_back(i); return 1.0; }, [](size_t) { return true; }, 1,
                   o);
  // reference (1) first, then the others for the check; then rounds 0 1 2 | 1 2 0 | 2 0 1
  const std::vector<size_t> expected = {1, 0, 2, 0, 1, 2, 1, 2, 0, 2, 0, 1};
  EXPECT_EQ(order, expected);
}

TEST(Tuner, WrongOutputsAreRejectedEvenWhenFastest) {
  auto measure = [](size_t i) { return i == 2 ? 0.1 : 1.0 + double(i); };
  const TuningResult r = select_candidate({"ref", "ok", "fast_but_wrong"}, measure, [](size_t i) { return i != 2; }, 0);
  EXPECT_TRUE(r.candidates[2].rejected);
  EXPECT_FALSE(r.candidates[0].rejected);
  EXPECT_EQ(r.chosen, 0u);
}

TEST(Tuner, BadArgumentsAreErrors) {
  auto m = [](size_t) { return 1.0; };
  auto ok = [](size_t) { return true; };
  EXPECT_THROW(select_candidate({}, m, ok, 0), InvalidArgument);
  EXPECT_THROW(select_candidate({"a"}, m, ok, 1), InvalidArgument);
}

class TunerCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("kfuse_tuner_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    path_ = (dir_ / "tuning.json").string();
  }
  void TearDown() override { fs::remove_all(dir_); }
  TuningKey key() const {
    return {"Fake GPU", 1, 13000, 13000, "op", "shape", "f16", "nhwc", candidate_set_checksum(names_)};
  }
  fs::path dir_;
  std::string path_;
  std::vector<std::string> names_ = {"default", "fast", "slow"};
};

TEST_F(TunerCacheTest, SecondProcessStartsFromTheCacheWithoutTiming) {
  int measured = 0;
  auto measure = [&](size_t i) { ++measured; return i == 1 ? 1.0 : 2.0 + double(i); };
  auto ok = [](size_t) { return true; };
  {
    TuningCache cache(path_);
    const TuningResult r = tune(cache, key(), names_, measure, ok, 0, TuningMode::kOnFirstUse);
    EXPECT_EQ(r.chosen, 1u);
    EXPECT_FALSE(r.from_cache);
    EXPECT_GT(measured, 0);
  }
  measured = 0;
  TuningCache fresh(path_);  // as a new process would
  const TuningResult again = tune(fresh, key(), names_, measure, ok, 0, TuningMode::kOnFirstUse);
  EXPECT_TRUE(again.from_cache);
  EXPECT_EQ(again.chosen, 1u);
  EXPECT_EQ(measured, 0);
  const auto stored = fresh.get(key());
  ASSERT_TRUE(stored.has_value());
  EXPECT_EQ(stored->candidate, "fast");
  EXPECT_DOUBLE_EQ(stored->median_ms, 1.0);
  EXPECT_DOUBLE_EQ(stored->default_ms, 2.0);

  EXPECT_EQ(tune(fresh, key(), names_, measure, ok, 0, TuningMode::kOff).chosen, 0u);
  EXPECT_EQ(measured, 0);
  EXPECT_FALSE(tune(fresh, key(), names_, measure, ok, 0, TuningMode::kRetune).from_cache);
  EXPECT_GT(measured, 0);
}

TEST_F(TunerCacheTest, KeyMustMatchTheCandidateSet) {
  TuningCache cache(path_);
  TuningKey k = key();
  k.candidates = candidate_set_checksum({"default", "fast"});
  EXPECT_THROW(tune(cache, k, names_, [](size_t) { return 1.0; }, [](size_t) { return true; }, 0,
                    TuningMode::kOnFirstUse),
               InvalidArgument);
}

TEST(TunerMode, FromEnvironment) {
  ::unsetenv("KFUSE_TUNE");
  EXPECT_EQ(tuning_mode_from_env(), TuningMode::kOnFirstUse);
  ::setenv("KFUSE_TUNE", "off", 1);
  EXPECT_EQ(tuning_mode_from_env(), TuningMode::kOff);
  ::setenv("KFUSE_TUNE", "retune", 1);
  EXPECT_EQ(tuning_mode_from_env(), TuningMode::kRetune);
  ::setenv("KFUSE_TUNE", "sometimes", 1);
  EXPECT_THROW(tuning_mode_from_env(), InvalidArgument);
  ::unsetenv("KFUSE_TUNE");
}

}  // namespace
}  // namespace kfuse
