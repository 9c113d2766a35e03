// Conversions between the network's storage types (fp16, bf16) and fp32 (single values, packed pairs and 16-byte
// vectors of 8), the m16n8k16 tensor-core product, and PyTorch's NaN-keeping ReLU, shared by the encoder's
// hand-written kernels. The rounding rules are host-callable too: tests/cpp/test_numeric_rules.cu checks the packed
// forms against the scalar ones on the CPU.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace kfuse::kernels {

template <class T>
__host__ __device__ inline float to_f(T v);
template <>
__host__ __device__ inline float to_f<__half>(__half v) { return __half2float(v); }
template <>
__host__ __device__ inline float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <class T>
__host__ __device__ inline T to_t(float v);
template <>
__host__ __device__ inline __half to_t<__half>(float v) { return __float2half_rn(v); }
template <>
__host__ __device__ inline __nv_bfloat16 to_t<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// The low 16 bits of b as a T, in fp32.
template <class T>
__host__ __device__ __forceinline__ float bits_to_f(uint32_t b) {
  if constexpr (std::is_same_v<T, __half>)
    return __half2float(__ushort_as_half(static_cast<unsigned short>(b)));
  else
  {
    const uint32_t u = (b & 0xffffu) << 16;  // bf16 -> fp32 is exact: the high half
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
  }
}

template <class T>
__host__ __device__ __forceinline__ uint32_t t_bits(T v) {
  if constexpr (std::is_same_v<T, __half>)
    return __half_as_ushort(v);
  else
    return __bfloat16_as_ushort(v);
}

// A packed pair of T (lo at the lower address) in fp32, and back: two round-to-nearest conversions (as to_t<T>) in
// one cvt.rn.{f16,bf16}x2.
template <class T>
__host__ __device__ __forceinline__ float2 pair_to_f2(uint32_t bits) {
  return make_float2(bits_to_f<T>(bits), bits_to_f<T>(bits >> 16));
}
template <class T>
__host__ __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

// 8 consecutive T of a 16-byte vector in fp32, and back.
template <class T>
__host__ __device__ __forceinline__ void unpack8(const uint4& u, float (&f)[8]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = pair_to_f2<T>(w[i]);
    f[2 * i] = p.x, f[2 * i + 1] = p.y;
  }
}
template <class T>
__host__ __device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  return make_uint4(pack2<T>(f[0], f[1]), pack2<T>(f[2], f[3]), pack2<T>(f[4], f[5]), pack2<T>(f[6], f[7]));
}

// The next value above `bits`, a finite 16-bit float of T (fp16 or bf16 bits; +-0 -> the smallest positive).
__host__ __device__ __forceinline__ uint32_t next_up_bits(uint32_t bits) {
  if ((bits & 0x7fffu) == 0) return 1u;
  return (bits & 0x8000u) ? bits - 1 : bits + 1;
}

// T(post + v) of a pair of values v (after a ReLU where there is one), where a positive v never stores T(post): the next value
// above it instead (faithful rounding, within one ulp). Then v > 0 <=> stored > T(post), exactly, and a backward reads
// the ReLU's decision from the stored sum alone (fixup_epilogue.h does the same for conv1's h2 = relu(.) + b2a; the
// squeeze-excite for the next block's a = relu(.) + b1a). post == 0 stores T(v): the decision is then T(v) > 0.
template <class T>
__host__ __device__ __forceinline__ uint32_t pack2_after_relu(float lo, float hi, float post) {
  const uint32_t post_bits = t_bits<T>(to_t<T>(post));
  const float v[2] = {lo, hi};
  uint32_t out = 0;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    uint32_t b = t_bits<T>(to_t<T>(post + v[k]));
    // Compared as values (+0 == -0), as fixup_epilogue.h does: a post below half of T's smallest subnormal stores as
    // -0 or +0, and a positive v whose sum rounds to the other zero must be bumped too (stored > T(post) again).
    if (post != 0.0f && v[k] > 0.0f && bits_to_f<T>(b) == bits_to_f<T>(post_bits)) b = next_up_bits(post_bits);
    out |= b << (16 * k);
  }
  return out;
}
// The same for 8 values as one 16-byte vector.
template <class T>
__host__ __device__ __forceinline__ uint4 pack8_after_relu(const float (&v)[8], float post) {
  return make_uint4(pack2_after_relu<T>(v[0], v[1], post), pack2_after_relu<T>(v[2], v[3], post),
                    pack2_after_relu<T>(v[4], v[5], post), pack2_after_relu<T>(v[6], v[7], post));
}

