// Backward of a block's tail (squeeze-excitation, residual join, final ReLU): see SeBackwardArgs for the math.
//
// Why this shape. The work is memory bound: y, dy and o are read and d_o and dz written once (at N = 2048, block 1
// moves ~335 MB); everything else (the per-image FC chain, the batch sums of the parameter gradients) is small. So:
//   1. a transpose kernel writes fc1.W^T and fc2.W^T into the workspace, so that each of the four FC products below
//      is a "contract over the rows of a row-major matrix" whose loads are coalesced and need no lane reductions;
//   2. the main kernel, G images per CTA (G = 1 for block 1 ... 8 for block 4: ~16K elements per CTA), reads y, dy, o
//      once with 16-byte loads; each thread owns fixed 8-channel columns of one image, so dz, the column sums of o
//      (the mean m) and of dz * o (dg) accumulate in registers in a fixed order. dz goes straight to global memory
//      (pitched) and to a shared-memory stage (T) for the last pass, so it is not read back from global memory (when
//      the image is too large for the stage, each thread re-reads the dz vectors it wrote itself, from L2). The
//      column partials are reduced through shared memory (a fixed-order warp pre-reduce, then the slices in order),
//      and the FC chain runs on chip for all G images at once: z1 = fc1(m), r, z2 = fc2(r), g, d_z2, dr = W2^T d_z2,
//      d_z1, dm = W1^T d_z1. Each product reads its fp32 weights through L2 once per CTA (G images share them: block
//      4's 256 KB of weight reads per CTA is what bounds G from below) with one thread per output column and its rows
//      split in slices, the G image operands as broadcast vector loads from shared memory (layout [row][G], every 8th
//      row padded so that the column-partial stores do not collide in banks), slice partials summed in order. The
//      last pass writes d_o = dz * g + dm / hw with 16-byte stores. For the last block dy arrives NCHW: the CTA's
//      (contiguous) dy is first copied with 16-byte loads and transposed into shared memory; when it does not fit,
//      it is read element by element instead.
//      m, r, d_z1, d_z2 (fp32) go to the workspace, and each CTA writes its partial scalar sums. Numerics: all sums
//      in fp32; dg (and sum_dz) use dz in fp32, d_o = dz * g + dm / hw uses dz as stored in T (the same thing unless
//      dy is fp32, where dz is dy rounded once).
//   3. a split-K kernel forms the parameter-gradient partials over chunks of images (tiny GEMMs over the batch:
//      dw1 = d_z1^T m, dw2 = d_z2^T r, and the bias sums), and
//   4. a finalize kernel sums the chunk partials and the per-CTA scalar partials in a fixed order.
// 512 threads and at most ~96 KB of shared memory per CTA (the opt-in max of sm_86/89 is 99 KB): two CTAs per SM on
// H100 overlap one CTA's FC phase with the other's loads. No floating-point atomics anywhere, every reduction order
// is fixed by the launch configuration (which depends only on the arguments and the SM count): the same inputs give
// the same bits.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/encoder/backward_kernels.h"
#include "kernels/encoder/numeric.cuh"

