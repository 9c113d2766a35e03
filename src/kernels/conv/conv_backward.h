// Backward convolutions of the encoder's training step: data gradient (dgrad) and weight gradient (wgrad), CUTLASS
// 2.x implicit GEMM (cp.async + mma.sync, SASS for sm_80 and sm_90), one instantiation per (op, dtype, tile) in its
// own .cu file (dgrad_*.cu, wgrad_*.cu). No CUTLASS header here.
//
// Both take the FORWARD problem p (x: NHWC [n, h, w, c], w: KRSC [k, r, s, c], y: NPQK [n, p(), q(), k]), densely
// packed, fp16 or bf16, fp32 accumulation; dilation 1, cross-correlation, zero padding:
//   dgrad: dx[n, y, x, c] = sum over (k, r, s) with y = p*stride_h + r - pad_h, x = q*stride_w + s - pad_w of
//                           dy[n, p, q, k] * w[k, r, s, c]                   (every element of dx is written)
//   wgrad: dw[k, r, s, c] = sum over (n, p, q) of dy[n, p, q, k] * x[n, p*stride_h + r - pad_h, q*stride_w + s - pad_w, c]
//                           (0 outside the input), written as fp32 (not accumulated into).
// The encoder uses dgrad for its stride-2 convolutions (a stride-1 3x3 data gradient runs as a forward conv with
// flipped, transposed filters, conv_fixup.h) and wgrad for every 3x3 conv; the GEMM K of wgrad is n*p*q (up to
// 2048*16*16), so it splits K in parallel: split_k slices write fp32 partial sums into the workspace, a reduction
// kernel sums them into dw.
#pragma once

#include <cstddef>

#include <cuda_runtime.h>

#include "kernels/conv/conv_fixup.h"  // ConvDType
#include "kernels/conv/conv_problem.h"

namespace kfuse::kernels {

// CTA tile M x N x K (dgrad: M = n*h*w input pixels, N = c; wgrad: M = k, N = r*s*c, K = n*p*q).
//   f16: all three; bf16: k128x64 only.
enum class BackwardTile { k128x128, k128x64, k64x64 };

// --- dgrad ------------------------------------------------------------------------------------------------------
// Host-only check: alignment (c and k multiples of 8), sizes, dtype/tile has an instance.
KFUSE_KERNEL_API bool conv2d_dgrad_can_implement(const Conv2dProblem& problem, ConvDType dtype, BackwardTile tile);
// Device workspace the launch needs (0 if none).
KFUSE_KERNEL_API size_t conv2d_dgrad_workspace_bytes(const Conv2dProblem& problem, ConvDType dtype,
                                                     BackwardTile tile);
// Asynchronous on `stream`. cudaErrorInvalidValue without launching when the problem cannot be implemented, a pointer
// is null or not 16-byte aligned, or the workspace is too small.
KFUSE_KERNEL_API cudaError_t conv2d_dgrad(const Conv2dProblem& problem, ConvDType dtype, BackwardTile tile,
                                          const void* dy, const void* w, void* dx, void* workspace,
                                          size_t workspace_bytes, cudaStream_t stream);

// --- wgrad ------------------------------------------------------------------------------------------------------
// split_k in [1, 256]: slices of the GEMM K (n*p*q).
KFUSE_KERNEL_API bool conv2d_wgrad_can_implement(const Conv2dProblem& problem, ConvDType dtype, BackwardTile tile,
                                                 int split_k);
// Device workspace of the launch: the split_k fp32 partial sums (and whatever else the instance needs).
KFUSE_KERNEL_API size_t conv2d_wgrad_workspace_bytes(const Conv2dProblem& problem, ConvDType dtype,
                                                     BackwardTile tile, int split_k);
// dw: fp32 KRSC [k, r, s, c], 16-byte aligned. Asynchronous on `stream`; same error contract as conv2d_dgrad.
KFUSE_KERNEL_API cudaError_t conv2d_wgrad(const Conv2dProblem& problem, ConvDType dtype, BackwardTile tile,
                                          int split_k, const void* dy, const void* x, float* dw, void* workspace,
                                          size_t workspace_bytes, cudaStream_t stream);

}  // namespace kfuse::kernels
