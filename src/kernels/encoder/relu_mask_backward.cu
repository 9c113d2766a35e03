// Backward of conv1's epilogue h2 = relu(v) + b2a: d_pre = h2 > T(b2a) ? scale * dh : 0, plus the optional full sums
// of scale * dh and d_pre (the gradients of fixup_bias2a and fixup_bias1b), in one memory-bound pass.
//
// Design (reads 2 x 2 B and writes 2 B per element: ~200 MB and ~70 us at 3 TB/s for 2048 x 16 x 16 x 64):
// - 16-byte vectors (8 channels; c % 8 == 0 keeps every row, and with d_pre_pitch % 8 == 0 every output row, 16-byte
//   aligned), grid-stride, two vectors per thread per iteration with all four loads issued before the first use.
//   d_pre is the select of dh's bits (exact, +0 where masked), written only into channels [0, c) of each output row
//   (d_pre may be the first half of a [d_pre | dz] concatenation that another kernel fills).
// - 32-bit vector indices (at most 2^31 - 1 vectors, checked), split into (row, 8-channel chunk) by one 32-bit
//   division per vector: cheap next to 48 bytes of memory traffic, and it keeps the kernel within 32 registers so that
//   8 CTAs of 256 threads fit on an SM.
// - Sums: fp32 per thread (each thread sums at most a few hundred values), fixed-order warp shuffles and a block
//   reduction into one fp32 partial per CTA in the workspace, then one CTA adds the partials in a fixed order in
//   float64. Deterministic (no atomics): bit-identical from run to run. The grid is capped at kMaxCtas whatever the
//   device, so the workspace size is a pure function of the arguments (1056 CTAs of 256 threads: 8 per SM on an H100,
//   enough 16-byte loads in flight to saturate HBM).
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/encoder/backward_kernels.h"
#include "kernels/encoder/numeric.cuh"

namespace kfuse::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxCtas = 1056;
constexpr int kVecsPerThread = 2;  // per grid-stride iteration

// 8 channels: the select of scale * dh, and the two running sums (of the scaled values). With scale 1 the select
// copies dh exactly (T(1 * v) == v).
template <class T>
__device__ __forceinline__ uint4 mask8(uint4 dh, uint4 h2, float thr, float scale, float& s_dh, float& s_pre) {
  const uint32_t d[4] = {dh.x, dh.y, dh.z, dh.w};
  const uint32_t h[4] = {h2.x, h2.y, h2.z, h2.w};
  uint32_t o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    o[i] = 0u;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const float dv = scale * bits_to_f<T>((d[i] >> (16 * k)) & 0xffffu);
      s_dh += dv;
      if (bits_to_f<T>(h[i] >> (16 * k)) > thr) {  // false for NaN h2, as torch's (h2 > b2a) mask
        const uint32_t db = t_bits<T>(to_t<T>(dv));
        o[i] |= db << (16 * k);
        s_pre += bits_to_f<T>(db);
      }
    }
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

struct Params {
  const uint4* dh;
  const uint4* h2;
  const float* b2a;
  const float* scale;   // or null (1)
  uint4* d_pre;
  uint32_t total;       // vectors: pixels * c / 8 (< 2^31)
  uint32_t row_vecs;    // c / 8
  int64_t pitch_vecs;   // d_pre_pitch / 8
  float* part;          // [2][gridDim.x] or null
};

template <class T>
__global__ void __launch_bounds__(kThreads, 8) relu_mask_kernel(const Params p) {
  __shared__ float red[2][kWarps];
  const float thr = to_f<T>(to_t<T>(__ldg(p.b2a)));  // b2a rounded to T, as the forward's store rounded h2
  const float scale = p.scale ? __ldg(p.scale) : 1.0f;
  const uint32_t stride = gridDim.x * kThreads;
  float s_dh = 0.f, s_pre = 0.f;
  for (uint32_t v = blockIdx.x * kThreads + threadIdx.x; v < p.total; v += kVecsPerThread * stride) {
    uint4 dh[kVecsPerThread], h2[kVecsPerThread];
    bool ok[kVecsPerThread];
#pragma unroll
    for (int j = 0; j < kVecsPerThread; ++j) {  // all loads first
      const uint32_t idx = v + j * stride;       // v < 2^31, stride < 2^19: no wrap
      ok[j] = idx < p.total;
      dh[j] = ok[j] ? __ldg(p.dh + idx) : make_uint4(0u, 0u, 0u, 0u);
      h2[j] = ok[j] ? __ldg(p.h2 + idx) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int j = 0; j < kVecsPerThread; ++j) {
      if (!ok[j]) continue;
      const uint32_t idx = v + j * stride, row = idx / p.row_vecs, chunk = idx - row * p.row_vecs;
      p.d_pre[int64_t(row) * p.pitch_vecs + chunk] = mask8<T>(dh[j], h2[j], thr, scale, s_dh, s_pre);
    }
  }
  if (p.part == nullptr) return;  // uniform
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    s_dh += __shfl_xor_sync(0xffffffffu, s_dh, o);
    s_pre += __shfl_xor_sync(0xffffffffu, s_pre, o);
  }
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) red[0][warp] = s_dh, red[1][warp] = s_pre;
  __syncthreads();
  if (threadIdx.x == 0) {
    float a = 0.f, b = 0.f;
    for (int w = 0; w < kWarps; ++w) a += red[0][w], b += red[1][w];
    p.part[blockIdx.x] = a;
    p.part[gridDim.x + blockIdx.x] = b;
  }
}

