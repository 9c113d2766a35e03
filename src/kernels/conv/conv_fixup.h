// Convolutions of the encoder with FixUp epilogues: CUTLASS 2.x implicit-GEMM fprop (cp.async + mma.sync, SASS for
// sm_80 and sm_90), and CUTLASS 3.x Hopper variants (the kSm90 tiles, fp16 only); one instantiation per (dtype, CTA
// tile) in its own .cu file. No CUTLASS header here.
//
//   y[n, p, q, k] = post + act(alpha * conv(x, w)[n, p, q, k] + pre),   act = relu if `relu` else identity
//
// x: NHWC, w: KRSC, y: NPQK, all densely packed, of one dtype (fp16 or bf16); fp32 accumulation and epilogue math.
// alpha, pre and post are device pointers to one float each, read inside the kernel: the FixUp scalars live on the
// GPU, so a captured CUDA graph sees their current values. nullptr stands for alpha = 1, pre = 0, post = 0.
// Uses in the encoder: conv1 -> h + b2a = relu(acc + b1b) + b2a; conv2 -> o = acc * scale + b2b; shortcut -> acc.
#pragma once

#include <cstddef>

#include <cuda_runtime.h>

#include "kernels/conv/conv_problem.h"

namespace kfuse::kernels {

enum class ConvDType { kF16, kBF16 };

// CTA tile M x N (M = output pixels, N = output channels), K step 32 unless named.
//   k128x64, k64x64: CUTLASS 2.x (above), fp16 / bf16, split-K, SASS for sm_80 and sm_90.
//   k64x64x64, k128x64x64 (K step 64), k64x128, k128x128, k128x64w8 (8 warps): CUTLASS 2.x, fp16 only; more
//   shapes for the tuner to try on the small, short-K layers where the two tiles above leave SMs underused.
//   kSm90_*: CUTLASS 3.x Hopper (TMA im2col + wgmma, K tile 64, no cluster), sm_90a SASS only. They need a compute
//   capability 9.0 device, ConvDType::kF16 and split_k == 1 (can_implement is false otherwise), and stride <= 8
//   (TMA im2col). can_implement cannot see the device: the caller must check it; on another device the launch
//   returns cudaErrorInvalidDevice without launching.
enum class ConvTile {
  k128x64,
  k64x64,
  kSm90_128x64,
  kSm90_64x64,
  k64x64x64,
  k128x64x64,
  k64x128,
  k128x128,
  k128x64w8,
  kSm90_64x64_c2x2,  // 2 x 2 cluster, TMA multicast of both operands
  kSm90_128x64_s4,   // 4 pipeline stages: two CTAs per SM
  kSm90_128x128,     // big tiles for the training batch (N = 2048: GEMMs of 0.5-1 M rows), schedule as CUTLASS picks
  kSm90_256x64,      //   (two consumer warpgroups); 256x64 for the 64-channel layers of block 1
  kSm90_128x64_k64,  // e4m3 only: K tile 64 for the 64-channel layers (the e4m3 tiles' K is 128 elements otherwise)
};

struct FixupEpilogue {
  const float* alpha = nullptr;
  const float* pre = nullptr;
  const float* post = nullptr;
  bool relu = false;
  // e4m3 convolutions only (conv2d_fprop_fixup_e4m3), where it is required and alpha must be null: K floats, the
  // multiplier of output channel k (the dequantization scales s_x * s_w[k], with any FixUp scale folded in); 16-byte
  // aligned. The fp16 / bf16 launchers refuse a non-null one.
  const float* channel_alpha = nullptr;
};

// Host-only check: alignment (C and K multiples of 8), sizes, split_k in [1, 64] (exactly 1 for the kSm90 tiles).
KFUSE_KERNEL_API bool conv2d_fprop_fixup_can_implement(const Conv2dProblem& problem, ConvDType dtype, ConvTile tile,
                                                       int split_k = 1);
// Device workspace the launch needs (serial split-K semaphores); 0 when split_k == 1.
KFUSE_KERNEL_API size_t conv2d_fprop_fixup_workspace_bytes(const Conv2dProblem& problem, ConvDType dtype,
                                                           ConvTile tile, int split_k = 1);
// Asynchronous on `stream`. Returns cudaErrorInvalidValue without launching when the problem cannot be implemented,
// a pointer is null or not 16-byte aligned, or the workspace is too small; cudaErrorInvalidDevice for a kSm90 tile
// when the current device's compute capability is not 9.x.
KFUSE_KERNEL_API cudaError_t conv2d_fprop_fixup(const Conv2dProblem& problem, ConvDType dtype, ConvTile tile,
                                                const void* x, const void* w, void* y, const FixupEpilogue& epilogue,
                                                int split_k, void* workspace, size_t workspace_bytes,
                                                cudaStream_t stream);

// fp8: x and w in e4m3 (one byte per element), y fp16, the epilogue's multiplier per output channel
// (FixupEpilogue::channel_alpha); fp32 accumulation. Hopper tiles only (CUTLASS 3.x, sm_90a; same device and
// stride conditions as the kSm90 tiles above), C and K multiples of 16; instances: kSm90_128x64, kSm90_128x64_k64,
// kSm90_128x128, kSm90_256x64. Same contracts as
// conv2d_fprop_fixup with split_k 1 and no workspace.
KFUSE_KERNEL_API bool conv2d_fprop_fixup_e4m3_can_implement(const Conv2dProblem& problem, ConvTile tile);
KFUSE_KERNEL_API cudaError_t conv2d_fprop_fixup_e4m3(const Conv2dProblem& problem, ConvTile tile, const void* x,
                                                     const void* w, void* y, const FixupEpilogue& epilogue,
                                                     cudaStream_t stream);

// Parallel split-K (fixup_split_impl.cuh): the split_k slices of the GEMM K run side by side (grid z = split_k) and
// store fp32 partial outputs in the workspace, then a reduction pass sums them in order and applies the epilogue,
// rounding once. For the late layers at small batches, whose tiles alone fill a fraction of the SMs. Instances:
// fp16 k128x128, k64x128, k64x64x64, k128x64; bf16 k128x128, k64x64. split_k in [2, 64]; K a multiple of 8.
// Same contracts as the serial functions above; the workspace holds split_k * n*p*q*k floats and must be 16-byte
// aligned.
KFUSE_KERNEL_API bool conv2d_fprop_fixup_parallel_can_implement(const Conv2dProblem& problem, ConvDType dtype,
                                                                ConvTile tile, int split_k);
KFUSE_KERNEL_API size_t conv2d_fprop_fixup_parallel_workspace_bytes(const Conv2dProblem& problem, ConvDType dtype,
                                                                    ConvTile tile, int split_k);
KFUSE_KERNEL_API cudaError_t conv2d_fprop_fixup_parallel(const Conv2dProblem& problem, ConvDType dtype, ConvTile tile,
                                                         const void* x, const void* w, void* y,
                                                         const FixupEpilogue& epilogue, int split_k, void* workspace,
                                                         size_t workspace_bytes, cudaStream_t stream);

}  // namespace kfuse::kernels
