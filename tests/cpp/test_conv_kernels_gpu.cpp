// GPU tests of the CUTLASS conv fprop launchers (src/kernels/conv/conv_fprop.h) against a float64 CPU
// cross-correlation. Tests that need a GPU skip when there is none or when its compute capability does not fit.
#include "kernels/conv/conv_fprop.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu_test_support.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

using kfuse::testing::DeviceBuffer;
using kfuse::testing::seed_for;
using kfuse::testing::StreamGuard;

using kfuse::kernels::Conv2dProblem;

using CanImplementFn = bool (*)(const Conv2dProblem&);
using WorkspaceFn = size_t (*)(const Conv2dProblem&);
using LaunchFn = cudaError_t (*)(const Conv2dProblem&, const __half*, const __half*, const __half*, __half*, float,
                                 float, void*, size_t, cudaStream_t);

struct KernelApi {
  const char* name;
  int min_major;  // compute capability majors whose SASS is in the library
  int max_major;
  CanImplementFn can_implement;
  WorkspaceFn workspace_bytes;
  LaunchFn launch;
};

const KernelApi kSm90{"sm90", 9, 9, kfuse::kernels::conv2d_fprop_f16_sm90_can_implement,
                      kfuse::kernels::conv2d_fprop_f16_sm90_workspace_bytes, kfuse::kernels::conv2d_fprop_f16_sm90};
const KernelApi kSm80{"sm80", 8, 9, kfuse::kernels::conv2d_fprop_f16_sm80_can_implement,
                      kfuse::kernels::conv2d_fprop_f16_sm80_workspace_bytes, kfuse::kernels::conv2d_fprop_f16_sm80};

constexpr uint16_t kNaNBits = 0x7e00;  // fp16 quiet NaN, poisons outputs before each launch

std::string device_skip_reason(const KernelApi& api) {
  return kfuse::testing::device_skip_reason(api.min_major, api.max_major, std::string(api.name) + " kernel");
}

__half half_from_bits(uint16_t bits) {
  __half_raw raw;
  raw.x = bits;
  return __half(raw);
}

uint16_t bits_of(__half h) {
  uint16_t bits;
  std::memcpy(&bits, &h, sizeof(bits));
  return bits;
}

std::vector<__half> random_halves(size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<__half> v(n);
  for (auto& x : v) x = __float2half(dist(rng));
  return v;
}

size_t act_elems(const Conv2dProblem& p) { return size_t(p.n) * p.h * p.w * p.c; }
size_t flt_elems(const Conv2dProblem& p) { return size_t(p.k) * p.r * p.s * p.c; }
size_t out_elems(const Conv2dProblem& p) { return size_t(p.n) * p.p() * p.q() * p.k; }

// float64 cross-correlation with zero padding: D = alpha * conv(X, W) + beta * C, all NHWC / KRSC / NPQK.
std::vector<double> reference_conv(const Conv2dProblem& p, const std::vector<__half>& x, const std::vector<__half>& w,
                                   const std::vector<__half>* c, double alpha, double beta) {
  const int P = p.p(), Q = p.q();
  std::vector<double> xd(x.size()), wd(w.size());
  for (size_t i = 0; i < x.size(); ++i) xd[i] = __half2float(x[i]);
  for (size_t i = 0; i < w.size(); ++i) wd[i] = __half2float(w[i]);
  std::vector<double> out(out_elems(p));
  for (int n = 0; n < p.n; ++n)
    for (int op = 0; op < P; ++op)
      for (int oq = 0; oq < Q; ++oq)
        for (int k = 0; k < p.k; ++k) {
          double acc = 0.0;
          for (int r = 0; r < p.r; ++r) {
            const int ih = op * p.stride_h - p.pad_h + r;
            if (ih < 0 || ih >= p.h) continue;
            for (int s = 0; s < p.s; ++s) {
              const int iw = oq * p.stride_w - p.pad_w + s;
              if (iw < 0 || iw >= p.w) continue;
              const double* xs = &xd[((size_t(n) * p.h + ih) * p.w + iw) * p.c];
              const double* ws = &wd[((size_t(k) * p.r + r) * p.s + s) * p.c];
              for (int ci = 0; ci < p.c; ++ci) acc += xs[ci] * ws[ci];
            }
          }
          const size_t o = ((size_t(n) * P + op) * Q + oq) * p.k + k;
          out[o] = alpha * acc + (c != nullptr ? beta * double(__half2float((*c)[o])) : 0.0);
        }
  return out;
}

struct ConvCase {
  const char* name;
  Conv2dProblem problem;
  float alpha;
  float beta;
  bool with_source;  // pass a C tensor (required when beta != 0)
};

