// Backward of the fused stem (stem.cu): the weight gradient dw = g^T s, the input gradient dinput = in_scale * g W^T
// (optional) and sum_da, with g = (da + dz) * (x0 > 0), as two tensor-core GEMMs (mma.sync m16n8k16, fp32 accumulate)
// that share one pass over the pixels. GEMM views, M = N*(H/4)*(W/4) pixels:
//   dw     [p0 x 16C]  = sum over M of g[pix][p] * s[pix][k]       (reduction over 524288 pixels at N = 2048)
//   dinput [M x 16C]   = g [M x p0] * W^T [p0 x 16C], scattered back to NCHW through the space-to-depth
//
// Operands (the semantics a float64 check must use): s = T(v), v = fmaf(x, in_scale[c], in_shift[c]), exactly the T
// value the forward's GEMM consumed (stem.cu rounds v to T for its mma), and g = T(da + dz) where x0 > 0, else 0:
// the gradient of the forward as computed, and what autograd under AMP forms (the two branch gradients of x0 summed
// in T, the ReLU's backward a select, the conv's weight gradient taken against its T input). With dz null, g is da
// itself (no rounding). Products of T values are exact in fp32 and every sum is fp32, so dw differs from a float64
// sum of the same operands only by fp32 accumulation (~1e-6 relative); dinput is rounded once, to its dtype.
//
// Why it looks the way it does (memory-bound at N = 2048, C = 3, p0 = 64: x0, da, dz are 384 B per pixel, x 48-192 B,
// dinput 0-192 B; about 250-400 MB, 90-135 us at 3 TB/s, against ~6.4 GFLOP that the tensor cores do in ~10 us):
// - Persistent CTAs (at most kMaxCtas = 2 per SM of an H100; __launch_bounds__ guarantees that residency) walk
//   128-pixel tiles. Per tile: (1) all 256 threads load x0 / da / dz as 16-byte vectors (each thread's loads issued
//   before their first use, together with its x loads) and write g as T into shared memory G [pixel][p0], and the
//   tile's s values as T into S [pixel][k]; (2) each warp adds G^T S for its (16-channel, n8-column) share of dw to
//   register accumulators that live across all the CTA's tiles; (3) each warp computes dinput for 16 pixels x all
//   columns, A = G, B = the weight staged once per CTA as per-lane fragments, and stores it.
// - G and S are read with ldmatrix (.trans for the dw GEMM, whose A is G transposed and whose reduction runs over
//   pixels); their rows are an odd number of 16-byte chunks long, so that 8 consecutive rows hit 8 different bank
//   groups (conflict-free ldmatrix without swizzling).
// - Column order: n8 tile t holds units 2t, 2t+1 (unit u = dy*C + c, the 4 dx of one input row of one channel, as in
//   stem.cu) x dx 0..3, so that (a) one thread writes a unit's 4 dx values to S as one 8-byte store, straight from
//   one vector load of the input (16 B fp32 / 8 B fp16 NCHW), and (b) an mma accumulator pair {2q, 2q+1} of dinput is
//   2 consecutive input pixels along w: 8 lanes x 2 units write 2 x 128 contiguous bytes per store (fp32).
// - dw is reduced in two deterministic stages: each CTA writes its [p0][16C] fp32 partial into the workspace (3 MB
//   at C = 3, ~3% of the traffic), then a small kernel sums the partials in a fixed order in float64. Same for
//   sum_da. No atomics: results are bit-identical from run to run on a given device.
// - The input is read as launch_stem reads it (any strides, fp32 / fp16 / bf16 / uint8 template parameter; the 4-wide
//   vector path is chosen in the kernel from the actual pointer, as in stem.cu). C = 1 and C = 3 are specialised
//   (compile-time column count: 2 and 6 n8 tiles); other C run a generic kernel over chunks of up to 48 units
//   (C <= 12 in one chunk; larger C re-read x0 / da / dz once per chunk, gridDim.y).
// Possible next steps if this ever dominates: double-buffer G / S (cp.async) so that one CTA's loads overlap its own
// MMAs instead of relying on the second resident CTA; read NHWC uint8 RGBA input as one 16-byte row per (pixel, dy)
// (the strided path does 4 byte-loads per unit there).
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/encoder/backward_kernels.h"
#include "kernels/encoder/numeric.cuh"
#include "kernels/encoder/stem_input.cuh"
#include "kernels/shared_memory_ptx.cuh"

