// GPU tests of launch_se_backward (src/kernels/encoder/backward_kernels.h) against a float64 CPU computation of the
// same math from the same rounded fp16 / bf16 inputs, and host-only tests of its argument checks (those run without
// a device: a rejected call returns cudaErrorInvalidValue before any CUDA call). GPU tests skip without a device of
// compute capability 8.x / 9.x.
//
// Tolerances, and why:
//   dz      exact: dz = dy * (y > 0) is dy itself or 0 (for fp32 dy: dy rounded to T once, round to nearest even).
//   d_o     normwise relative <= u + 1e-4, u the unit roundoff of T (2^-11 fp16, 2^-8 bf16): d_o is computed in fp32
//           from dz as stored (T) and rounded to T once, and |RN(x) - x| <= u |x| elementwise bounds the normwise
//           error by u; the fp32 math behind it (sums of <= 1024 products, sigmoid) adds ~1e-6.
//   dw1, db1, dw2, db2   normwise relative <= 1e-5: fp32 all the way (column sums over hw, FC dot products over p
//           or hidden, sums over the batch); a CPU emulation of the kernels measured ~2e-7 on these cases, while a T
//           rounding anywhere in the chain would show as >= 1e-4 (fp16) or 1e-3 (bf16). The ReLU mask of z1 is
//           discontinuous: b1 is chosen so that no z1 lies near 0 (see choose_b1), so the fp32 and float64 masks agree.
//   sum_*   |err| <= 1e-4 |ref| + 1e-5 sum |x|: a fixed-order fp32 sum of the same values, at most a few hundred
//           additions deep (worst-case bound ~ depth * 6e-8 * sum |x|).
#include "kernels/encoder/backward_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "gpu_test_support.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

namespace {

using kfuse::bits_to_float;
using kfuse::float_to_bits;

using kfuse::testing::DeviceBuffer;
using kfuse::testing::seed_for;
using kfuse::testing::StreamGuard;

using kfuse::kernels::ConvDType;
using kfuse::kernels::SeBackwardArgs;

constexpr uint16_t kSentinel = 0x1234;  // fills the dz rows' channels outside [0, p): must stay untouched

double unit_roundoff(ConvDType dt) { return dt == ConvDType::kF16 ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8); }

struct SeCase {
  const char* name;
  ConvDType dtype;
  int n, hw, p, hidden;
  int dz_front = 0, dz_back = 0;  // channels of each dz row before / after dz's p (the pitch is their sum + p)
  bool nchw = false, f32 = false;  // dy NCHW, fp32
  bool sums = true;                // ask for the scalar sums
  bool raw_o = false;              // o given as conv2's raw output v with o_scale / o_shift (the training step's way)
  bool y_offset = false;           // y given as the next block's a = y + b1a with y_offset (the training step's way)
  bool two_streams = false;        // the data phase and the parameter phase on two streams (the training step's way)
};

void PrintTo(const SeCase& c, std::ostream* os) { *os << c.name; }

constexpr ConvDType kF16 = ConvDType::kF16;
constexpr ConvDType kBF16 = ConvDType::kBF16;

