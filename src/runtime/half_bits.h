// Host-side conversions between float and the 16-bit storage types of the kernels (fp16 / bf16 bit patterns),
// round to nearest even, for packing weights and filling or checking device buffers.
#pragma once

#include <cstdint>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/conv/conv_fixup.h"  // ConvDType

namespace kfuse {

inline uint16_t float_to_bits(float f, kernels::ConvDType dt) {
  uint16_t b;
  if (dt == kernels::ConvDType::kF16) {
    const __half h = __float2half_rn(f);
    std::memcpy(&b, &h, 2);
  } else {
    const __nv_bfloat16 h = __float2bfloat16_rn(f);
    std::memcpy(&b, &h, 2);
  }
  return b;
}

inline float bits_to_float(uint16_t b, kernels::ConvDType dt) {
  if (dt == kernels::ConvDType::kF16) {
    __half_raw r;
    r.x = b;
    return __half2float(__half(r));
  }
  __nv_bfloat16_raw r;
  r.x = b;
  return __bfloat162float(__nv_bfloat16(r));
}

}  // namespace kfuse
