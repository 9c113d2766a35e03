// Squeeze-excitation and the residual join of one block, one CTA per image: the channel means, both tiny Linear
// layers and the gate stay in shared memory, and o is read twice from L2 (it was just written by conv2), so the
// block's tail costs one pass over o and the identity instead of PyTorch's six kernels.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/encoder/encoder_kernels.h"
#include "kernels/encoder/numeric.cuh"

namespace kfuse::kernels {
namespace {

// 1024 threads: one CTA per image leaves one CTA per SM, so the block itself must keep enough loads in flight.
constexpr int kThreads = 1024;

template <class T>
__global__ void __launch_bounds__(kThreads) squeeze_excite_kernel(const SqueezeExciteArgs a) {
  extern __shared__ float smem[];
  float* mean = smem;               // [p]
  float* gate = smem + a.p;         // [p]
  float* hidden = smem + 2 * a.p;   // [hidden]
  const int img = blockIdx.x;
  const int64_t base = int64_t(img) * a.hw * a.p;
  const T* o = static_cast<const T*>(a.o) + base;
  const T* idt = static_cast<const T*>(a.identity) + base;

  // Squeeze: consecutive threads take consecutive channels (coalesced rows of o); when P < kThreads the spare
  // threads take other rows, and the row slices are summed in a fixed order (deterministic, no atomics).
  float* partial = hidden + a.hidden;  // [slices][p]
  const int slices = a.p >= kThreads ? 1 : kThreads / a.p;
  for (int t = threadIdx.x; t < slices * a.p; t += kThreads) {
    const int c = t % a.p, slice = t / a.p;
    float s = 0.f;
#pragma unroll 4
    for (int i = slice; i < a.hw; i += slices) s += to_f(o[int64_t(i) * a.p + c]);
    partial[slice * a.p + c] = s;
  }
  __syncthreads();
  for (int c = threadIdx.x; c < a.p; c += kThreads) {
    float s = 0.f;
    for (int slice = 0; slice < slices; ++slice) s += partial[slice * a.p + c];
    mean[c] = s / float(a.hw);
  }
  __syncthreads();
  // fc1 + ReLU: one warp per hidden unit.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int j = warp; j < a.hidden; j += kThreads / 32) {
    float s = 0.f;
    for (int c = lane; c < a.p; c += 32) s += a.w1[int64_t(j) * a.p + c] * mean[c];
    for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) hidden[j] = relu_keep_nan(s + a.b1[j]);
  }
  __syncthreads();
  // fc2 + sigmoid.
  for (int c = threadIdx.x; c < a.p; c += kThreads) {
    float s = a.b2[c];
    for (int j = 0; j < a.hidden; ++j) s += a.w2[int64_t(c) * a.hidden + j] * hidden[j];
    gate[c] = 1.f / (1.f + __expf(-s));
  }
  __syncthreads();

  // Excite and join: 8 channels (16 bytes) per step; p % 8 == 0.
  const float nb1a = a.next_b1a ? *a.next_b1a : 0.f;
  const int64_t vectors = int64_t(a.hw) * a.p / 8;
  for (int64_t v = threadIdx.x; v < vectors; v += kThreads) {
    const int64_t e = v * 8;
    const int c0 = int(e % a.p);
    const int i = int(e / a.p);
    alignas(16) T o8[8], id8[8], y8[8], an8[8];
    *reinterpret_cast<uint4*>(o8) = *reinterpret_cast<const uint4*>(o + e);
    *reinterpret_cast<uint4*>(id8) = *reinterpret_cast<const uint4*>(idt + e);
    float y[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      y[k] = relu_keep_nan(to_f(o8[k]) * gate[c0 + k] + to_f(id8[k]));
      y8[k] = to_t<T>(y[k]);
      an8[k] = to_t<T>(y[k] + nb1a);
    }
    if (a.y) *reinterpret_cast<uint4*>(static_cast<T*>(a.y) + base + e) = *reinterpret_cast<const uint4*>(y8);
    if (a.a_next)
      *reinterpret_cast<uint4*>(static_cast<T*>(a.a_next) + base + e) = *reinterpret_cast<const uint4*>(an8);
    if (a.out_nchw) {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const int64_t idx = (int64_t(img) * a.p + c0 + k) * a.hw + i;
        if (a.out_f32)
          static_cast<float*>(a.out_nchw)[idx] = y[k];
        else
          static_cast<T*>(a.out_nchw)[idx] = y8[k];
      }
    }
  }
}

}  // namespace

cudaError_t launch_squeeze_excite(const SqueezeExciteArgs& a, ConvDType dtype, cudaStream_t stream) {
  if (!a.o || !a.identity || !a.w1 || !a.b1 || !a.w2 || !a.b2 || a.n <= 0 || a.hw <= 0 || a.p % 8 || a.hidden <= 0 ||
      (a.a_next && !a.next_b1a) || (!a.y && !a.a_next && !a.out_nchw))
    return cudaErrorInvalidValue;
  const int slices = a.p >= kThreads ? 1 : kThreads / a.p;
  const size_t smem = sizeof(float) * (2 * size_t(a.p) + a.hidden + size_t(slices) * a.p);
  if (smem > 48 * 1024) return cudaErrorInvalidValue;
  if (dtype == ConvDType::kF16)
    squeeze_excite_kernel<__half><<<a.n, kThreads, smem, stream>>>(a);
  else
    squeeze_excite_kernel<__nv_bfloat16><<<a.n, kThreads, smem, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace kfuse::kernels
