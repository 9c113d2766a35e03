// The stem's tensor-core GEMM for one warp: space-to-depth(4) + 1x1 conv as mma.sync m16n8k16 (fp32 accumulate), 32
// output pixels x 64 channels, its A operand gathered straight from the caller's input layout and dtype. Shared by the
// stem kernel (stem.cu: 4 warps per CTA) and the Hopper block-1 kernel that computes the stem of its own image
// (fused_block_wgmma.cu: 8 warps, one 16 x 16 output image). GEMM view: M = N*(H/4)*(W/4) pixels, N = P0 channels,
// K = 16C (48 for RGB).
//
// Why it looks the way it does (the stem is memory-bound: ~96 B read and 256 B written per pixel at C = 3, P0 = 64):
// - A never touches shared memory. The K order inside each 16-wide k-step is permuted (the sum does not care, and the
//   staged B rows get the same permutation) so that one lane's A fragment for one pixel is exactly the 4 dx values of
//   one (c, dy) "unit": a single 8-byte load for fp16 NCHW (16 B fp32, 4 B uint8), straight into mma registers, no
//   conversion when the input dtype is T and there is no affine. 16C is a multiple of 16, so K is never padded and
//   the number of k-steps is exactly C (3 for RGB).
// - The output-channel order of B is permuted too, so that a lane's accumulators for one pixel are 8 consecutive
//   channels (no shuffle, no shared-memory staging): the epilogue has 16-byte vectors, x and a from the same fp32 value.
// - B (the weight, kpad x p0 in global memory, rows >= 16C ignored) is staged per CTA (per 16 k-steps) into shared
//   memory already laid out as per-lane fragments: one conflict-free 16-byte lds feeds two mma.
// - Index math (two 32-bit divisions) once per pixel, not per element; the unit's (c, dy) once per k-step.
// - The input dtype E and T are template parameters; C = 3 and C = 1 are specialised (compile-time unit decode; all
//   A loads of a warp issued back to back before the first mma). The vector-load condition depends on the input
//   pointer and is evaluated on the device: a CUDA graph may patch a less aligned x into captured arguments.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/encoder/encoder_kernels.h"
#include "kernels/encoder/numeric.cuh"
#include "kernels/encoder/stem_input.cuh"

