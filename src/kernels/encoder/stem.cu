// The fused stem: space-to-depth(4) + 1x1 conv + ReLU as one tensor-core GEMM whose A operand is gathered straight
// from the caller's input layout and dtype, so no reordered copy of the input is ever written (the warp-level GEMM and
// why it looks the way it does: stem_tile.cuh). 128 pixels x 64 channels per CTA, 4 warps of 32 pixels each; the
// input dtype and T are template parameters (host dispatch in launch_stem). Used where block 1 does not compute its
// own stem (fused_block_wgmma.cu does, for inference of at most one image per SM).
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/encoder/encoder_kernels.h"
#include "kernels/encoder/stem_tile.cuh"
#include "kernels/programmatic_launch.h"

namespace kfuse::kernels {
namespace {

using stem_tile::kMTiles;
using stem_tile::kTileN;
using stem_tile::kWarpPixels;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTileM = kWarps * kWarpPixels;  // 128 output pixels per CTA

// kC > 0: C known at compile time (all k-steps in one batch); kC == 0: C = a.c, k-steps in batches of 4.
template <class T, class E, int kC>
__global__ void __launch_bounds__(kThreads) stem_kernel(const StemArgs a) {
  // Launched first in the forward, never early itself; lets block 1's conv1 in as soon as its CTAs have started.
  pdl_wait_for_predecessor();
  pdl_allow_successor();
  __shared__ uint4 bs[stem_tile::smem_steps<kC>() * 4 * 32];
  const int warp = threadIdx.x >> 5;
  const int m_warp = blockIdx.x * kTileM + warp * kWarpPixels;
  const int n0 = blockIdx.y * kTileN;
  float acc[kMTiles][8][4];
  stem_tile::warp_gemm<T, E, kC, kThreads>(a, m_warp, n0, bs, acc);

  T* x0 = static_cast<T*>(a.x0);
  T* a0 = static_cast<T*>(a.a0);
  stem_tile::for_each_output<T>(a, acc, m_warp, n0, [&](int m, int col, uint4 xv, uint4 av) {
    const int64_t off = int64_t(m) * a.p0 + col;
    *reinterpret_cast<uint4*>(x0 + off) = xv;
    if (a0) *reinterpret_cast<uint4*>(a0 + off) = av;
  });
}

template <class T>
cudaError_t launch_input(const StemArgs& a, dim3 grid, cudaStream_t stream) {
  return stem_tile::dispatch_input(a, cudaErrorInvalidValue, [&]<class E, int kC>() {
    stem_kernel<T, E, kC><<<grid, kThreads, 0, stream>>>(a);
    return cudaGetLastError();
  });
}

}  // namespace

// kpad: only rows < 16C are read (kpad >= 16C is what the kernel needs; kpad % 64 == 0 is the packing's contract and
// still checked). x0 / a0 must be 16-byte aligned (vector stores), as before.
cudaError_t launch_stem(const StemArgs& a, ConvDType dtype, cudaStream_t stream) {
  if (!a.x || !a.weight || !a.x0 || a.n <= 0 || a.c <= 0 || a.h % 4 || a.w % 4 || a.p0 % 8 || a.kpad % 64 ||
      a.kpad < 16 * a.c || (a.in_scale == nullptr) != (a.in_shift == nullptr))
    return cudaErrorInvalidValue;
  const int64_t m_total = int64_t(a.n) * (a.h / 4) * (a.w / 4);
  if (m_total > int64_t(INT32_MAX) - kTileM) return cudaErrorInvalidValue;  // the kernel indexes pixels in int
  const dim3 grid(unsigned((m_total + kTileM - 1) / kTileM), unsigned((a.p0 + kTileN - 1) / kTileN));
  if (dtype == ConvDType::kF16) return launch_input<__half>(a, grid, stream);
  return launch_input<__nv_bfloat16>(a, grid, stream);
}

}  // namespace kfuse::kernels