namespace kfuse::kernels {
namespace {

constexpr int kThreads = 512;                // main kernel
constexpr int kWarps = kThreads / 32;
constexpr int kMaxImagesPerCta = 8;
constexpr int64_t kTargetElemsPerCta = 16384; // G * hw * p: ~4 vectors per thread per tensor
constexpr size_t kDefaultSmem = 48 * 1024;
constexpr size_t kMaxSmem = 99 * 1024;        // sm_86 / sm_89 opt-in limit per block (sm_80: 163 KB, sm_90: 227 KB)
constexpr int kMaxP = 2048;
constexpr int kParamThreads = 256;            // parameter-gradient partials: one thread per channel
constexpr int kParamJ = 8;                    //   hidden units per CTA
constexpr int kParamN = 32;                   //   images staged per step
constexpr int kFinalThreads = 256;

// Where the main kernel reads dy from.
enum DyMode : int {
  kDyNhwc = 0,       // NHWC T, 16-byte loads
  kDyStagedT = 1,    // NCHW T, copied and transposed into shared memory first
  kDyStagedF32 = 2,  // NCHW fp32, the same
  kDyNchwT = 3,      // NCHW T, element loads (too large to stage)
  kDyNchwF32 = 4,    // NCHW fp32, element loads
};

// --- the main kernel -------------------------------------------------------------------------------------------------

// Everything the main kernel needs; shared-memory offsets (bytes) come from the host's plan (plan_main).
struct MainParams {
  const void* y;
  const float* y_offset;  // null: the ReLU was active where y > 0; else where y > T(*y_offset)
  const void* dy;
  const void* o;
  const float* o_scale;  // null: o is the SE input itself; else o = T(o * scale + shift)
  const float* o_shift;
  const float* w1;   // [hidden][p]
  const float* w1t;  // [p][hidden] (workspace)
  const float* b1;
  const float* w2;   // [p][hidden]
  const float* w2t;  // [hidden][p] (workspace)
  const float* b2;
  void* d_o;
  void* dz;
  float* ws_m;    // [n][p]
  float* ws_dz2;  // [n][p]
  float* ws_r;    // [n][hidden]
  float* ws_dz1;  // [n][hidden]
  float* ws_scal; // [ctas][3]: sum dy, sum dz, sum d_o
  int n, hw, p, hidden, dz_pitch;
  int dy_mode;
  int cached;     // dz kept in the shared-memory stage (else re-read from global memory)
  int sums;       // write the per-CTA scalar partials
  int sl_rows;    // row slices of an image in the elementwise passes: (kThreads / G) / (p / 8)
  int sl_col;     // slices of the column partials after the warp pre-reduce
  int prereduce;  // G * p / 8 divides 32: the lanes of one column are summed by shuffles first
  uint32_t off_stage, off_dyst, off_po, off_pd, off_y, off_r1, off_d1, off_red;
};

// Row r of an operand array of G floats per row: arrays of p rows get an empty row after every 8 (G > 1), so that the
// column-partial stores of a warp (lanes = images x 8-channel groups) hit distinct banks.
template <int G, bool kPad>
__device__ __forceinline__ int xrow(int r) {
  return (G > 1 && kPad) ? (r + (r >> 3)) * G : r * G;
}

template <int G>
__device__ __forceinline__ void load_g(const float* x, float (&v)[G]) {
  if constexpr (G == 8) {
    const float4 a = reinterpret_cast<const float4*>(x)[0], b = reinterpret_cast<const float4*>(x)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else if constexpr (G == 4) {
    const float4 a = *reinterpret_cast<const float4*>(x);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
  } else if constexpr (G == 2) {
    const float2 a = *reinterpret_cast<const float2*>(x);
    v[0] = a.x, v[1] = a.y;
  } else {
    v[0] = x[0];
  }
}

template <int G>
__device__ __forceinline__ void store_g(float* x, const float (&v)[G]) {
  if constexpr (G == 8) {
    reinterpret_cast<float4*>(x)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(x)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else if constexpr (G == 4) {
    *reinterpret_cast<float4*>(x) = make_float4(v[0], v[1], v[2], v[3]);
  } else if constexpr (G == 2) {
    *reinterpret_cast<float2*>(x) = make_float2(v[0], v[1]);
  } else {
    x[0] = v[0];
  }
}

// acc[g] = sum over rows r = r0, r0 + step, ... < rows of M[r][col] * x[r][g], in row order. The weights come from
// L2 in batches of independent loads (the FC phase is otherwise a chain of L2 round trips).
template <int G, bool kPadX>
__device__ __forceinline__ void dot_rows(const float* __restrict__ M, int rows, int cols, int col, int r0, int step,
                                         const float* x, float (&acc)[G]) {
  constexpr int kBatch = G >= 4 ? 4 : 8;
#pragma unroll
  for (int g = 0; g < G; ++g) acc[g] = 0.f;
  int r = r0;
  for (; r + (kBatch - 1) * step < rows; r += kBatch * step) {
    float w[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) w[k] = __ldg(M + size_t(r + k * step) * cols + col);
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      float xv[G];
      load_g<G>(x + xrow<G, kPadX>(r + k * step), xv);
#pragma unroll
      for (int g = 0; g < G; ++g) acc[g] = fmaf(w[k], xv[g], acc[g]);
    }
  }
  for (; r < rows; r += step) {
    const float w = __ldg(M + size_t(r) * cols + col);
    float xv[G];
    load_g<G>(x + xrow<G, kPadX>(r), xv);
#pragma unroll
    for (int g = 0; g < G; ++g) acc[g] = fmaf(w, xv[g], acc[g]);
  }
}

// out[col][g] = sum_r M[r][col] * x[r][g] for the G images, M row-major [rows][cols] fp32 in global memory (L2), x
// in shared memory. One thread per column (consecutive threads, consecutive columns: coalesced weight loads); when
// there are fewer columns than threads, the rows are split in sl = kThreads / cols slices (thread t: column t % cols,
// rows t / cols + k sl). Slice partials go to `part` ([slices][cols][G], at most kThreads * G floats), summed in slice
// order; when cols divides 32, the slices within a warp are summed by shuffles first. ep(col, g, value) is called
// once per output, by one thread. Every thread must call this (it may contain a barrier); the caller puts a barrier
// between it and anything that reads what ep wrote or reuses `part`.
template <int G, bool kPadX, class Ep>
__device__ __forceinline__ void contract(const float* __restrict__ M, int rows, int cols, const float* x, float* part,
                                         Ep&& ep) {
  const int t = threadIdx.x;
  const int sl = kThreads / cols;
  if (sl <= 1) {
    for (int col = t; col < cols; col += kThreads) {
      float acc[G];
      dot_rows<G, kPadX>(M, rows, cols, col, 0, 1, x, acc);
#pragma unroll
      for (int g = 0; g < G; ++g) ep(col, g, acc[g]);
    }
    return;
  }
  float acc[G];
  int col = t % cols, slice = t / cols;
  bool writer = t < sl * cols;
  if (writer) {
    dot_rows<G, kPadX>(M, rows, cols, col, slice, sl, x, acc);
  } else {
#pragma unroll
    for (int g = 0; g < G; ++g) acc[g] = 0.f;
  }
  int nsl = sl;
  if (32 % cols == 0) {  // sl * cols == kThreads: every lane holds a partial
    for (int off = cols; off < 32; off <<= 1) {
#pragma unroll
      for (int g = 0; g < G; ++g) acc[g] += __shfl_xor_sync(0xffffffffu, acc[g], off);
    }
    writer = (t & 31) < cols;
    slice = t >> 5;
    nsl = kWarps;
  }
  if (writer) store_g<G>(part + (size_t(slice) * cols + col) * G, acc);
  __syncthreads();
  for (int o = t; o < cols * G; o += kThreads) {
    const int c = o / G, g = o - c * G;
    float v = 0.f;
    for (int s = 0; s < nsl; ++s) v += part[(size_t(s) * cols + c) * G + g];
    ep(c, g, v);
  }
}

// Copies the CTA's dy (NCHW, contiguous: ge images of [p][hw]) into shared memory transposed to [ge][hw][p], with
// 16-byte global loads. D is the element type (T's 16 bits as unsigned short, or float).
template <class D>
__device__ __forceinline__ void stage_dy(const MainParams& a, int img0, int ge, D* st) {
  constexpr int kPer = 16 / int(sizeof(D));
  const int hw = a.hw, p = a.p;
  const D* src = static_cast<const D*>(a.dy) + int64_t(img0) * p * hw;
  const int total = ge * p * hw;  // a multiple of 8; fits the stage, so it fits an int
  for (int e0 = threadIdx.x * kPer; e0 < total; e0 += kThreads * kPer) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(src + e0));
    D vals[kPer];
    memcpy(vals, &v, 16);
    int gc = e0 / hw, i = e0 - gc * hw;  // gc = image * p + channel
#pragma unroll
    for (int q = 0; q < kPer; ++q) {
      const int g = gc / p, c = gc - g * p;
      st[(g * hw + i) * p + c] = vals[q];
      if (++i == hw) i = 0, ++gc;
    }
  }
}

template <class T>
__device__ __forceinline__ void load_dy8(const MainParams& a, const unsigned char* smem, int64_t pix, int img, int i,
                                         int local_row, int c0, float (&d)[8]) {
  const int p = a.p;
  switch (a.dy_mode) {
    case kDyNhwc:
      unpack8<T>(__ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(a.dy) + pix * p + c0)), d);
      break;
    case kDyStagedT:
      unpack8<T>(*reinterpret_cast<const uint4*>(reinterpret_cast<const T*>(smem + a.off_dyst) +
                                                 size_t(local_row) * p + c0),
                 d);
      break;
    case kDyStagedF32: {
      const float4* s =
          reinterpret_cast<const float4*>(reinterpret_cast<const float*>(smem + a.off_dyst) + size_t(local_row) * p + c0);
      const float4 u = s[0], v = s[1];
      d[0] = u.x, d[1] = u.y, d[2] = u.z, d[3] = u.w, d[4] = v.x, d[5] = v.y, d[6] = v.z, d[7] = v.w;
      break;
    }
    case kDyNchwT: {
      const unsigned short* b =
          static_cast<const unsigned short*>(a.dy) + (int64_t(img) * p + c0) * a.hw + i;
#pragma unroll
      for (int j = 0; j < 8; ++j) d[j] = bits_to_f<T>(__ldg(b + int64_t(j) * a.hw));
      break;
    }
    default: {
      const float* b = static_cast<const float*>(a.dy) + (int64_t(img) * p + c0) * a.hw + i;
#pragma unroll
      for (int j = 0; j < 8; ++j) d[j] = __ldg(b + int64_t(j) * a.hw);
      break;
    }
  }
}