namespace kfuse::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTileP = 128;          // pixels per tile: 8 k16 steps of the dw GEMM, one m16 tile of dinput per warp
constexpr int kMaxP0 = 64;           // G holds at most 64 channels (4 m16 tiles of dw, 4 k16 steps of dinput)
constexpr int kGStride = kMaxP0 + 8;  // 16-bit elements per G row: 144 B = 9 chunks of 16 B (odd: no bank conflicts)
constexpr int kMaxUnits = 48;        // (c, dy) units per column chunk: 192 columns, 24 n8 tiles
constexpr int kMaxNt = kMaxUnits / 2;
constexpr int kMaxCtas = 264;        // 2 per SM on an H100 (132 SMs): one wave of persistent CTAs
constexpr int kFinCols = 32;         // finalize: dw elements per CTA (one per lane) ...
constexpr int kFinRows = kThreads / kFinCols;  // ... and partials summed in parallel per element

// Row of the caller's weight layout (k = dy*4C + dx*C + c) of unit u = dy*C + c, dx.
__host__ __device__ constexpr int weight_row(int u, int dx, int c_count) {
  return (u / c_count) * 4 * c_count + dx * c_count + u % c_count;
}

struct Params {
  const void* x;
  int64_t sn, sc, sh, sw;
  int n, c, h, w;
  const float* in_scale;
  const float* in_shift;
  const void* weight;
  int p0;
  const void* x0;
  const void* da;
  const void* dz;
  void* dinput;
  int dinput_kind;  // 0: fp32, 1: fp16, 2: bf16
  float* ws_dw;     // [gridDim.x][p0][16C]
  float* ws_sum;    // [gridDim.x], null when sum_da is not wanted
  int m_total, hw, wo, tiles, units, e_total, ksteps;  // units = 4C, e_total = p0 * 16C, ksteps = ceil(p0 / 16)
};

// ---- tensor-core helpers ---------------------------------------------------------------------------------------
using ptx::ldsm_x4;
using ptx::ldsm_x4_trans;
__device__ __forceinline__ void ldsm_x2_trans(uint32_t (&r)[2], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(ptx::smem_u32(p))
               : "memory");
}

__device__ __forceinline__ void store_pair(void* base, int kind, int64_t off, float v0, float v1) {
  if (kind == 0) {
    *reinterpret_cast<float2*>(static_cast<float*>(base) + off) = make_float2(v0, v1);
  } else if (kind == 1) {
    *reinterpret_cast<__half2*>(static_cast<__half*>(base) + off) = __floats2half2_rn(v0, v1);
  } else {
    *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(base) + off) = __floats2bfloat162_rn(v0, v1);
  }
}

template <int kNT>
constexpr int smem_bytes() {
  return kTileP * kGStride * 2 + kTileP * (kNT | 1) * 8 * 2 + 4 * kNT * 32 * 8;
}

// The per-unit tables in shared memory: x offset, affine, dinput offset.
struct UnitTables {
  int64_t* xoff;
  int64_t* doff;
  float* sc;
  float* sh;
};

// Per-unit tables: x offset, affine (identity when absent: fmaf(x, 1, 0) == x), dinput offset.
__device__ __forceinline__ void build_unit_tables(const Params& p, const UnitTables& t, int u0, int units, int tid) {
  for (int ul = tid; ul < units; ul += kThreads) {
    const int u = u0 + ul, c = u % p.c, dy = u / p.c;
    t.xoff[ul] = int64_t(c) * p.sc + int64_t(dy) * p.sh;
    t.sc[ul] = p.in_scale ? __ldg(p.in_scale + c) : 1.f;
    t.sh[ul] = p.in_shift ? __ldg(p.in_shift + c) : 0.f;
    t.doff[ul] = (int64_t(c) * p.h + dy) * p.w;
  }
}

