// cuDNN's graph API (runtime fusion) for the training step: a convolution with its FixUp epilogue, and a data
// gradient with the ReLU-mask backward, each as ONE cuDNN kernel. cuDNN's legacy API cannot fuse, so where the tuner
// picks cuDNN the training step paid a memory-bound pass after each of these convolutions (fixup_epilogue_pass,
// relu_mask_backward: ~0.4 ms per step at batch 2048).
//
//   conv_relu:  h  = relu(conv(x, w) + b1b)                    (T; the ReLU mask the backward reads: h > 0)
//               h2 = h + b2a                                   (T; conv2's input, zero padding kept by conv2)
//   dgrad_mask: dh = scale * conv^T(dy, w)                     (conv2's data gradient; dy = dL/do)
//               d_pre = h > 0 ? dh : 0                         (T, rows of `pitch` elements: [d_pre | dz] layouts)
//               sums[c] = sum of dh[..., c], sums[C + c] = sum of d_pre[..., c]   (fp32; d b2a and d b1b per channel)
// b1b, b2a and scale are device scalars (fp32), read at run time: the launches can be captured in CUDA graphs and
// replayed after the optimizer changed them. Same problem convention as cudnn_conv.h (the FORWARD problem p, NHWC,
// KRSC filters, fp16 or bf16 with fp32 accumulation). The data gradient is for stride 1 only.
//
// The sums are cuDNN's fused reductions, which may add partial sums in a run-dependent order (atomics): d b2a and
// d b1b can differ in the last bits from step to step (the training step is not bit-reproducible; inference never
// uses these graphs). Reduction_attributes::set_is_deterministic would ask for a fixed order; not set, because it
// is untested whether the runtime-fusion engines still support the graph then.
//
// cuDNN compiles these kernels at run time (NVRTC, ~0.5 s per candidate plan): cudnn_fused_prepare builds the graph,
// times its first few plans on scratch data and keeps the fastest, once per (op, problem, dtype, pitch) and process.
// It must not run inside a stream capture; the launches may.
#pragma once

#include <cstddef>
#include <string>

#include <cuda_runtime.h>

#include "kernels/conv/conv_fixup.h"  // ConvDType
#include "kernels/conv/conv_problem.h"

namespace kfuse::kernels {

enum class CudnnFusedOp { kConvRelu, kDgradMask };

// Builds and tunes the op (synchronizes the device). False, with the reason in `why`, when kfuse was built without
// cuDNN's graph API headers, cuDNN is unavailable, or no engine supports the op on this device.
bool cudnn_fused_prepare(CudnnFusedOp op, const Conv2dProblem& p, ConvDType dtype, int pitch = 0,
                         std::string* why = nullptr);

// Launches (asynchronous on `stream`). cudaErrorNotSupported when the op was not prepared successfully.
cudaError_t cudnn_fused_conv_relu(const Conv2dProblem& p, ConvDType dtype, const void* x, const void* w,
                                  const float* b1b, const float* b2a, void* h, void* h2, cudaStream_t stream);
cudaError_t cudnn_fused_dgrad_mask(const Conv2dProblem& p, ConvDType dtype, const void* dy, const void* w,
                                   const float* scale, const void* h, void* d_pre, int pitch, float* sums,
                                   cudaStream_t stream);

}  // namespace kfuse::kernels
