// GPU test of launch_stem_backward (src/kernels/encoder/backward_kernels.h) against a float64 CPU computation of the
// same math from the same rounded inputs: dw = g^T s, dinput = in_scale * g W^T (NCHW), sum_da,
// g = T(da + dz) * (x0 > 0); and host-only tests of its argument validation. GPU tests skip without a device of
// compute capability 8.x / 9.x. Outputs (and workspaces) are poisoned with NaN before every launch, launches go to a
// non-blocking stream, and every result must repeat bit for bit.
#include "backward_kernel_test_util.h"

namespace {

using namespace kfuse::testing::backward_kernels;

// ================================================================================================================
// Stem backward
// ================================================================================================================

enum class Layout {
  kNchwF32,             // contiguous fp32 NCHW: the 16-byte vector path
  kNchwF32Unaligned,    // the same, starting one element into the buffer: the strided path with stride_w == 1
  kNchwT,               // contiguous NCHW in the network's dtype: 8-byte vectors
  kChannelsLastF16,     // fp16, channels_last strides (stride_c = 1, stride_w = C)
  kNhwcU8,              // uint8 NHWC with one extra (ignored) channel per pixel, like RGBA for C = 3
};

enum class DinputOut { kNone, kF32, kF16, kBF16 };

struct StemCase {
  const char* name;
  int c, n, h, w, p0;
  Layout layout;
  bool affine, dz, sum_da;
  DinputOut dinput;
};

const StemCase kStemCases[] = {
    {"c3_n5_64x64_nchw_f32", 3, 5, 64, 64, 64, Layout::kNchwF32, false, true, true, DinputOut::kF32},
    {"c3_n1_32x32_chlast_f16", 3, 1, 32, 32, 64, Layout::kChannelsLastF16, false, false, true, DinputOut::kF16},
    {"c3_n5_32x32_rgba_u8_affine", 3, 5, 32, 32, 64, Layout::kNhwcU8, true, true, false, DinputOut::kBF16},
    {"c3_n5_64x64_rgba_u8_affine_nodinput", 3, 5, 64, 64, 64, Layout::kNhwcU8, true, false, true, DinputOut::kNone},
    {"c3_n5_32x64_nchw_f32", 3, 5, 32, 64, 64, Layout::kNchwF32, false, true, true, DinputOut::kF32},
    {"c3_n2_20x44_nchw_f32_unaligned", 3, 2, 20, 44, 64, Layout::kNchwF32Unaligned, true, true, true,
     DinputOut::kF32},
    {"c3_n1_32x32_p24", 3, 1, 32, 32, 24, Layout::kNchwF32, false, true, true, DinputOut::kF32},
    {"c1_n5_64x64_nchw_f32", 1, 5, 64, 64, 64, Layout::kNchwF32, false, true, true, DinputOut::kF32},
    {"c1_n1_32x32_u8_affine", 1, 1, 32, 32, 64, Layout::kNhwcU8, true, false, true, DinputOut::kF16},
    {"c1_n5_32x32_nchw_t", 1, 5, 32, 32, 64, Layout::kNchwT, false, true, false, DinputOut::kF32},
    {"c11_n5_32x32_nchw_t", 11, 5, 32, 32, 64, Layout::kNchwT, false, true, true, DinputOut::kF32},
    {"c11_n1_64x64_chlast_f16_affine", 11, 1, 64, 64, 64, Layout::kChannelsLastF16, true, false, true,
     DinputOut::kF16},
    {"c11_n5_64x64_u8_affine", 11, 5, 64, 64, 64, Layout::kNhwcU8, true, true, true, DinputOut::kNone},
    {"c2_n2_32x32_p8_chlast_affine", 2, 2, 32, 32, 8, Layout::kChannelsLastF16, true, true, true, DinputOut::kBF16},
    // 16C = 208 columns: two column chunks (gridDim.y = 2) of the generic kernel.
    {"c13_n1_32x32_nchw_f32", 13, 1, 32, 32, 64, Layout::kNchwF32, false, true, true, DinputOut::kF32},
    // 280 tiles of 128 pixels: more tiles than CTAs, so CTAs accumulate dw over several tiles.
    {"c3_n140_64x64_nchw_t", 3, 140, 64, 64, 64, Layout::kNchwT, false, true, true, DinputOut::kF16},
};

void PrintTo(const StemCase& sc, std::ostream* os) { *os << sc.name; }

// The input as stored, read back as the kernel reads it.
struct HostInput {
  InputDType dtype = InputDType::kF32;
  ConvDType half_kind = ConvDType::kF16;  // for 16-bit dtypes
  int64_t sn = 0, sc = 0, sh = 0, sw = 0, offset = 0;
  std::vector<uint8_t> bytes;
  size_t esize() const { return dtype == InputDType::kF32 ? 4 : dtype == InputDType::kU8 ? 1 : 2; }
  float at(int n, int c, int y, int x) const {
    const int64_t e = offset + n * sn + c * sc + y * sh + x * sw;
    const uint8_t* p = bytes.data() + e * esize();
    if (dtype == InputDType::kF32) {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    if (dtype == InputDType::kU8) return float(*p);
    uint16_t b;
    std::memcpy(&b, p, 2);
    return bits_to_float(b, half_kind);
  }
};

HostInput make_input(const StemCase& sc, ConvDType dt, std::mt19937& rng) {
  HostInput in;
  const int C = sc.c, H = sc.h, W = sc.w;
  switch (sc.layout) {
    case Layout::kNchwF32:
    case Layout::kNchwF32Unaligned:
    case Layout::kNchwT:
      in.dtype = sc.layout == Layout::kNchwT ? (dt == ConvDType::kF16 ? InputDType::kF16 : InputDType::kBF16)
                                             : InputDType::kF32;
      in.sw = 1, in.sh = W, in.sc = int64_t(H) * W, in.sn = int64_t(C) * H * W;
      in.offset = sc.layout == Layout::kNchwF32Unaligned ? 1 : 0;
      break;
    case Layout::kChannelsLastF16:
      in.dtype = InputDType::kF16;
      in.sc = 1, in.sw = C, in.sh = int64_t(W) * C, in.sn = int64_t(H) * W * C;
      break;
    case Layout::kNhwcU8:
      in.dtype = InputDType::kU8;
      in.sc = 1, in.sw = C + 1, in.sh = int64_t(W) * (C + 1), in.sn = int64_t(H) * W * (C + 1);
      break;
  }
  in.half_kind = in.dtype == InputDType::kBF16 ? ConvDType::kBF16 : ConvDType::kF16;
  const int64_t elems = in.offset + sc.n * in.sn;  // every layout here is dense (up to the extra channel)
  in.bytes.resize(size_t(elems) * in.esize());
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::uniform_int_distribution<int> byte(0, 255);
  for (int64_t e = 0; e < elems; ++e) {
    uint8_t* p = in.bytes.data() + e * in.esize();
    if (in.dtype == InputDType::kF32) {
      const float f = dist(rng);
      std::memcpy(p, &f, 4);
    } else if (in.dtype == InputDType::kU8) {
      *p = static_cast<uint8_t>(byte(rng));
    } else {
      const uint16_t b = float_to_bits(dist(rng), in.half_kind);
      std::memcpy(p, &b, 2);
    }
  }
  return in;
}

struct StemData {
  HostInput x;
  std::vector<float> scale, shift;  // empty without the affine map
  std::vector<uint16_t> weight;     // [kpad][p0]
  int kpad = 0;
  std::vector<uint16_t> x0, da, dz;  // [M][p0]
};

struct StemReference {
  std::vector<double> dw;      // [p0][16C]
  std::vector<double> dinput;  // [n][c][h][w]
  double sum_da = 0.0;
};

// The math of backward_kernels.h on the operands the kernel's GEMMs see (see stem_backward.cu): s = T(v) with
// v = fmaf(x, scale, shift) (x without the map), g = T(da + dz) where x0 > 0, else 0 (da itself without dz).
StemReference reference_stem(const StemCase& sc, ConvDType dt, const StemData& d) {
  const int C = sc.c, K = 16 * C, P = sc.p0, ho = sc.h / 4, wo = sc.w / 4;
  const int64_t M = int64_t(sc.n) * ho * wo;
  StemReference r;
  r.dw.assign(size_t(P) * K, 0.0);
  r.dinput.assign(size_t(sc.n) * C * sc.h * sc.w, 0.0);
  std::vector<double> wd(size_t(K) * P);
  for (int k = 0; k < K; ++k)
    for (int p = 0; p < P; ++p) wd[size_t(k) * P + p] = bits_to_float(d.weight[size_t(k) * P + p], dt);
  std::vector<double> s(K), g(P);
  for (int64_t m = 0; m < M; ++m) {
    const int img = int(m / (ho * wo)), i = int(m / wo % ho), j = int(m % wo);
    for (int k = 0; k < K; ++k) {
      const int dy = k / (4 * C), dx = k % (4 * C) / C, c = k % C;
      float v = d.x.at(img, c, 4 * i + dy, 4 * j + dx);
      if (!d.scale.empty()) v = std::fma(v, d.scale[c], d.shift[c]);
      s[k] = round_t(v, dt);
    }
    for (int p = 0; p < P; ++p) {
      const size_t e = size_t(m) * P + p;
      const float da = bits_to_float(d.da[e], dt);
      r.sum_da += da;
      const float sum = d.dz.empty() ? da : round_t(da + bits_to_float(d.dz[e], dt), dt);
      g[p] = bits_to_float(d.x0[e], dt) > 0.f ? sum : 0.0;
    }
    for (int p = 0; p < P; ++p) {
      if (g[p] == 0.0) continue;
      double* row = &r.dw[size_t(p) * K];
      for (int k = 0; k < K; ++k) row[k] += g[p] * s[k];
    }
    for (int k = 0; k < K; ++k) {
      double acc = 0.0;
      const double* wr = &wd[size_t(k) * P];
      for (int p = 0; p < P; ++p) acc += g[p] * wr[p];
      const int dy = k / (4 * C), dx = k % (4 * C) / C, c = k % C;
      const double scale = d.scale.empty() ? 1.0 : double(d.scale[c]);
      r.dinput[((size_t(img) * C + c) * sc.h + 4 * i + dy) * sc.w + 4 * j + dx] = scale * acc;
    }
  }
  return r;
}

InputDType dinput_dtype(DinputOut o) {
  return o == DinputOut::kF16 ? InputDType::kF16 : o == DinputOut::kBF16 ? InputDType::kBF16 : InputDType::kF32;
}
size_t dinput_esize(DinputOut o) { return o == DinputOut::kF32 ? 4 : 2; }

std::vector<double> dinput_values(const std::vector<uint8_t>& raw, DinputOut o) {
  const size_t es = dinput_esize(o), n = raw.size() / es;
  std::vector<double> v(n);
  for (size_t i = 0; i < n; ++i) {
    if (o == DinputOut::kF32) {
      float f;
      std::memcpy(&f, raw.data() + i * 4, 4);
      v[i] = f;
    } else {
      uint16_t b;
      std::memcpy(&b, raw.data() + i * 2, 2);
      v[i] = bits_to_float(b, o == DinputOut::kF16 ? ConvDType::kF16 : ConvDType::kBF16);
    }
  }
  return v;
}

class StemBackwardGpuTest : public ::testing::TestWithParam<std::tuple<StemCase, ConvDType>> {};

TEST_P(StemBackwardGpuTest, MatchesFloat64Reference) {
  const StemCase& sc = std::get<0>(GetParam());
  const ConvDType dt = std::get<1>(GetParam());
  if (const std::string why = gpu_skip_reason(); !why.empty()) GTEST_SKIP() << why;
  const std::string test_name = std::string("stem_backward/") + sc.name + "/" + dtype_name(dt);
  const uint32_t seed = seed_for(test_name);
  SCOPED_TRACE(test_name + " seed=" + std::to_string(seed));
  std::mt19937 rng(seed);

  const int C = sc.c, K = 16 * C, P = sc.p0;
  const int64_t M = int64_t(sc.n) * (sc.h / 4) * (sc.w / 4);
  StemData d;
  d.x = make_input(sc, dt, rng);
  if (sc.affine) {
    const bool bytes = d.x.dtype == InputDType::kU8;  // /255 and a running-mean shift, as the policy's input map
    std::uniform_real_distribution<float> scale_dist(bytes ? 0.01f : 0.5f, bytes ? 0.02f : 2.0f);
    std::uniform_real_distribution<float> shift_dist(bytes ? -2.5f : -0.5f, bytes ? -1.0f : 0.5f);
    for (int c = 0; c < C; ++c) d.scale.push_back(scale_dist(rng)), d.shift.push_back(shift_dist(rng));
  }
  d.kpad = (K + 63) / 64 * 64;
  d.weight = random_bits(size_t(d.kpad) * P, -0.5f, 0.5f, dt, rng);
  for (size_t e = size_t(K) * P; e < d.weight.size(); ++e)  // rows >= 16C must be ignored: NaN there
    d.weight[e] = dt == ConvDType::kF16 ? 0x7e00 : 0x7fc0;
  d.x0 = random_bits(size_t(M) * P, -1.f, 1.f, dt, rng);
  for (auto& b : d.x0)
    if (bits_to_float(b, dt) < 0.f) b = 0;  // relu: about half are 0 (masked)
  d.da = random_bits(size_t(M) * P, -0.5f, 1.0f, dt, rng);  // mean 0.25: sum_da far from cancellation
  if (sc.dz) d.dz = random_bits(size_t(M) * P, -1.f, 1.f, dt, rng);

  const StemReference ref = reference_stem(sc, dt, d);

  DeviceBuffer dx, dscale, dshift, dweight, dx0, dda, ddz, ddw, dsum, ddin, dws;
  ASSERT_NO_FATAL_FAILURE(upload(dx, d.x.bytes));
  if (sc.affine) {
    ASSERT_NO_FATAL_FAILURE(upload(dscale, d.scale));
    ASSERT_NO_FATAL_FAILURE(upload(dshift, d.shift));
  }
  ASSERT_NO_FATAL_FAILURE(upload(dweight, d.weight));
  ASSERT_NO_FATAL_FAILURE(upload(dx0, d.x0));
  ASSERT_NO_FATAL_FAILURE(upload(dda, d.da));
  if (sc.dz) {
    ASSERT_NO_FATAL_FAILURE(upload(ddz, d.dz));
  }
  ASSERT_EQ(ddw.alloc(size_t(P) * K * sizeof(float)), cudaSuccess);
  ASSERT_EQ(dsum.alloc(sizeof(float)), cudaSuccess);
  if (sc.dinput != DinputOut::kNone) {
    ASSERT_EQ(ddin.alloc(ref.dinput.size() * dinput_esize(sc.dinput)), cudaSuccess);
  }

  StemBackwardArgs a;
  a.x = static_cast<const uint8_t*>(dx.ptr) + d.x.offset * d.x.esize();
  a.x_dtype = d.x.dtype;
  a.stride_n = d.x.sn, a.stride_c = d.x.sc, a.stride_h = d.x.sh, a.stride_w = d.x.sw;
  a.n = sc.n, a.c = C, a.h = sc.h, a.w = sc.w;
  a.in_scale = sc.affine ? dscale.as<float>() : nullptr;
  a.in_shift = sc.affine ? dshift.as<float>() : nullptr;
  a.weight = dweight.ptr, a.kpad = d.kpad, a.p0 = P;
  a.x0 = dx0.ptr, a.da = dda.ptr, a.dz = sc.dz ? ddz.ptr : nullptr;
  a.dw = ddw.as<float>();
  a.sum_da = sc.sum_da ? dsum.as<float>() : nullptr;
  a.dinput = sc.dinput != DinputOut::kNone ? ddin.ptr : nullptr;
  a.dinput_dtype = dinput_dtype(sc.dinput);
  const size_t ws_bytes = kfuse::kernels::stem_backward_workspace_bytes(a);
  ASSERT_GT(ws_bytes, 0u);
  ASSERT_EQ(dws.alloc(ws_bytes), cudaSuccess);

  StreamGuard stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream.stream, cudaStreamNonBlocking), cudaSuccess);
  std::vector<float> first_dw, first_sum;
  std::vector<uint8_t> first_din;
  for (int run = 0; run < 2; ++run) {
    SCOPED_TRACE("run " + std::to_string(run));
    // NaN everywhere the launch writes (0xffff.. is NaN in fp32, fp16 and bf16), the workspace included.
    ASSERT_EQ(cudaMemset(ddw.ptr, 0xff, ddw.bytes), cudaSuccess);
    ASSERT_EQ(cudaMemset(dsum.ptr, 0xff, dsum.bytes), cudaSuccess);
    if (ddin.ptr) {
      ASSERT_EQ(cudaMemset(ddin.ptr, 0xff, ddin.bytes), cudaSuccess);
    }
    ASSERT_EQ(cudaMemset(dws.ptr, 0xff, dws.bytes), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(kfuse::kernels::launch_stem_backward(a, dt, dws.ptr, stream.stream), cudaSuccess);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream.stream), cudaSuccess);