// The weight as dinput's B fragments: n8 tile nt, column n = g: unit 2nt + (g >> 2), dx = g & 3; k16 step ks:
// b0 = W[k][16ks + 2q, +1], b1 = W[k][16ks + 2q + 8, +9] (zero past p0). 16-bit loads: any alignment.
template <int kNT>
__device__ __forceinline__ void stage_weight_fragments(const Params& p, uint2* wfr, int u0, int nt_count, int tid) {
  const unsigned short* wt = static_cast<const unsigned short*>(p.weight);
  const int items = p.ksteps * nt_count * 32;
  for (int i = tid; i < items; i += kThreads) {
    const int ln = i & 31, nt = (i >> 5) % nt_count, ks = (i >> 5) / nt_count;
    const int gg = ln >> 2, qq = ln & 3;
    const unsigned short* row = wt + int64_t(weight_row(u0 + 2 * nt + (gg >> 2), gg & 3, p.c)) * p.p0;
    const int ch = 16 * ks + 2 * qq;
    uint32_t b0 = 0u, b1 = 0u;
    if (ch < p.p0) b0 = uint32_t(__ldg(row + ch)) | (uint32_t(__ldg(row + ch + 1)) << 16);
    if (ch + 8 < p.p0) b1 = uint32_t(__ldg(row + ch + 8)) | (uint32_t(__ldg(row + ch + 9)) << 16);
    wfr[(ks * kNT + nt) * 32 + ln] = make_uint2(b0, b1);
  }
}

// A batch of kXBatch units' x values of this thread's pixel (units (tid / 128) + 2 (j0 + j)), zero past the end.
template <class E, int kXBatch>
__device__ __forceinline__ void load_x_batch(uint32_t (&raw)[kXBatch][kRawWords<E>], const E* x, bool vec, int64_t sw,
                                             int64_t poff, const int64_t* t_xoff, bool ok, int j0, int nt_count,
                                             int tid) {
#pragma unroll
  for (int j = 0; j < kXBatch; ++j) {
    const int ul = (tid >> 7) + 2 * (j0 + j);
    if (ok && j0 + j < nt_count) {
      const E* src = x + poff + t_xoff[ul];
      if (vec)
        load_raw_vec(src, raw[j]);
      else
        load_raw_strided(src, sw, raw[j]);
    } else {
#pragma unroll
      for (int r = 0; r < kRawWords<E>; ++r) raw[j][r] = 0u;
    }
  }
}

// The batch as s = T(fmaf(x, in_scale, in_shift)) into the pixel's row of S (zero past the end).
template <class T, class E, int kXBatch>
__device__ __forceinline__ void store_s_batch(const uint32_t (&raw)[kXBatch][kRawWords<E>], uint16_t* srow,
                                              const float* t_sc, const float* t_sh, bool ok, int j0, int nt_count,
                                              int tid) {
#pragma unroll
  for (int j = 0; j < kXBatch; ++j) {
    const int ul = (tid >> 7) + 2 * (j0 + j);
    if (j0 + j < nt_count) {
      uint2 packed = make_uint2(0u, 0u);
      if (ok) {
        const float sc = t_sc[ul], sh = t_sh[ul];
        float v[4];
#pragma unroll
        for (int dx = 0; dx < 4; ++dx) v[dx] = __fmaf_rn(raw_elem<E>(raw[j], dx), sc, sh);
        packed = make_uint2(pack2<T>(v[0], v[1]), pack2<T>(v[2], v[3]));
      }
      *reinterpret_cast<uint2*>(srow + 4 * ul) = packed;  // columns 4ul .. 4ul+3: unit ul, dx 0..3
    }
  }
}

