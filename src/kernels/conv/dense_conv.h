// Convolutions of images so small that every output pixel sees (nearly) every input pixel, as one dense GEMM over
// the flattened images. The filter is unrolled into a [Ho*Wo*K][H*W*C] matrix (zero where a tap falls outside the
// filter), and the zero padding an implicit GEMM multiplies through costs nothing:
//   y[n][po][k] = sum over (q, c) of Wd[po][k][q][c] x[n][q][c],   Wd[po][k][q][c] = w[k][r][s][c] with
//   (r, s) = q - po * stride + pad when inside the filter, else 0.
// The encoder's last block (2x2 images, 3x3 filters, pad 1): every (po, q) pair is a real tap, 4 of each output's 9
// taps: 2.25x fewer multiply-adds than the implicit GEMM. Worth it where H * W <= R * S.
//
// GEMMs by cuBLAS (fp32 accumulation) on a per-device handle, each call with the caller's stream and workspace (two
// streams of one graph may run dense convolutions at the same time). The unrolled filter is built in the workspace
// per call (a gather, ~5 us for the 2048 x 2048 one).
#pragma once

#include <cstddef>

#include <cuda_runtime.h>

#include "kernels/conv/conv_fixup.h"  // ConvDType
#include "kernels/conv/conv_problem.h"

namespace kfuse::kernels {

// Whether the dense formulation runs p: H * W <= R * S (no more multiply-adds than the implicit GEMM), C and K
// multiples of 8, groups and dilation 1 (Conv2dProblem's), the unrolled filter within 256 MiB.
bool dense_conv_can_implement(const Conv2dProblem& p, ConvDType dtype);

// y (NHWC T, no epilogue) = conv(x, w); w KRSC T.
size_t dense_conv_fprop_workspace_bytes(const Conv2dProblem& p, ConvDType dtype);
cudaError_t dense_conv_fprop(const Conv2dProblem& p, ConvDType dtype, const void* x, const void* w, void* y,
                             void* workspace, size_t workspace_bytes, cudaStream_t stream);

// The same from a filter unrolled ahead of time: dense_conv_fprop's gather (~5 us for the 2048 x 2048 filter, as long
// as the GEMM itself at batch 128) done once per weight set by the caller (the inference forward keeps the unrolled
// filters of its weights). wd: dense_conv_unrolled_filter_bytes of T, 16-byte aligned; the fprop's workspace is
// cuBLAS's only.
size_t dense_conv_unrolled_filter_bytes(const Conv2dProblem& p, ConvDType dtype);
// run_flag: where non-null, the kernel returns at once unless *run_flag != 0 (a weight repack that runs only when the
// parameters changed).
cudaError_t dense_conv_unroll_filter(const Conv2dProblem& p, ConvDType dtype, const void* w, void* wd,
                                     cudaStream_t stream, const unsigned* run_flag = nullptr);
// extra_rows: wd holds that many more rows after the unrolled filter's Ho*Wo*K (the caller's: e.g. the squeeze
// projection of encoder_kernels.h), and y's image rows are Ho*Wo*K + extra_rows long, the extra outputs last.
// (Ho*Wo*K + extra_rows) % 8 == 0.
size_t dense_conv_fprop_unrolled_workspace_bytes(const Conv2dProblem& p, ConvDType dtype);
cudaError_t dense_conv_fprop_unrolled(const Conv2dProblem& p, ConvDType dtype, const void* x, const void* wd, void* y,
                                      void* workspace, size_t workspace_bytes, cudaStream_t stream,
                                      int extra_rows = 0);

// dw (KRSC fp32) = the weight gradient of y = conv(x, w) for dL/dy = dy (NHWC T).
size_t dense_conv_wgrad_workspace_bytes(const Conv2dProblem& p, ConvDType dtype);
cudaError_t dense_conv_wgrad(const Conv2dProblem& p, ConvDType dtype, const void* dy, const void* x, float* dw,
                             void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace kfuse::kernels
