// The squeeze and fc1 of a squeeze-excite folded into the dense GEMM of the block's conv2 (encoder_kernels.h
// launch_squeeze_projection, SqueezeExciteArgs::pre_hidden).
//
// Why. In the last block at batch 128 the squeeze-excite is a serial chain of phases behind one barrier each (o, the
// squeeze, fc1, fc2, the excite, the NCHW store); its phase stamps (H100) put the squeeze and fc1 at
// ~0.45 us each of its ~4.8. Both are linear in conv2's raw output, and conv2 there is one dense GEMM over the
// flattened image (dense_conv.h): fc1's pre-activations are then 32 more output columns of that GEMM (2048 -> 2080
// rows of the unrolled filter; nvjet's 48-row tiles already cover 2080 with the same CTA count), computed while conv2
// runs, and the squeeze-excite starts at fc2.
//
// Made once per weight set (the prepared filters' remake, which a training step triggers too), not per forward, but
// that is every optimizer step of an engine that also runs inference, so it has to stream Wd at memory speed: it is
// a skinny GEMM, proj [hidden x kd] = w1 [hidden x K] . Wbar [K x kd], with Wbar summed from Wd's po_count row blocks
// on the way in. A thread per column chained over all of K and po (the first version) is latency bound (265 us on
// H100 for the 8 MB Wd of the default network).
//
// Work split. One CTA (8 warps) per 16-column tile of Wd (kd / 16 CTAs: 128 for the default kd = 2048), each over all
// of K; within the CTA, K in chunks of 32 dealt round-robin to the warps (chunk c to warp c % 8). Per chunk a warp
// loads its 32 x 16 block of Wd for every po (16-byte loads: lane = (k, 8-column half)), sums it over po into Wbar
// (fp32, shared memory), copies w1's matching [32 hidden][32 k] block to shared memory, and accumulates the chunk's
// product into per-lane registers (lane = (8 hidden units strided by 8, 4 columns): 16 accumulators, 16 FMAs per 8
// shared loads). The next chunk's global loads are issued before the current chunk's product, so memory and FMAs
// overlap. The warps' [32][16] fp32 partials are then reduced through shared memory. hidden > 32 runs in passes of
// 32 hidden units, each re-reading its tile of Wd (the network's default has 32).
//
// Summation order (fixed, so the same bits on every run; no atomics): Wbar[k][col] * po_count = ((0 + Wd[0*K + k]) +
// Wd[1*K + k]) + ... in po order; warp w's partial = a fused multiply-add chain over its chunks' k in increasing
// order, starting from 0; proj = T(((p_0 + p_1) + ... + p_7) / po_count) over the warps in index order. rowsum[j]:
// lane-strided sums over k (lane l adds w1[j][l], w1[j][l + 32], ...) then an xor butterfly (16, 8, 4, 2, 1).
//
// Bytes per CTA: 16 columns x po_count * K rows of Wd (64 KB by default) and all of w1 (64 KB: each CTA multiplies
// the whole of it), all through L2; 48 KB of static shared memory (no opt-in needed on any sm_80+ part).
#include <climits>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/encoder/encoder_kernels.h"
#include "kernels/encoder/numeric.cuh"