// dw[16mt .. +15][tiles nbase + 2i] += G^T S over the tile's 128 pixels (8 k16 steps). (nt_count is taken as kNT
// where that is known at compile time, as in the kernel, whose SASS is then the same.)
template <class T, int kNT, int kSStride, int kNW>
__device__ __forceinline__ void dw_tile_mma(float (&acc)[kNW][4], const uint16_t* gsm, const uint16_t* ssm, int mt,
                                            int nbase, int nt_count_rt, int lane) {
  const int nt_count = kNT == kMaxNt ? nt_count_rt : kNT;
#pragma unroll 2
  for (int kp = 0; kp < kTileP / 16; ++kp) {
    uint32_t a[4];  // matrices: (pix 0-7, ch 0-7), (pix 0-7, ch 8-15), (pix 8-15, ch 0-7), (pix 8-15, ch 8-15)
    ldsm_x4_trans(a, gsm + (16 * kp + (lane & 7) + ((lane >> 4) << 3)) * kGStride + (2 * mt + ((lane >> 3) & 1)) * 8);
    const int brow = 16 * kp + (lane & 7) + (((lane >> 3) & 1) << 3);
#pragma unroll
    for (int i = 0; i < kNW; i += 2) {
      const int nta = nbase + 2 * i, ntb = nta + 2;
      if (nta >= nt_count) break;  // warp-uniform
      if (i + 1 < kNW && ntb < nt_count) {
        uint32_t b[4];  // matrices: (pix 0-7, nta), (pix 8-15, nta), (pix 0-7, ntb), (pix 8-15, ntb)
        ldsm_x4_trans(b, ssm + brow * kSStride + ((lane >> 4) ? ntb : nta) * 8);
        mma16816<T>(acc[i], a, b[0], b[1]);
        mma16816<T>(acc[i + 1], a, b[2], b[3]);
      } else {
        uint32_t b[2];
        ldsm_x2_trans(b, ssm + brow * kSStride + nta * 8);
        mma16816<T>(acc[i], a, b[0], b[1]);
      }
    }
  }
}

// This thread's 4 vectors of x0 / da / dz in the tile (zero past the end; vok: in range).
__device__ __forceinline__ void load_tile_vectors(const uint4* x0v, const uint4* dav, const uint4* dzv, bool has_dz,
                                                  int m_total, int row_vecs, int m0, int tid, uint4 (&vx0)[4],
                                                  uint4 (&vda)[4], uint4 (&vdz)[4], bool (&vok)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int v = tid + i * kThreads, pix = v >> 3, ch8 = v & 7, m = m0 + pix;
    vok[i] = m < m_total && ch8 < row_vecs;
    const int64_t off = int64_t(m) * row_vecs + ch8;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    vx0[i] = vok[i] ? __ldg(x0v + off) : zero;
    vda[i] = vok[i] ? __ldg(dav + off) : zero;
    vdz[i] = vok[i] && has_dz ? __ldg(dzv + off) : zero;
  }
}

// A vector's words of x0, da and dz, and a pair's g (declared by the kernel: see the tile loop).
struct GRegs {
  uint32_t wx[4], wa[4], wz[4];
  float gv[2];
};

// g = T(da + dz) where x0 > 0, else 0 (g = da exactly without dz), of one 16-byte vector into out; sum_da on the side.
template <class T>
__device__ __forceinline__ void g_vector(const uint4& vx0, const uint4& vda, const uint4& vdz, bool has_dz, GRegs& r,
                                         uint32_t (&out)[4], float& sum_da) {
  r.wx[0] = vx0.x, r.wx[1] = vx0.y, r.wx[2] = vx0.z, r.wx[3] = vx0.w;
  r.wa[0] = vda.x, r.wa[1] = vda.y, r.wa[2] = vda.z, r.wa[3] = vda.w;
  r.wz[0] = vdz.x, r.wz[1] = vdz.y, r.wz[2] = vdz.z, r.wz[3] = vdz.w;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float xv = bits_to_f<T>(r.wx[e] >> (16 * hh));
      const float av = bits_to_f<T>(r.wa[e] >> (16 * hh));
      sum_da += av;
      const float sv = has_dz ? av + bits_to_f<T>(r.wz[e] >> (16 * hh)) : av;
      r.gv[hh] = xv > 0.f ? sv : 0.f;
    }
    out[e] = pack2<T>(r.gv[0], r.gv[1]);
  }
}

