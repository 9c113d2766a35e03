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
// Steps 1 and 2 are here, 3 and 4 in se_backward_params.cu; the host's plan (workspace layout, images per CTA, shared-
// memory offsets) in se_backward_plan.cpp.
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
#include "kernels/encoder/se_backward_plan.cuh"

namespace kfuse::kernels {
namespace {

using namespace se_backward_detail;

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

// Pass 1's registers for one pixel: dy, o, y and dz (declared by the kernel, as Pass2Regs below).
struct Pass1Regs {
  float dyf[8], of[8], yf[8], dzf[8];
};

// Pass 1 of this thread's (image g, channel group c0, row slice s): dz = dy * (y > threshold) -> global (and the
// stage when cached); column sums of o (so) and dz * o (sd); scalar sums of dy and dz. Nothing without an image
// (has_img is tested here: tested by the caller, nvcc orders s_dy and s_dz's registers differently).
template <class T>
__device__ __forceinline__ void pass1(const MainParams& a, const unsigned char* smem, T* stage, T* dzg, int p, int hw,
                                      int slr, int img, int g, int s, int c0, Pass1Regs& v, float (&so)[8],
                                      float (&sd)[8], float& s_dy, float& s_dz, bool has_img) {
  if (!has_img) return;
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
    load_dy8<T>(a, smem, pix, img, i, g * hw + i, c0, v.dyf);
    unpack8<T>(ov, v.of);
    unpack8<T>(yv, v.yf);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      v.dzf[j] = v.yf[j] > y_thr ? v.dyf[j] : 0.f;
      so[j] += v.of[j];
      sd[j] = fmaf(v.dzf[j], v.of[j], sd[j]);
      s_dy += v.dyf[j];
      s_dz += v.dzf[j];
    }
    const uint4 dzv = pack8<T>(v.dzf);
    *reinterpret_cast<uint4*>(dzg + pix * a.dz_pitch + c0) = dzv;
    if (a.cached) *reinterpret_cast<uint4*>(stage + (size_t(g) * hw + i) * p + c0) = dzv;
  }
}

// Column partials -> [slice][rho_p][G]; slice 0 accumulates the total.
template <int G>
__device__ __forceinline__ void store_column_partials(const MainParams& a, float* po, float* pd, float (&so)[8],
                                                      float (&sd)[8], bool active, int s, int g, int cv, int c0,
                                                      int c8, int rho_p, int t) {
  const int lane = t & 31, warp = t >> 5;
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

// The slices' column partials summed in slice order: m = sum o / hw into po (and ws_m), dg = sum dz * o into pd.
template <int G>
__device__ __forceinline__ void column_totals(const MainParams& a, float* po, float* pd, int p, int hw, int img0,
                                              int ge, int rho_p) {
  for (int o = threadIdx.x; o < p * G; o += kThreads) {
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
}

// The FC chain, all G images at once: r, the gate and d_z2, d_z1, and dm / hw (into pd).
template <int G>
__device__ __forceinline__ void fc_chain(const MainParams& a, float* po, float* pd, float* part, float* r1, float* d1,
                                         int p, int hw, int hid, int img0, int ge) {
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
}

// Pass 2's registers: this thread's gates and dm / hw, and a pixel's dz and d_o. The kernel declares them: nvcc
// places a function's own arrays ahead of the kernel's, and its register assignment (hence the SASS) then differs.
struct Pass2Regs {
  float gt[8], dmh[8];
  float dzf[8], r[8];
};

// Pass 2 of this thread's (image g, channel group c0, row slice s): d_o = dz * gate + dm / hw; returns s_do plus
// the sum of its d_o.
template <class T, int G>
__device__ __forceinline__ float pass2(const MainParams& a, const float* po, const float* pd, const T* stage,
                                       const T* dzg, int p, int hw, int slr, int img0, int g, int s, int cv, int c0,
                                       Pass2Regs& v, float s_do) {
  if constexpr (G == 1) {
    const float4 g0 = reinterpret_cast<const float4*>(po + c0)[0], g1 = reinterpret_cast<const float4*>(po + c0)[1];
    const float4 m0 = reinterpret_cast<const float4*>(pd + c0)[0], m1 = reinterpret_cast<const float4*>(pd + c0)[1];
    v.gt[0] = g0.x, v.gt[1] = g0.y, v.gt[2] = g0.z, v.gt[3] = g0.w;
    v.gt[4] = g1.x, v.gt[5] = g1.y, v.gt[6] = g1.z, v.gt[7] = g1.w;
    v.dmh[0] = m0.x, v.dmh[1] = m0.y, v.dmh[2] = m0.z, v.dmh[3] = m0.w;
    v.dmh[4] = m1.x, v.dmh[5] = m1.y, v.dmh[6] = m1.z, v.dmh[7] = m1.w;
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      v.gt[j] = po[(9 * cv + j) * G + g];
      v.dmh[j] = pd[(9 * cv + j) * G + g];
    }
  }
  const int img = img0 + g;
  T* d_o = static_cast<T*>(a.d_o);
#pragma unroll 2
  for (int i = s; i < hw; i += slr) {
    const int64_t pix = int64_t(img) * hw + i;
    const uint4 dzv = a.cached ? *reinterpret_cast<const uint4*>(stage + (size_t(g) * hw + i) * p + c0)
                               : *reinterpret_cast<const uint4*>(dzg + pix * a.dz_pitch + c0);
    unpack8<T>(dzv, v.dzf);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      v.r[j] = fmaf(v.dzf[j], v.gt[j], v.dmh[j]);
      s_do += v.r[j];
    }
    *reinterpret_cast<uint4*>(d_o + pix * p + c0) = pack8<T>(v.r);
  }
  return s_do;
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
  Pass1Regs v;
  pass1<T>(a, smem, stage, dzg, p, hw, slr, img0 + g, g, s, c0, v, so, sd, s_dy, s_dz, has_img);
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

  store_column_partials<G>(a, po, pd, so, sd, active, s, g, cv, c0, c8, rho_p, t);
  __syncthreads();
  column_totals<G>(a, po, pd, p, hw, img0, ge, rho_p);
  __syncthreads();

  fc_chain<G>(a, po, pd, part, r1, d1, p, hw, hid, img0, ge);
  __syncthreads();

  if (has_img) {
    Pass2Regs v;
    s_do = pass2<T, G>(a, po, pd, stage, dzg, p, hw, slr, img0, g, s, cv, c0, v, s_do);
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


using namespace se_backward_detail;

size_t se_backward_workspace_bytes(const SeBackwardArgs& args) {
  const int n = std::max(args.n, 1), p = std::max(args.p, 8), hidden = std::max(args.hidden, 1);
  return ws_layout(n, p, hidden).total;
}

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

cudaError_t launch_se_backward(const SeBackwardArgs& a, ConvDType dtype, void* workspace, cudaStream_t stream) {
  const cudaError_t err = launch_se_backward_data(a, dtype, workspace, stream);
  return err != cudaSuccess ? err : launch_se_backward_params(a, dtype, workspace, stream);
}

}  // namespace kfuse::kernels
