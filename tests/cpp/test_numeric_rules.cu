// The encoder kernels' rounding rules (kernels/encoder/numeric.cuh), on the CPU: the packed-pair forms that the fused
// kernels' epilogues use must store exactly what the scalar rules store (the other kernels and the training step use
// those), for every 16-bit value of fp16 and bf16 and for the edge cases of the faithful rule (post = 0, sums that
// round back to T(post), subnormals, NaN).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/encoder/numeric.cuh"

namespace kfuse::kernels {
namespace {

template <class T>
float value_of(uint32_t bits16) {
  return bits_to_f<T>(bits16);
}

// Equal as stored bits, except that +0 and -0 count as equal (relu_pack2 may store either where the scalar ReLU
// stores +0) and any NaN equals any NaN.
template <class T>
bool same_t(uint32_t a16, uint32_t b16) {
  const float a = value_of<T>(a16), b = value_of<T>(b16);
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return a16 == b16 || (a == 0.0f && b == 0.0f);
}

// The posts of the faithful rule worth checking: 0 and -0 (the rule off), the FixUp biases' usual magnitudes, a post
// below T's smallest subnormal, a large one, negatives.
std::vector<float> posts() {
  return {0.0f, -0.0f, 0.1f, -0.1f, 1.0f, -1.25f, 3.0e-5f, 1.0e-8f, -2.0e-8f, 1000.0f, 0.3333333f, 7.5e-3f};
}

template <class T>
void check_after_relu_t2() {
  for (const float post : posts()) {
    const FaithfulPost f = faithful_post<T>(post);
    for (uint32_t lo = 0; lo < 0x10000; ++lo) {
      const uint32_t hi = (lo * 40503u + 17u) & 0xffffu;  // another value in the other half
      const uint32_t packed = pack2_after_relu_t2<T>(lo | (hi << 16), f);
      const uint32_t scalar = pack2_after_relu<T>(value_of<T>(lo), value_of<T>(hi), post);
      ASSERT_TRUE(same_t<T>(packed & 0xffffu, scalar & 0xffffu) && same_t<T>(packed >> 16, scalar >> 16))
          << "post " << post << " v " << std::hex << lo << " / " << hi << ": packed " << packed << " scalar " << scalar;
      // The stored bits themselves (zeros included): the rule never produces a zero of the other sign here.
      ASSERT_EQ(packed, scalar) << "post " << post << " v " << std::hex << lo << " / " << hi;
    }
  }
}
TEST(NumericRules, PackedAfterReluMatchesScalarFp16) { check_after_relu_t2<__half>(); }
TEST(NumericRules, PackedAfterReluMatchesScalarBf16) { check_after_relu_t2<__nv_bfloat16>(); }

template <class T>
void check_after_relu_f2() {
  std::mt19937 rng(7);
  std::vector<float> values = {0.0f, -0.0f, 1.0e-30f, 1.0e-9f, 2.9e-8f, 6.0e-8f, 1.0e-7f, -1.0e-9f, 0.5f, 1.0f,
                               65504.0f, 1.0e6f, std::numeric_limits<float>::quiet_NaN(),
                               std::numeric_limits<float>::infinity()};
  std::uniform_real_distribution<float> mag(-30.0f, 12.0f);
  for (int i = 0; i < 20000; ++i) values.push_back((i & 1 ? 1.0f : -0.25f) * std::exp2(mag(rng)));
  for (const float post : posts()) {
    const FaithfulPost f = faithful_post<T>(post);
    // Values just around -post too: there the sum rounds to small numbers and to T(post)'s neighbours.
    for (size_t i = 0; i < values.size(); ++i) {
      const float lo = values[i], hi = values[(i * 7919 + 3) % values.size()];
      const uint32_t packed = pack2_after_relu_f2<T>(lo, hi, f);
      const uint32_t scalar = pack2_after_relu<T>(lo, hi, post);
      ASSERT_TRUE(same_t<T>(packed & 0xffffu, scalar & 0xffffu) && same_t<T>(packed >> 16, scalar >> 16))
          << "post " << post << " y " << lo << " / " << hi << std::hex << ": packed " << packed << " scalar "
          << scalar;
    }
  }
}
TEST(NumericRules, AfterReluOfFp32MatchesScalarFp16) { check_after_relu_f2<__half>(); }
TEST(NumericRules, AfterReluOfFp32MatchesScalarBf16) { check_after_relu_f2<__nv_bfloat16>(); }

// relu_pack2 rounds first and applies the ReLU to the pair: the same values as the ReLU in fp32, then the rounding.
template <class T>
void check_relu_pack2() {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> mag(-40.0f, 20.0f);
  std::vector<float> values = {0.0f, -0.0f, -1.0e-30f, 1.0e-30f, std::numeric_limits<float>::quiet_NaN(),
                               -std::numeric_limits<float>::infinity(), 70000.0f, -70000.0f};
  for (int i = 0; i < 20000; ++i) values.push_back((i % 3 ? 1.0f : -1.0f) * std::exp2(mag(rng)));
  for (size_t i = 0; i < values.size(); ++i) {
    const float lo = values[i], hi = values[(i * 104729 + 5) % values.size()];
    const uint32_t packed = relu_pack2<T>(lo, hi);
    const uint32_t scalar = pack2<T>(relu_keep_nan(lo), relu_keep_nan(hi));
    ASSERT_TRUE(same_t<T>(packed & 0xffffu, scalar & 0xffffu) && same_t<T>(packed >> 16, scalar >> 16))
        << lo << " / " << hi;
  }
}
TEST(NumericRules, PackedReluMatchesScalarFp16) { check_relu_pack2<__half>(); }
TEST(NumericRules, PackedReluMatchesScalarBf16) { check_relu_pack2<__nv_bfloat16>(); }

// conv1's epilogue both ways: h2 = T(T(relu(acc + b1b)) + b2a), faithful where h > 0, as block 1's training pass
// computes it (pack2 of the ReLU, then pack8_after_relu of the stored h) and as the fused kernels compute it from the
// accumulators (relu_post_pair).
template <class T>
void check_conv1_epilogue() {
  std::mt19937 rng(3);
  std::normal_distribution<float> acc(0.0f, 2.0f);
  for (const float b1b : {0.0f, 0.05f, -0.3f}) {
    for (const float b2a : posts()) {
      const FaithfulPost f = faithful_post<T>(b2a);
      for (int i = 0; i < 4000; ++i) {
        const float a0 = acc(rng) * (i % 5 ? 1.0f : 1.0e-6f), a1 = acc(rng);
        const uint32_t h = pack2<T>(relu_keep_nan(a0 + b1b), relu_keep_nan(a1 + b1b));
        const float2 hf = pair_to_f2<T>(h);
        const uint32_t pass = pack2_after_relu<T>(hf.x, hf.y, b2a);
        const uint32_t direct = relu_post_pair<T>(a0, a1, b1b, f);
        ASSERT_EQ(direct, pass) << "acc " << a0 << " / " << a1 << " b1b " << b1b << " b2a " << b2a;
      }
    }
  }
}
TEST(NumericRules, Conv1EpilogueFromAccumulatorsMatchesPassFp16) { check_conv1_epilogue<__half>(); }
TEST(NumericRules, Conv1EpilogueFromAccumulatorsMatchesPassBf16) { check_conv1_epilogue<__nv_bfloat16>(); }

// The fused kernels' excite-and-join (excite_join8) against its scalar form: o = affine1(v), y = relu(o * g + id),
// y as T, a = pack8_after_relu(y, post).
template <class T>
void check_excite_join8() {
  std::mt19937 rng(5);
  std::normal_distribution<float> val(0.0f, 1.5f);
  std::uniform_real_distribution<float> gate(0.0f, 1.0f);
  for (const float post : posts()) {
    const FaithfulPost f = faithful_post<T>(post);
    for (int i = 0; i < 3000; ++i) {
      float v[8], id[8], g[8];
      for (int e = 0; e < 8; ++e) {
        v[e] = val(rng), id[e] = val(rng) * (i % 7 ? 1.0f : 1.0e-7f), g[e] = gate(rng);
        if (i % 11 == 0 && e == 3) id[e] = -v[e] * g[e];  // y near 0 from both sides
      }
      if (i == 5) v[1] = std::numeric_limits<float>::quiet_NaN();
      const uint4 v8 = pack8<T>(v), id8 = pack8<T>(id);
      const float scale = 0.75f, shift = -0.125f;
      uint4 y8, a8;
      excite_join8<T>(v8, id8, g, scale, shift, f, y8, a8);
      float vf[8], idf[8], y[8];
      unpack8<T>(v8, vf);
      unpack8<T>(id8, idf);
      for (int e = 0; e < 8; ++e) y[e] = relu_keep_nan(fmaf(affine1<T>(vf[e], scale, shift), g[e], idf[e]));
      const uint4 ys = pack8<T>(y), as = pack8_after_relu<T>(y, post);
      const uint32_t got[8] = {y8.x, y8.y, y8.z, y8.w, a8.x, a8.y, a8.z, a8.w};
      const uint32_t want[8] = {ys.x, ys.y, ys.z, ys.w, as.x, as.y, as.z, as.w};
      for (int w = 0; w < 8; ++w)
        ASSERT_TRUE(same_t<T>(got[w] & 0xffffu, want[w] & 0xffffu) && same_t<T>(got[w] >> 16, want[w] >> 16))
            << "post " << post << " case " << i << " word " << w << std::hex << ": " << got[w] << " vs " << want[w];
    }
  }
}
TEST(NumericRules, ExciteJoinMatchesScalarFp16) { check_excite_join8<__half>(); }
TEST(NumericRules, ExciteJoinMatchesScalarBf16) { check_excite_join8<__nv_bfloat16>(); }

}  // namespace
}  // namespace kfuse::kernels