namespace kfuse::kernels::stem_tile {

constexpr int kMTiles = 2;                 // m16 tiles per warp
constexpr int kWarpPixels = 16 * kMTiles;  // 32 output pixels per warp
constexpr int kTileN = 64;                 // output channels per warp tile: 8 n8 tiles
constexpr int kChunkSteps = 16;            // k-steps (of 16) whose B fragments are staged at once: 32 KB

// k-steps staged at once for a compile-time C (kC > 0) or a run-time one (kC == 0): the staging buffer holds
// smem_steps<kC>() * 4 * 32 uint4 (2 KB per k-step).
template <int kC>
__host__ __device__ constexpr int smem_steps() {
  return kC > 0 && kC < kChunkSteps ? kC : kChunkSteps;
}

// ---- the two permutations (shared by the B staging and the lanes) -----------------------------------------------
// Unit u in [0, 4C) is the (dy, c) pair u = dy*C + c; k-step s holds units 4s..4s+3; within a k-step, lane quad
// position q takes unit 4s+q and the fragment's k slots {2q, 2q+1, 2q+8, 2q+9} hold dx = 0, 1, 2, 3.
// The weight row of (unit u, dx) in the caller's order k = dy*4C + dx*C + c:
__host__ __device__ constexpr int stem_weight_row(int u, int dx, int c_count) {
  return (u / c_count) * 4 * c_count + dx * c_count + u % c_count;
}
// Column n (0..7) of n8 tile t (0..7) holds local output channel (t/4)*32 + (n/2)*8 + (t%4)*2 + n%2, so that the
// accumulator pair {2q, 2q+1} of tiles t = 4b..4b+3 is channels 32b + 8q .. 32b + 8q + 7, in order.
__host__ __device__ constexpr int stem_channel(int t, int n) {
  return (t >> 2) * 32 + (n >> 1) * 8 + (t & 3) * 2 + (n & 1);
}
// Where (in 16-bit elements from the start of k-step sl's 2 KB) the staged B value of (quad position q, dx) and local
// channel lc goes: fragments [tile pair tp][lane][4 x 32 bits] = {b01(t=2tp), b23(t=2tp), b01(t=2tp+1), b23(t=2tp+1)},
// lane = 4 * n + q with n the column in the tile.
__host__ __device__ constexpr int stem_tile_of(int lc) { return ((lc >> 5) << 2) | ((lc >> 1) & 3); }
__host__ __device__ constexpr int stem_col_of(int lc) { return (((lc >> 3) & 3) << 1) | (lc & 1); }
__host__ __device__ constexpr int stem_b_slot(int q, int dx, int lc) {
  const int t = stem_tile_of(lc), n = stem_col_of(lc);
  return ((t >> 1) * 32 + n * 4 + q) * 8 + ((t & 1) * 2 + (dx >> 1)) * 2 + (dx & 1);
}
// Compile-time proof that the permutations are what the staging and the epilogue assume.
constexpr bool stem_permutations_ok() {
  for (int lc = 0; lc < 64; ++lc)
    if (stem_channel(stem_tile_of(lc), stem_col_of(lc)) != lc) return false;  // inverse
  for (int t = 0; t < 8; ++t)  // epilogue: accumulator pair {2q, 2q+1} of tile 4b + tt is channel 32b + 8q + 2tt + e
    for (int n = 0; n < 8; ++n)
      if (stem_channel(t, n) != 32 * (t >> 2) + 8 * (n >> 1) + 2 * (t & 3) + (n & 1)) return false;
  for (int c = 1; c <= 12; ++c) {  // (unit, dx) -> weight row is a bijection onto [0, 16C)
    int hits[16 * 12] = {};
    for (int u = 0; u < 4 * c; ++u)
      for (int dx = 0; dx < 4; ++dx) {
        const int k = stem_weight_row(u, dx, c);
        if (k < 0 || k >= 16 * c || hits[k]++) return false;
      }
  }
  bool slot[4 * 32 * 8] = {};  // (q, dx, lc) -> slot is a bijection onto one k-step's 1024 elements
  for (int q = 0; q < 4; ++q)
    for (int dx = 0; dx < 4; ++dx)
      for (int lc = 0; lc < 64; ++lc) {
        const int o = stem_b_slot(q, dx, lc);
        if (o < 0 || o >= 1024 || slot[o]) return false;
        slot[o] = true;
      }
  return true;
}
static_assert(stem_permutations_ok());

// Stages k-steps [s0, s0 + ns) of the weight (columns n0 .. n0 + 63, zero past p0) into bs as per-lane fragments.
template <class T, int kThreads>
__device__ __forceinline__ void stage_b(const StemArgs& a, int c_count, int s0, int ns, int n0, uint4* bs) {
  const T* w = static_cast<const T*>(a.weight);
  const bool wvec = (reinterpret_cast<uintptr_t>(w) & 15) == 0;  // p0 % 8 == 0 keeps every row 16-byte aligned then
  uint16_t* b16 = reinterpret_cast<uint16_t*>(bs);
  const int items = ns * 16 * 8;  // (unit, dx) rows x 8-channel chunks
  for (int i = threadIdx.x; i < items; i += kThreads) {
    const int chunk = i & 7, ud = i >> 3;  // consecutive threads: consecutive 16 bytes of one weight row
    const int dx = ud & 3, ul = ud >> 2;   // unit within the staged k-steps
    const int u = 4 * s0 + ul;
    const int col = n0 + 8 * chunk;
    uint32_t v[4] = {0u, 0u, 0u, 0u};
    if (col < a.p0) {
      const T* src = w + int64_t(stem_weight_row(u, dx, c_count)) * a.p0 + col;
      if (wvec) {
        const uint4 r = __ldg(reinterpret_cast<const uint4*>(src));
        v[0] = r.x, v[1] = r.y, v[2] = r.z, v[3] = r.w;
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = t_bits(src[2 * j]) | (t_bits(src[2 * j + 1]) << 16);
      }
    }
    uint16_t* dst = b16 + (ul >> 2) * (4 * 32 * 8);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      dst[stem_b_slot(ul & 3, dx, 8 * chunk + j)] = static_cast<uint16_t>(v[j >> 1] >> (16 * (j & 1)));
  }
}
// The lane's 4 pixels: rows g and g + 8 of the warp's two m16 tiles, as offsets into x (pixels past m_total: pixel
// 0's, and pix_ok false).
__device__ __forceinline__ void lane_pixels(const StemArgs& a, int m_warp, int g, int wo, int hw, int m_total,
                                            int64_t (&pix_off)[kMTiles][2], bool (&pix_ok)[kMTiles][2]) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = m_warp + mt * 16 + h * 8 + g;
      pix_ok[mt][h] = m < m_total;
      const unsigned mm = pix_ok[mt][h] ? unsigned(m) : 0u;
      const unsigned img = mm / unsigned(hw), rem = mm - img * unsigned(hw);
      const unsigned oi = rem / unsigned(wo), oj = rem - oi * unsigned(wo);
      pix_off[mt][h] = int64_t(img) * a.stride_n + int64_t(4 * oi) * a.stride_h + int64_t(4 * oj) * a.stride_w;
    }
}