// dinput for pixels 16 * warp .. +15: D = G W^T, scaled by in_scale[c], stored as pairs of dx.
template <class T, int kNT, int kNB>
__device__ __forceinline__ void dinput_tile(const Params& p, const UnitTables& t, const uint16_t* gsm,
                                            const uint2* wfr, float (&d)[kNB][4], int m0, int nt_count, int warp,
                                            int lane, int g, int q) {
  int64_t base[2];
  bool pok[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int m = m0 + 16 * warp + g + 8 * hh;
    pok[hh] = m < p.m_total;
    const unsigned mm = pok[hh] ? unsigned(m) : 0u;
    const unsigned img = mm / unsigned(p.hw), rem = mm - img * unsigned(p.hw);
    const unsigned oi = rem / unsigned(p.wo), oj = rem - oi * unsigned(p.wo);
    base[hh] = int64_t(img) * p.c * p.h * p.w + int64_t(4 * oi) * p.w + 4 * oj;
  }
  const uint16_t* arow = gsm + (16 * warp + (lane & 7) + (((lane >> 3) & 1) << 3)) * kGStride + (lane >> 4) * 8;
  for (int nb0 = 0; nb0 < nt_count; nb0 += kNB) {
#pragma unroll
    for (int j = 0; j < kNB; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) d[j][r] = 0.f;
    for (int ks = 0; ks < p.ksteps; ++ks) {
      uint32_t a[4];  // matrices: (pix 0-7, ch 0-7), (pix 8-15, ch 0-7), (pix 0-7, ch 8-15), (pix 8-15, ch 8-15)
      ldsm_x4(a, arow + ks * 16);
#pragma unroll
      for (int j = 0; j < kNB; ++j) {
        const int nt = nb0 + j;
        if (nt < nt_count) {
          const uint2 b = wfr[(ks * kNT + nt) * 32 + lane];
          mma16816<T>(d[j], a, b.x, b.y);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kNB; ++j) {
      const int nt = nb0 + j;
      if (nt >= nt_count) break;
      const int ul = 2 * nt + (q >> 1);  // accumulator columns 2q, 2q+1: unit ul, dx 2(q&1), +1
      const int64_t uoff = t.doff[ul] + 2 * (q & 1);
      const float sc = t.sc[ul];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        if (pok[hh]) store_pair(p.dinput, p.dinput_kind, base[hh] + uoff, d[j][2 * hh] * sc, d[j][2 * hh + 1] * sc);
    }
  }
}

// This CTA's dw partial: accumulator e of tile nt: channel 16mt + g + 8(e/2), column 2q + e%2.
template <int kNW>
__device__ __forceinline__ void store_dw_partial(const Params& p, const float (&acc)[kNW][4], int u0, int mt,
                                                 int nbase, int nt_count, int g, int q) {
  float* const part = p.ws_dw + int64_t(blockIdx.x) * p.e_total;
  const int k16 = 4 * p.c * 4;
#pragma unroll
  for (int i = 0; i < kNW; ++i) {
    const int nt = nbase + 2 * i;
    if (nt >= nt_count) break;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int ch = 16 * mt + g + 8 * (e >> 1), col = 2 * q + (e & 1);
      if (ch < p.p0) part[ch * k16 + weight_row(u0 + 2 * nt + (col >> 2), col & 3, p.c)] = acc[i][e];
    }
  }
}

// This CTA's sum_da partial: a fixed-order block reduction (the warp's lanes, then the warps in order).
__device__ __forceinline__ void store_sum_da(float* ws_sum, float* red, float sum_da, int tid, int warp, int lane) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum_da += __shfl_xor_sync(0xffffffffu, sum_da, o);
  if (lane == 0) red[warp] = sum_da;
  __syncthreads();
  if (tid == 0) {
    float s = 0.f;
    for (int w = 0; w < kWarps; ++w) s += red[w];
    ws_sum[blockIdx.x] = s;
  }
}