namespace kfuse::kernels {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kTileCols = 16;  // columns per CTA: two 16-byte vectors of Wd per row
constexpr int kChunk = 32;     // k per warp step
constexpr int kRows = 32;      // hidden units per pass: 8 lane groups x 4 rows per lane
constexpr int kRowsPerLane = kRows / 8;
constexpr int kPoBatch = 4;    // Wd row blocks held in registers per prefetch (all of them at the default po = 4)
constexpr int kItems = kChunk * 2 / 32;  // (k, 8-column half) pairs per lane per chunk
constexpr int kW1Vecs = kRows * kChunk / 4 / 32;  // float4 of w1 per lane per chunk

// One warp's staging area: a chunk's Wbar (fp32) and w1 block. w1's 16-byte segments are swizzled by row (segment s
// of row r at s ^ (r % 8)): the product reads one segment of 8 consecutive rows per instruction, conflict-free.
struct WarpStage {
  float4 wbar[kChunk][kTileCols / 4];  // 2 KB
  float4 w1[kRows][kChunk / 4];        // 4 KB
};
union SharedMem {
  WarpStage stage[kWarps];                        // 48 KB
  float4 partial[kWarps][kRows][kTileCols / 4];  // 16 KB: the warps' partial products, after the last chunk
};

// This lane's loader role: item i is row k = chunk start + i * 16 + lane / 2, columns col0 + (lane % 2) * 8 .. + 8.
template <class T>
struct Loader {
  const T* wd;
  int K, kd, po_count, hidden, ld_k, ld_col;
  bool ld_col_ok;  // kd % 8 == 0: a half tile is all in or all out
  __device__ __forceinline__ const uint4* wd_at(int po, int k) const {
    return reinterpret_cast<const uint4*>(wd + (int64_t(po) * K + k) * kd + ld_col);
  }
};

// Issues chunk c's global loads (pass j0) into registers.
template <class T>
__device__ __forceinline__ void load_chunk(const SqueezeProjectionArgs& a, const Loader<T>& ld,
                                           uint4 (&wd_v)[kItems][kPoBatch], float4 (&w1_v)[kW1Vecs], int c, int j0,
                                           int lane) {
  const int k0 = c * kChunk;
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int k = k0 + i * 16 + ld.ld_k;
    const bool ok = ld.ld_col_ok && k < ld.K;
#pragma unroll
    for (int q = 0; q < kPoBatch; ++q)
      wd_v[i][q] = ok && q < ld.po_count ? __ldg(ld.wd_at(q, k)) : make_uint4(0u, 0u, 0u, 0u);
  }
#pragma unroll
  for (int q = 0; q < kW1Vecs; ++q) {
    const int idx = q * 32 + lane, r = idx / (kChunk / 4), seg = idx % (kChunk / 4);
    const int j = min(j0 + r, ld.hidden - 1);  // rows past hidden: a copy of the last (read, never stored)
    const int k = k0 + seg * 4;                // K % 4 == 0: a segment is all in or all out
    w1_v[q] = k < ld.K ? __ldg(reinterpret_cast<const float4*>(a.w1 + int64_t(j) * ld.K + k))
                       : make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

// Sums the loaded Wd over po (in po order; row blocks past kPoBatch loaded here) into Wbar, and stores w1's block.
template <class T>
__device__ __forceinline__ void stage_chunk(WarpStage& st, const Loader<T>& ld, const uint4 (&wd_v)[kItems][kPoBatch],
                                            const float4 (&w1_v)[kW1Vecs], int c, int lane) {
  const int k0 = c * kChunk;
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int k = k0 + i * 16 + ld.ld_k;
    const bool ok = ld.ld_col_ok && k < ld.K;
    float s[8] = {};
#pragma unroll
    for (int q = 0; q < kPoBatch; ++q) {
      if (q < ld.po_count) {
        float f[8];
        unpack8<T>(wd_v[i][q], f);
#pragma unroll
        for (int e = 0; e < 8; ++e) s[e] += f[e];
      }
    }
    for (int p0 = kPoBatch; p0 < ld.po_count; p0 += kPoBatch) {
      uint4 v[kPoBatch];
#pragma unroll
      for (int q = 0; q < kPoBatch; ++q)
        v[q] = ok && p0 + q < ld.po_count ? __ldg(ld.wd_at(p0 + q, k)) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
      for (int q = 0; q < kPoBatch; ++q) {
        if (p0 + q < ld.po_count) {
          float f[8];
          unpack8<T>(v[q], f);
#pragma unroll
          for (int e = 0; e < 8; ++e) s[e] += f[e];
        }
      }
    }
    const int row = i * 16 + ld.ld_k, v4 = (lane & 1) * 2;
    st.wbar[row][v4] = make_float4(s[0], s[1], s[2], s[3]);
    st.wbar[row][v4 + 1] = make_float4(s[4], s[5], s[6], s[7]);
  }
#pragma unroll
  for (int q = 0; q < kW1Vecs; ++q) {
    const int idx = q * 32 + lane, r = idx / (kChunk / 4), seg = idx % (kChunk / 4);
    st.w1[r][seg ^ (r & 7)] = w1_v[q];
  }
}

// w1's row sums, spread over the CTAs' warps (one row per warp at the default sizes).
__device__ __forceinline__ void w1_row_sums(const SqueezeProjectionArgs& a, int K, int hidden, int warp, int lane) {
  for (int j = blockIdx.x * kWarps + warp; j < hidden; j += gridDim.x * kWarps) {
    const float* w1 = a.w1 + int64_t(j) * K;
    float s = 0.f;
    for (int k = lane; k < K; k += 32) s += __ldg(w1 + k);
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) a.rowsum[j] = s;
  }
}

// acc += the staged chunk's w1 block (rows g + 8 r) times its Wbar (columns 4 cg .. 4 cg + 3) over its len k.
__device__ __forceinline__ void chunk_product(const WarpStage& st, float (&acc)[kRowsPerLane][4], int len, int g,
                                              int cg) {
#pragma unroll
  for (int s4 = 0; s4 < kChunk / 4; ++s4) {
    if (s4 * 4 < len) {
      float4 w[kRowsPerLane], b[4];
#pragma unroll
      for (int r = 0; r < kRowsPerLane; ++r) w[r] = st.w1[g + 8 * r][s4 ^ g];  // (g + 8 r) % 8 == g
#pragma unroll
      for (int q = 0; q < 4; ++q) b[q] = st.wbar[s4 * 4 + q][cg];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
#pragma unroll
        for (int r = 0; r < kRowsPerLane; ++r) {
          const float wq = q == 0 ? w[r].x : q == 1 ? w[r].y : q == 2 ? w[r].z : w[r].w;
          acc[r][0] = fmaf(wq, b[q].x, acc[r][0]);
          acc[r][1] = fmaf(wq, b[q].y, acc[r][1]);
          acc[r][2] = fmaf(wq, b[q].z, acc[r][2]);
          acc[r][3] = fmaf(wq, b[q].w, acc[r][3]);
        }
      }
    }
  }
}