// The encoder's (hw, p, hidden) at 64x64 inputs: (256, 64, 4), (64, 128, 8), (16, 256, 16), (4, 512, 32).
const SeCase kCases[] = {
    // name                       dtype  n     hw    p     hid  front back nchw  f32    sums
    {"f16_b1_n3_concat", kF16, 3, 256, 64, 4, 64, 0},
    {"f16_b1_n33", kF16, 33, 256, 64, 4},
    {"f16_b2_n3_concat", kF16, 3, 64, 128, 8, 128, 0},
    {"f16_b2_n33", kF16, 33, 64, 128, 8},
    {"f16_b3_n3_concat", kF16, 3, 16, 256, 16, 256, 0},
    {"f16_b3_n33", kF16, 33, 16, 256, 16},
    {"f16_b4_n3_concat", kF16, 3, 4, 512, 32, 512, 0},
    {"f16_b4_n33", kF16, 33, 4, 512, 32},
    {"bf16_b1_n3_concat", kBF16, 3, 256, 64, 4, 64, 0},
    {"bf16_b1_n33", kBF16, 33, 256, 64, 4},
    {"bf16_b2_n3_concat", kBF16, 3, 64, 128, 8, 128, 0},
    {"bf16_b2_n33", kBF16, 33, 64, 128, 8},
    {"bf16_b3_n3_concat", kBF16, 3, 16, 256, 16, 256, 0},
    {"bf16_b3_n33", kBF16, 33, 16, 256, 16},
    {"bf16_b4_n3_concat", kBF16, 3, 4, 512, 32, 512, 0},
    {"bf16_b4_n33", kBF16, 33, 4, 512, 32},
    // odd sizes: p = 24 (3 vectors per row), hidden = 3, hw = 9; gaps on both sides of dz
    {"f16_odd_n3", kF16, 3, 9, 24, 3, 8, 8},
    {"f16_odd_n33", kF16, 33, 9, 24, 3, 0, 8},
    {"bf16_odd_n3", kBF16, 3, 9, 24, 3, 8, 8},
    {"bf16_odd_n33", kBF16, 33, 9, 24, 3, 0, 8},
    // the last block: dy NCHW, T or fp32
    {"f16_b4_nchw_f32_n33", kF16, 33, 4, 512, 32, 0, 0, true, true},
    {"bf16_b4_nchw_f32_n33", kBF16, 33, 4, 512, 32, 0, 0, true, true},
    {"f16_b4_nchw_t_n3", kF16, 3, 4, 512, 32, 0, 0, true, false},
    {"bf16_b4_nchw_t_n3", kBF16, 3, 4, 512, 32, 0, 0, true, false},
    {"f16_b1_nchw_t_n3", kF16, 3, 256, 64, 4, 0, 0, true, false},
    {"bf16_odd_nchw_f32_n5", kBF16, 5, 9, 24, 3, 8, 0, true, true},
    {"f16_odd_nchw_t_n5", kF16, 5, 9, 24, 3, 0, 0, true, false},
    // an image too large for the shared-memory stages: dz re-read from global memory, dy NCHW read element-wise
    {"f16_hw1024_n3", kF16, 3, 1024, 64, 4, 64, 0},
    {"bf16_hw1024_nchw_f32_n2", kBF16, 2, 1024, 64, 4, 0, 0, true, true},
    // wide and narrow channel counts, hidden not p / 16
    {"f16_p2048_h128_n3", kF16, 3, 2, 2048, 128, 0, 8},
    {"bf16_p8_h40_n5", kBF16, 5, 4, 8, 40, 8, 8},
    {"f16_p64_h1_n4", kF16, 4, 16, 64, 1},
    {"bf16_b3_n33_nosums", kBF16, 33, 16, 256, 16, 0, 0, false, false, false},
    // training-size batches: several images per CTA (on a GPU with <= ~250 SMs), a partial last CTA (n = 2047, 1030)
    {"f16_b2_n2048", kF16, 2048, 64, 128, 8, 128, 0},
    {"f16_b3_n1030", kF16, 1030, 16, 256, 16},
    {"f16_b4_n2047", kF16, 2047, 4, 512, 32, 512, 0},
    {"bf16_b4_nchw_f32_n2048", kBF16, 2048, 4, 512, 32, 0, 0, true, true},
    {"bf16_b3_nchw_t_n1030", kBF16, 1030, 16, 256, 16, 0, 0, true, false},
    // o as raw conv2 output plus the FixUp scale and shift, read through them (the training step's four blocks)
    {"f16_b1_n33_raw", kF16, 33, 256, 64, 4, 0, 0, false, false, true, true},
    {"bf16_b2_n33_raw", kBF16, 33, 64, 128, 8, 128, 0, false, false, true, true},
    {"f16_b3_n1030_raw", kF16, 1030, 16, 256, 16, 256, 0, false, false, true, true},
    {"bf16_b4_nchw_f32_n33_raw", kBF16, 33, 4, 512, 32, 0, 0, true, true, true, true},
    {"f16_odd_n5_raw", kF16, 5, 9, 24, 3, 8, 8, false, false, true, true},
    // y read back from a = y + b1a (faithful where y > 0, with tiny y that round to T(b1a)); phases on two streams
    {"f16_b1_n33_yoff_2s", kF16, 33, 256, 64, 4, 0, 0, false, false, true, true, true, true},
    {"bf16_b2_n33_yoff_2s", kBF16, 33, 64, 128, 8, 128, 0, false, false, true, true, true, true},
    {"f16_b3_n1030_yoff", kF16, 1030, 16, 256, 16, 256, 0, false, false, true, true, true, false},
    {"bf16_odd_n5_2s", kBF16, 5, 9, 24, 3, 8, 8, false, false, true, false, false, true},
};

// ---- inputs --------------------------------------------------------------------------------------------------------

struct Inputs {
  std::vector<uint16_t> y, o;   // NHWC T; o is the SE input the reference uses
  std::vector<uint16_t> y_stored;  // y_offset: what the kernel reads, T(y + y_off) but never T(y_off) where y > 0
  float y_off = 0.f;
  std::vector<uint16_t> v;      // raw_o: what the kernel reads, with o = T(v * scale + shift) (fp32 fma)
  float scale = 1.f, shift = 0.f;
  std::vector<uint16_t> dy_t;   // dy as T (NHWC or NCHW), unless f32
  std::vector<float> dy_f;      // dy as fp32 (NCHW), when f32
  std::vector<float> w1, b1, w2, b2;
  std::vector<double> m;        // [n][p]: mean over hw of o (float64)
  std::vector<double> a1;       // [n][hidden]: fc1.W m (float64), before b1
};