// kNT: n8 column tiles per chunk at compile time (2: C = 1, 6: C = 3, kMaxNt: any C, chunks of <= 48 units).
template <class T, class E, int kNT>
__global__ void __launch_bounds__(kThreads, 2) stem_backward_kernel(const Params p) {
  constexpr int kSStride = (kNT | 1) * 8;          // 16-bit elements per S row (odd number of 16-byte chunks)
  constexpr int kNW = (kNT + 1) / 2;               // dw n8 tiles per warp: nbase + 2i
  constexpr int kNB = kNT < 6 ? kNT : 6;           // dinput n8 tiles per accumulator batch
  constexpr int kXBatch = kNT <= 6 ? kNT : sizeof(E) == 4 ? 2 : 4;  // units in flight per thread (x loads)
  extern __shared__ uint4 smem[];
  uint16_t* const gsm = reinterpret_cast<uint16_t*>(smem);  // G [kTileP][kGStride]
  uint16_t* const ssm = gsm + kTileP * kGStride;            // S [kTileP][kSStride]
  uint2* const wfr = reinterpret_cast<uint2*>(ssm + kTileP * kSStride);  // W fragments [ks][kNT][lane]
  __shared__ int64_t t_xoff[kMaxUnits], t_doff[kMaxUnits];
  __shared__ float t_sc[kMaxUnits], t_sh[kMaxUnits];
  __shared__ float red[kWarps];
  const UnitTables tables{t_xoff, t_doff, t_sc, t_sh};

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, q = lane & 3, g = lane >> 2;
  const int u0 = blockIdx.y * kMaxUnits;
  const int units = min(kMaxUnits, p.units - u0);  // even (4C is)
  const int nt_count = kNT == kMaxNt ? units / 2 : kNT;
  const bool want_dinput = p.dinput != nullptr;

  build_unit_tables(p, tables, u0, units, tid);
  if (want_dinput) stage_weight_fragments<kNT>(p, wfr, u0, nt_count, tid);

  const E* x = static_cast<const E*>(p.x);
  // One vector load per (pixel, unit) when the 4 dx values are contiguous and aligned (as stem.cu decides it).
  const bool vec = p.sw == 1 && (reinterpret_cast<uintptr_t>(x) % (4 * sizeof(E))) == 0 &&
                   (p.n == 1 || p.sn % 4 == 0) && (p.c == 1 || p.sc % 4 == 0) && p.sh % 4 == 0;
  const uint4* x0v = static_cast<const uint4*>(p.x0);
  const uint4* dav = static_cast<const uint4*>(p.da);
  const uint4* dzv = static_cast<const uint4*>(p.dz);
  const bool has_dz = dzv != nullptr;
  const int row_vecs = p.p0 / 8;  // 16-byte vectors per pixel row of x0 / da / dz

  const int mt = warp & 3, nbase = warp >> 2;  // dw: this warp's 16 channels and n8 tiles nbase + 2i
  float acc[kNW][4];
#pragma unroll
  for (int i = 0; i < kNW; ++i)
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[i][r] = 0.f;
  float sum_da = 0.f;

  // The phases' register arrays (the vectors, raw, out and GRegs, d) are declared here, not in the phase functions:
  // there nvcc orders their registers differently, and the SASS would change.
  for (int tile = blockIdx.x; tile < p.tiles; tile += gridDim.x) {
    const int m0 = tile * kTileP;
    __syncthreads();  // the previous tile's readers are done (and, first time round, the tables are written)

    // (1) x0 / da / dz: 128 pixels x 8 vectors, 4 per thread, consecutive threads on consecutive 16 bytes.
    uint4 vx0[4], vda[4], vdz[4];
    bool vok[4];
    load_tile_vectors(x0v, dav, dzv, has_dz, p.m_total, row_vecs, m0, tid, vx0, vda, vdz, vok);

    // (1) s: thread tid handles pixel tid % 128 and units (tid / 128) + 2j, written as T to S (zero past the end).
    {
      const int pix = tid & (kTileP - 1), m = m0 + pix;
      const bool ok = m < p.m_total;
      int64_t poff = 0;
      if (ok) {
        const unsigned img = unsigned(m) / unsigned(p.hw), rem = unsigned(m) - img * unsigned(p.hw);
        const unsigned oi = rem / unsigned(p.wo), oj = rem - oi * unsigned(p.wo);
        poff = int64_t(img) * p.sn + int64_t(4 * oi) * p.sh + int64_t(4 * oj) * p.sw;
      }
      uint16_t* const srow = ssm + pix * kSStride;
      for (int j0 = 0; j0 < nt_count; j0 += kXBatch) {
        uint32_t raw[kXBatch][kRawWords<E>];
        load_x_batch<E, kXBatch>(raw, x, vec, p.sw, poff, t_xoff, ok, j0, nt_count, tid);
        store_s_batch<T, E, kXBatch>(raw, srow, t_sc, t_sh, ok, j0, nt_count, tid);
      }
    }

    // (1) g = T(da + dz) where x0 > 0, else 0 (g = da exactly without dz), into G; sum_da on the side.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int v = tid + i * kThreads, pix = v >> 3, ch8 = v & 7;
      uint32_t out[4] = {0u, 0u, 0u, 0u};
      GRegs r;
      if (vok[i]) g_vector<T>(vx0[i], vda[i], vdz[i], has_dz, r, out, sum_da);
      *reinterpret_cast<uint4*>(gsm + pix * kGStride + ch8 * 8) = make_uint4(out[0], out[1], out[2], out[3]);
    }
    __syncthreads();

    if (16 * mt < p.p0) dw_tile_mma<T, kNT, kSStride, kNW>(acc, gsm, ssm, mt, nbase, nt_count, lane);  // (2)

    // (3) dinput.
    float d[kNB][4];
    if (want_dinput && m0 + 16 * warp < p.m_total)
      dinput_tile<T, kNT, kNB>(p, tables, gsm, wfr, d, m0, nt_count, warp, lane, g, q);
  }

  if (16 * mt < p.p0) store_dw_partial<kNW>(p, acc, u0, mt, nbase, nt_count, g, q);
  if (p.ws_sum != nullptr && blockIdx.y == 0) store_sum_da(p.ws_sum, red, sum_da, tid, warp, lane);
}