// The pass's projection rows: the warps' partial products summed (in warp order), / po_count, rounded to T.
// Thread t: row t / 8 of the pass, columns 2 (t % 8), 2 (t % 8) + 1 of the tile.
template <class T>
__device__ __forceinline__ void store_pass(const SqueezeProjectionArgs& a, const SharedMem& sm, int j0, int col0,
                                           int kd, int po_count, int hidden) {
  const int row = threadIdx.x >> 3, cp = threadIdx.x & 7;
  const float* p0 = reinterpret_cast<const float*>(&sm.partial[0][row][0]) + 2 * cp;
  constexpr int kWarpStride = kRows * kTileCols;  // floats from one warp's partial to the next
  float sx = p0[0], sy = p0[1];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) sx += p0[w * kWarpStride], sy += p0[w * kWarpStride + 1];
  const int j = j0 + row, col = col0 + 2 * cp;
  if (j < hidden && col < kd) {
    const float n = float(po_count);
    *reinterpret_cast<uint32_t*>(static_cast<T*>(a.proj) + int64_t(j) * kd + col) = pack2<T>(sx / n, sy / n);
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads, 1) squeeze_projection_kernel(const SqueezeProjectionArgs a) {
  if (a.run_flag != nullptr && *a.run_flag == 0u) return;
  __shared__ SharedMem sm;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int K = a.k, kd = a.kd, po_count = a.po_count, hidden = a.hidden;
  const int col0 = blockIdx.x * kTileCols;
  const int nchunks = (K + kChunk - 1) / kChunk;
  const T* wd = static_cast<const T*>(a.wd);
  WarpStage& st = sm.stage[warp];

  const int ld_k = lane >> 1, ld_col = col0 + (lane & 1) * 8;
  const Loader<T> ld{wd, K, kd, po_count, hidden, ld_k, ld_col, ld_col < kd};
  // Product role: rows g + 8 r (r < 4) of the pass, columns 4 cg .. 4 cg + 3 of the tile.
  const int g = lane >> 2, cg = lane & 3;

  uint4 wd_v[kItems][kPoBatch];  // the next chunk's Wd, po 0 .. kPoBatch - 1
  float4 w1_v[kW1Vecs];          // the next chunk's w1 block

  for (int j0 = 0; j0 < hidden; j0 += kRows) {
    float acc[kRowsPerLane][4] = {};
    if (warp < nchunks) load_chunk(a, ld, wd_v, w1_v, warp, j0, lane);
    if (j0 == 0) w1_row_sums(a, K, hidden, warp, lane);  // while the loads fly
    for (int c = warp; c < nchunks; c += kWarps) {
      stage_chunk(st, ld, wd_v, w1_v, c, lane);
      __syncwarp();
      if (c + kWarps < nchunks) load_chunk(a, ld, wd_v, w1_v, c + kWarps, j0, lane);
      chunk_product(st, acc, min(kChunk, K - c * kChunk), g, cg);  // len: a multiple of 4
      __syncwarp();  // the stage is rewritten by this warp's next chunk
    }
    __syncthreads();  // every warp's stage read: the partials overwrite them
#pragma unroll
    for (int r = 0; r < kRowsPerLane; ++r)
      sm.partial[warp][g + 8 * r][cg] = make_float4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
    __syncthreads();
    store_pass<T>(a, sm, j0, col0, kd, po_count, hidden);
    __syncthreads();  // the partials read before the next pass stages into the same memory
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

cudaError_t launch_squeeze_projection(const SqueezeProjectionArgs& a, ConvDType dtype, cudaStream_t stream) {
  if (!a.wd || !a.w1 || !a.proj || !a.rowsum || a.po_count < 1 || a.k < 4 || a.k % 4 != 0 || a.kd < 8 ||
      a.kd % 8 != 0 || a.hidden < 1 || !aligned16(a.wd) || !aligned16(a.w1) || !aligned16(a.proj) ||
      (reinterpret_cast<uintptr_t>(a.rowsum) & 3u) != 0 || int64_t(a.po_count) * a.k > INT32_MAX ||
      (dtype != ConvDType::kF16 && dtype != ConvDType::kBF16))
    return cudaErrorInvalidValue;
  const dim3 grid(unsigned((a.kd + kTileCols - 1) / kTileCols));
  if (dtype == ConvDType::kF16)
    squeeze_projection_kernel<__half><<<grid, kThreads, 0, stream>>>(a);
  else
    squeeze_projection_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace kfuse::kernels
