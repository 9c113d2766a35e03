// GPU tests of the training step's parameter packing (src/kernels/encoder/weight_layout.h launch_pack_params): a job
// table with every kind, in shapes that take each of the kernel's paths (full and partial tiles, channel counts that
// are not multiples of 32 or of 8, a slice of a filter at k0 != 0, 1x1, 1x3 and 5x5 filters, misaligned source and
// destination, several element tiles, empty jobs, tables longer than one chunk of jobs), from fp32 / fp16 / bf16
// sources into fp16 / bf16 layouts, against a host reference that scatters each source element to the places the
// header documents. Packing is a conversion, so every byte must match: the reference rounds with the same
// round-to-nearest-even rules (and kPooled divides in fp32, v / 9.0f). The destination is poisoned with 0xFF bytes,
// which must survive everywhere outside the jobs' layouts (no stray writes). The run flag: 0 writes nothing, 1 packs.
// GPU tests skip without a device of compute capability 8.x / 9.x.
#include "kernels/encoder/weight_layout.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu_test_support.h"

#include <cstdint>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

namespace {

using kfuse::bits_to_float;
using kfuse::float_to_bits;

using kfuse::testing::DeviceBuffer;
using kfuse::testing::seed_for;
using kfuse::testing::StreamGuard;

using kfuse::kernels::ConvDType;
using kfuse::kernels::PackJob;
using kfuse::kernels::PackKind;
using kfuse::kernels::ParamDType;

std::string gpu_skip_reason() { return kfuse::testing::device_skip_reason(8, 9, "the parameter packing kernel"); }

const char* dtype_name(ConvDType dt) { return dt == ConvDType::kF16 ? "f16" : "bf16"; }
const char* dtype_name(ParamDType dt) {
  return dt == ParamDType::kF32 ? "f32" : dt == ParamDType::kF16 ? "f16" : "bf16";
}
size_t elem_bytes(ParamDType dt) { return dt == ParamDType::kF32 ? 4 : 2; }
ConvDType as_conv(ParamDType dt) { return dt == ParamDType::kF16 ? ConvDType::kF16 : ConvDType::kBF16; }

// One job of a test table before placement. kStem: k = p, c = kin, r = kpad (PackJob's convention).
struct JobSpec {
  const char* name;
  PackKind kind;
  int k = 0, c = 0, r = 0, s = 0;
  int k0 = 0, k_rows = 0;    // kTapPlanes: the slice's first row and the source filter's rows (0: k)
  int64_t copy_count = 0;    // kCopyF32
  int src_misalign = 0;      // source elements past a 256-byte boundary
  int dst_misalign = 0;      // destination bytes past a 256-byte boundary (even: T stays aligned)
};

int64_t src_elems(const JobSpec& j) {
  switch (j.kind) {
    case PackKind::kCopyF32: return j.copy_count;
    case PackKind::kPooled:
    case PackKind::kStem: return int64_t(j.k) * j.c;
    default: return int64_t(j.k_rows ? j.k_rows : j.k) * j.c * j.r * j.s;
  }
}

int64_t dst_elems(const JobSpec& j) {
  switch (j.kind) {
    case PackKind::kCopyF32: return j.copy_count;
    case PackKind::kPooled: return int64_t(j.k) * 9 * j.c;
    case PackKind::kStem: return int64_t(j.r) * j.k;
    default: return int64_t(j.k) * j.r * j.s * j.c;
  }
}

// Every kind and every path of the kernel, in shapes of the encoder and odd ones.
std::vector<JobSpec> main_table() {
  using K = PackKind;
  return {
      {.name = "stem_p64_kin48_kpad64", .kind = K::kStem, .k = 64, .c = 48, .r = 64},
      {.name = "stem_p16_kin16_kpad32", .kind = K::kStem, .k = 16, .c = 16, .r = 32},
      {.name = "krsc3x3_k64_c48", .kind = K::kKrsc, .k = 64, .c = 48, .r = 3, .s = 3},  // a 16-channel tile
      {.name = "krsc3x3_k33_c20", .kind = K::kKrsc, .k = 33, .c = 20, .r = 3, .s = 3},  // c % 8: 2-byte stores
      {.name = "flip3x3_k40_c64", .kind = K::kFlip, .k = 40, .c = 64, .r = 3, .s = 3},  // an 8-channel k tile
      {.name = "flip3x3_k36_c20", .kind = K::kFlip, .k = 36, .c = 20, .r = 3, .s = 3},  // k % 8: 2-byte stores
      {.name = "flip1x3_k16_c24", .kind = K::kFlip, .k = 16, .c = 24, .r = 1, .s = 3},  // a non-square flip
      {.name = "planes3x3_k24_of64_at40_c48", .kind = K::kTapPlanes, .k = 24, .c = 48, .r = 3, .s = 3, .k0 = 40,
       .k_rows = 64},
      {.name = "planes1x1_k32_of64_at32_c64", .kind = K::kTapPlanes, .k = 32, .c = 64, .r = 1, .s = 1, .k0 = 32,
       .k_rows = 64},
      {.name = "planes3x3_k64_c64", .kind = K::kTapPlanes, .k = 64, .c = 64, .r = 3, .s = 3},
      {.name = "planes3x3_k20_c24", .kind = K::kTapPlanes, .k = 20, .c = 24, .r = 3, .s = 3},
      {.name = "pooled_k48_c40", .kind = K::kPooled, .k = 48, .c = 40, .r = 1, .s = 1},
      {.name = "pooled_k8_c12", .kind = K::kPooled, .k = 8, .c = 12, .r = 1, .s = 1},  // c % 8: 2-byte stores
      {.name = "krsc1x1_k4_c512", .kind = K::kKrsc, .k = 4, .c = 512, .r = 1, .s = 1},  // squeeze-excite fc1
      {.name = "krsc1x1_k512_c4", .kind = K::kKrsc, .k = 512, .c = 4, .r = 1, .s = 1},  // fc2: 4-element rows
      {.name = "krsc1x1_k40_c300", .kind = K::kKrsc, .k = 40, .c = 300, .r = 1, .s = 1},
      {.name = "flip1x1_k48_c264", .kind = K::kFlip, .k = 48, .c = 264, .r = 1, .s = 1},
      {.name = "krsc5x5_k8_c8", .kind = K::kKrsc, .k = 8, .c = 8, .r = 5, .s = 5},  // element-wise gather
      {.name = "flip5x5_k8_c8", .kind = K::kFlip, .k = 8, .c = 8, .r = 5, .s = 5},
      {.name = "krsc3x3_k128_c96", .kind = K::kKrsc, .k = 128, .c = 96, .r = 3, .s = 3},
      {.name = "flip3x3_k128_c96", .kind = K::kFlip, .k = 128, .c = 96, .r = 3, .s = 3},
      {.name = "krsc3x3_src_misaligned", .kind = K::kKrsc, .k = 32, .c = 32, .r = 3, .s = 3, .src_misalign = 1},
      {.name = "flip3x3_dst_misaligned", .kind = K::kFlip, .k = 32, .c = 32, .r = 3, .s = 3, .dst_misalign = 2},
      {.name = "pooled_dst_misaligned", .kind = K::kPooled, .k = 16, .c = 32, .r = 1, .s = 1, .dst_misalign = 6},
      {.name = "copy_1", .kind = K::kCopyF32, .copy_count = 1},
      {.name = "copy_0", .kind = K::kCopyF32, .copy_count = 0},
      {.name = "krsc_empty", .kind = K::kKrsc, .k = 0, .c = 16, .r = 3, .s = 3},
      {.name = "copy_5000", .kind = K::kCopyF32, .copy_count = 5000},  // several element tiles
      {.name = "copy_37_src_misaligned", .kind = K::kCopyF32, .copy_count = 37, .src_misalign = 1},
  };
}

// Source values as the device holds them (bytes) and as the reference reads them (fp32, exact).
struct Source {
  std::vector<uint8_t> bytes;
  std::vector<float> values;
};

// Values every few elements that probe the rounding: ties to even (fp16 and bf16), overflow to inf, subnormals of
// fp16 / bf16 / fp32, signed zero, the largest finite values, infinity (16-bit patterns: none is a NaN in either
// format).
float special_f32(size_t i) {
  const float kSpecial[] = {0.0f, -0.0f, 1.00048828125f, 1.00390625f, 1e5f, -70000.f, 65519.f, 3e-6f, -6e-8f, 1e-40f};
  return kSpecial[i % (sizeof(kSpecial) / sizeof(kSpecial[0]))];
}
uint16_t special_bits(size_t i) {
  const uint16_t kSpecial[] = {0x0000, 0x8000, 0x0001, 0x8003, 0x7bff, 0x7c00, 0x3c01, 0x0400};
  return kSpecial[i % (sizeof(kSpecial) / sizeof(kSpecial[0]))];
}

Source make_source(int64_t n, ParamDType dt, std::mt19937& rng) {
  Source s;
  s.values.resize(size_t(n));
  s.bytes.resize(size_t(n) * elem_bytes(dt));
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  for (size_t i = 0; i < size_t(n); ++i) {
    const bool special = i % 7 == 3;
    if (dt == ParamDType::kF32) {
      const float f = special ? special_f32(i / 7) : dist(rng);
      s.values[i] = f;
      std::memcpy(&s.bytes[4 * i], &f, 4);
    } else {
      const ConvDType cd = as_conv(dt);
      const uint16_t b = special ? special_bits(i / 7) : float_to_bits(dist(rng), cd);
      s.values[i] = bits_to_float(b, cd);
      std::memcpy(&s.bytes[2 * i], &b, 2);
    }
  }
  return s;
}

// The reference: each source element scattered to the documented layout (the kernel gathers; this walks the
// source), as T bits (or fp32 bits for kCopyF32) at the job's bytes of `out`.
void put_t(std::vector<uint8_t>& out, size_t at, int64_t i, float v, ConvDType dt) {
  const uint16_t b = float_to_bits(v, dt);
  std::memcpy(&out[at + 2 * size_t(i)], &b, 2);
}

void reference(const JobSpec& j, const std::vector<float>& v, ConvDType dt, std::vector<uint8_t>& out, size_t at) {
  if (j.kind == PackKind::kCopyF32) {
    for (int64_t i = 0; i < j.copy_count; ++i) std::memcpy(&out[at + 4 * size_t(i)], &v[size_t(i)], 4);
    return;
  }
  if (j.kind == PackKind::kStem) {  // dst [kpad][p] = src[p][row], rows >= kin zero
    for (int row = 0; row < j.r; ++row)
      for (int p = 0; p < j.k; ++p)
        put_t(out, at, int64_t(row) * j.k + p, row < j.c ? v[size_t(p) * j.c + row] : 0.f, dt);
    return;
  }
  if (j.kind == PackKind::kPooled) {  // dst [k][9][c] = src[k][c] / 9
    for (int k = 0; k < j.k; ++k)
      for (int c = 0; c < j.c; ++c)
        for (int t = 0; t < 9; ++t) put_t(out, at, (int64_t(k) * 9 + t) * j.c + c, v[size_t(k) * j.c + c] / 9.0f, dt);
    return;
  }
  const int R = j.r, S = j.s;
  for (int k = 0; k < j.k; ++k)
    for (int c = 0; c < j.c; ++c)
      for (int r = 0; r < R; ++r)
        for (int s = 0; s < S; ++s) {
          const float x = v[((size_t(j.k0 + k) * j.c + c) * R + r) * S + s];
          int64_t d = 0;
          if (j.kind == PackKind::kKrsc)
            d = ((int64_t(k) * R + r) * S + s) * j.c + c;
          else if (j.kind == PackKind::kFlip)  // dst[c][R-1-r][S-1-s][k] = src[k][c][r][s]
            d = ((int64_t(c) * R + (R - 1 - r)) * S + (S - 1 - s)) * j.k + k;
          else  // kTapPlanes: [r][s][c / 8][k][c % 8]
            d = ((int64_t(r * S + s) * (j.c / 8) + c / 8) * j.k + k) * 8 + c % 8;
          put_t(out, at, d, x, dt);
        }
}

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// A job table laid out on the device, its sources uploaded, and the reference image of the destination.
struct Table {
  std::vector<JobSpec> specs;
  std::vector<PackJob> jobs;
  std::vector<size_t> dst_at;     // byte offset of each job's layout in the destination
  std::vector<uint8_t> expected;  // 0xFF outside the layouts
  DeviceBuffer src, dst, d_jobs;
};

void build(Table& t, ParamDType sd, ConvDType dd, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<Source> sources;
  std::vector<size_t> src_at;
  size_t src_bytes = 0, dst_bytes = 0;
  for (const JobSpec& j : t.specs) {
    sources.push_back(make_source(src_elems(j), sd, rng));
    src_at.push_back(src_bytes + j.src_misalign * elem_bytes(sd));
    src_bytes = align256(src_at.back() + sources.back().bytes.size());
    t.dst_at.push_back(dst_bytes + j.dst_misalign);
    dst_bytes = align256(t.dst_at.back() + dst_elems(j) * (j.kind == PackKind::kCopyF32 ? 4 : 2)) + 256;
  }
  std::vector<uint8_t> src_image(src_bytes + 256, 0);
  t.expected.assign(dst_bytes, 0xFF);
  ASSERT_EQ(t.src.alloc(src_image.size()), cudaSuccess);
  for (size_t i = 0; i < t.specs.size(); ++i) {
    const JobSpec& j = t.specs[i];
    std::memcpy(src_image.data() + src_at[i], sources[i].bytes.data(), sources[i].bytes.size());
    reference(j, sources[i].values, dd, t.expected, t.dst_at[i]);
    PackJob p;
    p.src = t.src.as<uint8_t>() + src_at[i];
    p.dst_offset = int64_t(t.dst_at[i]);
    p.count = dst_elems(j);
    p.kind = j.kind;
    p.src_dtype = sd;
    p.k = j.k, p.c = j.c, p.r = j.r, p.s = j.s, p.k0 = j.k0;
    t.jobs.push_back(p);
  }
  ASSERT_EQ(cudaMemcpy(t.src.ptr, src_image.data(), src_image.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(t.dst.alloc(dst_bytes), cudaSuccess);
  ASSERT_EQ(t.d_jobs.alloc(t.jobs.size() * sizeof(PackJob)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(t.d_jobs.ptr, t.jobs.data(), t.d_jobs.bytes, cudaMemcpyHostToDevice), cudaSuccess);
}

// Poisons the destination, packs (gated by `flag` where given), and returns the destination's bytes.
std::vector<uint8_t> pack(Table& t, ConvDType dd, const unsigned* flag, cudaStream_t stream) {
  std::vector<uint8_t> got(t.dst.bytes);
  EXPECT_EQ(cudaMemsetAsync(t.dst.ptr, 0xFF, t.dst.bytes, stream), cudaSuccess);
  EXPECT_EQ(kfuse::kernels::launch_pack_params(t.d_jobs.as<PackJob>(), int(t.jobs.size()), t.dst.ptr, dd, stream,
                                               flag),
            cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(got.data(), t.dst.ptr, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  return got;
}

// Byte-exact comparison; names the job (or the gap) and the element of the first difference.
void expect_equal(const Table& t, const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  ASSERT_EQ(got.size(), want.size());
  size_t bad = 0, first = got.size();
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i]) bad += 1, first = first < i ? first : i;
  if (bad == 0) return;
  std::string where = "a gap between layouts";
  for (size_t i = 0; i < t.specs.size(); ++i) {
    const size_t width = t.specs[i].kind == PackKind::kCopyF32 ? 4 : 2;
    const size_t end = t.dst_at[i] + size_t(dst_elems(t.specs[i])) * width;
    if (first >= t.dst_at[i] && first < end)
      where = std::string(t.specs[i].name) + " element " + std::to_string((first - t.dst_at[i]) / width);
  }
  ADD_FAILURE() << bad << " bytes differ; the first at byte " << first << " (" << where << "): got "
                << int(got[first]) << ", want " << int(want[first]);
}

class PackParamsGpuTest : public ::testing::TestWithParam<std::tuple<ParamDType, ConvDType>> {};

TEST_P(PackParamsGpuTest, EveryKindMatchesTheDocumentedLayouts) {
  const ParamDType sd = std::get<0>(GetParam());
  const ConvDType dd = std::get<1>(GetParam());
  if (const std::string why = gpu_skip_reason(); !why.empty()) GTEST_SKIP() << why;
  const std::string name = std::string("pack/") + dtype_name(sd) + "_to_" + dtype_name(dd);
  SCOPED_TRACE(name);
  Table t;
  t.specs = main_table();
  ASSERT_NO_FATAL_FAILURE(build(t, sd, dd, seed_for(name)));
  StreamGuard sg;
  ASSERT_EQ(cudaStreamCreateWithFlags(&sg.stream, cudaStreamNonBlocking), cudaSuccess);
  const std::vector<uint8_t> got = pack(t, dd, nullptr, sg.stream);
  expect_equal(t, got, t.expected);
  EXPECT_EQ(pack(t, dd, nullptr, sg.stream), got) << "a second launch must write the same bytes";
}

INSTANTIATE_TEST_SUITE_P(SourcesAndLayouts, PackParamsGpuTest,
                         ::testing::Combine(::testing::Values(ParamDType::kF32, ParamDType::kF16, ParamDType::kBF16),
                                            ::testing::Values(ConvDType::kF16, ConvDType::kBF16)),
                         [](const auto& info) {
                           return std::string(dtype_name(std::get<0>(info.param))) + "_to_" +
                                  dtype_name(std::get<1>(info.param));
                         });

TEST(PackParamsGpu, RunFlagGatesEveryWrite) {
  if (const std::string why = gpu_skip_reason(); !why.empty()) GTEST_SKIP() << why;
  Table t;
  t.specs = main_table();
  ASSERT_NO_FATAL_FAILURE(build(t, ParamDType::kF32, ConvDType::kBF16, seed_for("pack/run_flag")));
  StreamGuard sg;
  ASSERT_EQ(cudaStreamCreateWithFlags(&sg.stream, cudaStreamNonBlocking), cudaSuccess);
  DeviceBuffer flag;
  ASSERT_EQ(flag.alloc(sizeof(unsigned)), cudaSuccess);
  const unsigned off = 0, on = 1;
  ASSERT_EQ(cudaMemcpy(flag.ptr, &off, sizeof(off), cudaMemcpyHostToDevice), cudaSuccess);
  expect_equal(t, pack(t, ConvDType::kBF16, flag.as<unsigned>(), sg.stream), std::vector<uint8_t>(t.dst.bytes, 0xFF));
  ASSERT_EQ(cudaMemcpy(flag.ptr, &on, sizeof(on), cudaMemcpyHostToDevice), cudaSuccess);
  expect_equal(t, pack(t, ConvDType::kBF16, flag.as<unsigned>(), sg.stream), t.expected);
}

// More jobs than a CTA plans at once (1024): the tile prefix carries over from one chunk of jobs to the next.
TEST(PackParamsGpu, TablesLongerThanOneChunk) {
  if (const std::string why = gpu_skip_reason(); !why.empty()) GTEST_SKIP() << why;
  Table t;
  for (int i = 0; i < 1500; ++i) {
    t.specs.push_back({.name = "copy_3", .kind = PackKind::kCopyF32, .copy_count = 3});
    if (i % 500 == 250)
      t.specs.push_back({.name = "krsc3x3_k64_c64", .kind = PackKind::kKrsc, .k = 64, .c = 64, .r = 3, .s = 3});
  }
  t.specs.push_back({.name = "flip3x3_k64_c32", .kind = PackKind::kFlip, .k = 64, .c = 32, .r = 3, .s = 3});
  ASSERT_NO_FATAL_FAILURE(build(t, ParamDType::kF16, ConvDType::kF16, seed_for("pack/chunks")));
  StreamGuard sg;
  ASSERT_EQ(cudaStreamCreateWithFlags(&sg.stream, cudaStreamNonBlocking), cudaSuccess);
  expect_equal(t, pack(t, ConvDType::kF16, nullptr, sg.stream), t.expected);
}

// Host-only: rejected before any CUDA call.
TEST(PackParamsArgs, RejectsEmptyTables) {
  int dummy = 0;
  const auto* jobs = reinterpret_cast<const PackJob*>(&dummy);
  EXPECT_EQ(kfuse::kernels::launch_pack_params(jobs, 0, &dummy, ConvDType::kF16, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(kfuse::kernels::launch_pack_params(nullptr, 1, &dummy, ConvDType::kF16, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(kfuse::kernels::launch_pack_params(jobs, 1, nullptr, ConvDType::kF16, nullptr), cudaErrorInvalidValue);
}

}  // namespace
