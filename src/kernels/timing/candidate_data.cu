// Random fills and output comparison for tuning (candidate_data.h). Memory-bound grid-stride kernels; the
// comparison reduces per CTA in fp64 and adds the partial sums with fp64 atomics (the order does not matter: the
// result is compared with a tolerance, never bit-for-bit).
#include "kernels/timing/candidate_data.h"

#include <algorithm>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace kfuse::kernels {
namespace {

constexpr int kThreads = 256;

// A 32-bit integer hash (lowbias32, Wellons): well mixed, so that consecutive indices give independent values.
__device__ __forceinline__ uint32_t mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

__device__ __forceinline__ float load_value(const void* p, ValueType t, size_t i) {
  switch (t) {
    case ValueType::kF16: return __half2float(static_cast<const __half*>(p)[i]);
    case ValueType::kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

__global__ void fill_uniform_kernel(void* dst, size_t elems, ValueType t, float scale, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < elems; i += size_t(gridDim.x) * blockDim.x) {
    const uint32_t h = mix(uint32_t(i) ^ mix(seed ^ uint32_t(i >> 32) * 0x9e3779b9u));
    const float u = (float(h >> 8) + 0.5f) * (1.0f / 16777216.0f);  // (0, 1)
    const float v = (2.0f * u - 1.0f) * scale;
    switch (t) {
      case ValueType::kF16: static_cast<__half*>(dst)[i] = __float2half_rn(v); break;
      case ValueType::kBF16: static_cast<__nv_bfloat16*>(dst)[i] = __float2bfloat16_rn(v); break;
      default: static_cast<float*>(dst)[i] = v; break;
    }
  }
}

__global__ void convert_kernel(const void* src, ValueType t, size_t elems, float* dst) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < elems; i += size_t(gridDim.x) * blockDim.x)
    dst[i] = load_value(src, t, i);
}

__global__ void compare_kernel(const void* out, ValueType t, const float* ref, size_t elems, double* result) {
  double err = 0, norm = 0, bad = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < elems; i += size_t(gridDim.x) * blockDim.x) {
    const float o = load_value(out, t, i), r = ref[i];
    if (!isfinite(o)) {
      bad += 1;
      continue;
    }
    const double d = double(o) - double(r);
    err += d * d;
    norm += double(r) * double(r);
  }
  __shared__ double part[3][kThreads / 32];
  for (int off = 16; off > 0; off >>= 1) {
    err += __shfl_down_sync(0xffffffffu, err, off);
    norm += __shfl_down_sync(0xffffffffu, norm, off);
    bad += __shfl_down_sync(0xffffffffu, bad, off);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) part[0][warp] = err, part[1][warp] = norm, part[2][warp] = bad;
  __syncthreads();
  if (threadIdx.x < 3) {
    double s = 0;
    for (int w = 0; w < kThreads / 32; ++w) s += part[threadIdx.x][w];
    atomicAdd(result + threadIdx.x, s);
  }
}

unsigned grid_for(size_t elems) {
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const size_t blocks = std::min<size_t>((elems + kThreads - 1) / kThreads, size_t(std::max(sms, 1)) * 8);
  return unsigned(std::max<size_t>(1, blocks));
}

}  // namespace

cudaError_t fill_uniform(void* dst, size_t elems, ValueType type, float scale, uint32_t seed, cudaStream_t stream) {
  if (!dst) return cudaErrorInvalidValue;
  if (elems == 0) return cudaSuccess;
  fill_uniform_kernel<<<grid_for(elems), kThreads, 0, stream>>>(dst, elems, type, scale, seed);
  return cudaGetLastError();
}

cudaError_t convert_to_f32(const void* src, ValueType type, size_t elems, float* dst, cudaStream_t stream) {
  if (!src || !dst) return cudaErrorInvalidValue;
  if (elems == 0) return cudaSuccess;
  convert_kernel<<<grid_for(elems), kThreads, 0, stream>>>(src, type, elems, dst);
  return cudaGetLastError();
}

cudaError_t compare_with_reference(const void* out, ValueType type, const float* ref, size_t elems, double* result,
                                   cudaStream_t stream) {
  if (!out || !ref || !result) return cudaErrorInvalidValue;
  if (cudaError_t e = cudaMemsetAsync(result, 0, 3 * sizeof(double), stream); e != cudaSuccess) return e;
  if (elems == 0) return cudaSuccess;
  compare_kernel<<<grid_for(elems), kThreads, 0, stream>>>(out, type, ref, elems, result);
  return cudaGetLastError();
}

}  // namespace kfuse::kernels