// G images per CTA. Thread t works on image g = t % G (images interleaved across lanes) and, within it, u = t / G:
// 8-channel group cv = u % C8 and row slice s = u / C8 (rows s, s + sl_rows, ...), for u < sl_rows * C8.
template <class T, int G>
__global__ void __launch_bounds__(kThreads, 2) se_backward_main_kernel(const MainParams a) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int p = a.p, c8 = p / 8, hw = a.hw, hid = a.hidden;
  const int img0 = blockIdx.x * G;
  const int ge = min(G, a.n - img0);
  const int g = t % G, u = t / G;
  const int slr = a.sl_rows;
  const bool active = u < slr * c8;
  const int cv = u % c8, s = u / c8, c0 = 8 * cv;
  const bool has_img = active && g < ge;
  const int rho_p = G > 1 ? p + p / 8 : p;  // rows of the padded [p][G] operand arrays

  T* stage = reinterpret_cast<T*>(smem + a.off_stage);
  float* po = reinterpret_cast<float*>(smem + a.off_po);  // column partials of o; slice 0 becomes m, then the gate
  float* pd = reinterpret_cast<float*>(smem + a.off_pd);  // of dz * o; slice 0 becomes dg, d_z2, then dm / hw
  float* part = reinterpret_cast<float*>(smem + a.off_y);
  float* r1 = reinterpret_cast<float*>(smem + a.off_r1);  // [hidden][G]: r
  float* d1 = reinterpret_cast<float*>(smem + a.off_d1);  // [hidden][G]: d_z1
  T* dzg = static_cast<T*>(a.dz);                         // written here, and read back by the same thread

  const bool staged = a.dy_mode == kDyStagedT || a.dy_mode == kDyStagedF32;
  if (staged) {
    if (a.dy_mode == kDyStagedT)
      stage_dy<unsigned short>(a, img0, ge, reinterpret_cast<unsigned short*>(smem + a.off_dyst));  // T's bits
    else
      stage_dy<float>(a, img0, ge, reinterpret_cast<float*>(smem + a.off_dyst));
    __syncthreads();
  }

  // Pass 1: dz = dy * (y > threshold) -> global and stage; column sums of o and dz * o; scalar sums of dy and dz.
  float so[8], sd[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) so[j] = 0.f, sd[j] = 0.f;
  float s_dy = 0.f, s_dz = 0.f, s_do = 0.f;
  if (has_img) {
    const int img = img0 + g;
    const T* o = static_cast<const T*>(a.o);
    const T* y = static_cast<const T*>(a.y);
    const bool raw = a.o_scale != nullptr;
    const float o_sc = raw ? __ldg(a.o_scale) : 1.f, o_sh = raw ? __ldg(a.o_shift) : 0.f;
    const float y_thr = a.y_offset ? to_f(to_t<T>(__ldg(a.y_offset))) : 0.f;
#pragma unroll 2
    for (int i = s; i < hw; i += slr) {
      const int64_t pix = int64_t(img) * hw + i;
      uint4 ov = __ldg(reinterpret_cast<const uint4*>(o + pix * p + c0));
      if (raw) ov = affine8<T>(ov, o_sc, o_sh);
      const uint4 yv = __ldg(reinterpret_cast<const uint4*>(y + pix * p + c0));
      float dyf[8], of[8], yf[8], dzf[8];
      load_dy8<T>(a, smem, pix, img, i, g * hw + i, c0, dyf);
      unpack8<T>(ov, of);
      unpack8<T>(yv, yf);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        dzf[j] = yf[j] > y_thr ? dyf[j] : 0.f;
        so[j] += of[j];
        sd[j] = fmaf(dzf[j], of[j], sd[j]);
        s_dy += dyf[j];
        s_dz += dzf[j];
      }
      const uint4 dzv = pack8<T>(dzf);
      *reinterpret_cast<uint4*>(dzg + pix * a.dz_pitch + c0) = dzv;
      if (a.cached) *reinterpret_cast<uint4*>(stage + (size_t(g) * hw + i) * p + c0) = dzv;
    }
  }
  if (staged) __syncthreads();  // the dy stage shares its space with the partials (and red)

  // Scalar sums of dy and dz: butterfly in the warp, the warps' totals to red (summed in order at the end).
  float* red = reinterpret_cast<float*>(smem + a.off_red);  // [kWarps][3]: dy, dz, d_o
  if (a.sums) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      s_dy += __shfl_xor_sync(0xffffffffu, s_dy, off);
      s_dz += __shfl_xor_sync(0xffffffffu, s_dz, off);
    }
    if (lane == 0) red[warp * 3 + 0] = s_dy, red[warp * 3 + 1] = s_dz;
  }

  // Column partials -> [slice][rho_p][G]; slice 0 accumulates the total.
  {
    bool writer = active;
    int slice = s;
    if (a.prereduce) {  // all threads active; lanes l, l + G*C8, ... hold the same (image, column group)
      for (int off = G * c8; off < 32; off <<= 1) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          so[j] += __shfl_xor_sync(0xffffffffu, so[j], off);
          sd[j] += __shfl_xor_sync(0xffffffffu, sd[j], off);
        }
      }
      writer = lane < G * c8;
      slice = warp;
    }
    if (writer) {
      float* pos = po + size_t(slice) * rho_p * G;
      float* pds = pd + size_t(slice) * rho_p * G;
      if constexpr (G == 1) {
        reinterpret_cast<float4*>(pos + c0)[0] = make_float4(so[0], so[1], so[2], so[3]);
        reinterpret_cast<float4*>(pos + c0)[1] = make_float4(so[4], so[5], so[6], so[7]);
        reinterpret_cast<float4*>(pds + c0)[0] = make_float4(sd[0], sd[1], sd[2], sd[3]);
        reinterpret_cast<float4*>(pds + c0)[1] = make_float4(sd[4], sd[5], sd[6], sd[7]);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          pos[(9 * cv + j) * G + g] = so[j];  // row rho(c0 + j) = c0 + j + cv
          pds[(9 * cv + j) * G + g] = sd[j];
        }
      }
    }
  }
  __syncthreads();
  for (int o = t; o < p * G; o += kThreads) {
    const int c = o / G, gg = o - c * G;
    const int idx = xrow<G, true>(c) + gg;
    float vm = 0.f, vd = 0.f;
    for (int k = 0; k < a.sl_col; ++k) {
      vm += po[size_t(k) * rho_p * G + idx];
      vd += pd[size_t(k) * rho_p * G + idx];
    }
    vm = vm / float(hw);
    po[idx] = vm;  // m
    pd[idx] = vd;  // dg
    if (gg < ge) a.ws_m[int64_t(img0 + gg) * p + c] = vm;
  }
  __syncthreads();

  // The FC chain, all G images at once.
  contract<G, true>(a.w1t, p, hid, po, part, [&](int j, int gg, float v) {  // z1 = W1 m + b1, r = relu(z1)
    const float r = relu_keep_nan(v + __ldg(a.b1 + j));
    r1[j * G + gg] = r;
    if (gg < ge) a.ws_r[int64_t(img0 + gg) * hid + j] = r;
  });
  __syncthreads();
  contract<G, false>(a.w2t, hid, p, r1, part, [&](int c, int gg, float v) {  // z2 = W2 r + b2, gate, d_z2
    const float gate = 1.f / (1.f + __expf(-(v + __ldg(a.b2 + c))));
    const int idx = xrow<G, true>(c) + gg;
    const float d2 = pd[idx] * gate * (1.f - gate);
    po[idx] = gate;
    pd[idx] = d2;
    if (gg < ge) a.ws_dz2[int64_t(img0 + gg) * p + c] = d2;
  });
  __syncthreads();
  contract<G, true>(a.w2, p, hid, pd, part, [&](int j, int gg, float v) {  // dr = W2^T d_z2, d_z1 = dr (r > 0)
    const float d = r1[j * G + gg] > 0.f ? v : 0.f;
    d1[j * G + gg] = d;
    if (gg < ge) a.ws_dz1[int64_t(img0 + gg) * hid + j] = d;
  });
  __syncthreads();
  contract<G, false>(a.w1, hid, p, d1, part, [&](int c, int gg, float v) {  // dm = W1^T d_z1, stored as dm / hw
    pd[xrow<G, true>(c) + gg] = v / float(hw);
  });
  __syncthreads();

  // Pass 2: d_o = dz * gate + dm / hw.
  if (has_img) {
    float gt[8], dmh[8];
    if constexpr (G == 1) {
      const float4 g0 = reinterpret_cast<const float4*>(po + c0)[0], g1 = reinterpret_cast<const float4*>(po + c0)[1];
      const float4 m0 = reinterpret_cast<const float4*>(pd + c0)[0], m1 = reinterpret_cast<const float4*>(pd + c0)[1];
      gt[0] = g0.x, gt[1] = g0.y, gt[2] = g0.z, gt[3] = g0.w, gt[4] = g1.x, gt[5] = g1.y, gt[6] = g1.z, gt[7] = g1.w;
      dmh[0] = m0.x, dmh[1] = m0.y, dmh[2] = m0.z, dmh[3] = m0.w;
      dmh[4] = m1.x, dmh[5] = m1.y, dmh[6] = m1.z, dmh[7] = m1.w;
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        gt[j] = po[(9 * cv + j) * G + g];
        dmh[j] = pd[(9 * cv + j) * G + g];
      }
    }
    const int img = img0 + g;
    T* d_o = static_cast<T*>(a.d_o);
