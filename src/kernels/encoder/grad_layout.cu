// Gradient layout kernels of the training step (weight_layout.h): the weight gradients from the kernels' KRSC sums
// into PyTorch's layouts in the flat fp32 gradient buffer (~20 MB out, one launch from its own job table), with the
// dot products that give fixup_scale's gradient; and an identity block's data gradient with its sum.
#include "kernels/encoder/weight_layout.h"

#include <atomic>
#include <cstring>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/encoder/numeric.cuh"
#include "kernels/shared_memory_ptx.cuh"

namespace kfuse::kernels {
namespace {

constexpr int kThreads = 256;
// CTAs per job, also the number of dot-product partial sums per job. The jobs differ 64x in size (block 1's
// 64 x 64 x 9 filter to block 4's 512 x 512 x 9): with 64 CTAs, block 4's conv2 gave each thread 16 (k, c) pairs of
// 9 dependent loads, and the whole finalize took 99 us (H200) for ~40 MB of traffic. 512 gives it 2 pairs per
// thread; the small jobs' surplus CTAs find no pair and exit at once.
constexpr int kGradCtasPerJob = 512;

// ---- weight gradients ----------------------------------------------------------------------------------------------

template <class T>
__device__ inline float block_sum(float v, float* smem) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = 0.f;
  if (warp == 0) {
    v = lane < int(blockDim.x / 32) ? smem[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  __syncthreads();
  return v;  // valid in thread 0
}

template <class T>
__device__ __forceinline__ float grad_at(const GradJob& j, int64_t i) {
  return j.g_is_t ? to_f<T>(static_cast<const T*>(j.g)[i]) : static_cast<const float*>(j.g)[i];
}

template <class T>
__global__ void __launch_bounds__(kThreads) grad_finalize_kernel(const GradJob* jobs, float* partials) {
  __shared__ float smem[kThreads / 32];
  const GradJob j = jobs[blockIdx.y];
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  float dot = 0.f;
  if (j.kind == 0 && j.r * j.s == 9) {
    // 3x3 filters (every job of the encoder): one (k, c) pair per thread, its nine taps loaded first (the reads
    // g[k][rs][c] are coalesced across the warp, c consecutive), then staged in shared memory so that the warp writes
    // its 32 pairs' 288 contiguous floats dst[k][c][rs] with coalesced stores. (A thread storing its own nine taps
    // wrote with a 36-byte stride: 9x the L2 write requests, 45 us for the network on H100 where ~13 us moves the
    // bytes; walking dst element by element before that took 164 us.)
    __shared__ float stage[kThreads * 9];
    const float alpha = j.alpha ? *j.alpha : 1.0f;
    const int64_t pairs = int64_t(j.k) * j.c;
    const int lane = threadIdx.x % 32;
    float* warp_stage = stage + (threadIdx.x - lane) * 9;
    for (int64_t i0 = int64_t(blockIdx.x) * blockDim.x; i0 < pairs; i0 += stride) {  // uniform per CTA
      const int64_t i = i0 + threadIdx.x;
      if (i < pairs) {
        const int64_t c = i % j.c, k = i / j.c;
        float g[9];
#pragma unroll
        for (int rs = 0; rs < 9; ++rs) g[rs] = grad_at<T>(j, (k * 9 + rs) * j.c + c);
        if (j.dot_w) {
          float w[9];
#pragma unroll
          for (int rs = 0; rs < 9; ++rs) w[rs] = to_f<T>(static_cast<const T*>(j.dot_w)[(k * 9 + rs) * j.c + c]);
#pragma unroll
          for (int rs = 0; rs < 9; ++rs) dot += w[rs] * g[rs];
        }
#pragma unroll
        for (int rs = 0; rs < 9; ++rs) warp_stage[lane * 9 + rs] = alpha * g[rs];  // stride 9: no bank conflicts
      }
      __syncwarp();
      const int64_t first = (i0 + threadIdx.x - lane) * 9, end = pairs * 9;
#pragma unroll
      for (int e = lane; e < 32 * 9; e += 32)
        if (first + e < end) j.dst[first + e] = warp_stage[e];
      __syncwarp();
    }
  } else if (j.kind == 0) {
    const float alpha = j.alpha ? *j.alpha : 1.0f;
    const int64_t pairs = int64_t(j.k) * j.c, rs_n = int64_t(j.r) * j.s;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < pairs; i += stride) {
      const int64_t c = i % j.c, k = i / j.c;
      float* out = j.dst + i * rs_n;
      for (int64_t rs = 0; rs < rs_n; ++rs) {
        const int64_t gi = (k * rs_n + rs) * j.c + c;
        const float g = grad_at<T>(j, gi);
        out[rs] = alpha * g;
        if (j.dot_w) dot += to_f<T>(static_cast<const T*>(j.dot_w)[gi]) * g;
      }
    }
  } else {
    const int64_t n = int64_t(j.k) * j.c;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
      const int64_t c = i % j.c, k = i / j.c;
      float s = 0.f;
      for (int t = 0; t < 9; ++t) s += grad_at<T>(j, (k * 9 + t) * j.c + c);
      j.dst[i] = s / 9.0f;
    }
  }
  if (j.dot_w == nullptr) return;  // uniform per CTA
  dot = block_sum<T>(dot, smem);
  if (threadIdx.x == 0) partials[blockIdx.y * kGradCtasPerJob + blockIdx.x] = dot;
}

__global__ void dot_reduce_kernel(const GradJob* jobs, const float* partials) {
  const GradJob j = jobs[blockIdx.x];
  if (j.dot_w == nullptr) return;
  float v = 0.f;
  for (int i = threadIdx.x; i < kGradCtasPerJob; i += 32) v += partials[blockIdx.x * kGradCtasPerJob + i];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x == 0) *j.dst_dot = v;
}