// dw[e] = sum of the partials (fixed order, float64): kFinCols elements per CTA, kFinRows partial rows each summed
// in parallel. One extra CTA (the last) sums the sum_da partials when asked.
__global__ void __launch_bounds__(kThreads) stem_backward_finalize(const float* ws_dw, const float* ws_sum, int parts,
                                                                  int e_total, float* dw, float* sum_da) {
  __shared__ double red[kThreads];
  const int tid = threadIdx.x;
  const int col_blocks = (e_total + kFinCols - 1) / kFinCols;
  if (int(blockIdx.x) < col_blocks) {
    const int e = blockIdx.x * kFinCols + (tid % kFinCols), r = tid / kFinCols;
    double s = 0.0;
    if (e < e_total) {
#pragma unroll 4
      for (int b = r; b < parts; b += kFinRows) s += ws_dw[int64_t(b) * e_total + e];
    }
    red[tid] = s;
    __syncthreads();
    if (tid < kFinCols && e < e_total) {
      double t = 0.0;
      for (int rr = 0; rr < kFinRows; ++rr) t += red[rr * kFinCols + tid];
      dw[e] = static_cast<float>(t);
    }
  } else {
    double s = 0.0;
    for (int b = tid; b < parts; b += kThreads) s += ws_sum[b];
    red[tid] = s;
    __syncthreads();
    for (int o = kThreads / 2; o > 0; o >>= 1) {
      if (tid < o) red[tid] += red[tid + o];
      __syncthreads();
    }
    if (tid == 0) *sum_da = static_cast<float>(red[0]);
  }
}

size_t align256(size_t b) { return (b + 255) / 256 * 256; }

bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

int64_t pixel_count(const StemBackwardArgs& a) { return int64_t(a.n) * (a.h / 4) * (a.w / 4); }

bool valid_args(const StemBackwardArgs& a) {
  if (!a.x || !a.x0 || !a.da || !a.dw) return false;
  if (a.n <= 0 || a.c <= 0 || a.h <= 0 || a.w <= 0 || a.h % 4 || a.w % 4) return false;
  if (a.p0 <= 0 || a.p0 % 8 || a.p0 > kMaxP0) return false;
  if ((a.in_scale == nullptr) != (a.in_shift == nullptr)) return false;
  switch (a.x_dtype) {
    case InputDType::kF32: case InputDType::kF16: case InputDType::kBF16: case InputDType::kU8: break;
    default: return false;
  }
  if (!aligned(a.x0, 16) || !aligned(a.da, 16) || !aligned(a.dz, 16)) return false;  // 16-byte vector loads
  if (int64_t(16) * a.c * a.p0 > int64_t(INT32_MAX) / 2) return false;
  if (pixel_count(a) > int64_t(INT32_MAX) - kTileP) return false;  // pixels are indexed in int
  if (a.dinput) {
    size_t es = 0;
    switch (a.dinput_dtype) {
      case InputDType::kF32: es = 4; break;
      case InputDType::kF16: case InputDType::kBF16: es = 2; break;
      default: return false;
    }
    if (!aligned(a.dinput, 2 * es)) return false;  // pairs of dx are stored together
    if (!a.weight || a.kpad < 16 * a.c) return false;
  }
  return true;
}

int grid_x(const StemBackwardArgs& a) {
  const int64_t tiles = (pixel_count(a) + kTileP - 1) / kTileP;
  return int(std::min<int64_t>(tiles, kMaxCtas));
}