#pragma unroll 2
    for (int i = s; i < hw; i += slr) {
      const int64_t pix = int64_t(img) * hw + i;
      const uint4 dzv = a.cached ? *reinterpret_cast<const uint4*>(stage + (size_t(g) * hw + i) * p + c0)
                                 : *reinterpret_cast<const uint4*>(dzg + pix * a.dz_pitch + c0);
      float dzf[8], r[8];
      unpack8<T>(dzv, dzf);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        r[j] = fmaf(dzf[j], gt[j], dmh[j]);
        s_do += r[j];
      }
      *reinterpret_cast<uint4*>(d_o + pix * p + c0) = pack8<T>(r);
    }
  }

  // Per-CTA scalar partials, fixed order: butterfly in the warp, then the warps in order.
  if (a.sums) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s_do += __shfl_xor_sync(0xffffffffu, s_do, off);
    if (lane == 0) red[warp * 3 + 2] = s_do;
    __syncthreads();
    if (t < 3) {
      float sum = 0.f;
      for (int w = 0; w < kWarps; ++w) sum += red[w * 3 + t];
      a.ws_scal[int64_t(blockIdx.x) * 3 + t] = sum;
    }
  }
}

// --- fc weight transposes --------------------------------------------------------------------------------------------

// blockIdx.z == 0: w1 [hidden][p] -> w1t [p][hidden]; 1: w2 [p][hidden] -> w2t [hidden][p]. blockIdx.x tiles p,
// blockIdx.y tiles hidden (32 x 32 tiles through shared memory).
__global__ void __launch_bounds__(256) se_transpose_kernel(const float* w1, const float* w2, float* w1t, float* w2t,
                                                           int p, int hidden) {
  __shared__ float tile[32][33];
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;  // 32 x 8
  const int c0 = blockIdx.x * 32, j0 = blockIdx.y * 32;
  if (blockIdx.z == 0) {  // read rows j, columns c
    for (int k = ty; k < 32; k += 8) {
      const int j = j0 + k, c = c0 + tx;
      if (j < hidden && c < p) tile[k][tx] = w1[size_t(j) * p + c];
    }
    __syncthreads();
    for (int k = ty; k < 32; k += 8) {
      const int c = c0 + k, j = j0 + tx;
      if (j < hidden && c < p) w1t[size_t(c) * hidden + j] = tile[tx][k];
    }
  } else {  // read rows c, columns j
    for (int k = ty; k < 32; k += 8) {
      const int c = c0 + k, j = j0 + tx;
      if (j < hidden && c < p) tile[k][tx] = w2[size_t(c) * hidden + j];
    }
    __syncthreads();
    for (int k = ty; k < 32; k += 8) {
      const int j = j0 + k, c = c0 + tx;
      if (j < hidden && c < p) w2t[size_t(j) * p + c] = tile[tx][k];
    }
  }
}

