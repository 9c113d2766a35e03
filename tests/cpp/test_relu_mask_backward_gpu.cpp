// GPU test of launch_relu_mask_backward (src/kernels/encoder/backward_kernels.h) against a float64 CPU computation
// of the same math from the same rounded inputs: d_pre = h2 > T(b2a) ? dh : 0 into a pitched buffer, sum_dh,
// sum_d_pre; and host-only tests of its argument validation. GPU tests skip without a device of compute capability
// 8.x / 9.x. Outputs (and workspaces) are poisoned with NaN before every launch, launches go to a non-blocking
// stream, and every result must repeat bit for bit.
#include "backward_kernel_test_util.h"

namespace {

using namespace kfuse::testing::backward_kernels;

// ================================================================================================================
// ReLU mask backward
// ================================================================================================================

struct MaskCase {
  const char* name;
  int64_t pixels;
  int c, pitch;
  bool sum_dh, sum_d_pre;
  bool negative_b2a;
  float scale = 0.0f;  // conv2's fixup_scale multiplying dh; 0: none (the scale pointer left null)
};

const MaskCase kMaskCases[] = {
    {"p1000_c64", 1000, 64, 64, true, true, false},
    {"p777_c64_pitch128", 777, 64, 128, true, true, false},  // the first half of a [d_pre | dz] concatenation
    {"p3_c24_pitch40", 3, 24, 40, true, true, true},         // 3 vectors per row: rows and grid stride out of step
    {"p50_c8_pitch16_nosums", 50, 8, 16, false, false, false},
    {"p257_c128_pitch256_sumdh", 257, 128, 256, true, false, true},
    {"p255_c128_sumdpre", 255, 128, 128, false, true, false},
    // More vectors (800 k) than the capped grid has threads x 2: several grid-stride iterations, a ragged end.
    {"p100003_c64_pitch128", 100003, 64, 128, true, true, false},
    // dh scaled (the data gradient leaves conv2's scale to this kernel): d_pre = T(scale * dh), rounded.
    {"p1000_c64_scale", 1000, 64, 64, true, true, false, 1.37f},
    {"p257_c128_pitch256_scale", 257, 128, 256, true, true, true, 0.61f},
};

void PrintTo(const MaskCase& mc, std::ostream* os) { *os << mc.name; }

constexpr uint16_t kGapSentinel = 0x5a5a;  // left in the pitch gap: no write may touch it

// The neighbour of a (nonzero, finite) 16-bit float pattern, one ulp up or down in value.
uint16_t ulp_step(uint16_t bits, bool up) {
  const bool negative = (bits & 0x8000u) != 0;
  return static_cast<uint16_t>(up != negative ? bits + 1 : bits - 1);
}

struct MaskData {
  std::vector<uint16_t> dh, h2;
  float b2a = 0.f;      // as given (fp32): rounds to t_bits, *upward*, so that comparing against fp32 b2a would fail
  uint16_t t_bits = 0;  // T(b2a)
};

MaskData make_mask_data(const MaskCase& mc, ConvDType dt, std::mt19937& rng) {
  MaskData d;
  const size_t n = size_t(mc.pixels) * mc.c;
  const float t0 = std::uniform_real_distribution<float>(0.2f, 0.6f)(rng) * (mc.negative_b2a ? -1.f : 1.f);
  d.t_bits = float_to_bits(t0, dt);
  const float t = bits_to_float(d.t_bits, dt);
  const float below = bits_to_float(ulp_step(d.t_bits, false), dt);
  d.b2a = t - 0.3f * (t - below);  // strictly between below and t, nearer t: T(b2a) == t > b2a
  if (float_to_bits(d.b2a, dt) != d.t_bits || !(d.b2a < t)) d.b2a = t;  // (cannot happen for these magnitudes)
  const uint16_t up1 = ulp_step(d.t_bits, true);
  d.dh = random_bits(n, -0.5f, 1.0f, dt, rng);  // mean 0.25: sums far from cancellation
  d.h2.resize(n);
  std::uniform_real_distribution<float> kind(0.f, 1.f), above(0.f, 2.f);
  for (auto& h : d.h2) {
    const float k = kind(rng);
    if (k < 0.4f) {
      h = d.t_bits;  // relu(v) = 0: exactly T(b2a)
    } else if (k < 0.5f) {
      h = up1;       // the smallest value that counts as active
    } else {
      h = float_to_bits(t + above(rng), dt);
      if (bits_to_float(h, dt) <= t) h = up1;
    }
  }
  return d;
}

class ReluMaskBackwardGpuTest : public ::testing::TestWithParam<std::tuple<MaskCase, ConvDType>> {};

TEST_P(ReluMaskBackwardGpuTest, MatchesFloat64Reference) {
  const MaskCase& mc = std::get<0>(GetParam());
  const ConvDType dt = std::get<1>(GetParam());
  if (const std::string why = gpu_skip_reason(); !why.empty()) GTEST_SKIP() << why;
  const std::string test_name = std::string("relu_mask/") + mc.name + "/" + dtype_name(dt);
  const uint32_t seed = seed_for(test_name);
  SCOPED_TRACE(test_name + " seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  const MaskData d = make_mask_data(mc, dt, rng);

  // Reference: the select (exact) and the two sums in float64.
  const float t = bits_to_float(d.t_bits, dt);
  std::vector<uint16_t> expect(size_t(mc.pixels) * mc.pitch, kGapSentinel);
  double ref_dh = 0.0, ref_pre = 0.0;
  size_t active = 0;
  for (int64_t i = 0; i < mc.pixels; ++i)
    for (int ch = 0; ch < mc.c; ++ch) {
      const size_t src = size_t(i) * mc.c + ch;
      const bool on = bits_to_float(d.h2[src], dt) > t;
      const float scaled = mc.scale != 0.0f ? mc.scale * bits_to_float(d.dh[src], dt) : bits_to_float(d.dh[src], dt);
      const uint16_t stored = float_to_bits(scaled, dt);
      ref_dh += double(scaled);
      if (on) ref_pre += bits_to_float(stored, dt), ++active;
      expect[size_t(i) * mc.pitch + ch] = on ? stored : uint16_t(0);
    }
  ASSERT_GT(active, 0u);
  ASSERT_LT(active, d.h2.size()) << "the mask must be mixed";

  DeviceBuffer ddh, dh2, db2a, dout, dsums, dws;
  ASSERT_NO_FATAL_FAILURE(upload(ddh, d.dh));
  ASSERT_NO_FATAL_FAILURE(upload(dh2, d.h2));
  ASSERT_NO_FATAL_FAILURE(upload(db2a, std::vector<float>{d.b2a, mc.scale}));
  std::vector<uint16_t> poison(expect.size(), kGapSentinel);  // NaN in [0, c) of each row, the sentinel past it
  for (int64_t i = 0; i < mc.pixels; ++i)
    for (int ch = 0; ch < mc.c; ++ch) poison[size_t(i) * mc.pitch + ch] = dt == ConvDType::kF16 ? 0x7e00 : 0x7fc0;
  ASSERT_NO_FATAL_FAILURE(upload(dout, poison));
  ASSERT_EQ(dsums.alloc(2 * sizeof(float)), cudaSuccess);

  ReluMaskBackwardArgs a;
  a.dh = ddh.ptr, a.h2 = dh2.ptr, a.b2a = db2a.as<float>();
  a.scale = mc.scale != 0.0f ? db2a.as<float>() + 1 : nullptr;
  a.pixels = mc.pixels, a.c = mc.c;
  a.d_pre = dout.ptr, a.d_pre_pitch = mc.pitch;
  a.sum_dh = mc.sum_dh ? dsums.as<float>() + 0 : nullptr;
  a.sum_d_pre = mc.sum_d_pre ? dsums.as<float>() + 1 : nullptr;
  const size_t ws_bytes = kfuse::kernels::relu_mask_backward_workspace_bytes(a);
  if (mc.sum_dh || mc.sum_d_pre)
    EXPECT_GT(ws_bytes, 0u);
  else
    EXPECT_EQ(ws_bytes, 0u);
  ASSERT_EQ(dws.alloc(ws_bytes), cudaSuccess);

  StreamGuard stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream.stream, cudaStreamNonBlocking), cudaSuccess);
  std::vector<uint16_t> first_out;
  std::vector<float> first_sums;
  for (int run = 0; run < 2; ++run) {
    SCOPED_TRACE("run " + std::to_string(run));
    ASSERT_EQ(cudaMemcpy(dout.ptr, poison.data(), dout.bytes, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemset(dsums.ptr, 0xff, dsums.bytes), cudaSuccess);  // NaN
    if (ws_bytes) {
      ASSERT_EQ(cudaMemset(dws.ptr, 0xff, ws_bytes), cudaSuccess);
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(kfuse::kernels::launch_relu_mask_backward(a, dt, dws.ptr, stream.stream), cudaSuccess);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream.stream), cudaSuccess);
    std::vector<uint16_t> out;
    std::vector<float> sums;
    ASSERT_NO_FATAL_FAILURE(download(&out, dout));
    ASSERT_NO_FATAL_FAILURE(download(&sums, dsums));

    size_t wrong = 0, gap_touched = 0;
    for (int64_t i = 0; i < mc.pixels; ++i)
      for (int ch = 0; ch < mc.pitch; ++ch) {
        const size_t k = size_t(i) * mc.pitch + ch;
        if (out[k] == expect[k]) continue;
        if (ch < mc.c) {
          if (wrong++ < 5)
            ADD_FAILURE() << "d_pre[" << i << "][" << ch << "] = 0x" << std::hex << out[k] << ", expected 0x"
                          << expect[k] << std::dec;
        } else {
          ++gap_touched;
        }
      }
    EXPECT_EQ(wrong, 0u) << "d_pre must be exactly the select of T(scale * dh) (bits)";
    EXPECT_EQ(gap_touched, 0u) << "channels [c, pitch) of d_pre rows were written";
    // Sums: fp32 per thread and per CTA, float64 across CTAs; the values have mean 0.25 (no cancellation).
    if (mc.sum_dh) {
      EXPECT_LE(rel_diff(sums[0], ref_dh), 1e-4) << "sum_dh " << sums[0] << " vs " << ref_dh;
    } else {
      EXPECT_TRUE(std::isnan(sums[0])) << "sum_dh written although null";
    }
    if (mc.sum_d_pre) {
      EXPECT_LE(rel_diff(sums[1], ref_pre), 1e-4) << "sum_d_pre " << sums[1] << " vs " << ref_pre;
    } else {
      EXPECT_TRUE(std::isnan(sums[1])) << "sum_d_pre written although null";
    }

    if (run == 0) {
      first_out = out, first_sums = sums;
    } else {
      EXPECT_TRUE(out == first_out) << "d_pre differs between two identical launches";
      EXPECT_EQ(std::memcmp(sums.data(), first_sums.data(), sizeof(float) * 2), 0)
          << "the sums differ between two identical launches (not deterministic)";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, ReluMaskBackwardGpuTest,
                         ::testing::Combine(::testing::ValuesIn(kMaskCases), ::testing::ValuesIn(kDtypes)),
                         [](const ::testing::TestParamInfo<std::tuple<MaskCase, ConvDType>>& info) {
                           return std::string(std::get<0>(info.param).name) + "_" +
                                  dtype_name(std::get<1>(info.param));
                         });

// ---- host-only: argument validation returns before any CUDA call ------------------------------------------------


ReluMaskBackwardArgs valid_mask_args() {
  ReluMaskBackwardArgs a;
  a.dh = fake_ptr(0x0000), a.h2 = fake_ptr(0x1000);
  a.b2a = static_cast<const float*>(fake_ptr(0x2000));
  a.pixels = 100, a.c = 64;
  a.d_pre = fake_ptr(0x3000), a.d_pre_pitch = 128;
  a.sum_dh = static_cast<float*>(fake_ptr(0x4000));
  a.sum_d_pre = static_cast<float*>(fake_ptr(0x4004));
  return a;
}

TEST(ReluMaskBackwardArgs, WorkspaceBytes) {
  ReluMaskBackwardArgs a = valid_mask_args();
  EXPECT_GT(kfuse::kernels::relu_mask_backward_workspace_bytes(a), 0u);
  EXPECT_EQ(kfuse::kernels::relu_mask_backward_workspace_bytes(a) % 256, 0u);
  a.sum_dh = nullptr;
  EXPECT_GT(kfuse::kernels::relu_mask_backward_workspace_bytes(a), 0u);
  a.sum_d_pre = nullptr;
  EXPECT_EQ(kfuse::kernels::relu_mask_backward_workspace_bytes(a), 0u) << "no sums, no workspace";
  a = valid_mask_args();
  a.pixels = int64_t(1) << 27;  // 2^30 vectors: the grid is capped, the workspace stays small
  EXPECT_GT(kfuse::kernels::relu_mask_backward_workspace_bytes(a), 0u);
  EXPECT_LE(kfuse::kernels::relu_mask_backward_workspace_bytes(a), 64u * 1024u);
}

TEST(ReluMaskBackwardArgs, RejectsInvalidArguments) {
  using kfuse::kernels::launch_relu_mask_backward;
  struct Bad {
    const char* what;
    void (*edit)(ReluMaskBackwardArgs&);
  };
  const Bad bad[] = {
      {"null dh", [](ReluMaskBackwardArgs& a) { a.dh = nullptr; }},
      {"null h2", [](ReluMaskBackwardArgs& a) { a.h2 = nullptr; }},
      {"null b2a", [](ReluMaskBackwardArgs& a) { a.b2a = nullptr; }},
      {"null d_pre", [](ReluMaskBackwardArgs& a) { a.d_pre = nullptr; }},
      {"c = 12 (not a multiple of 8)", [](ReluMaskBackwardArgs& a) { a.c = 12; }},
      {"c = 0", [](ReluMaskBackwardArgs& a) { a.c = 0; }},
      {"pixels = 0", [](ReluMaskBackwardArgs& a) { a.pixels = 0; }},
      {"pitch < c", [](ReluMaskBackwardArgs& a) { a.d_pre_pitch = 56; }},
      {"pitch % 8", [](ReluMaskBackwardArgs& a) { a.d_pre_pitch = 68; }},
      {"misaligned dh", [](ReluMaskBackwardArgs& a) { a.dh = fake_ptr(2); }},
      {"misaligned h2", [](ReluMaskBackwardArgs& a) { a.h2 = fake_ptr(0x1008); }},
      {"misaligned d_pre", [](ReluMaskBackwardArgs& a) { a.d_pre = fake_ptr(0x3002); }},
      {"more than 2^31 vectors", [](ReluMaskBackwardArgs& a) { a.pixels = int64_t(1) << 29; }},
  };
  for (const Bad& b : bad) {
    ReluMaskBackwardArgs a = valid_mask_args();
    b.edit(a);
    EXPECT_EQ(launch_relu_mask_backward(a, ConvDType::kF16, fake_ptr(0x8000), nullptr), cudaErrorInvalidValue)
        << b.what;
    EXPECT_EQ(kfuse::kernels::relu_mask_backward_workspace_bytes(a), 0u) << b.what;
  }
  EXPECT_EQ(launch_relu_mask_backward(valid_mask_args(), ConvDType::kF16, nullptr, nullptr), cudaErrorInvalidValue)
      << "sums without a workspace";
  EXPECT_EQ(launch_relu_mask_backward(valid_mask_args(), static_cast<ConvDType>(7), fake_ptr(0x8000), nullptr),
            cudaErrorInvalidValue)
      << "unknown dtype";
}

}  // namespace