Conv2dProblem make_problem(int n, int h, int w, int c, int k, int r, int s, int pad, int stride) {
  Conv2dProblem p;
  p.n = n, p.h = h, p.w = w, p.c = c, p.k = k, p.r = r, p.s = s;
  p.pad_h = p.pad_w = pad;
  p.stride_h = p.stride_w = stride;
  return p;
}

const ConvCase kCases[] = {
    {"conv3x3_s1_c64_k64", make_problem(2, 16, 16, 64, 64, 3, 3, 1, 1), 1.0f, 0.0f, false},
    {"conv3x3_s2_c64_k128", make_problem(3, 16, 16, 64, 128, 3, 3, 1, 2), 1.0f, 0.0f, false},
    {"conv1x1_c128_k256", make_problem(2, 16, 16, 128, 256, 1, 1, 0, 1), 1.0f, 0.0f, false},
    {"conv1x1_s2_c64_k128", make_problem(2, 16, 16, 64, 128, 1, 1, 0, 2), 1.0f, 0.0f, false},
    {"conv3x3_alpha_beta_source", make_problem(2, 16, 16, 64, 64, 3, 3, 1, 1), 0.5f, 0.75f, true},
    // Partial tiles everywhere: C below the K-tile, K not a tile multiple, odd extents, stride 2.
    {"conv3x3_s2_odd_c16_k24", make_problem(1, 9, 7, 16, 24, 3, 3, 1, 2), 1.25f, -0.5f, true},
};

struct GpuParam {
  const KernelApi* api;
  ConvCase conv;
};

class ConvFpropGpuTest : public ::testing::TestWithParam<GpuParam> {};