// --- parameter gradients: split over chunks of images, then a fixed-order sum ----------------------------------------

// Partial slab of chunk q (slab = 2 hidden p + hidden + p floats): [dw1 as [hidden][p]] [dw2 as [hidden][p]]
// [db1 [hidden]] [db2 [p]].
struct ParamParams {
  const float* m;    // [n][p]
  const float* dz2;  // [n][p]
  const float* r;    // [n][hidden]
  const float* dz1;  // [n][hidden]
  float* part;       // [q][slab]
  int n, p, hidden, chunk;
};

// Grid (ceil(p / 256), ceil(hidden / 8), q): thread = channel c, 8 hidden units j, images of chunk q in order.
__global__ void __launch_bounds__(kParamThreads) se_param_partial_kernel(const ParamParams a) {
  __shared__ float sd1[kParamN][kParamJ], sr[kParamN][kParamJ];
  const int t = threadIdx.x;
  const int c = blockIdx.x * kParamThreads + t;
  const int j0 = blockIdx.y * kParamJ;
  const int q = blockIdx.z;
  const int p = a.p, hid = a.hidden;
  const int n0 = q * a.chunk, n1 = min(a.n, n0 + a.chunk);
  float acc1[kParamJ], acc2[kParamJ], accb2 = 0.f, accb1 = 0.f;
#pragma unroll
  for (int k = 0; k < kParamJ; ++k) acc1[k] = 0.f, acc2[k] = 0.f;
  static_assert(kParamN * kParamJ == kParamThreads, "one staged value per thread");
  for (int nb = n0; nb < n1; nb += kParamN) {
    const int cnt = min(kParamN, n1 - nb);
    __syncthreads();
    {
      const int nn = t / kParamJ, jj = t % kParamJ, j = j0 + jj;
      const bool ok = nn < cnt && j < hid;
      sd1[nn][jj] = ok ? __ldg(a.dz1 + int64_t(nb + nn) * hid + j) : 0.f;
      sr[nn][jj] = ok ? __ldg(a.r + int64_t(nb + nn) * hid + j) : 0.f;
    }
    __syncthreads();
    if (c < p) {
#pragma unroll 4
      for (int nn = 0; nn < cnt; ++nn) {
        const float mc = __ldg(a.m + int64_t(nb + nn) * p + c);
        const float d2 = __ldg(a.dz2 + int64_t(nb + nn) * p + c);
        accb2 += d2;
#pragma unroll
        for (int k = 0; k < kParamJ; ++k) {
          acc1[k] = fmaf(sd1[nn][k], mc, acc1[k]);
          acc2[k] = fmaf(d2, sr[nn][k], acc2[k]);
        }
      }
    }
    if (blockIdx.x == 0 && t < kParamJ) {
      for (int nn = 0; nn < cnt; ++nn) accb1 += sd1[nn][t];
    }
  }
  const size_t hp = size_t(hid) * p;
  float* slab = a.part + size_t(q) * (2 * hp + hid + p);
  if (c < p) {
#pragma unroll
    for (int k = 0; k < kParamJ; ++k) {
      const int j = j0 + k;
      if (j < hid) {
        slab[size_t(j) * p + c] = acc1[k];
        slab[hp + size_t(j) * p + c] = acc2[k];
      }
    }
    if (blockIdx.y == 0) slab[2 * hp + hid + c] = accb2;
  }
  if (blockIdx.x == 0 && t < kParamJ && j0 + t < hid) slab[2 * hp + j0 + t] = accb1;
}

