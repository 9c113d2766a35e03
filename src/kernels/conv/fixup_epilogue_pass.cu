// The FixUp epilogue as a memory-bound pass (fixup_epilogue_pass.h): 16-byte vectors of 8 output elements,
// grid-stride; in place over a 16-bit output, or reducing fp32 partial sums of parallel split-K.
#include "kernels/conv/fixup_epilogue_pass.h"

#include <algorithm>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/encoder/numeric.cuh"
#include "kernels/programmatic_launch.h"

namespace kfuse::kernels {
namespace {

// The epilogue's scalars, read once per thread from device memory (nullptr: 1, 0, 0).
template <class T>
struct EpilogueScalars {
  float alpha, pre, post;
  bool relu;
  __device__ EpilogueScalars(const float* alpha_p, const float* pre_p, const float* post_p, bool relu_)
      : alpha(alpha_p ? *alpha_p : 1.0f), pre(pre_p ? *pre_p : 0.0f), post(post_p ? *post_p : 0.0f), relu(relu_) {}

  // post + act(alpha * acc + pre) for 8 values, packed as 8 T; an active ReLU never stores T(post)
  // (fixup_epilogue.h; numeric.cuh pack8_after_relu).
  __device__ uint4 finish(const float (&acc)[8]) const {
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      v[j] = alpha * acc[j] + pre;
      if (relu && v[j] < 0.0f) v[j] = 0.0f;  // NaN passes, as torch.relu
    }
    return pack8_after_relu<T>(v, post);
  }
};

template <class T>
__global__ void __launch_bounds__(256) fixup_epilogue_kernel(uint4* y, size_t vecs, const float* alpha_p,
                                                             const float* pre_p, const float* post_p, bool relu) {
  pdl_wait_for_predecessor();
  pdl_allow_successor();
  const EpilogueScalars<T> e(alpha_p, pre_p, post_p, relu);
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < vecs; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 in = y[i];
    const uint32_t w[4] = {in.x, in.y, in.z, in.w};
    float acc[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] = bits_to_f<T>((w[j / 2] >> (16 * (j % 2))) & 0xffffu);
    y[i] = e.finish(acc);
  }
}

// One thread per 8 outputs: two float4 of every slice, added in slice order.
template <class T>
__global__ void __launch_bounds__(256) fixup_epilogue_reduce_kernel(const float4* partials, int slices,
                                                                    size_t slice_vecs4, uint4* y, size_t vecs,
                                                                    const float* alpha_p, const float* pre_p,
                                                                    const float* post_p, bool relu) {
  pdl_wait_for_predecessor();
  pdl_allow_successor();
  const EpilogueScalars<T> e(alpha_p, pre_p, post_p, relu);
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < vecs; i += size_t(gridDim.x) * blockDim.x) {
    float4 a = partials[2 * i], b = partials[2 * i + 1];
    for (int s = 1; s < slices; ++s) {
      const float4 c = partials[s * slice_vecs4 + 2 * i], d = partials[s * slice_vecs4 + 2 * i + 1];
      a.x += c.x, a.y += c.y, a.z += c.z, a.w += c.w;
      b.x += d.x, b.y += d.y, b.z += d.z, b.w += d.w;
    }
    const float acc[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    y[i] = e.finish(acc);
  }
}

unsigned grid_for(size_t vecs) {
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return unsigned(std::min<size_t>((vecs + 255) / 256, size_t(std::max(sms, 1)) * 8));
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

cudaError_t fixup_epilogue_inplace(void* y, size_t count, ConvDType dtype, const FixupEpilogue& e,
                                   cudaStream_t stream) {
  if (!y || !aligned16(y) || count % 8 != 0) return cudaErrorInvalidValue;
  const size_t vecs = count / 8;
  if (vecs == 0) return cudaSuccess;
  const unsigned blocks = grid_for(vecs);
  auto* y4 = static_cast<uint4*>(y);
  const cudaError_t err =
      dtype == ConvDType::kF16
          ? launch_kernel(fixup_epilogue_kernel<__half>, blocks, 256, 0, stream, true, y4, vecs, e.alpha, e.pre,
                          e.post, e.relu)
          : launch_kernel(fixup_epilogue_kernel<__nv_bfloat16>, blocks, 256, 0, stream, true, y4, vecs, e.alpha,
                          e.pre, e.post, e.relu);
  (void)cudaGetLastError();
  return err;
}

cudaError_t fixup_epilogue_reduce(const float* partials, int slices, size_t slice_stride, void* y, size_t count,
                                  ConvDType dtype, const FixupEpilogue& e, cudaStream_t stream) {
  if (!partials || !y || !aligned16(partials) || !aligned16(y) || count % 8 != 0 || slice_stride % 8 != 0 ||
      slices < 1 || (slices > 1 && slice_stride < count))
    return cudaErrorInvalidValue;
  const size_t vecs = count / 8;
  if (vecs == 0) return cudaSuccess;
  const unsigned blocks = grid_for(vecs);
  const auto* p4 = reinterpret_cast<const float4*>(partials);
  auto* y4 = static_cast<uint4*>(y);
  const size_t stride4 = slice_stride / 4;
  const cudaError_t err =
      dtype == ConvDType::kF16
          ? launch_kernel(fixup_epilogue_reduce_kernel<__half>, blocks, 256, 0, stream, true, p4, slices, stride4, y4,
                          vecs, e.alpha, e.pre, e.post, e.relu)
          : launch_kernel(fixup_epilogue_reduce_kernel<__nv_bfloat16>, blocks, 256, 0, stream, true, p4, slices,
                          stride4, y4, vecs, e.alpha, e.pre, e.post, e.relu);
  (void)cudaGetLastError();
  return err;
}

}  // namespace kfuse::kernels