// b1[j] puts the ReLU threshold of hidden unit j into the widest gap between consecutive values of a1[.][j] in the
// middle 40 % of the batch: about half the images active, and no z1 within half that gap of 0, far beyond the fp32
// error of the kernel's z1 (~1e-7), so the kernel's mask and the float64 reference's agree.
void choose_b1(const SeCase& c, Inputs* in, std::mt19937& rng) {
  for (int j = 0; j < c.hidden; ++j) {
    std::vector<double> a(c.n);
    for (int i = 0; i < c.n; ++i) a[i] = in->a1[size_t(i) * c.hidden + j];
    std::sort(a.begin(), a.end());
    double b;
    if (c.n == 1) {
      b = -a[0] + (rng() & 1 ? 0.05 : -0.05);
    } else {
      const int lo = (c.n - 1) * 3 / 10, hi = std::min(std::max(lo, (c.n - 1) * 7 / 10), c.n - 2);
      int best = lo;
      for (int k = lo; k <= hi; ++k)
        if (a[k + 1] - a[k] > a[best + 1] - a[best]) best = k;
      b = -0.5 * (a[best] + a[best + 1]);
    }
    in->b1[j] = static_cast<float>(b);
  }
}

Inputs make_inputs(const SeCase& c, std::mt19937& rng) {
  std::uniform_real_distribution<float> u11(-1.0f, 1.0f);
  const size_t elems = size_t(c.n) * c.hw * c.p;
  Inputs in;
  in.y.resize(elems);
  in.o.resize(elems);
  for (size_t i = 0; i < elems; ++i) {
    in.y[i] = float_to_bits(std::max(u11(rng), 0.0f), c.dtype);  // relu of random values: about half exact zeros
    in.o[i] = float_to_bits(u11(rng), c.dtype);
  }
  if (c.y_offset) {  // the forward's squeeze-excite store of a = y + b1a (numeric.cuh pack8_after_relu)
    in.y_off = 0.3f + 0.2f * u11(rng);
    const uint16_t off_t = float_to_bits(in.y_off, c.dtype);
    in.y_stored.resize(elems);
    for (size_t i = 0; i < elems; ++i) {
      if (i % 7 == 3) in.y[i] = float_to_bits(1e-5f * std::abs(u11(rng)), c.dtype);  // active, yet a rounds to b1a
      const float y = bits_to_float(in.y[i], c.dtype);
      uint16_t b = float_to_bits(y + in.y_off, c.dtype);
      if (y > 0.0f && b == off_t) b = uint16_t(b + 1);  // the next value above (b1a > 0 here)
      in.y_stored[i] = b;
    }
  }
  if (c.raw_o) {  // non-trivial FixUp scalars; o as the kernel must form it: one fp32 fma, one rounding to T
    in.scale = 0.75f + 0.5f * std::abs(u11(rng));
    in.shift = 0.25f * u11(rng);
    in.v = in.o;
    for (size_t i = 0; i < elems; ++i)
      in.o[i] = float_to_bits(std::fmaf(bits_to_float(in.v[i], c.dtype), in.scale, in.shift), c.dtype);
  }
  if (c.f32) {
    in.dy_f.resize(elems);
    for (float& v : in.dy_f) v = u11(rng);
  } else {
    in.dy_t.resize(elems);
    for (uint16_t& v : in.dy_t) v = float_to_bits(u11(rng), c.dtype);
  }
  const float s1 = 1.0f / std::sqrt(float(c.p)), s2 = 1.0f / std::sqrt(float(c.hidden));
  in.w1.resize(size_t(c.hidden) * c.p);
  in.w2.resize(size_t(c.p) * c.hidden);
  in.b1.resize(c.hidden);
  in.b2.resize(c.p);
  for (float& v : in.w1) v = s1 * u11(rng);
  for (float& v : in.w2) v = s2 * u11(rng);
  for (float& v : in.b2) v = 0.5f * u11(rng);
  // m and fc1.W m in float64, for b1
  in.m.assign(size_t(c.n) * c.p, 0.0);
  in.a1.assign(size_t(c.n) * c.hidden, 0.0);
  for (int n = 0; n < c.n; ++n) {
    double* m = &in.m[size_t(n) * c.p];
    for (int i = 0; i < c.hw; ++i)
      for (int ch = 0; ch < c.p; ++ch) m[ch] += bits_to_float(in.o[(size_t(n) * c.hw + i) * c.p + ch], c.dtype);
    for (int ch = 0; ch < c.p; ++ch) m[ch] /= c.hw;
    for (int j = 0; j < c.hidden; ++j) {
      double s = 0.0;
      for (int ch = 0; ch < c.p; ++ch) s += double(in.w1[size_t(j) * c.p + ch]) * m[ch];
      in.a1[size_t(n) * c.hidden + j] = s;
    }
  }
  choose_b1(c, &in, rng);
  return in;
}

// ---- one launch --------------------------------------------------------------------------------------------------

struct Outputs {
  std::vector<uint16_t> d_o, dz_buf;  // dz_buf: the whole pitched buffer, gaps included
  std::vector<float> dw1, db1, dw2, db2;
  float sums[3] = {0.f, 0.f, 0.f};    // sum_d_o, sum_dz, sum_dy
};

int pitch_of(const SeCase& c) { return c.dz_front + c.p + c.dz_back; }

// Device copies of the inputs, the outputs and the workspace.
struct DeviceState {
  DeviceBuffer y, dy, o, w1, b1, w2, b2, d_o, dz, dw1, db1, dw2, db2, sums, ws, affine;
  std::vector<uint16_t> dz_init;  // sentinel in the gaps, NaN where dz goes
};