// One CTA: the partials of each sum added in a fixed order in float64.
__global__ void __launch_bounds__(kThreads) relu_mask_finalize(const float* part, int parts, float* sum_dh,
                                                              float* sum_d_pre) {
  __shared__ double red[2][kThreads];
  double a = 0.0, b = 0.0;
  for (int i = threadIdx.x; i < parts; i += kThreads) a += part[i], b += part[parts + i];
  red[0][threadIdx.x] = a, red[1][threadIdx.x] = b;
  __syncthreads();
  for (int o = kThreads / 2; o > 0; o >>= 1) {
    if (int(threadIdx.x) < o) red[0][threadIdx.x] += red[0][threadIdx.x + o], red[1][threadIdx.x] += red[1][threadIdx.x + o];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    if (sum_dh) *sum_dh = static_cast<float>(red[0][0]);
    if (sum_d_pre) *sum_d_pre = static_cast<float>(red[1][0]);
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

bool valid_args(const ReluMaskBackwardArgs& a) {
  if (!a.dh || !a.h2 || !a.b2a || !a.d_pre) return false;
  if (a.pixels <= 0 || a.c <= 0 || a.c % 8 || a.d_pre_pitch < a.c || a.d_pre_pitch % 8) return false;
  if (!aligned16(a.dh) || !aligned16(a.h2) || !aligned16(a.d_pre)) return false;
  // Vector indices are 32-bit: at most 2^31 - 1 vectors of 8 (32 GiB of fp16 per input; far beyond any encoder layer).
  if (a.pixels > (int64_t(INT32_MAX) / (a.c / 8))) return false;
  return true;
}

int grid_size(const ReluMaskBackwardArgs& a) {
  const uint64_t vecs = uint64_t(a.pixels) * uint64_t(a.c / 8);
  const uint64_t per_cta = uint64_t(kThreads) * kVecsPerThread;
  return int(std::min<uint64_t>((vecs + per_cta - 1) / per_cta, kMaxCtas));
}

}  // namespace

size_t relu_mask_backward_workspace_bytes(const ReluMaskBackwardArgs& a) {
  if (!valid_args(a) || (!a.sum_dh && !a.sum_d_pre)) return 0;
  return (size_t(2) * grid_size(a) * sizeof(float) + 255) / 256 * 256;
}

cudaError_t launch_relu_mask_backward(const ReluMaskBackwardArgs& a, ConvDType dtype, void* workspace,
                                      cudaStream_t stream) {
  if (!valid_args(a)) return cudaErrorInvalidValue;
  if (dtype != ConvDType::kF16 && dtype != ConvDType::kBF16) return cudaErrorInvalidValue;
  const bool sums = a.sum_dh || a.sum_d_pre;
  if (sums && (workspace == nullptr || reinterpret_cast<uintptr_t>(workspace) % 4 != 0)) return cudaErrorInvalidValue;
  const int grid = grid_size(a);
  Params p;
  p.dh = static_cast<const uint4*>(a.dh);
  p.h2 = static_cast<const uint4*>(a.h2);
  p.b2a = a.b2a;
  p.scale = a.scale;
  p.d_pre = static_cast<uint4*>(a.d_pre);
  p.total = uint32_t(a.pixels * (a.c / 8));
  p.row_vecs = uint32_t(a.c / 8);
  p.pitch_vecs = a.d_pre_pitch / 8;
  p.part = sums ? static_cast<float*>(workspace) : nullptr;
  if (dtype == ConvDType::kF16)
    relu_mask_kernel<__half><<<grid, kThreads, 0, stream>>>(p);
  else
    relu_mask_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(p);
  if (sums) relu_mask_finalize<<<1, kThreads, 0, stream>>>(p.part, grid, a.sum_dh, a.sum_d_pre);
  return cudaGetLastError();
}

cudaError_t launch_sum_pair_finalize(const float* part, int parts, float* sum_a, float* sum_b, cudaStream_t stream) {
  if (!part || parts <= 0 || (!sum_a && !sum_b)) return cudaErrorInvalidValue;
  relu_mask_finalize<<<1, kThreads, 0, stream>>>(part, parts, sum_a, sum_b);
  return cudaGetLastError();
}

}  // namespace kfuse::kernels