struct FinalParams {
  const float* part;  // [q][slab]
  const float* scal;  // [ctas][3]
  float *dw1, *db1, *dw2, *db2;
  float *sum_d_o, *sum_dz, *sum_dy;
  int p, hidden, q, ctas;
};

// Sums the q chunk partials of every parameter-gradient element in chunk order; block 0 also sums the per-CTA scalar
// partials (strided per thread, then a fixed tree).
__global__ void __launch_bounds__(kFinalThreads) se_finalize_kernel(const FinalParams a) {
  const size_t hp = size_t(a.hidden) * a.p;
  const size_t slab = 2 * hp + a.hidden + a.p;
  for (size_t idx = size_t(blockIdx.x) * kFinalThreads + threadIdx.x; idx < slab;
       idx += size_t(gridDim.x) * kFinalThreads) {
    float v = 0.f;
#pragma unroll 8
    for (int q = 0; q < a.q; ++q) v += __ldg(a.part + size_t(q) * slab + idx);
    if (idx < hp) {
      a.dw1[idx] = v;
    } else if (idx < 2 * hp) {
      const size_t k = idx - hp, j = k / a.p, c = k - j * a.p;
      a.dw2[c * a.hidden + j] = v;
    } else if (idx < 2 * hp + a.hidden) {
      a.db1[idx - 2 * hp] = v;
    } else {
      a.db2[idx - 2 * hp - a.hidden] = v;
    }
  }
  if (blockIdx.x != 0 || (!a.sum_d_o && !a.sum_dz && !a.sum_dy)) return;
  __shared__ float red[3][kFinalThreads];
  float v[3] = {0.f, 0.f, 0.f};
  for (int i = threadIdx.x; i < a.ctas; i += kFinalThreads) {
#pragma unroll
    for (int k = 0; k < 3; ++k) v[k] += __ldg(a.scal + size_t(i) * 3 + k);
  }
#pragma unroll
  for (int k = 0; k < 3; ++k) red[k][threadIdx.x] = v[k];
  __syncthreads();
  for (int half = kFinalThreads / 2; half > 0; half >>= 1) {
    if (int(threadIdx.x) < half) {
#pragma unroll
      for (int k = 0; k < 3; ++k) red[k][threadIdx.x] += red[k][threadIdx.x + half];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    if (a.sum_dy) *a.sum_dy = red[0][0];
    if (a.sum_dz) *a.sum_dz = red[1][0];
    if (a.sum_d_o) *a.sum_d_o = red[2][0];
  }
}

// --- host side: workspace layout, plan, dispatch ---------------------------------------------------------------------

size_t up256(size_t b) { return (b + 255) / 256 * 256; }
size_t up16(size_t b) { return (b + 15) / 16 * 16; }

struct WsLayout {
  size_t w1t, w2t, m, dz2, r, dz1, part, scal, total;
  int q, chunk;
};

// Depends on n, p, hidden only (the main grid has at most n CTAs).
WsLayout ws_layout(int n, int p, int hidden) {
  WsLayout l{};
  const size_t hp = size_t(hidden) * p;
  // Parameter-gradient chunks: enough CTAs to fill a GPU (~264 of 256 threads), at least 8 images per chunk.
  const int64_t tiles = int64_t((p + kParamThreads - 1) / kParamThreads) * ((hidden + kParamJ - 1) / kParamJ);
  int64_t q = std::clamp<int64_t>((264 + tiles - 1) / tiles, 1, 64);
  q = std::min<int64_t>(q, (n + 7) / 8);
  q = std::max<int64_t>(q, 1);
  l.chunk = int((n + q - 1) / q);
  l.q = (n + l.chunk - 1) / l.chunk;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t o = off;
    off = up256(off + bytes);
    return o;
  };
  l.w1t = take(hp * 4);
  l.w2t = take(hp * 4);
  l.m = take(size_t(n) * p * 4);
  l.dz2 = take(size_t(n) * p * 4);
  l.r = take(size_t(n) * hidden * 4);
  l.dz1 = take(size_t(n) * hidden * 4);
  l.part = take(size_t(l.q) * (2 * hp + hidden + p) * 4);
  l.scal = take(size_t(n) * 3 * 4);
  l.total = off;
  return l;
}

struct Plan {
  int g = 1;
  bool cached = false;
  int dy_mode = kDyNhwc;
  int sl_rows = 0, sl_col = 0, prereduce = 0;
  size_t smem = 0;
  uint32_t off_stage = 0, off_dyst = 0, off_po = 0, off_pd = 0, off_y = 0, off_r1 = 0, off_d1 = 0, off_red = 0;
};

// Shared-memory layout of the main kernel for G images per CTA; false if it does not fit.
//   [dz stage (cached): G hw p T] [region: dy stage (staged modes) | po, pd: [sl_col][rho_p][G] fp32, contract
//   partials [kThreads][G], r1, d1: [hidden][G], red: [kWarps][3]] (the dy stage is dead before the region's
//   other uses begin).
bool plan_main(const SeBackwardArgs& a, int g, bool cached, bool stage_dy, Plan* pl) {
  const int c8 = a.p / 8;
  if (int64_t(g) * c8 > kThreads) return false;
  Plan l;
  l.g = g;
  l.cached = cached;
  l.dy_mode = !a.dy_nchw ? kDyNhwc
              : stage_dy ? (a.dy_f32 ? kDyStagedF32 : kDyStagedT)
                         : (a.dy_f32 ? kDyNchwF32 : kDyNchwT);
  const int s = kThreads / g;
  l.sl_rows = s / c8;
  l.prereduce = 32 % (g * c8) == 0;
  l.sl_col = l.prereduce ? kWarps : l.sl_rows;
  const size_t rho_p = g > 1 ? size_t(a.p) + a.p / 8 : size_t(a.p);
  const size_t img_elems = size_t(g) * a.hw * a.p;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t o = off;
    off = up16(off + bytes);
    return o;
  };
  l.off_stage = uint32_t(take(cached ? img_elems * 2 : 0));
  const size_t region = off;
  l.off_po = uint32_t(take(size_t(l.sl_col) * rho_p * g * 4));
  l.off_pd = uint32_t(take(size_t(l.sl_col) * rho_p * g * 4));
  l.off_y = uint32_t(take(size_t(kThreads) * g * 4));
  l.off_r1 = uint32_t(take(size_t(a.hidden) * g * 4));
  l.off_d1 = uint32_t(take(size_t(a.hidden) * g * 4));
  l.off_red = uint32_t(take(size_t(kWarps) * 3 * 4));
  size_t end = off;
  if (l.dy_mode == kDyStagedT || l.dy_mode == kDyStagedF32) {
    l.off_dyst = uint32_t(region);
    end = std::max(end, region + img_elems * (a.dy_f32 ? 4 : 2));
  }
  l.smem = end;
  if (end > kMaxSmem) return false;
  *pl = l;
  return true;
}

