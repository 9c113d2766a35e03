// The parameters' fingerprint (kernels/param_fingerprint.h) and the weight watch built on it (encoder/weight_watch.h):
// the chunk plan on the host (runs anywhere), and on a GPU that every single change of the watched bytes is seen
// (first, middle and last word of an aligned region; a region at a 2-byte offset, as vector_to_parameters leaves
// parameters; a swap of two words), that unchanged bytes are not, and that a captured check runs its repack body
// exactly when the bytes changed.
#include "kernels/param_fingerprint.h"
#include "runtime/launch_graph_cache.h"
#include "encoder/weight_watch.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu_test_support.h"

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace {

using kfuse::kernels::FingerprintChunk;
using kfuse::kernels::FingerprintState;
using kfuse::kernels::WatchedRegion;
using kfuse::kernels::plan_fingerprint_chunks;

const void* at(uintptr_t address) { return reinterpret_cast<const void*>(address); }

TEST(FingerprintPlan, AlignedRegionsTakeSixteenByteWordsInChunks) {
  const auto chunks = plan_fingerprint_chunks({{at(0x1000), 40 << 10}, {at(0x20000), 48}}, 16 << 10);
  ASSERT_EQ(chunks.size(), 4u);
  EXPECT_EQ(chunks[0].words, 1024);
  EXPECT_EQ(chunks[1].ptr, at(0x1000 + (16 << 10)));
  EXPECT_EQ(chunks[2].words, 512);  // the 8 KB rest
  for (const auto& c : chunks) EXPECT_EQ(c.word_bytes, 16);
  // Global indices in 8-byte words, without gaps or overlaps across chunks and regions.
  EXPECT_EQ(chunks[1].first_word, 2048);
  EXPECT_EQ(chunks[2].first_word, 4096);
  EXPECT_EQ(chunks[3].first_word, 5120);
  EXPECT_EQ(chunks[3].words, 3);
}

TEST(FingerprintPlan, MisalignedOrOddRegionsTakeTwoByteWords) {
  const auto chunks = plan_fingerprint_chunks({{at(0x1002), 64}, {at(0x2000), 18}, {at(0x3000), 32}}, 16 << 10);
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_EQ(chunks[0].word_bytes, 2);
  EXPECT_EQ(chunks[0].words, 32);
  EXPECT_EQ(chunks[1].word_bytes, 2);  // 16-byte aligned but 18 bytes long
  EXPECT_EQ(chunks[1].first_word, 32);
  EXPECT_EQ(chunks[2].word_bytes, 16);
  EXPECT_EQ(chunks[2].first_word, 41);
}

TEST(FingerprintPlan, LaunchRejectsAnEmptyTable) {
  EXPECT_EQ(kfuse::kernels::launch_param_fingerprint(nullptr, 0, nullptr, 0, false, 1, nullptr),
            cudaErrorInvalidValue);
}

class FingerprintGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string why = kfuse::testing::device_skip_reason(8, 99, "the parameter fingerprint");
    if (!why.empty()) GTEST_SKIP() << why;
    std::mt19937 rng(kfuse::testing::seed_for("fingerprint"));
    host_.resize(kBytes);
    for (auto& b : host_) b = static_cast<uint8_t>(rng());
    ASSERT_EQ(cudaMalloc(&data_, kBytes), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(data_, host_.data(), kBytes, cudaMemcpyHostToDevice), cudaSuccess);
    // An aligned 100 KB region (7 chunks) and a 34-byte one at a 2-byte offset past it.
    regions_ = {{data_, kAligned}, {static_cast<uint8_t*>(data_) + kAligned + 2, 34}};
    const auto chunks = plan_fingerprint_chunks(regions_);
    count_ = int(chunks.size());
    ASSERT_EQ(cudaMalloc(&chunks_, chunks.size() * sizeof(FingerprintChunk)), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(chunks_, chunks.data(), chunks.size() * sizeof(FingerprintChunk), cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMalloc(&state_, sizeof(FingerprintState)), cudaSuccess);
    FingerprintState s{};
    s.force = 1;
    ASSERT_EQ(cudaMemcpy(state_, &s, sizeof(s), cudaMemcpyHostToDevice), cudaSuccess);
  }
  void TearDown() override {
    cudaFree(data_);
    cudaFree(chunks_);
    cudaFree(state_);
  }
  unsigned fingerprint() {
    EXPECT_EQ(kfuse::kernels::launch_param_fingerprint(chunks_, count_, state_, 0, false, 132, nullptr),
              cudaSuccess);
    FingerprintState s{};
    EXPECT_EQ(cudaMemcpy(&s, state_, sizeof(s), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(s.arrived, 0u);
    EXPECT_EQ(s.sum, 0ull);
    return s.changed;
  }
  void write(size_t offset, const void* bytes, size_t n) {
    ASSERT_EQ(cudaMemcpy(static_cast<uint8_t*>(data_) + offset, bytes, n, cudaMemcpyHostToDevice), cudaSuccess);
  }
  static constexpr size_t kAligned = 100 << 10, kBytes = kAligned + 64;
  std::vector<uint8_t> host_;
  void* data_ = nullptr;
  std::vector<WatchedRegion> regions_;
  FingerprintChunk* chunks_ = nullptr;
  FingerprintState* state_ = nullptr;
  int count_ = 0;
};

TEST_F(FingerprintGpu, SeesEverySingleChangeAndNothingElse) {
  EXPECT_EQ(fingerprint(), 1u) << "forced";
  EXPECT_EQ(fingerprint(), 0u) << "unchanged";
  // One bit flipped at each position (the first, a middle and the last 2-byte word of each region), then put back.
  const size_t positions[] = {0, 2, kAligned / 2 + 6, kAligned - 2, kAligned + 2, kAligned + 18, kAligned + 34};
  for (const size_t p : positions) {
    const uint8_t flipped = host_[p] ^ 0x10;
    write(p, &flipped, 1);
    EXPECT_EQ(fingerprint(), 1u) << "bit flipped at byte " << p;
    EXPECT_EQ(fingerprint(), 0u) << "after the change at byte " << p;
    write(p, &host_[p], 1);
    EXPECT_EQ(fingerprint(), 1u) << "restored at byte " << p;
    EXPECT_EQ(fingerprint(), 0u);
  }
  // Bytes outside the regions (the 2 bytes before the misaligned one) are not watched.
  const uint8_t other = host_[kAligned] ^ 0xFF;
  write(kAligned, &other, 1);
  EXPECT_EQ(fingerprint(), 0u) << "a byte outside the regions";
  // Two different 8-byte words swapped: the same multiset of words at other indices.
  uint64_t a, b;
  std::memcpy(&a, &host_[64], 8);
  std::memcpy(&b, &host_[4096], 8);
  ASSERT_NE(a, b);
  write(64, &b, 8);
  write(4096, &a, 8);
  EXPECT_EQ(fingerprint(), 1u) << "two words swapped";
  // The same values written again.
  write(64, &b, 8);
  EXPECT_EQ(fingerprint(), 0u) << "rewriting the same bytes";
}

TEST_F(FingerprintGpu, EagerCheckHandsTheVerdictToTheRepack) {
  kfuse::WeightWatch watch;
  ASSERT_TRUE(watch.watch(regions_, 132));
  EXPECT_FALSE(watch.watch(regions_, 132)) << "the same regions again";
  const unsigned* flag = nullptr;
  auto verdict = [&] {
    watch.check(nullptr, [&](cudaStream_t, const unsigned* f) { flag = f; });
    unsigned v = 7;
    EXPECT_EQ(cudaMemcpy(&v, flag, sizeof(v), cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  };
  EXPECT_EQ(verdict(), 1u) << "a new watch";
  EXPECT_EQ(verdict(), 0u);
  const uint8_t flipped = host_[777] ^ 1;
  write(777, &flipped, 1);
  EXPECT_EQ(verdict(), 1u);
  EXPECT_EQ(verdict(), 0u);
  watch.invalidate();
  EXPECT_EQ(verdict(), 1u) << "invalidated";
}

TEST_F(FingerprintGpu, CapturedCheckRunsItsBodyExactlyWhenTheBytesChanged) {
  kfuse::WeightWatch watch;
  watch.watch(regions_, 132);
  int* marker = nullptr;
  ASSERT_EQ(cudaMalloc(&marker, sizeof(int)), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  const std::string why = kfuse::capture_graph(
      [&](cudaStream_t s) {
        watch.check(s, [&](cudaStream_t body, const unsigned*) { cudaMemsetAsync(marker, 1, sizeof(int), body); });
      },
      &exec);
  ASSERT_TRUE(why.empty()) << why;
  auto replay = [&] {
    int v = 0;
    EXPECT_EQ(cudaMemset(marker, 0, sizeof(int)), cudaSuccess);
    EXPECT_EQ(cudaGraphLaunch(exec, nullptr), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(&v, marker, sizeof(int), cudaMemcpyDeviceToHost), cudaSuccess);
    return v != 0;
  };
  EXPECT_TRUE(replay()) << "the first check after watch() repacks";
  EXPECT_FALSE(replay());
  EXPECT_FALSE(replay());
  const uint8_t flipped = host_[kAligned + 30] ^ 4;  // in the misaligned region
  write(kAligned + 30, &flipped, 1);
  EXPECT_TRUE(replay());
  EXPECT_FALSE(replay());
  cudaGraphExecDestroy(exec);
  cudaFree(marker);
}

}  // namespace
