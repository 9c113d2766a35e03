// Reading the stem's input (fp32, fp16, bf16 or uint8, any strides) four horizontally adjacent pixels of one channel
// at a time, as the space-to-depth of the forward stem (stem.cu) and its backward (stem_backward.cu) consume it.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace kfuse::kernels {

// The 4 dx values of one (pixel, unit) are kept as sizeof(E) 32-bit words (fp32: 4, fp16 / bf16: 2, uint8: 1), element
// dx at bits 8 * sizeof(E) * dx of the little-endian concatenation: exactly what one aligned vector load returns.
template <class E>
constexpr int kRawWords = int(sizeof(E));

template <class E>
__device__ __forceinline__ void load_raw_vec(const E* p, uint32_t (&w)[kRawWords<E>]) {  // p aligned to 4 elements
  if constexpr (sizeof(E) == 4) {
    const uint4 r = __ldg(reinterpret_cast<const uint4*>(p));
    w[0] = r.x, w[1] = r.y, w[2] = r.z, w[3] = r.w;
  } else if constexpr (sizeof(E) == 2) {
    const uint2 r = __ldg(reinterpret_cast<const uint2*>(p));
    w[0] = r.x, w[1] = r.y;
  } else {
    w[0] = __ldg(reinterpret_cast<const unsigned int*>(p));
  }
}

template <class E>
__device__ __forceinline__ void load_raw_strided(const E* p, int64_t stride, uint32_t (&w)[kRawWords<E>]) {
  if constexpr (sizeof(E) == 4) {
#pragma unroll
    for (int dx = 0; dx < 4; ++dx) w[dx] = __ldg(reinterpret_cast<const unsigned int*>(p + dx * stride));
  } else if constexpr (sizeof(E) == 2) {
    const unsigned short* p16 = reinterpret_cast<const unsigned short*>(p);
#pragma unroll
    for (int i = 0; i < 2; ++i)
      w[i] = uint32_t(__ldg(p16 + 2 * i * stride)) | (uint32_t(__ldg(p16 + (2 * i + 1) * stride)) << 16);
  } else {
    const unsigned char* p8 = reinterpret_cast<const unsigned char*>(p);
    w[0] = uint32_t(__ldg(p8)) | (uint32_t(__ldg(p8 + stride)) << 8) | (uint32_t(__ldg(p8 + 2 * stride)) << 16) |
           (uint32_t(__ldg(p8 + 3 * stride)) << 24);
  }
}

template <class E>
__device__ __forceinline__ float raw_elem(const uint32_t (&w)[kRawWords<E>], int dx) {  // dx: compile-time after unroll
  if constexpr (std::is_same_v<E, float>) {
    return __uint_as_float(w[dx]);
  } else if constexpr (std::is_same_v<E, __half>) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(w[dx >> 1] >> (16 * (dx & 1)))));
  } else if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    return __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(w[dx >> 1] >> (16 * (dx & 1)))));
  } else {
    return static_cast<float>((w[0] >> (8 * dx)) & 0xffu);
  }
}

}  // namespace kfuse::kernels