TEST_P(ConvFpropGpuTest, MatchesFloat64Reference) {
  const KernelApi& api = *GetParam().api;
  const ConvCase& tc = GetParam().conv;
  const Conv2dProblem& p = tc.problem;
  if (const std::string why = device_skip_reason(api); !why.empty()) GTEST_SKIP() << why;

  const std::string test_name = std::string(api.name) + "/" + tc.name;
  const uint32_t seed = seed_for(test_name);
  SCOPED_TRACE(test_name + " seed=" + std::to_string(seed));
  ASSERT_TRUE(api.can_implement(p));
  ASSERT_GT(p.p(), 0);
  ASSERT_GT(p.q(), 0);

  std::mt19937 rng(seed);
  const std::vector<__half> x = random_halves(act_elems(p), rng);
  const std::vector<__half> w = random_halves(flt_elems(p), rng);
  const std::vector<__half> c = tc.with_source ? random_halves(out_elems(p), rng) : std::vector<__half>{};
  const std::vector<__half> poison(out_elems(p), half_from_bits(kNaNBits));

  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  DeviceBuffer dx, dw, dc, dd, ws;
  ASSERT_EQ(dx.alloc(x.size() * sizeof(__half)), cudaSuccess);
  ASSERT_EQ(dw.alloc(w.size() * sizeof(__half)), cudaSuccess);
  ASSERT_EQ(dc.alloc(c.size() * sizeof(__half)), cudaSuccess);
  ASSERT_EQ(dd.alloc(poison.size() * sizeof(__half)), cudaSuccess);
  ASSERT_EQ(ws.alloc(api.workspace_bytes(p)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dx.ptr, x.data(), dx.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dw.ptr, w.data(), dw.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  if (tc.with_source) {
    ASSERT_EQ(cudaMemcpy(dc.ptr, c.data(), dc.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  }
  ASSERT_EQ(cudaMemcpy(dd.ptr, poison.data(), dd.bytes, cudaMemcpyHostToDevice), cudaSuccess);

  // A non-default stream, so that a launcher ignoring its stream argument races with the synchronisation below.
  StreamGuard stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream.stream, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(api.launch(p, dx.as<__half>(), dw.as<__half>(), tc.with_source ? dc.as<__half>() : nullptr, dd.as<__half>(), tc.alpha, tc.beta,
                       ws.ptr, ws.bytes, stream.stream),
            cudaSuccess);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream.stream), cudaSuccess);

  std::vector<__half> out(out_elems(p));
  ASSERT_EQ(cudaMemcpy(out.data(), dd.ptr, dd.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  const std::vector<double> ref = reference_conv(p, x, w, tc.with_source ? &c : nullptr, tc.alpha, tc.beta);

  size_t nan_count = 0;
  double err2 = 0.0, ref2 = 0.0;
  for (size_t i = 0; i < out.size(); ++i) {
    const double o = __half2float(out[i]);
    if (std::isnan(o)) {
      ++nan_count;
      continue;
    }
    err2 += (o - ref[i]) * (o - ref[i]);
    ref2 += ref[i] * ref[i];
  }
  EXPECT_EQ(nan_count, 0u) << "output elements left unwritten (NaN poison) or NaN, of " << out.size();
  ASSERT_GT(ref2, 0.0);
  const double rel = std::sqrt(err2 / ref2);
  EXPECT_LE(rel, 1e-2) << "normwise relative error ||out-ref||/||ref||";
}

std::vector<GpuParam> all_gpu_params() {
  std::vector<GpuParam> params;
  for (const KernelApi* api : {&kSm90, &kSm80})
    for (const ConvCase& tc : kCases) params.push_back({api, tc});
  return params;
}

INSTANTIATE_TEST_SUITE_P(Kernels, ConvFpropGpuTest, ::testing::ValuesIn(all_gpu_params()),
                         [](const ::testing::TestParamInfo<GpuParam>& info) {
                           return std::string(info.param.api->name) + "_" + info.param.conv.name;
                         });

// Host-only: can_implement needs no device.
TEST(ConvFpropCanImplement, RejectsUnsupportedProblems) {
  for (const KernelApi* api : {&kSm90, &kSm80}) {
    SCOPED_TRACE(api->name);
    EXPECT_TRUE(api->can_implement(make_problem(2, 16, 16, 64, 64, 3, 3, 1, 1)));
    EXPECT_FALSE(api->can_implement(make_problem(2, 16, 16, 3, 64, 3, 3, 1, 1))) << "C = 3 is not a multiple of 8";
    EXPECT_FALSE(api->can_implement(make_problem(2, 16, 16, 64, 12, 3, 3, 1, 1))) << "K = 12 is not a multiple of 8";
    EXPECT_FALSE(api->can_implement(make_problem(2, 16, 16, 64, 64, 3, 3, 1, 0))) << "stride 0";
    EXPECT_FALSE(api->can_implement(make_problem(2, 2, 2, 64, 64, 5, 5, 0, 1))) << "filter larger than input";
    EXPECT_FALSE(api->can_implement(make_problem(0, 16, 16, 64, 64, 3, 3, 1, 1))) << "empty batch";
  }
}

class ConvFpropRejectTest : public ::testing::TestWithParam<const KernelApi*> {};

TEST_P(ConvFpropRejectTest, LauncherReturnsErrorWithoutLaunching) {
  const KernelApi& api = *GetParam();
  if (const std::string why = device_skip_reason(api); !why.empty()) GTEST_SKIP() << why;

  const Conv2dProblem bad = make_problem(1, 8, 8, 3, 64, 3, 3, 1, 1);  // C = 3: not 16-byte rows
  ASSERT_FALSE(api.can_implement(bad));
  const Conv2dProblem good = make_problem(1, 8, 8, 64, 64, 3, 3, 1, 1);
  ASSERT_TRUE(api.can_implement(good));

  const std::vector<__half> poison(out_elems(good), half_from_bits(kNaNBits));  // covers both problems' outputs
  DeviceBuffer dx, dw, dd;
  ASSERT_EQ(dx.alloc(act_elems(good) * sizeof(__half)), cudaSuccess);
  ASSERT_EQ(dw.alloc(flt_elems(good) * sizeof(__half)), cudaSuccess);
  ASSERT_EQ(dd.alloc(poison.size() * sizeof(__half)), cudaSuccess);
  ASSERT_EQ(cudaMemset(dx.ptr, 0x3c, dx.bytes), cudaSuccess);  // finite, nonzero fp16 (0x3c3c = 1.06)
  ASSERT_EQ(cudaMemset(dw.ptr, 0x3c, dw.bytes), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dd.ptr, poison.data(), dd.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);

  EXPECT_EQ(api.launch(bad, dx.as<__half>(), dw.as<__half>(), nullptr, dd.as<__half>(), 1.0f, 0.0f, nullptr, 0, nullptr),
            cudaErrorInvalidValue);
  // beta != 0 without a C tensor, and a misaligned pointer, are rejected the same way.
  EXPECT_EQ(api.launch(good, dx.as<__half>(), dw.as<__half>(), nullptr, dd.as<__half>(), 1.0f, 1.0f, nullptr, 0, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(api.launch(good, dx.as<__half>() + 1, dw.as<__half>(), nullptr, dd.as<__half>(), 1.0f, 0.0f, nullptr, 0, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "a rejected call must not leave a CUDA error behind";
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  std::vector<__half> out(poison.size());
  ASSERT_EQ(cudaMemcpy(out.data(), dd.ptr, dd.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  size_t touched = 0;
  for (const __half& h : out) touched += bits_of(h) != kNaNBits;
  EXPECT_EQ(touched, 0u) << "a rejected call wrote to the output, so something was launched";
}

INSTANTIATE_TEST_SUITE_P(Kernels, ConvFpropRejectTest, ::testing::Values(&kSm90, &kSm80),
                         [](const ::testing::TestParamInfo<const KernelApi*>& info) {
                           return std::string(info.param->name);
                         });

}  // namespace
