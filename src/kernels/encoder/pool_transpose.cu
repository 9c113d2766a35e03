// dx += the average pool's transpose of g (pool_transpose.cuh): where no squeeze-excite backward precedes a block
// with a strided shortcut (the first block of a network whose first stage downsamples), the stem's da gets the
// shortcut's gradient here. One thread per 8 channels of a pixel; memory bound, used off the default network.
#include <algorithm>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/encoder/backward_kernels.h"
#include "kernels/encoder/pool_transpose.cuh"

namespace kfuse::kernels {
namespace {

template <class T>
__global__ void __launch_bounds__(256) add_pool_transpose_kernel(uint4* dx, const void* g, int64_t vectors, int h,
                                                                 int w, int p) {
  const int c8 = p / 8;
  for (int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; v < vectors; v += int64_t(gridDim.x) * blockDim.x) {
    const int64_t pix = v / c8;
    const int c0 = int(v - pix * c8) * 8;
    const int64_t img = pix / (int64_t(h) * w);
    const int i = int(pix - img * h * w);
    float d[8];
    unpack8<T>(dx[v], d);
    add_pool_transpose8<T>(g, img, i, h, w, p, c0, d);
    dx[v] = pack8<T>(d);
  }
}

}  // namespace

cudaError_t launch_add_pool_transpose(void* dx, const void* g, int n, int h, int w, int p, ConvDType dtype,
                                      cudaStream_t stream) {
  if (!dx || !g || n < 1 || h < 1 || w < 1 || p < 8 || p % 8 || (reinterpret_cast<uintptr_t>(dx) & 15) ||
      (reinterpret_cast<uintptr_t>(g) & 15))
    return cudaErrorInvalidValue;
  const int64_t vectors = int64_t(n) * h * w * (p / 8);
  const int ctas = int(std::min<int64_t>((vectors + 255) / 256, 4096));
  if (dtype == ConvDType::kF16)
    add_pool_transpose_kernel<__half><<<ctas, 256, 0, stream>>>(static_cast<uint4*>(dx), g, vectors, h, w, p);
  else
    add_pool_transpose_kernel<__nv_bfloat16><<<ctas, 256, 0, stream>>>(static_cast<uint4*>(dx), g, vectors, h, w, p);
  return cudaGetLastError();
}

}  // namespace kfuse::kernels