bool aligned(const void* p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) & (a - 1)) == 0; }

// Everything launch_se_backward rejects, without any CUDA call.
bool valid_args(const SeBackwardArgs& a, ConvDType dtype) {
  if (dtype != ConvDType::kF16 && dtype != ConvDType::kBF16) return false;
  if (!a.y || !a.dy || !a.o || !a.w1 || !a.b1 || !a.w2 || !a.b2 || !a.d_o || !a.dz || !a.dw1 || !a.db1 || !a.dw2 ||
      !a.db2)
    return false;
  if (a.n < 1 || a.hw < 1 || a.hidden < 1 || a.p < 8 || a.p > kMaxP || a.p % 8 != 0) return false;
  if (a.dz_pitch < a.p || a.dz_pitch % 8 != 0) return false;
  if (a.dy_f32 && !a.dy_nchw) return false;
  if (!a.o_scale != !a.o_shift) return false;
  for (const void* ptr : {a.y, a.dy, a.o, static_cast<const void*>(a.d_o), static_cast<const void*>(a.dz)})
    if (!aligned(ptr, 16)) return false;
  for (const void* ptr : {static_cast<const void*>(a.w1), static_cast<const void*>(a.b1),
                          static_cast<const void*>(a.w2), static_cast<const void*>(a.b2),
                          static_cast<const void*>(a.dw1), static_cast<const void*>(a.db1),
                          static_cast<const void*>(a.dw2), static_cast<const void*>(a.db2),
                          static_cast<const void*>(a.sum_d_o), static_cast<const void*>(a.sum_dz),
                          static_cast<const void*>(a.sum_dy)})
    if (!aligned(ptr, 4)) return false;
  Plan pl;
  return plan_main(a, 1, false, false, &pl);  // the smallest configuration must fit (bounds hidden)
}

// SM count of the current device (cached per device; 132 if the query fails).
int sm_count(int dev) {
  static std::atomic<int> cache[64];  // 0 = not queried yet
  int n = 0;
  if (dev >= 0 && dev < 64 && (n = cache[dev].load(std::memory_order_relaxed)) > 0) return n;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) {
    (void)cudaGetLastError();
    return 132;
  }
  if (dev >= 0 && dev < 64) cache[dev].store(n, std::memory_order_relaxed);
  return n;
}

// Images per CTA: up to ~kTargetElemsPerCta elements (and G * p / 8 <= kThreads), but no fewer CTAs than SMs.
// Prefers the dz stage and the dy stage; falls back to fewer images, then to G = 1 without them.
Plan choose_plan(const SeBackwardArgs& a, int sms) {
  int gmax = 1;
  while (gmax < kMaxImagesPerCta && int64_t(2 * gmax) * a.p / 8 <= kThreads &&
         int64_t(2 * gmax) * a.hw * a.p <= kTargetElemsPerCta && int64_t(2 * gmax) * sms <= a.n)
    gmax *= 2;
  Plan pl;
  for (int g = gmax; g >= 1; g /= 2)
    if (plan_main(a, g, true, a.dy_nchw, &pl)) return pl;
  if (plan_main(a, 1, true, false, &pl)) return pl;
  if (plan_main(a, 1, false, a.dy_nchw, &pl)) return pl;
  plan_main(a, 1, false, false, &pl);  // fits: checked by valid_args
  return pl;
}

template <class T, int G>
cudaError_t launch_main(const MainParams& mp, const Plan& pl, int dev, cudaStream_t stream) {
  auto kernel = se_backward_main_kernel<T, G>;
  if (pl.smem > kDefaultSmem) {
    static std::atomic<bool> opted[64];
    if (dev < 0 || dev >= 64 || !opted[dev].load(std::memory_order_relaxed)) {
      const cudaError_t err =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kMaxSmem));
      if (err != cudaSuccess) return err;
      if (dev >= 0 && dev < 64) opted[dev].store(true, std::memory_order_relaxed);
    }
  }
  const int grid = (mp.n + G - 1) / G;
  kernel<<<grid, kThreads, pl.smem, stream>>>(mp);
  return cudaGetLastError();
}

template <class T>
cudaError_t launch_main_typed(const MainParams& mp, const Plan& pl, int dev, cudaStream_t stream) {
  switch (pl.g) {
    case 8: return launch_main<T, 8>(mp, pl, dev, stream);
    case 4: return launch_main<T, 4>(mp, pl, dev, stream);
    case 2: return launch_main<T, 2>(mp, pl, dev, stream);
    default: return launch_main<T, 1>(mp, pl, dev, stream);
  }
}

}  // namespace

size_t se_backward_workspace_bytes(const SeBackwardArgs& args) {
  const int n = std::max(args.n, 1), p = std::max(args.p, 8), hidden = std::max(args.hidden, 1);
  return ws_layout(n, p, hidden).total;
}

