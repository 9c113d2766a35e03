// The transpose of the strided shortcut's 3x3, stride-2, pad-1 average pool (count_include_pad: its 1 / 9 lives in
// the packed filter, PackKind::kPooled), applied to a gradient on the pooled grid: pixel (r, c) of an h x w image
// receives the sum of g at every pooled (r', c') whose window covers it, |2r' - r| <= 1 and |2c' - c| <= 1: 1, 2 or 4
// pooled pixels. The pooled grid is ((h + 1) / 2) x ((w + 1) / 2), as the stride-2 conv's output.
#pragma once

#include <cstdint>

#include "kernels/encoder/numeric.cuh"

namespace kfuse::kernels {

// d[0..7] += the pool transpose of g (NHWC [n][ph][pw][p] of T) at pixel i (row-major) of image img, channels
// c0 .. c0 + 7. g's loads are 16 bytes; at most 4 of them.
template <class T>
__device__ __forceinline__ void add_pool_transpose8(const void* g, int64_t img, int i, int h, int w, int p, int c0,
                                                    float (&d)[8]) {
  const int ph = (h + 1) >> 1, pw = (w + 1) >> 1;
  const int r = i / w, c = i - r * w;
  const int r0 = r >> 1, r1 = min((r + 1) >> 1, ph - 1), q0 = c >> 1, q1 = min((c + 1) >> 1, pw - 1);
  const T* base = static_cast<const T*>(g) + img * ph * pw * p + c0;
  for (int rr = r0; rr <= r1; ++rr)
    for (int qq = q0; qq <= q1; ++qq) {
      float v[8];
      unpack8<T>(__ldg(reinterpret_cast<const uint4*>(base + (int64_t(rr) * pw + qq) * p)), v);
#pragma unroll
      for (int j = 0; j < 8; ++j) d[j] += v[j];
    }
}

}  // namespace kfuse::kernels