constexpr int kAddCtas = 256;

template <class T>
__global__ void __launch_bounds__(kThreads) add_and_sum_kernel(const uint4* a, const uint4* b, uint4* out,
                                                               int64_t vectors, float* partials) {
  __shared__ float smem[kThreads / 32];
  float sum = 0.f;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < vectors; i += int64_t(gridDim.x) * blockDim.x) {
    uint4 va = a[i], vb = b[i], vo;
    const T* ta = reinterpret_cast<const T*>(&va);
    const T* tb = reinterpret_cast<const T*>(&vb);
    T* to = reinterpret_cast<T*>(&vo);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float fa = to_f<T>(ta[e]);
      sum += fa;
      to[e] = to_t<T>(fa + to_f<T>(tb[e]));
    }
    out[i] = vo;
  }
  sum = block_sum<T>(sum, smem);
  if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

__global__ void sum_partials_kernel(const float* partials, int count, float* out) {
  float v = 0.f;
  for (int i = threadIdx.x; i < count; i += 32) v += partials[i];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x == 0) *out = v;
}

}  // namespace

size_t grad_finalize_workspace_bytes(int count) { return size_t(count > 0 ? count : 0) * kGradCtasPerJob * 4; }

cudaError_t launch_grad_finalize(const GradJob* jobs, int count, ConvDType dtype, void* workspace,
                                 cudaStream_t stream) {
  if (count <= 0 || jobs == nullptr || workspace == nullptr || count > 65535) return cudaErrorInvalidValue;
  auto* partials = static_cast<float*>(workspace);
  const dim3 grid(kGradCtasPerJob, count);
  if (dtype == ConvDType::kF16)
    grad_finalize_kernel<__half><<<grid, kThreads, 0, stream>>>(jobs, partials);
  else
    grad_finalize_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(jobs, partials);
  dot_reduce_kernel<<<count, 32, 0, stream>>>(jobs, partials);
  return cudaGetLastError();
}

size_t add_and_sum_workspace_bytes(int64_t) { return kAddCtas * sizeof(float); }

cudaError_t launch_add_and_sum(const void* a, const void* b, void* out, int64_t n, float* sum_a, ConvDType dtype,
                               void* workspace, cudaStream_t stream) {
  if (!a || !b || !out || !sum_a || !workspace || n <= 0 || n % 8) return cudaErrorInvalidValue;
  auto* partials = static_cast<float*>(workspace);
  const auto* va = static_cast<const uint4*>(a);
  const auto* vb = static_cast<const uint4*>(b);
  auto* vo = static_cast<uint4*>(out);
  if (dtype == ConvDType::kF16)
    add_and_sum_kernel<__half><<<kAddCtas, kThreads, 0, stream>>>(va, vb, vo, n / 8, partials);
  else
    add_and_sum_kernel<__nv_bfloat16><<<kAddCtas, kThreads, 0, stream>>>(va, vb, vo, n / 8, partials);
  sum_partials_kernel<<<1, 32, 0, stream>>>(partials, kAddCtas, sum_a);
  return cudaGetLastError();
}

}  // namespace kfuse::kernels