// Raw A data of k-steps s0 .. s0 + kBatch - 1, all loads issued back to back (straight-line code: pixels past the
// end read pixel 0 and are zeroed later), with each step's unit's scale and shift.
template <class E, int kC, int kBatch>
__device__ __forceinline__ void load_raw_batch(const StemArgs& a, const E* x, bool vec, bool affine, int c_count,
                                               int s0, int q, const int64_t (&pix_off)[kMTiles][2],
                                               uint32_t (&raw)[kBatch][kMTiles][2][kRawWords<E>], float (&sc)[kBatch],
                                               float (&sh)[kBatch]) {
#pragma unroll
  for (int i = 0; i < kBatch; ++i) {
    const int s = s0 + i;
    const bool step_ok = kC > 0 || s < c_count;
    const int u = step_ok ? 4 * s + q : q;  // keeps the scale / shift index in range
    const int c = u % c_count, dy = u / c_count;
    const int64_t uoff = int64_t(c) * a.stride_c + int64_t(dy) * a.stride_h;
    sc[i] = 1.f, sh[i] = 0.f;
    if (affine) sc[i] = __ldg(a.in_scale + c), sh[i] = __ldg(a.in_shift + c);
    if (!step_ok) {  // uniform (generic C only)
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int r = 0; r < kRawWords<E>; ++r) raw[i][mt][h][r] = 0u;
    } else if (vec) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) load_raw_vec(x + pix_off[mt][h] + uoff, raw[i][mt][h]);
    } else {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) load_raw_strided(x + pix_off[mt][h] + uoff, a.stride_w, raw[i][mt][h]);
    }
  }
}

// acc += the batch's A fragments times the staged B of its k-steps (stopping at c_count for a run-time C).
template <class T, int kC, int kBatch>
__device__ __forceinline__ void batch_mma(float (&acc)[kMTiles][8][4], const uint32_t (&af)[kBatch][kMTiles][4],
                                          const uint4* bs, int c_count, int s0, int lane) {
#pragma unroll
  for (int i = 0; i < kBatch; ++i) {
    const int s = s0 + i;
    if (kC == 0 && s >= c_count) break;
    const uint4* bstep = bs + (s % kChunkSteps) * (4 * 32);
#pragma unroll
    for (int tp = 0; tp < 4; ++tp) {
      const uint4 b = bstep[tp * 32 + lane];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        mma16816<T>(acc[mt][2 * tp], af[i][mt], b.x, b.y);
        mma16816<T>(acc[mt][2 * tp + 1], af[i][mt], b.z, b.w);
      }
    }
  }
}

// Accumulates this warp's tile: pixels m_warp .. m_warp + 31 (pixels past m_total read pixel 0 and are zeroed) x
// channels n0 .. n0 + 63. Every thread of the CTA (kThreads of them) must call it: B is staged into bs (smem_steps<kC>()
// * 2 KB of shared memory, free on entry) between CTA barriers.
template <class T, class E, int kC, int kThreads>
__device__ __forceinline__ void warp_gemm(const StemArgs& a, int m_warp, int n0, uint4* bs,
                                          float (&acc)[kMTiles][8][4]) {
  constexpr int kBatch = kC > 0 ? kC : 4;
  constexpr int kSmemSteps = smem_steps<kC>();
  static_assert(kChunkSteps % kBatch == 0 || kC > 0, "B chunks must start on batch boundaries");
  static_assert(kC <= kChunkSteps, "a compile-time C must fit one staged chunk");
  const int c_count = kC > 0 ? kC : a.c;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, q = lane & 3;
  const int wo = a.w >> 2, hw = (a.h >> 2) * wo;
  const int m_total = a.n * hw;  // the launchers guarantee it (plus a tile) fits in int
  const E* x = static_cast<const E*>(a.x);
  const bool affine = a.in_scale != nullptr;
  // One vector load per (pixel, unit) when the 4 dx values are contiguous and aligned: stride_w == 1 and every other
  // term of the offset (stride * index, with 4 | 4i, 4j) a multiple of 4 elements.
  const bool vec = a.stride_w == 1 && (reinterpret_cast<uintptr_t>(x) % (4 * sizeof(E))) == 0 &&
                   (a.n == 1 || a.stride_n % 4 == 0) && (c_count == 1 || a.stride_c % 4 == 0) && a.stride_h % 4 == 0;

  int64_t pix_off[kMTiles][2];
  bool pix_ok[kMTiles][2];
  lane_pixels(a, m_warp, g, wo, hw, m_total, pix_off, pix_ok);

#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int t = 0; t < 8; ++t)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[mt][t][r] = 0.f;

  for (int s0 = 0; s0 < c_count; s0 += kBatch) {
    // The batch's raw A data is loaded before the B staging so that both latencies overlap; conversion only after
    // the barrier.
    uint32_t raw[kBatch][kMTiles][2][kRawWords<E>];
    float sc[kBatch], sh[kBatch];
    load_raw_batch<E, kC, kBatch>(a, x, vec, affine, c_count, s0, q, pix_off, raw, sc, sh);

    if (s0 % kChunkSteps == 0) {  // (re)stage B for k-steps s0 .. s0 + 15
      if (s0 > 0) __syncthreads();
      stage_b<T, kThreads>(a, c_count, s0, min(c_count - s0, kSmemSteps), n0, bs);
      __syncthreads();
    }

    // A fragments (the K permutation): a[0]: pixel g, dx 0-1; a[1]: pixel g+8, dx 0-1; a[2], a[3]: the same, dx 2-3.
    // (Here, not in a function of its own: there nvcc orders the registers of sc and sh differently.)
    uint32_t af[kBatch][kMTiles][4];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const bool step_ok = kC > 0 || s0 + i < c_count;
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint32_t lo, hi;
          bool done = false;
          if constexpr (std::is_same_v<E, T>) {
            if (!affine) {  // the input already is T: its bits are the fragment
              lo = raw[i][mt][h][0], hi = raw[i][mt][h][1], done = true;
            }
          }
          if (!done) {
            float v[4];
#pragma unroll
            for (int dx = 0; dx < 4; ++dx) v[dx] = raw_elem<E>(raw[i][mt][h], dx);
            if (affine) {
#pragma unroll
              for (int dx = 0; dx < 4; ++dx) v[dx] = v[dx] * sc[i] + sh[i];
            }
            lo = pack2<T>(v[0], v[1]);
            hi = pack2<T>(v[2], v[3]);
          }
          const bool ok = step_ok && pix_ok[mt][h];
          af[i][mt][h] = ok ? lo : 0u;
          af[i][mt][2 + h] = ok ? hi : 0u;
        }
    }

    batch_mma<T, kC, kBatch>(acc, af, bs, c_count, s0, lane);
  }
}

