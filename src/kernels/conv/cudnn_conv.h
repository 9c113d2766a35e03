// cuDNN as a provider of convolutions (forward, data and weight gradients), a candidate beside kfuse's CUTLASS
// kernels in the tuner (the forward without kfuse's fused FixUp epilogue: the caller runs that as a separate pass).
// cuDNN's Hopper kernels (sm90 xmma, warp-specialized) are what PyTorch and torch.compile run;
// offering them to the tuner means kfuse is never slower than them on a convolution it leaves unfused.
//
// cuDNN is loaded at run time (dlopen of libcudnn.so.9 and its libcudnn_cnn.so.9 sibling): libkfuse has no link-time
// dependency on it, and inside a PyTorch process it shares the copy PyTorch already loaded. Where it cannot be loaded
// (no library, no GPU, no headers at build time) cudnn_available() says why and no cuDNN candidate is offered.
//
// Same problem convention as conv_backward.h: the FORWARD problem p, NHWC activations, KRSC filters, fp16 or bf16
// storage with fp32 accumulation, cross-correlation, zero padding, dilation 1.
//   fprop: y[n, p, q, k]  = sum x * w  (no epilogue), written in T
//   dgrad: dx[n, h, w, c]  = sum dy * w  (as conv2d_dgrad), written in T
//   wgrad: dw[k, r, s, c]  = sum dy * x  (as conv2d_wgrad), written in T (not fp32: cuDNN's legacy API stores the
//          filter gradient in the filter's type, as PyTorch's fp16 / bf16 convolutions do)
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#if KFUSE_HAVE_CUDNN
#include <cudnn.h>
#endif

#include "kernels/conv/conv_fixup.h"  // ConvDType
#include "kernels/conv/conv_problem.h"

namespace kfuse::kernels {

enum class CudnnConvOp { kFprop, kDgrad, kWgrad };

// Whether cuDNN 9 could be loaded and a handle created on the current device; `why` receives the reason if not.
bool cudnn_available(std::string* why = nullptr);

// The algorithms cuDNN's heuristic offers for the problem (its order, at most `max_count`), each supported with a
// workspace of at most `max_workspace` bytes. Empty when cuDNN is unavailable or supports none.
std::vector<int> cudnn_conv_algorithms(CudnnConvOp op, const Conv2dProblem& p, ConvDType dtype, int max_count = 3,
                                       size_t max_workspace = size_t(1) << 30);

// Device workspace of one algorithm (0 if none); SIZE_MAX when the algorithm does not support the problem.
size_t cudnn_conv_workspace_bytes(CudnnConvOp op, const Conv2dProblem& p, ConvDType dtype, int algo);

// Asynchronous on `stream`. cudaErrorInvalidValue without launching for null pointers or a workspace that is too
// small, cudaErrorNotSupported when cuDNN is unavailable or rejects the call.
cudaError_t cudnn_conv_fprop(const Conv2dProblem& p, ConvDType dtype, int algo, const void* x, const void* w,
                             void* y, void* workspace, size_t workspace_bytes, cudaStream_t stream);
cudaError_t cudnn_conv_dgrad(const Conv2dProblem& p, ConvDType dtype, int algo, const void* dy, const void* w,
                             void* dx, void* workspace, size_t workspace_bytes, cudaStream_t stream);
cudaError_t cudnn_conv_wgrad(const Conv2dProblem& p, ConvDType dtype, int algo, const void* dy, const void* x,
                             void* dw, void* workspace, size_t workspace_bytes, cudaStream_t stream);

// For the graph API's fused operations (kernels/conv/cudnn_fused.h): libcudnn.so.9's dlopen handle (null when cuDNN
// is unavailable), and a call of `fn` with the current device's handle bound to `stream`, under the lock that
// serializes every use of kfuse's cuDNN handles. False when cuDNN is unavailable or `fn` returns false.
void* cudnn_library();
#if KFUSE_HAVE_CUDNN
bool with_cudnn_handle(cudaStream_t stream, const std::function<bool(cudnnHandle_t)>& fn);
#endif

}  // namespace kfuse::kernels