// --- packed pairs -------------------------------------------------------------------------------------------------
// The same rules as above, two values per instruction where the hardware has one. For the fused kernels' epilogues,
// which run once per image as straight-line code on 8 warps per SM: there their instruction count is their time.

// A packed pair of T as the intrinsics' pair type, and back.
template <class T>
using t2_of = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
template <class T>
__host__ __device__ __forceinline__ t2_of<T> as_t2(uint32_t bits) {
  t2_of<T> v;
  memcpy(&v, &bits, 4);
  return v;
}
template <class T>
__host__ __device__ __forceinline__ uint32_t t2_bits(t2_of<T> v) {
  uint32_t bits;
  memcpy(&bits, &v, 4);
  return bits;
}

// PyTorch's NaN-keeping ReLU in one instruction (max.NaN: NaN if either operand is NaN).
__host__ __device__ __forceinline__ float relu_nan(float v) {
#ifdef __CUDA_ARCH__
  float r;
  asm("max.NaN.f32 %0, %1, 0f00000000;" : "=f"(r) : "f"(v));
  return r;
#else
  return v != v ? v : (v > 0.0f ? v : 0.0f);
#endif
}
// pack2(relu_keep_nan(lo), relu_keep_nan(hi)) as the rounding, then the NaN-keeping ReLU of the pair (the same
// values; a negative input may store -0 instead of +0).
template <class T>
__host__ __device__ __forceinline__ uint32_t relu_pack2(float lo, float hi) {
  return t2_bits<T>(__hmax2_nan(as_t2<T>(pack2<T>(lo, hi)), as_t2<T>(0u)));
}

// pack2_after_relu's constants for `post`, both halves: T(post), the next value above it, and whether the rule
// applies at all (post != 0).
struct FaithfulPost {
  float post;
  uint32_t post2, up2, active;
};
template <class T>
__host__ __device__ __forceinline__ FaithfulPost faithful_post(float post) {
  const uint32_t b = t_bits<T>(to_t<T>(post)), up = next_up_bits(b);
  return {post, b | (b << 16), up | (up << 16), post != 0.0f ? 0xffffffffu : 0u};
}
// pack2_after_relu(v.lo, v.hi, f.post) for a pair v of T (packed: the ReLU's rounded output).
template <class T>
__host__ __device__ __forceinline__ uint32_t pack2_after_relu_t2(uint32_t v, const FaithfulPost& f) {
  const float2 vf = pair_to_f2<T>(v);
  const uint32_t r = pack2<T>(f.post + vf.x, f.post + vf.y);
  const uint32_t m = __heq2_mask(as_t2<T>(r), as_t2<T>(f.post2)) & __hgt2_mask(as_t2<T>(v), as_t2<T>(0u)) & f.active;
  return (r & ~m) | (f.up2 & m);
}
// pack2_after_relu(lo, hi, f.post) for fp32 values.
template <class T>
__host__ __device__ __forceinline__ uint32_t pack2_after_relu_f2(float lo, float hi, const FaithfulPost& f) {
  const uint32_t r = pack2<T>(f.post + lo, f.post + hi);
  const uint32_t pos = (lo > 0.0f ? 0xffffu : 0u) | (hi > 0.0f ? 0xffff0000u : 0u);
  const uint32_t m = __heq2_mask(as_t2<T>(r), as_t2<T>(f.post2)) & pos & f.active;
  return (r & ~m) | (f.up2 & m);
}

