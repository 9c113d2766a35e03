// The fused stem: space-to-depth(4) + 1x1 conv + ReLU as one tensor-core GEMM (WMMA 16x16x16) whose A operand is
// gathered straight from the caller's input layout and dtype, so no reordered copy of the input is ever written.
// K = 16C is small (48 for RGB), so a CTA stages a 64-pixel x 64-k slice of A and a 64 x 64 slice of W per step.
#include <mma.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/encoder/encoder_kernels.h"
#include "kernels/encoder/numeric.cuh"

namespace kfuse::kernels {
namespace {

constexpr int kTileM = 64;   // output pixels per CTA
constexpr int kTileN = 64;   // output channels per CTA
constexpr int kTileK = 64;
constexpr int kThreads = 128;  // 4 warps, each 16 pixels x 64 channels
constexpr int kPad = 8;        // row padding (elements) against shared-memory bank conflicts

__device__ float load_input(const StemArgs& a, int64_t offset) {
  switch (a.x_dtype) {
    case InputDType::kF32: return static_cast<const float*>(a.x)[offset];
    case InputDType::kF16: return __half2float(static_cast<const __half*>(a.x)[offset]);
    case InputDType::kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(a.x)[offset]);
    case InputDType::kU8: return static_cast<float>(static_cast<const uint8_t*>(a.x)[offset]);
  }
  return 0.f;
}

template <class T>
__global__ void __launch_bounds__(kThreads) stem_kernel(const StemArgs a) {
  using namespace nvcuda;
  __shared__ __align__(32) T As[kTileM][kTileK + kPad];
  __shared__ __align__(32) T Bs[kTileK][kTileN + kPad];
  __shared__ __align__(32) float Cs[kTileM][kTileN + 4];

  const int ho = a.h / 4, wo = a.w / 4;
  const int64_t m_total = int64_t(a.n) * ho * wo;
  const int64_t m0 = int64_t(blockIdx.x) * kTileM;
  const int n0 = blockIdx.y * kTileN;
  const int k_real = 16 * a.c;
  const int warp = threadIdx.x / 32;

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4];
  for (auto& f : acc) wmma::fill_fragment(f, 0.f);

  for (int k0 = 0; k0 < a.kpad; k0 += kTileK) {
    for (int i = threadIdx.x; i < kTileM * kTileK; i += kThreads) {
      // Consecutive threads take consecutive pixels: neighbouring input addresses (4 elements apart in NCHW).
      const int r = i % kTileM, kk = i / kTileM, k = k0 + kk;
      const int64_t m = m0 + r;
      float v = 0.f;
      if (k < k_real && m < m_total) {
        const int64_t img = m / (ho * wo);
        const int rem = int(m % (ho * wo));
        const int oi = rem / wo, oj = rem % wo;
        const int dy = k / (4 * a.c), dx = (k / a.c) % 4, c = k % a.c;
        v = load_input(a, img * a.stride_n + c * a.stride_c + int64_t(4 * oi + dy) * a.stride_h +
                              int64_t(4 * oj + dx) * a.stride_w);
        if (a.in_scale) v = v * a.in_scale[c] + a.in_shift[c];
      }
      As[r][kk] = to_t<T>(v);
    }
    const T* w = static_cast<const T*>(a.weight);
    for (int i = threadIdx.x; i < kTileK * kTileN; i += kThreads) {
      const int kk = i / kTileN, col = i % kTileN;
      Bs[kk][col] = n0 + col < a.p0 ? w[int64_t(k0 + kk) * a.p0 + n0 + col] : to_t<T>(0.f);
    }
    __syncthreads();
#pragma unroll
    for (int ks = 0; ks < kTileK; ks += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
      wmma::load_matrix_sync(fa, &As[warp * 16][ks], kTileK + kPad);
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fb;
        wmma::load_matrix_sync(fb, &Bs[ks][t * 16], kTileN + kPad);
        wmma::mma_sync(acc[t], fa, fb, acc[t]);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int t = 0; t < 4; ++t)
    wmma::store_matrix_sync(&Cs[warp * 16][t * 16], acc[t], kTileN + 4, wmma::mem_row_major);
  __syncthreads();

  // 8 channels (16 bytes) per store; p0 % 8 == 0 keeps every vector inside one pixel's row.
  const float b1a = a.b1a ? *a.b1a : 0.f;
  for (int i = threadIdx.x; i < kTileM * kTileN / 8; i += kThreads) {
    const int r = i / (kTileN / 8), col = (i % (kTileN / 8)) * 8;
    const int64_t m = m0 + r;
    if (m >= m_total || n0 + col >= a.p0) continue;
    alignas(16) T x8[8], a8[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float v = relu_keep_nan(Cs[r][col + e]);
      x8[e] = to_t<T>(v);
      a8[e] = to_t<T>(v + b1a);
    }
    const int64_t off = m * a.p0 + n0 + col;
    *reinterpret_cast<uint4*>(static_cast<T*>(a.x0) + off) = *reinterpret_cast<const uint4*>(x8);
    if (a.a0) *reinterpret_cast<uint4*>(static_cast<T*>(a.a0) + off) = *reinterpret_cast<const uint4*>(a8);
  }
}

}  // namespace

cudaError_t launch_stem(const StemArgs& a, ConvDType dtype, cudaStream_t stream) {
  if (!a.x || !a.weight || !a.x0 || a.n <= 0 || a.c <= 0 || a.h % 4 || a.w % 4 || a.p0 % 8 || a.kpad % kTileK ||
      a.kpad < 16 * a.c || (a.in_scale == nullptr) != (a.in_shift == nullptr))
    return cudaErrorInvalidValue;
  const int64_t m_total = int64_t(a.n) * (a.h / 4) * (a.w / 4);
  const dim3 grid(unsigned((m_total + kTileM - 1) / kTileM), unsigned((a.p0 + kTileN - 1) / kTileN));
  if (dtype == ConvDType::kF16)
    stem_kernel<__half><<<grid, kThreads, 0, stream>>>(a);
  else
    stem_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace kfuse::kernels