    std::vector<float> dw, sum;
    std::vector<uint8_t> din;
    ASSERT_NO_FATAL_FAILURE(download(&dw, ddw));
    ASSERT_NO_FATAL_FAILURE(download(&sum, dsum));
    if (ddin.ptr) {
      ASSERT_NO_FATAL_FAILURE(download(&din, ddin));
    }

    // dw: both sides multiply the same T operands (exact products in fp32) and differ only in the order and
    // precision of the sums (fp32 chains of <= 128 * tiles-per-CTA products, float64 across CTAs): ~1e-6 relative
    // normwise. 1e-4 leaves a wide margin and still catches an operand rounded differently (not rounding s or g to
    // T costs ~3e-4 in fp16 and ~2e-3 in bf16 with these inputs).
    const Comparison cw = compare(std::vector<double>(dw.begin(), dw.end()), ref.dw);
    EXPECT_EQ(cw.nan_count, 0u) << "dw elements left unwritten (NaN poison) or NaN, of " << dw.size();
    ASSERT_GT(cw.ref_norm2, 0.0);
    EXPECT_LE(cw.rel, 1e-4) << "dw: normwise relative error";
    if (sc.sum_da)
      EXPECT_LE(rel_diff(sum[0], ref.sum_da), 1e-4) << "sum_da " << sum[0] << " vs " << ref.sum_da;
    else
      EXPECT_TRUE(std::isnan(sum[0])) << "sum_da written although null";
    if (ddin.ptr) {
      // dinput: exact products, fp32 sums of p0 terms, then one rounding to its dtype (2^-9 relative for bf16).
      const Comparison ci = compare(dinput_values(din, sc.dinput), ref.dinput);
      EXPECT_EQ(ci.nan_count, 0u) << "dinput elements left unwritten (NaN poison) or NaN, of " << ref.dinput.size();
      ASSERT_GT(ci.ref_norm2, 0.0);
      EXPECT_LE(ci.rel, 1e-2) << "dinput: normwise relative error";
    }
    if (run == 0) {
      first_dw = dw, first_sum = sum, first_din = din;
    } else {
      EXPECT_EQ(std::memcmp(dw.data(), first_dw.data(), dw.size() * sizeof(float)), 0)
          << "dw differs between two identical launches (not deterministic)";
      EXPECT_EQ(std::memcmp(sum.data(), first_sum.data(), sizeof(float)), 0) << "sum_da differs between launches";
      EXPECT_TRUE(din == first_din) << "dinput differs between two identical launches";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, StemBackwardGpuTest,
                         ::testing::Combine(::testing::ValuesIn(kStemCases), ::testing::ValuesIn(kDtypes)),
                         [](const ::testing::TestParamInfo<std::tuple<StemCase, ConvDType>>& info) {
                           return std::string(std::get<0>(info.param).name) + "_" +
                                  dtype_name(std::get<1>(info.param));
                         });

// ---- host-only: argument validation returns before any CUDA call ------------------------------------------------

StemBackwardArgs valid_stem_args() {
  StemBackwardArgs a;
  a.x = fake_ptr(0x0000), a.x_dtype = InputDType::kF32;
  a.n = 2, a.c = 3, a.h = 32, a.w = 32;
  a.stride_w = 1, a.stride_h = 32, a.stride_c = 32 * 32, a.stride_n = 3 * 32 * 32;
  a.weight = fake_ptr(0x10000), a.kpad = 64, a.p0 = 64;
  a.x0 = fake_ptr(0x20000), a.da = fake_ptr(0x30000), a.dz = fake_ptr(0x40000);
  a.dw = static_cast<float*>(fake_ptr(0x50000));
  a.sum_da = static_cast<float*>(fake_ptr(0x60000));
  a.dinput = fake_ptr(0x70000), a.dinput_dtype = InputDType::kF32;
  return a;
}

TEST(StemBackwardArgs, WorkspaceBytes) {
  using kfuse::kernels::stem_backward_workspace_bytes;
  StemBackwardArgs a = valid_stem_args();
  const size_t small = stem_backward_workspace_bytes(a);
  EXPECT_GT(small, 0u);
  EXPECT_EQ(small % 256, 0u);
  EXPECT_GE(small, size_t(64) * 48 * sizeof(float)) << "at least one dw partial";
  a.n = 2048, a.h = 64, a.w = 64;  // the training batch: capped number of partials, a few MB
  const size_t big = stem_backward_workspace_bytes(a);
  EXPECT_GE(big, small);
  EXPECT_LE(big, size_t(8) << 20);
  a.dinput = nullptr, a.weight = nullptr, a.sum_da = nullptr, a.dz = nullptr;  // the optional outputs / inputs
  EXPECT_GT(stem_backward_workspace_bytes(a), 0u);
}

TEST(StemBackwardArgs, RejectsInvalidArguments) {
  using kfuse::kernels::launch_stem_backward;
  struct Bad {
    const char* what;
    void (*edit)(StemBackwardArgs&);
  };
  const Bad bad[] = {
      {"null x", [](StemBackwardArgs& a) { a.x = nullptr; }},
      {"null x0", [](StemBackwardArgs& a) { a.x0 = nullptr; }},
      {"null da", [](StemBackwardArgs& a) { a.da = nullptr; }},
      {"null dw", [](StemBackwardArgs& a) { a.dw = nullptr; }},
      {"n = 0", [](StemBackwardArgs& a) { a.n = 0; }},
      {"c = 0", [](StemBackwardArgs& a) { a.c = 0; }},
      {"h % 4", [](StemBackwardArgs& a) { a.h = 30; }},
      {"w % 4", [](StemBackwardArgs& a) { a.w = 34; }},
      {"p0 % 8", [](StemBackwardArgs& a) { a.p0 = 60; }},
      {"p0 = 0", [](StemBackwardArgs& a) { a.p0 = 0; }},
      {"p0 > 64", [](StemBackwardArgs& a) { a.p0 = 72; }},
      {"in_scale without in_shift",
       [](StemBackwardArgs& a) { a.in_scale = static_cast<const float*>(fake_ptr(0x80000)); }},
      {"in_shift without in_scale",
       [](StemBackwardArgs& a) { a.in_shift = static_cast<const float*>(fake_ptr(0x80000)); }},
      {"unknown x dtype", [](StemBackwardArgs& a) { a.x_dtype = static_cast<InputDType>(9); }},
      {"misaligned x0", [](StemBackwardArgs& a) { a.x0 = fake_ptr(0x20008); }},
      {"misaligned da", [](StemBackwardArgs& a) { a.da = fake_ptr(0x30002); }},
      {"misaligned dz", [](StemBackwardArgs& a) { a.dz = fake_ptr(0x40004); }},
      {"uint8 dinput", [](StemBackwardArgs& a) { a.dinput_dtype = InputDType::kU8; }},
      {"misaligned fp32 dinput", [](StemBackwardArgs& a) { a.dinput = fake_ptr(0x70004); }},
      {"misaligned fp16 dinput",
       [](StemBackwardArgs& a) { a.dinput = fake_ptr(0x70002), a.dinput_dtype = InputDType::kF16; }},
      {"dinput without weight", [](StemBackwardArgs& a) { a.weight = nullptr; }},
      {"dinput with kpad < 16C", [](StemBackwardArgs& a) { a.kpad = 32; }},
      {"too many pixels", [](StemBackwardArgs& a) { a.n = 1 << 20, a.h = 1024, a.w = 1024; }},
  };
  for (const Bad& b : bad) {
    StemBackwardArgs a = valid_stem_args();
    b.edit(a);
    EXPECT_EQ(launch_stem_backward(a, ConvDType::kF16, fake_ptr(0x90000), nullptr), cudaErrorInvalidValue)
        << b.what;
    EXPECT_EQ(kfuse::kernels::stem_backward_workspace_bytes(a), 0u) << b.what;
  }
  EXPECT_EQ(launch_stem_backward(valid_stem_args(), ConvDType::kBF16, nullptr, nullptr), cudaErrorInvalidValue)
      << "no workspace";
  EXPECT_EQ(launch_stem_backward(valid_stem_args(), static_cast<ConvDType>(7), fake_ptr(0x90000), nullptr),
            cudaErrorInvalidValue)
      << "unknown dtype";
  // Without dinput, neither the weight nor kpad matter.
  StemBackwardArgs a = valid_stem_args();
  a.dinput = nullptr, a.weight = nullptr, a.kpad = 0;
  EXPECT_GT(kfuse::kernels::stem_backward_workspace_bytes(a), 0u);
}

}  // namespace