void upload(const SeCase& c, const Inputs& in, DeviceState* d) {
  const size_t elems = size_t(c.n) * c.hw * c.p, rows = size_t(c.n) * c.hw;
  auto put = [](DeviceBuffer& b, const void* src, size_t bytes) {
    ASSERT_EQ(b.alloc(bytes), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(b.ptr, src, bytes, cudaMemcpyHostToDevice), cudaSuccess);
  };
  ASSERT_NO_FATAL_FAILURE(put(d->y, (c.y_offset ? in.y_stored : in.y).data(), elems * 2));
  ASSERT_NO_FATAL_FAILURE(put(d->o, (c.raw_o ? in.v : in.o).data(), elems * 2));
  const float affine[3] = {in.scale, in.shift, in.y_off};
  ASSERT_NO_FATAL_FAILURE(put(d->affine, affine, sizeof(affine)));
  if (c.f32)
    ASSERT_NO_FATAL_FAILURE(put(d->dy, in.dy_f.data(), elems * 4));
  else
    ASSERT_NO_FATAL_FAILURE(put(d->dy, in.dy_t.data(), elems * 2));
  ASSERT_NO_FATAL_FAILURE(put(d->w1, in.w1.data(), in.w1.size() * 4));
  ASSERT_NO_FATAL_FAILURE(put(d->b1, in.b1.data(), in.b1.size() * 4));
  ASSERT_NO_FATAL_FAILURE(put(d->w2, in.w2.data(), in.w2.size() * 4));
  ASSERT_NO_FATAL_FAILURE(put(d->b2, in.b2.data(), in.b2.size() * 4));
  ASSERT_EQ(d->d_o.alloc(elems * 2), cudaSuccess);
  const int pitch = pitch_of(c);
  d->dz_init.assign(rows * pitch, kSentinel);
  const uint16_t nan = c.dtype == kF16 ? 0x7e00 : 0x7fc0;
  for (size_t r = 0; r < rows; ++r)
    std::fill_n(d->dz_init.begin() + r * pitch + c.dz_front, c.p, nan);
  ASSERT_EQ(d->dz.alloc(d->dz_init.size() * 2), cudaSuccess);
  ASSERT_EQ(d->dw1.alloc(size_t(c.hidden) * c.p * 4), cudaSuccess);
  ASSERT_EQ(d->db1.alloc(size_t(c.hidden) * 4), cudaSuccess);
  ASSERT_EQ(d->dw2.alloc(size_t(c.p) * c.hidden * 4), cudaSuccess);
  ASSERT_EQ(d->db2.alloc(size_t(c.p) * 4), cudaSuccess);
  ASSERT_EQ(d->sums.alloc(3 * 4), cudaSuccess);
}

SeBackwardArgs make_args(const SeCase& c, const DeviceState& d) {
  SeBackwardArgs a;
  a.y = d.y.ptr;
  a.dy = d.dy.ptr;
  a.dy_nchw = c.nchw;
  a.dy_f32 = c.f32;
  a.o = d.o.ptr;
  if (c.raw_o) a.o_scale = d.affine.as<float>(), a.o_shift = d.affine.as<float>() + 1;
  if (c.y_offset) a.y_offset = d.affine.as<float>() + 2;
  a.n = c.n, a.hw = c.hw, a.p = c.p, a.hidden = c.hidden;
  a.w1 = d.w1.as<float>(), a.b1 = d.b1.as<float>(), a.w2 = d.w2.as<float>(), a.b2 = d.b2.as<float>();
  a.d_o = d.d_o.ptr;
  a.dz = d.dz.as<uint16_t>() + c.dz_front;
  a.dz_pitch = pitch_of(c);
  a.dw1 = d.dw1.as<float>(), a.db1 = d.db1.as<float>(), a.dw2 = d.dw2.as<float>(), a.db2 = d.db2.as<float>();
  if (c.sums) {
    a.sum_d_o = d.sums.as<float>() + 0;
    a.sum_dz = d.sums.as<float>() + 1;
    a.sum_dy = d.sums.as<float>() + 2;
  }
  return a;
}