// conv1's FixUp epilogue for a pair of accumulators, as the fused block kernels store conv2's input: h = T(relu(acc +
// pre)), then T(h + post.post), faithful where h > 0 (the training forward's pass computes the same from stored h).
template <class T>
__host__ __device__ __forceinline__ uint32_t relu_post_pair(float acc0, float acc1, float pre, const FaithfulPost& post) {
  return pack2_after_relu_t2<T>(relu_pack2<T>(acc0 + pre, acc1 + pre), post);
}

// The squeeze-excite's join of 8 channels, as the fused block kernels store it: o = T(v * scale + shift) (affine1's
// rule), y = relu(o * gate + identity) as T, and the next block's a = T(y + post.post), faithful where y > 0
// (pack2_after_relu's rule). v, identity: 16-byte vectors of 8 T; gate: the 8 channels' gates.
template <class T>
__host__ __device__ __forceinline__ void excite_join8(const uint4& v, const uint4& identity, const float* gate,
                                                      float scale, float shift, const FaithfulPost& post, uint4& y,
                                                      uint4& a_next) {
  const uint32_t vw[4] = {v.x, v.y, v.z, v.w}, iw[4] = {identity.x, identity.y, identity.z, identity.w};
  uint32_t yw[4], aw[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const float2 v2 = pair_to_f2<T>(vw[u]), i2 = pair_to_f2<T>(iw[u]);
    const float2 o2 = pair_to_f2<T>(pack2<T>(fmaf(v2.x, scale, shift), fmaf(v2.y, scale, shift)));
    const float y0 = relu_nan(fmaf(o2.x, gate[2 * u], i2.x)), y1 = relu_nan(fmaf(o2.y, gate[2 * u + 1], i2.y));
    yw[u] = pack2<T>(y0, y1);
    aw[u] = pack2_after_relu_f2<T>(y0, y1, post);
  }
  y = make_uint4(yw[0], yw[1], yw[2], yw[3]);
  a_next = make_uint4(aw[0], aw[1], aw[2], aw[3]);
}

// A raw convolution output v (in fp32) -> T(v * scale + shift), returned in fp32: one fp32 fma, one round-to-nearest
// to T. This is conv2's FixUp epilogue o = acc * scale + b2b as the training step's readers of o apply it instead of a
// pass over conv2's output; the squeeze-excite kernels, forward (fast and generic) and backward, use only this rule
// (here or through affine8), so they all see the same o.
template <class T>
__host__ __device__ __forceinline__ float affine1(float v, float scale, float shift) {
  return to_f(to_t<T>(fmaf(v, scale, shift)));
}
// The same for a 16-byte vector of 8 T (pack8 rounds to nearest as to_t does).
template <class T>
__host__ __device__ __forceinline__ uint4 affine8(const uint4& v, float scale, float shift) {
  float f[8];
  unpack8<T>(v, f);
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = fmaf(f[i], scale, shift);
  return pack8<T>(f);
}

// D += A * B, m16n8k16 (row-major A, column-major B), fp32 accumulators.
template <class T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>)
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// acc + w . m over 4 lanes of fp32, in order (the squeeze-excite's fc layers).
__device__ __forceinline__ float dot4(float4 w, float4 m, float acc) {
  acc = fmaf(w.x, m.x, acc);
  acc = fmaf(w.y, m.y, acc);
  acc = fmaf(w.z, m.z, acc);
  return fmaf(w.w, m.w, acc);
}

// torch.relu keeps NaN (fmaxf would turn it into 0).
__host__ __device__ inline float relu_keep_nan(float v) { return v != v ? v : fmaxf(v, 0.f); }

}  // namespace kfuse::kernels
