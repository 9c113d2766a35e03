// The squeeze and fc1 of a squeeze-excite folded into the dense GEMM of the block's conv2 (encoder_kernels.h
// launch_squeeze_projection, SqueezeExciteArgs::pre_hidden).
//
// Why. In the last block at batch 128 the squeeze-excite is a serial chain of phases behind one barrier each (o, the
// squeeze, fc1, fc2, the excite, the NCHW store); its phase stamps (PERF.md session 28) put the squeeze and fc1 at
// ~0.45 us each of its ~4.8. Both are linear in conv2's raw output, and conv2 there is one dense GEMM over the
// flattened image (dense_conv.h): fc1's pre-activations are then 32 more output columns of that GEMM (2048 -> 2080
// rows of the unrolled filter; nvjet's 48-row tiles already cover 2080 with the same CTA count), computed while conv2
// runs, and the squeeze-excite starts at fc2.
//
// Made once per weight set (the prepared filters' remake, which a training step triggers too), not per forward: one
// thread per (filter column, 4 hidden units), summing over the Ho*Wo output pixels and K output channels in a fixed
// order (the same bits every time).
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/encoder/encoder_kernels.h"
#include "kernels/encoder/numeric.cuh"

namespace kfuse::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerThread = 4;  // hidden units per thread: each Wd load serves 4 of them

// Thread (col, group of kRowsPerThread hidden units): Wbar[k][col] * po_count summed from Wd as it goes, times w1's
// rows (the same address across the warp: one broadcast load each). The k loop unrolled by 4: 16 independent Wd loads
// in flight per thread.
template <class T>
__global__ void __launch_bounds__(kThreads) squeeze_projection_kernel(const SqueezeProjectionArgs a) {
  const int j0 = blockIdx.y * kRowsPerThread;
  const int col = blockIdx.x * kThreads + threadIdx.x;
  const T* wd = static_cast<const T*>(a.wd);
  const int rows = min(kRowsPerThread, a.hidden - j0);
  if (col < a.kd) {
    float acc[kRowsPerThread] = {};
#pragma unroll 4
    for (int k = 0; k < a.k; ++k) {
      float s = 0.f;  // Wbar[k][col] * po_count
      for (int po = 0; po < a.po_count; ++po) s += to_f(wd[(int64_t(po) * a.k + k) * a.kd + col]);
#pragma unroll
      for (int r = 0; r < kRowsPerThread; ++r)
        if (r < rows) acc[r] = fmaf(__ldg(a.w1 + int64_t(j0 + r) * a.k + k), s, acc[r]);
    }
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r)
      if (r < rows) static_cast<T*>(a.proj)[int64_t(j0 + r) * a.kd + col] = to_t<T>(acc[r] / float(a.po_count));
  }
  if (blockIdx.x == 0 && threadIdx.x < 32) {  // w1's row sums: lane-strided, then a fixed butterfly
    for (int r = 0; r < rows; ++r) {
      const float* w1 = a.w1 + int64_t(j0 + r) * a.k;
      float s = 0.f;
      for (int k = threadIdx.x; k < a.k; k += 32) s += w1[k];
      for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
      if (threadIdx.x == 0) a.rowsum[j0 + r] = s;
    }
  }
}

}  // namespace

cudaError_t launch_squeeze_projection(const SqueezeProjectionArgs& a, ConvDType dtype, cudaStream_t stream) {
  if (!a.wd || !a.w1 || !a.proj || !a.rowsum || a.po_count < 1 || a.k < 1 || a.kd < 1 || a.hidden < 1 ||
      a.hidden > 65535)
    return cudaErrorInvalidValue;
  const dim3 grid(unsigned((a.kd + kThreads - 1) / kThreads), unsigned((a.hidden + kRowsPerThread - 1) / kRowsPerThread));
  if (dtype == ConvDType::kF16)
    squeeze_projection_kernel<__half><<<grid, kThreads, 0, stream>>>(a);
  else
    squeeze_projection_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace kfuse::kernels
