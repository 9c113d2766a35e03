// Plain C++ launchers for the CUTLASS implicit-GEMM conv fprop kernels. Deliberately free of CUTLASS headers so
// that only the two kernel TUs pay CUTLASS's compile cost.
//
// Layouts: activations X are NHWC, the filter W is KRSC (K output channels, R x S taps, C input channels), the
// output D and the source C are NPQK. All fp16, densely packed, accumulation in fp32.
//   D = alpha * conv(X, W) + beta * C      (cross-correlation, zero padding, dilation 1, groups 1)
// C may be nullptr when beta == 0.
#pragma once

#include <cstddef>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#define KFUSE_KERNEL_API __attribute__((visibility("default")))

namespace kfuse::kernels {

struct Conv2dProblem {
  int n = 0, h = 0, w = 0, c = 0;
  int k = 0, r = 0, s = 0;
  int pad_h = 0, pad_w = 0;
  int stride_h = 1, stride_w = 1;

  // Output extents; 0 when the (padded) input is smaller than the filter or the stride is not positive.
  int p() const { return out_extent(h, pad_h, r, stride_h); }
  int q() const { return out_extent(w, pad_w, s, stride_w); }

 private:
  static int out_extent(int in, int pad, int filt, int stride) {
    const int span = in + 2 * pad - filt;  // checked before dividing: negative spans must not round to 0
    return (stride > 0 && span >= 0) ? span / stride + 1 : 0;
  }
};

// Each *_can_implement is a host-only check of the problem (no CUDA calls). Each launcher returns
// cudaErrorInvalidValue without launching when *_can_implement is false, when a required pointer is null or not
// 16-byte aligned, or when the workspace is too small; otherwise the result of the launch. The launch is
// asynchronous on `stream`.

// CUTLASS 3.x Hopper kernel (TMA im2col + wgmma), SASS for sm_90a only: needs a compute capability 9.0 device.
// Limits: C % 8 == 0, K % 8 == 0 (16-byte TMA rows), stride in [1, 8], and padding / filter extents inside the
// TMA im2col corner and offset ranges (roughly padding <= 127, R, S <= 255).
KFUSE_KERNEL_API bool conv2d_fprop_f16_sm90_can_implement(const Conv2dProblem& problem);
KFUSE_KERNEL_API size_t conv2d_fprop_f16_sm90_workspace_bytes(const Conv2dProblem& problem);
KFUSE_KERNEL_API cudaError_t conv2d_fprop_f16_sm90(const Conv2dProblem& problem, const __half* x, const __half* w,
                                                   const __half* c, __half* d, float alpha, float beta,
                                                   void* workspace, size_t workspace_bytes, cudaStream_t stream);

// CUTLASS 2.x Ampere kernel (cp.async + mma.sync), SASS for sm_80 and sm_90: runs on compute capability 8.x / 9.x.
// Limits: C % 8 == 0, K % 8 == 0, R, S <= 32, every tensor < 2 GiB.
KFUSE_KERNEL_API bool conv2d_fprop_f16_sm80_can_implement(const Conv2dProblem& problem);
KFUSE_KERNEL_API size_t conv2d_fprop_f16_sm80_workspace_bytes(const Conv2dProblem& problem);
KFUSE_KERNEL_API cudaError_t conv2d_fprop_f16_sm80(const Conv2dProblem& problem, const __half* x, const __half* w,
                                                   const __half* c, __half* d, float alpha, float beta,
                                                   void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace kfuse::kernels