// Poisons every output (NaN; dz's gaps hold the sentinel), launches on a non-blocking stream (so that a launcher
// ignoring its stream argument races with the synchronisation) and copies everything back.
void run(const SeCase& c, DeviceState* d, Outputs* out) {
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const SeBackwardArgs a = make_args(c, *d);
  ASSERT_EQ(cudaMemset(d->d_o.ptr, 0xff, d->d_o.bytes), cudaSuccess);  // all-ones: NaN in fp16, bf16 and fp32
  ASSERT_EQ(cudaMemcpy(d->dz.ptr, d->dz_init.data(), d->dz.bytes, cudaMemcpyHostToDevice), cudaSuccess);
  for (DeviceBuffer* b : {&d->dw1, &d->db1, &d->dw2, &d->db2, &d->sums})
    ASSERT_EQ(cudaMemset(b->ptr, 0xff, b->bytes), cudaSuccess);
  if (d->ws.ptr == nullptr) {  // first launch: garbage workspace (nothing may rely on it being zeroed)
    const size_t ws_bytes = kfuse::kernels::se_backward_workspace_bytes(a);
    ASSERT_GT(ws_bytes, 0u);
    ASSERT_EQ(d->ws.alloc(ws_bytes), cudaSuccess);
    ASSERT_EQ(cudaMemset(d->ws.ptr, 0xff, ws_bytes), cudaSuccess);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  StreamGuard stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream.stream, cudaStreamNonBlocking), cudaSuccess);
  if (c.two_streams) {  // the parameter phase waits for the data phase through an event only
    StreamGuard second;
    ASSERT_EQ(cudaStreamCreateWithFlags(&second.stream, cudaStreamNonBlocking), cudaSuccess);
    cudaEvent_t done;
    ASSERT_EQ(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), cudaSuccess);
    ASSERT_EQ(kfuse::kernels::launch_se_backward_data(a, c.dtype, d->ws.ptr, stream.stream), cudaSuccess);
    ASSERT_EQ(cudaEventRecord(done, stream.stream), cudaSuccess);
    ASSERT_EQ(cudaStreamWaitEvent(second.stream, done, 0), cudaSuccess);
    ASSERT_EQ(kfuse::kernels::launch_se_backward_params(a, c.dtype, d->ws.ptr, second.stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(second.stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream.stream), cudaSuccess);
    ASSERT_EQ(cudaEventDestroy(done), cudaSuccess);
  } else {
    ASSERT_EQ(kfuse::kernels::launch_se_backward(a, c.dtype, d->ws.ptr, stream.stream), cudaSuccess);
  }
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream.stream), cudaSuccess);

  auto get = [](auto& v, const DeviceBuffer& b) {
    v.resize(b.bytes / sizeof(v[0]));
    ASSERT_EQ(cudaMemcpy(v.data(), b.ptr, b.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  };
  ASSERT_NO_FATAL_FAILURE(get(out->d_o, d->d_o));
  ASSERT_NO_FATAL_FAILURE(get(out->dz_buf, d->dz));
  ASSERT_NO_FATAL_FAILURE(get(out->dw1, d->dw1));
  ASSERT_NO_FATAL_FAILURE(get(out->db1, d->db1));
  ASSERT_NO_FATAL_FAILURE(get(out->dw2, d->dw2));
  ASSERT_NO_FATAL_FAILURE(get(out->db2, d->db2));
  ASSERT_EQ(cudaMemcpy(out->sums, d->sums.ptr, sizeof(out->sums), cudaMemcpyDeviceToHost), cudaSuccess);
}

// ---- the float64 reference, compared image by image ------------------------------------------------------------

struct Norm {  // normwise relative error of a device output against its reference
  double err2 = 0.0, ref2 = 0.0;
  size_t nan = 0;
  void add(double out, double ref) {
    if (std::isnan(out)) {
      ++nan;
      return;
    }
    err2 += (out - ref) * (out - ref);
    ref2 += ref * ref;
  }
  double rel() const { return ref2 > 0.0 ? std::sqrt(err2 / ref2) : 0.0; }
};

struct Sum {
  double v = 0.0, abs = 0.0;
  void add(double x) { v += x, abs += std::fabs(x); }
};

void expect_sum(const char* what, float out, const Sum& ref) {
  EXPECT_FALSE(std::isnan(out)) << what;
  EXPECT_NEAR(out, ref.v, 1e-4 * std::fabs(ref.v) + 1e-5 * ref.abs) << what << " (sum of |x| " << ref.abs << ")";
}

void expect_norm(const char* what, const std::vector<float>& out, const std::vector<double>& ref, double tol) {
  Norm nm;
  for (size_t i = 0; i < out.size(); ++i) nm.add(out[i], ref[i]);
  EXPECT_EQ(nm.nan, 0u) << what << ": elements left unwritten (NaN poison) or NaN, of " << out.size();
  ASSERT_GT(nm.ref2, 0.0) << what;
  EXPECT_LE(nm.rel(), tol) << what << ": normwise relative error ||out-ref||/||ref||";
}

void check_against_reference(const SeCase& c, const Inputs& in, const Outputs& out) {
  const int P = c.p, H = c.hidden, HW = c.hw, pitch = pitch_of(c);
  std::vector<double> dw1(size_t(H) * P, 0.0), db1(H, 0.0), dw2(size_t(P) * H, 0.0), db2(P, 0.0);
  std::vector<double> z1(H), r(H), g(P), dg(P), d2(P), d1(H), dm(P), dzt(size_t(HW) * P);
  Norm d_o;
  Sum s_do, s_dz, s_dy;
  size_t dz_bad = 0, gap_bad = 0;
  double dz_first_bad[3] = {0, 0, 0};
  for (int n = 0; n < c.n; ++n) {
    const double* m = &in.m[size_t(n) * P];
    for (int j = 0; j < H; ++j) {
      z1[j] = in.a1[size_t(n) * H + j] + in.b1[j];
      r[j] = z1[j] > 0.0 ? z1[j] : 0.0;
    }
    for (int ch = 0; ch < P; ++ch) {
      double z2 = in.b2[ch];
      for (int j = 0; j < H; ++j) z2 += double(in.w2[size_t(ch) * H + j]) * r[j];
      g[ch] = 1.0 / (1.0 + std::exp(-z2));
      dg[ch] = 0.0;
    }
    for (int i = 0; i < HW; ++i)
      for (int ch = 0; ch < P; ++ch) {
        const size_t e = (size_t(n) * HW + i) * P + ch;
        const size_t ed = c.nchw ? (size_t(n) * P + ch) * HW + i : e;
        const double dyv = c.f32 ? double(in.dy_f[ed]) : bits_to_float(in.dy_t[ed], c.dtype);
        const double dyt = c.f32 ? bits_to_float(float_to_bits(in.dy_f[ed], c.dtype), c.dtype) : dyv;  // dy rounded to T
        const bool on = bits_to_float(in.y[e], c.dtype) > 0.0;
        const double dz = on ? dyv : 0.0;
        dzt[size_t(i) * P + ch] = on ? dyt : 0.0;
        dg[ch] += dz * bits_to_float(in.o[e], c.dtype);
        s_dy.add(dyv);
        s_dz.add(dz);
      }
    for (int ch = 0; ch < P; ++ch) d2[ch] = dg[ch] * g[ch] * (1.0 - g[ch]);
    for (int j = 0; j < H; ++j) {
      double s = 0.0;
      for (int ch = 0; ch < P; ++ch) s += double(in.w2[size_t(ch) * H + j]) * d2[ch];
      d1[j] = z1[j] > 0.0 ? s : 0.0;
    }
    for (int ch = 0; ch < P; ++ch) {
      double s = 0.0;
      for (int j = 0; j < H; ++j) s += double(in.w1[size_t(j) * P + ch]) * d1[j];
      dm[ch] = s;
    }
    for (int i = 0; i < HW; ++i) {
      const size_t row = size_t(n) * HW + i;
      for (int ch = 0; ch < P; ++ch) {
        const double ref = dzt[size_t(i) * P + ch] * g[ch] + dm[ch] / HW;  // from dz as stored
        d_o.add(bits_to_float(out.d_o[row * P + ch], c.dtype), ref);
        s_do.add(ref);
        const double got = bits_to_float(out.dz_buf[row * pitch + c.dz_front + ch], c.dtype);
        if (!(got == dzt[size_t(i) * P + ch])) {
          if (dz_bad++ == 0) dz_first_bad[0] = double(row), dz_first_bad[1] = ch, dz_first_bad[2] = got;
        }
      }
      for (int k = 0; k < c.dz_front; ++k) gap_bad += out.dz_buf[row * pitch + k] != kSentinel;
      for (int k = c.dz_front + P; k < pitch; ++k) gap_bad += out.dz_buf[row * pitch + k] != kSentinel;
    }
    for (int j = 0; j < H; ++j) {
      db1[j] += d1[j];
      for (int ch = 0; ch < P; ++ch) dw1[size_t(j) * P + ch] += d1[j] * m[ch];
    }
    for (int ch = 0; ch < P; ++ch) {
      db2[ch] += d2[ch];
      for (int j = 0; j < H; ++j) dw2[size_t(ch) * H + j] += d2[ch] * r[j];
    }
  }
  EXPECT_EQ(dz_bad, 0u) << "dz differs from dy * (y > 0) (in T); first at pixel row " << dz_first_bad[0]
                        << ", channel " << dz_first_bad[1] << ": " << dz_first_bad[2];
  EXPECT_EQ(gap_bad, 0u) << "dz row channels outside [0, p) were written";
  EXPECT_EQ(d_o.nan, 0u) << "d_o elements left unwritten (NaN poison) or NaN";
  ASSERT_GT(d_o.ref2, 0.0);
  EXPECT_LE(d_o.rel(), unit_roundoff(c.dtype) + 1e-4) << "d_o: normwise relative error ||out-ref||/||ref||";
  expect_norm("dw1", out.dw1, dw1, 1e-5);
  expect_norm("db1", out.db1, db1, 1e-5);
  expect_norm("dw2", out.dw2, dw2, 1e-5);
  expect_norm("db2", out.db2, db2, 1e-5);
  if (c.sums) {
    expect_sum("sum_d_o", out.sums[0], s_do);
    expect_sum("sum_dz", out.sums[1], s_dz);
    expect_sum("sum_dy", out.sums[2], s_dy);
  } else {
    for (float v : out.sums) {
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      EXPECT_EQ(bits, 0xffffffffu) << "a scalar sum was written though its pointer was null";
    }
  }
}

template <class V>
size_t count_bit_differences(const V& a, const V& b) {
  if (a.size() != b.size()) return std::max(a.size(), b.size());
  size_t d = 0;
  for (size_t i = 0; i < a.size(); ++i) d += std::memcmp(&a[i], &b[i], sizeof(a[i])) != 0;
  return d;
}

class SeBackwardGpu : public ::testing::TestWithParam<SeCase> {};

TEST_P(SeBackwardGpu, MatchesFloat64ReferenceAndRepeatsBitExactly) {
  const SeCase& c = GetParam();
  if (const std::string why = kfuse::testing::device_skip_reason(8, 9, "the SE backward kernels"); !why.empty())
    GTEST_SKIP() << why;
  const uint32_t seed = seed_for(std::string("se_backward/") + c.name);
  SCOPED_TRACE(std::string(c.name) + " seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  const Inputs in = make_inputs(c, rng);

  DeviceState d;
  ASSERT_NO_FATAL_FAILURE(upload(c, in, &d));
  Outputs first, second;
  ASSERT_NO_FATAL_FAILURE(run(c, &d, &first));
  ASSERT_NO_FATAL_FAILURE(check_against_reference(c, in, first));

  // Same inputs again (outputs re-poisoned, the workspace as the first launch left it): the same bits.
  ASSERT_NO_FATAL_FAILURE(run(c, &d, &second));
  EXPECT_EQ(count_bit_differences(first.d_o, second.d_o), 0u) << "d_o";
  EXPECT_EQ(count_bit_differences(first.dz_buf, second.dz_buf), 0u) << "dz";
  EXPECT_EQ(count_bit_differences(first.dw1, second.dw1), 0u) << "dw1";
  EXPECT_EQ(count_bit_differences(first.db1, second.db1), 0u) << "db1";
  EXPECT_EQ(count_bit_differences(first.dw2, second.dw2), 0u) << "dw2";
  EXPECT_EQ(count_bit_differences(first.db2, second.db2), 0u) << "db2";
  EXPECT_EQ(std::memcmp(first.sums, second.sums, sizeof(first.sums)), 0) << "sums";
}

INSTANTIATE_TEST_SUITE_P(Kernels, SeBackwardGpu, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<SeCase>& info) { return std::string(info.param.name); });

// A rejected call launches nothing (the poisoned output stays untouched) and leaves no CUDA error behind.
TEST(SeBackwardGpuReject, RejectedCallLaunchesNothing) {
  if (const std::string why = kfuse::testing::device_skip_reason(8, 9, "the SE backward kernels"); !why.empty())
    GTEST_SKIP() << why;
  const SeCase c{"reject", kF16, 2, 16, 64, 4};
  std::mt19937 rng(seed_for("se_backward/reject"));
  const Inputs in = make_inputs(c, rng);
  DeviceState d;
  ASSERT_NO_FATAL_FAILURE(upload(c, in, &d));
  ASSERT_EQ(cudaMemset(d.d_o.ptr, 0xff, d.d_o.bytes), cudaSuccess);
  SeBackwardArgs a = make_args(c, d);
  ASSERT_EQ(d.ws.alloc(kfuse::kernels::se_backward_workspace_bytes(a)), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  a.dz_pitch = 60;  // < p
  EXPECT_EQ(kfuse::kernels::launch_se_backward(a, c.dtype, d.ws.ptr, nullptr), cudaErrorInvalidValue);
  a = make_args(c, d);
  a.o = d.o.as<uint16_t>() + 1;  // misaligned
  EXPECT_EQ(kfuse::kernels::launch_se_backward(a, c.dtype, d.ws.ptr, nullptr), cudaErrorInvalidValue);
  a = make_args(c, d);
  EXPECT_EQ(kfuse::kernels::launch_se_backward(a, c.dtype, nullptr, nullptr), cudaErrorInvalidValue) << "no workspace";
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint16_t> out(d.d_o.bytes / 2);
  ASSERT_EQ(cudaMemcpy(out.data(), d.d_o.ptr, d.d_o.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  size_t touched = 0;
  for (uint16_t bits : out) touched += bits != 0xffff;
  EXPECT_EQ(touched, 0u) << "a rejected call wrote to d_o, so something was launched";
}

// ---- host-only: argument checks return before any CUDA call ----------------------------------------------------

// Fake, suitably aligned device addresses: never dereferenced, since every call below must be rejected.
void* fake(uintptr_t k) { return reinterpret_cast<void*>(uintptr_t(1) << 20 | (k << 12)); }

SeBackwardArgs fake_args() {
  SeBackwardArgs a;
  a.y = fake(1), a.dy = fake(2), a.o = fake(3);
  a.n = 4, a.hw = 16, a.p = 64, a.hidden = 4;
  a.w1 = static_cast<const float*>(fake(4)), a.b1 = static_cast<const float*>(fake(5));
  a.w2 = static_cast<const float*>(fake(6)), a.b2 = static_cast<const float*>(fake(7));
  a.d_o = fake(8), a.dz = fake(9), a.dz_pitch = 128;
  a.dw1 = static_cast<float*>(fake(10)), a.db1 = static_cast<float*>(fake(11));
  a.dw2 = static_cast<float*>(fake(12)), a.db2 = static_cast<float*>(fake(13));
  a.sum_d_o = static_cast<float*>(fake(14)), a.sum_dz = static_cast<float*>(fake(15));
  a.sum_dy = static_cast<float*>(fake(16));
  return a;
}

TEST(SeBackwardValidation, RejectsWithoutTouchingTheDevice) {
  using kfuse::kernels::launch_se_backward;
  void* ws = fake(17);
  const auto rejects = [&](const SeBackwardArgs& a, const char* what, ConvDType dt = kF16, void* w = nullptr) {
    EXPECT_EQ(launch_se_backward(a, dt, w ? w : ws, nullptr), cudaErrorInvalidValue) << what;
  };
  const auto with = [](auto f) {
    SeBackwardArgs a = fake_args();
    f(a);
    return a;
  };
  rejects(with([](SeBackwardArgs& a) { a.y = nullptr; }), "null y");
  rejects(with([](SeBackwardArgs& a) { a.dy = nullptr; }), "null dy");
  rejects(with([](SeBackwardArgs& a) { a.o = nullptr; }), "null o");
  rejects(with([](SeBackwardArgs& a) { a.w1 = nullptr; }), "null w1");
  rejects(with([](SeBackwardArgs& a) { a.b1 = nullptr; }), "null b1");
  rejects(with([](SeBackwardArgs& a) { a.w2 = nullptr; }), "null w2");
  rejects(with([](SeBackwardArgs& a) { a.b2 = nullptr; }), "null b2");
  rejects(with([](SeBackwardArgs& a) { a.d_o = nullptr; }), "null d_o");
  rejects(with([](SeBackwardArgs& a) { a.dz = nullptr; }), "null dz");
  rejects(with([](SeBackwardArgs& a) { a.dw1 = nullptr; }), "null dw1");
  rejects(with([](SeBackwardArgs& a) { a.db1 = nullptr; }), "null db1");
  rejects(with([](SeBackwardArgs& a) { a.dw2 = nullptr; }), "null dw2");
  rejects(with([](SeBackwardArgs& a) { a.db2 = nullptr; }), "null db2");
  rejects(with([](SeBackwardArgs& a) { a.n = 0; }), "n = 0");
  rejects(with([](SeBackwardArgs& a) { a.hw = 0; }), "hw = 0");
  rejects(with([](SeBackwardArgs& a) { a.hidden = 0; }), "hidden = 0");
  rejects(with([](SeBackwardArgs& a) { a.p = 0; }), "p = 0");
  rejects(with([](SeBackwardArgs& a) { a.p = 60, a.dz_pitch = 120; }), "p not a multiple of 8");
  rejects(with([](SeBackwardArgs& a) { a.p = 4096, a.dz_pitch = 4096; }), "p above 2048");
  rejects(with([](SeBackwardArgs& a) { a.dz_pitch = 56; }), "dz_pitch < p");
  rejects(with([](SeBackwardArgs& a) { a.dz_pitch = 132; }), "dz_pitch not a multiple of 8");
  rejects(with([](SeBackwardArgs& a) { a.dy_f32 = true; }), "dy_f32 without dy_nchw");
  rejects(with([](SeBackwardArgs& a) { a.o_scale = static_cast<const float*>(fake(18)); }), "o_scale without o_shift");
  rejects(with([](SeBackwardArgs& a) { a.o_shift = static_cast<const float*>(fake(18)); }), "o_shift without o_scale");
  rejects(with([](SeBackwardArgs& a) { a.hidden = 1 << 20; }), "hidden too large for shared memory");
  rejects(with([](SeBackwardArgs& a) { a.y = static_cast<const char*>(a.y) + 2; }), "misaligned y");
  rejects(with([](SeBackwardArgs& a) { a.dy = static_cast<const char*>(a.dy) + 8; }), "misaligned dy");
  rejects(with([](SeBackwardArgs& a) { a.o = static_cast<const char*>(a.o) + 4; }), "misaligned o");
  rejects(with([](SeBackwardArgs& a) { a.d_o = static_cast<char*>(a.d_o) + 2; }), "misaligned d_o");
  rejects(with([](SeBackwardArgs& a) { a.dz = static_cast<char*>(a.dz) + 6; }), "misaligned dz");
  rejects(with([](SeBackwardArgs& a) { a.w1 = reinterpret_cast<const float*>(static_cast<char*>(fake(4)) + 2); }), "misaligned w1");
  rejects(with([](SeBackwardArgs& a) { a.sum_dz = reinterpret_cast<float*>(static_cast<char*>(fake(15)) + 1); }),
          "misaligned sum_dz");
  rejects(fake_args(), "unknown dtype", static_cast<ConvDType>(7));
  EXPECT_EQ(launch_se_backward(fake_args(), kF16, nullptr, nullptr), cudaErrorInvalidValue) << "null workspace";
  EXPECT_EQ(launch_se_backward(fake_args(), kF16, static_cast<char*>(ws) + 8, nullptr), cudaErrorInvalidValue)
      << "misaligned workspace";
}

TEST(SeBackwardValidation, WorkspaceCoversIntermediatesAndGrowsWithTheBatch) {
  using kfuse::kernels::se_backward_workspace_bytes;
  SeBackwardArgs a = fake_args();
  a.hw = 4, a.p = 512, a.hidden = 32, a.dz_pitch = 512;
  for (int n : {1, 3, 33, 2048, 8192}) {
    a.n = n;
    const size_t bytes = se_backward_workspace_bytes(a);
    // at least m, d_z2 ([n][p]), r, d_z1 ([n][hidden]) in fp32 and the two transposed weights
    EXPECT_GE(bytes, size_t(n) * (2 * 512 + 2 * 32) * 4 + 2 * 512 * 32 * 4) << "n = " << n;
    EXPECT_EQ(bytes % 256, 0u);
  }
  a.n = 33;
  const size_t small = se_backward_workspace_bytes(a);
  a.n = 2048;
  EXPECT_GT(se_backward_workspace_bytes(a), small);
}

}  // namespace