// The epilogue's values: for each of the lane's (pixel, 8-channel chunk) pairs, calls store(m, col, x, a) with the
// stem output x = T(relu(acc)) and block 1's input a = T(relu(acc) + b1a) as 8 consecutive channels col .. col + 7
// (lane (g, q): pixel rows g and g + 8, channels 32b + 8q .. +7 from tiles 4b .. 4b+3). Pixels past the batch and
// channels >= p0 are skipped; p0 % 8 == 0 keeps each chunk inside one pixel's row.
template <class T, class F>
__device__ __forceinline__ void for_each_output(const StemArgs& a, const float (&acc)[kMTiles][8][4], int m_warp,
                                                int n0, F&& store) {
  const int m_total = a.n * (a.h >> 2) * (a.w >> 2), p0 = a.p0;
  const float b1a = a.b1a ? *a.b1a : 0.f;  // block 1's scalar, read from device memory (graph replays see updates)
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = m_warp + mt * 16 + h * 8 + g;
      if (m >= m_total) continue;
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int col = n0 + 32 * b + 8 * q;
        if (col >= p0) continue;
        uint32_t xw[4], aw[4];
#pragma unroll
        for (int tt = 0; tt < 4; ++tt) {
          const float v0 = relu_keep_nan(acc[mt][4 * b + tt][2 * h]);
          const float v1 = relu_keep_nan(acc[mt][4 * b + tt][2 * h + 1]);
          xw[tt] = pack2<T>(v0, v1);
          aw[tt] = pack2<T>(v0 + b1a, v1 + b1a);
        }
        store(m, col, make_uint4(xw[0], xw[1], xw[2], xw[3]), make_uint4(aw[0], aw[1], aw[2], aw[3]));
      }
    }
}

// The host side of every kernel that runs warp_gemm: returns visit.template operator()<E, kC>() for the input's
// element type E and the channel count's specialisation kC (3: RGB, the workload that matters; 1: depth / grey; 0:
// any other C, known at run time), or `unsupported` for an input dtype without a kernel.
template <class R, class Visit>
R dispatch_input(const StemArgs& a, R unsupported, Visit&& visit) {
  auto by_channels = [&]<class E>() -> R {
    if (a.c == 3) return visit.template operator()<E, 3>();
    if (a.c == 1) return visit.template operator()<E, 1>();
    return visit.template operator()<E, 0>();
  };
  switch (a.x_dtype) {
    case InputDType::kF32: return by_channels.template operator()<float>();
    case InputDType::kF16: return by_channels.template operator()<__half>();
    case InputDType::kBF16: return by_channels.template operator()<__nv_bfloat16>();
    case InputDType::kU8: return by_channels.template operator()<uint8_t>();
  }
  return unsupported;
}

}  // namespace kfuse::kernels::stem_tile
