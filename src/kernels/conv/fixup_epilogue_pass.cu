// The FixUp epilogue as a memory-bound pass (fixup_epilogue_pass.h): 16-byte vectors of 8 elements, grid-stride.
#include "kernels/conv/fixup_epilogue_pass.h"

#include <algorithm>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/encoder/numeric.cuh"

namespace kfuse::kernels {
namespace {

// The next value above `bits` (a finite 16-bit float), as fixup_epilogue.h's next_up.
__device__ __forceinline__ uint32_t next_up_bits(uint32_t bits) {
  if ((bits & 0x7fffu) == 0) return 1u;  // +-0 -> smallest positive
  return (bits & 0x8000u) ? bits - 1 : bits + 1;
}

template <class T>
__global__ void __launch_bounds__(256) fixup_epilogue_kernel(uint4* y, size_t vecs, const float* alpha_p,
                                                             const float* pre_p, const float* post_p, bool relu) {
  const float alpha = alpha_p ? *alpha_p : 1.0f;
  const float pre = pre_p ? *pre_p : 0.0f;
  const float post = post_p ? *post_p : 0.0f;
  const uint32_t post_bits = t_bits<T>(to_t<T>(post));
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < vecs; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 in = y[i];
    uint32_t w[4] = {in.x, in.y, in.z, in.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t out = 0;
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        float v = alpha * bits_to_f<T>((w[j] >> (16 * k)) & 0xffffu) + pre;
        if (relu && v < 0.0f) v = 0.0f;  // NaN passes, as torch.relu
        uint32_t b = t_bits<T>(to_t<T>(post + v));
        if (post != 0.0f && v > 0.0f && b == post_bits) b = next_up_bits(b);
        out |= b << (16 * k);
      }
      w[j] = out;
    }
    y[i] = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

}  // namespace

cudaError_t fixup_epilogue_inplace(void* y, size_t count, ConvDType dtype, const FixupEpilogue& e,
                                   cudaStream_t stream) {
  if (!y || reinterpret_cast<uintptr_t>(y) % 16 != 0 || count % 8 != 0) return cudaErrorInvalidValue;
  const size_t vecs = count / 8;
  if (vecs == 0) return cudaSuccess;
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const unsigned blocks = unsigned(std::min<size_t>((vecs + 255) / 256, size_t(std::max(sms, 1)) * 8));
  if (dtype == ConvDType::kF16)
    fixup_epilogue_kernel<__half><<<blocks, 256, 0, stream>>>(static_cast<uint4*>(y), vecs, e.alpha, e.pre, e.post,
                                                              e.relu);
  else
    fixup_epilogue_kernel<__nv_bfloat16><<<blocks, 256, 0, stream>>>(static_cast<uint4*>(y), vecs, e.alpha, e.pre,
                                                                     e.post, e.relu);
  return cudaGetLastError();
}

}  // namespace kfuse::kernels