namespace {

// The main kernel's parameters for these arguments (the same in both phases: the plan depends only on the arguments
// and the device's SM count).
MainParams main_params(const SeBackwardArgs& a, const Plan& pl, const WsLayout& wl, unsigned char* ws) {
  MainParams mp{};
  mp.y = a.y, mp.y_offset = a.y_offset, mp.dy = a.dy, mp.o = a.o, mp.o_scale = a.o_scale, mp.o_shift = a.o_shift;
  mp.w1 = a.w1, mp.w1t = reinterpret_cast<float*>(ws + wl.w1t), mp.b1 = a.b1;
  mp.w2 = a.w2, mp.w2t = reinterpret_cast<float*>(ws + wl.w2t), mp.b2 = a.b2;
  mp.d_o = a.d_o, mp.dz = a.dz;
  mp.ws_m = reinterpret_cast<float*>(ws + wl.m);
  mp.ws_dz2 = reinterpret_cast<float*>(ws + wl.dz2);
  mp.ws_r = reinterpret_cast<float*>(ws + wl.r);
  mp.ws_dz1 = reinterpret_cast<float*>(ws + wl.dz1);
  mp.ws_scal = reinterpret_cast<float*>(ws + wl.scal);
  mp.n = a.n, mp.hw = a.hw, mp.p = a.p, mp.hidden = a.hidden, mp.dz_pitch = a.dz_pitch;
  mp.dy_mode = pl.dy_mode;
  mp.cached = pl.cached;
  mp.sums = a.sum_d_o || a.sum_dz || a.sum_dy;
  mp.sl_rows = pl.sl_rows, mp.sl_col = pl.sl_col, mp.prereduce = pl.prereduce;
  mp.off_stage = pl.off_stage, mp.off_dyst = pl.off_dyst, mp.off_po = pl.off_po, mp.off_pd = pl.off_pd;
  mp.off_y = pl.off_y, mp.off_r1 = pl.off_r1, mp.off_d1 = pl.off_d1, mp.off_red = pl.off_red;
  return mp;
}

// What both phases derive from the arguments: the device, the main kernel's plan and parameters, the workspace
// layout. Returns cudaErrorInvalidValue for arguments launch_se_backward rejects.
struct Setup {
  int dev = 0;
  Plan pl;
  WsLayout wl;
  MainParams mp;
};
cudaError_t setup(const SeBackwardArgs& a, ConvDType dtype, void* workspace, Setup* s) {
  if (!valid_args(a, dtype) || !workspace || !aligned(workspace, 16)) return cudaErrorInvalidValue;
  if (const cudaError_t err = cudaGetDevice(&s->dev); err != cudaSuccess) return err;
  s->pl = choose_plan(a, sm_count(s->dev));
  s->wl = ws_layout(a.n, a.p, a.hidden);
  s->mp = main_params(a, s->pl, s->wl, static_cast<unsigned char*>(workspace));
  return cudaSuccess;
}

}  // namespace

cudaError_t launch_se_backward_data(const SeBackwardArgs& a, ConvDType dtype, void* workspace, cudaStream_t stream) {
  Setup su;
  cudaError_t err = setup(a, dtype, workspace, &su);
  if (err != cudaSuccess) return err;
  const MainParams& mp = su.mp;

  // 1. the weight transposes
  {
    const dim3 grid((a.p + 31) / 32, (a.hidden + 31) / 32, 2);
    se_transpose_kernel<<<grid, 256, 0, stream>>>(a.w1, a.w2, const_cast<float*>(mp.w1t),
                                                  const_cast<float*>(mp.w2t), a.p, a.hidden);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  // 2. the per-image pass
  return dtype == ConvDType::kF16 ? launch_main_typed<__half>(mp, su.pl, su.dev, stream)
                                  : launch_main_typed<__nv_bfloat16>(mp, su.pl, su.dev, stream);
}

cudaError_t launch_se_backward_params(const SeBackwardArgs& a, ConvDType dtype, void* workspace,
                                      cudaStream_t stream) {
  Setup su;
  cudaError_t err = setup(a, dtype, workspace, &su);
  if (err != cudaSuccess) return err;
  const MainParams& mp = su.mp;
  const WsLayout& wl = su.wl;
  // 3. parameter-gradient partials over chunks of images
  ParamParams pp{};
  pp.m = mp.ws_m, pp.dz2 = mp.ws_dz2, pp.r = mp.ws_r, pp.dz1 = mp.ws_dz1;
  pp.part = reinterpret_cast<float*>(static_cast<unsigned char*>(workspace) + wl.part);
  pp.n = a.n, pp.p = a.p, pp.hidden = a.hidden, pp.chunk = wl.chunk;
  {
    const dim3 grid((a.p + kParamThreads - 1) / kParamThreads, (a.hidden + kParamJ - 1) / kParamJ, wl.q);
    se_param_partial_kernel<<<grid, kParamThreads, 0, stream>>>(pp);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  // 4. fixed-order sums
  FinalParams fp{};
  fp.part = pp.part, fp.scal = mp.ws_scal;
  fp.dw1 = a.dw1, fp.db1 = a.db1, fp.dw2 = a.dw2, fp.db2 = a.db2;
  fp.sum_d_o = a.sum_d_o, fp.sum_dz = a.sum_dz, fp.sum_dy = a.sum_dy;
  fp.p = a.p, fp.hidden = a.hidden, fp.q = wl.q, fp.ctas = (a.n + su.pl.g - 1) / su.pl.g;
  {
    const size_t slab = 2 * size_t(a.hidden) * a.p + a.hidden + a.p;
    const int grid = int(std::min<size_t>((slab + kFinalThreads - 1) / kFinalThreads, 1024));
    se_finalize_kernel<<<grid, kFinalThreads, 0, stream>>>(fp);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  return cudaSuccess;
}

cudaError_t launch_se_backward(const SeBackwardArgs& a, ConvDType dtype, void* workspace, cudaStream_t stream) {
  const cudaError_t err = launch_se_backward_data(a, dtype, workspace, stream);
  return err != cudaSuccess ? err : launch_se_backward_params(a, dtype, workspace, stream);
}

}  // namespace kfuse::kernels
