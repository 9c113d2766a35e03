// Weight gradient of the encoder's first-block convolutions on Hopper: a hand-written wgmma kernel for 3x3, stride-1,
// pad-1 convolutions with 64 input and 64 output channels on small images (block 1: 16 x 16 maps at batch 2048, where
// cuDNN's weight gradient runs at ~40% of the tensor rate).
//
//   dw[k, r, s, c] = sum over (n, p, q) of dy[n, p, q, k] * x[n, p + r - 1, q + s - 1, c]   (0 outside the input)
//
// x NHWC [n, h, w, 64] and dy NPQK [n, h, w, 64], densely packed, fp16 or bf16; dw fp32 KRSC [64][3][3][64], written
// (not accumulated into). fp32 accumulation in a fixed order: the result is bitwise reproducible.
//
// Why a kernel of its own: CUTLASS 4.2's Hopper convolutions have no split-K or persistent schedule (the builder
// refuses them for conv), and this GEMM's output is one 64 x 576 tile while its K is n*h*w = 524288. Here each CTA
// owns whole images: it keeps x (with a zero halo) and dy of one image in shared memory, so every tap's im2col is an
// address offset of x, and accumulates the whole 64 x 576 gradient in registers over its images (one warpgroup per
// filter row r, the three taps s as three m64n64k16 MMAs sharing dy's fragment); a second small kernel sums the
// per-CTA partials in CTA order.
#pragma once

#include <cstddef>
#include <string>

#include <cuda_runtime.h>

#include "kernels/conv/conv_fixup.h"  // ConvDType
#include "kernels/conv/conv_problem.h"

namespace kfuse::kernels {

// Host-only: whether the kernel runs problem p on the current device (compute capability 9.0, sm_90a SASS); if not,
// the reason in *why.
KFUSE_KERNEL_API bool wgrad_wgmma_can_implement(const Conv2dProblem& p, ConvDType dtype, std::string* why = nullptr);
// The per-CTA partial sums (fp32), one 64 x 576 gradient per CTA of the current device's grid.
KFUSE_KERNEL_API size_t wgrad_wgmma_workspace_bytes(const Conv2dProblem& p, ConvDType dtype);
// Asynchronous on `stream`. cudaErrorInvalidValue without launching when the problem cannot be implemented, a pointer
// is null or not 16-byte aligned, or the workspace is too small.
KFUSE_KERNEL_API cudaError_t wgrad_wgmma(const Conv2dProblem& p, ConvDType dtype, const void* dy, const void* x,
                                         float* dw, void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace kfuse::kernels
