// Conversions between the network's storage types (fp16, bf16) and fp32, and PyTorch's NaN-keeping ReLU, shared by
// the encoder's hand-written kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace kfuse::kernels {

template <class T>
__device__ inline float to_f(T v);
template <>
__device__ inline float to_f<__half>(__half v) { return __half2float(v); }
template <>
__device__ inline float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <class T>
__device__ inline T to_t(float v);
template <>
__device__ inline __half to_t<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ inline __nv_bfloat16 to_t<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// torch.relu keeps NaN (fmaxf would turn it into 0).
__device__ inline float relu_keep_nan(float v) { return v != v ? v : fmaxf(v, 0.f); }

}  // namespace kfuse::kernels