template <class T, class E, int kNT>
cudaError_t launch_kernel(const Params& p, dim3 grid, cudaStream_t stream) {
  constexpr int bytes = smem_bytes<kNT>();
  if constexpr (bytes > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(stem_backward_kernel<T, E, kNT>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err != cudaSuccess) return err;
  }
  stem_backward_kernel<T, E, kNT><<<grid, kThreads, bytes, stream>>>(p);
  return cudaGetLastError();
}

template <class T, class E>
cudaError_t launch_cols(const Params& p, int gx, cudaStream_t stream) {
  if (p.c == 3) return launch_kernel<T, E, 6>(p, dim3(gx, 1), stream);  // RGB: the workload that matters
  if (p.c == 1) return launch_kernel<T, E, 2>(p, dim3(gx, 1), stream);  // depth / grey
  const int chunks = (p.units + kMaxUnits - 1) / kMaxUnits;
  return launch_kernel<T, E, kMaxNt>(p, dim3(gx, chunks), stream);
}

template <class T>
cudaError_t launch_input(const Params& p, InputDType xd, int gx, cudaStream_t stream) {
  switch (xd) {
    case InputDType::kF32: return launch_cols<T, float>(p, gx, stream);
    case InputDType::kF16: return launch_cols<T, __half>(p, gx, stream);
    case InputDType::kBF16: return launch_cols<T, __nv_bfloat16>(p, gx, stream);
    case InputDType::kU8: return launch_cols<T, uint8_t>(p, gx, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

// The workspace holds one [p0][16C] fp32 partial of dw per CTA of the main kernel and one float of sum_da per CTA:
// at C = 3, p0 = 64 about 3.2 MB (264 CTAs) once there are at least 264 tiles of 128 pixels.
size_t stem_backward_workspace_bytes(const StemBackwardArgs& a) {
  if (!valid_args(a)) return 0;
  const size_t parts = size_t(grid_x(a));
  return align256(parts * size_t(a.p0) * 16 * a.c * sizeof(float)) + align256(parts * sizeof(float));
}

cudaError_t launch_stem_backward(const StemBackwardArgs& a, ConvDType dtype, void* workspace, cudaStream_t stream) {
  if (!valid_args(a) || workspace == nullptr || !aligned(workspace, 16)) return cudaErrorInvalidValue;
  if (dtype != ConvDType::kF16 && dtype != ConvDType::kBF16) return cudaErrorInvalidValue;
  const int gx = grid_x(a);
  Params p{};
  p.x = a.x;
  p.sn = a.stride_n, p.sc = a.stride_c, p.sh = a.stride_h, p.sw = a.stride_w;
  p.n = a.n, p.c = a.c, p.h = a.h, p.w = a.w;
  p.in_scale = a.in_scale, p.in_shift = a.in_shift;
  p.weight = a.weight, p.p0 = a.p0;
  p.x0 = a.x0, p.da = a.da, p.dz = a.dz;
  p.dinput = a.dinput;
  p.dinput_kind = a.dinput_dtype == InputDType::kF32 ? 0 : a.dinput_dtype == InputDType::kF16 ? 1 : 2;
  p.e_total = a.p0 * 16 * a.c;
  p.ws_dw = static_cast<float*>(workspace);
  p.ws_sum = a.sum_da ? reinterpret_cast<float*>(static_cast<char*>(workspace) +
                                                 align256(size_t(gx) * p.e_total * sizeof(float)))
                      : nullptr;
  p.wo = a.w / 4, p.hw = (a.h / 4) * p.wo;
  p.m_total = int(pixel_count(a));
  p.tiles = (p.m_total + kTileP - 1) / kTileP;
  p.units = 4 * a.c;
  p.ksteps = (a.p0 + 15) / 16;

  const cudaError_t err = dtype == ConvDType::kF16 ? launch_input<__half>(p, a.x_dtype, gx, stream)
                                                   : launch_input<__nv_bfloat16>(p, a.x_dtype, gx, stream);
  if (err != cudaSuccess) return err;
  const int col_blocks = (p.e_total + kFinCols - 1) / kFinCols;
  stem_backward_finalize<<<col_blocks + (a.sum_da ? 1 : 0), kThreads, 0, stream>>>(p.ws_dw, p.ws_sum, gx, p.e_total,
                                                                                  a.dw, a.sum_da);
  return cudaGetLastError();
}

}  // namespace kfuse::kernels
