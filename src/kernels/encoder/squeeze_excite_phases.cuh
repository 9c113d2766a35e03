// The squeeze-excite kernels' shared pieces (squeeze_excite.cu): the launch geometry, the warp reduce-scatter and the
// fast kernel's phases (squeeze, fc1, fc2, excite, the NCHW write), each a device function of its own. The reasons
// for this shape are at the top of squeeze_excite.cu.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/encoder/encoder_kernels.h"
#include "kernels/encoder/numeric.cuh"

namespace kfuse::kernels::se_phases {

// 1024 threads: one CTA per SM (the fast kernel's registers fill the file), so the block itself keeps the loads in
// flight.
constexpr int kThreads = 1024;
constexpr int kMaxVectorsPerThread = 2;      // fast kernel: o / identity vectors cached in registers per thread
constexpr size_t kDefaultSmem = 48 * 1024;    // dynamic shared memory without the opt-in

// Lane-group reduce-scatter. The lanes that differ only in bits kOff, kOff/2, ..., 1 (a group of 2 kOff lanes) each
// hold N values; value i is to be summed over the group. While a lane carries more than NOUT = max(1, N / (2 kOff))
// values, each butterfly step halves them (the lane with the step's bit set keeps the upper half: one shuffle per value
// kept instead of one per value and step); the remaining bits are summed whole. out[i] is then the group total of value
// Scatter::base(lane) + i, and every lane that differs only in Scatter::kWhole bits holds the same bits. Fixed pairing,
// so the result depends only on the inputs.
__host__ __device__ constexpr int scatter_whole(int n, int off, int nout) {
  int m = 0;
  for (; off >= 1; off >>= 1)
    if (n > nout) n /= 2;
    else m |= off;
  return m;
}

template <int N, int kOff>
struct Scatter {
  static constexpr int kLanes = 2 * kOff > 1 ? 2 * kOff : 1;
  static constexpr int kOut = N > kLanes ? N / kLanes : 1;
  static_assert((N & (N - 1)) == 0 && (kLanes & (kLanes - 1)) == 0, "powers of two");
  __device__ static int base(int lane) {
    int b = 0, n = N;
#pragma unroll
    for (int off = kOff; off >= 1; off >>= 1)
      if (n > kOut) n /= 2, b += (lane & off) ? n : 0;
    return b;
  }
  static constexpr int kWhole = scatter_whole(N, kOff, kOut);  // the bits summed whole
};

template <int N, int NOUT, int OFF>
__device__ __forceinline__ void reduce_scatter(const float (&v)[N], float (&out)[NOUT], int lane) {
  if constexpr (OFF < 1) {
    static_assert(N == NOUT, "");
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = v[i];
  } else if constexpr (N == NOUT) {
    float w[N];
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = v[i] + __shfl_xor_sync(0xffffffffu, v[i], OFF);
    reduce_scatter<N, NOUT, OFF / 2>(w, out, lane);
  } else {
    constexpr int kHalf = N / 2;
    float w[kHalf];
    const bool upper = (lane & OFF) != 0;
#pragma unroll
    for (int k = 0; k < kHalf; ++k) {
      const float send = upper ? v[k] : v[k + kHalf];
      const float keep = upper ? v[k + kHalf] : v[k];
      w[k] = keep + __shfl_xor_sync(0xffffffffu, send, OFF);
    }
    reduce_scatter<kHalf, NOUT, OFF / 2>(w, out, lane);
  }
}

// --- the fast kernels: shared geometry and phases ------------------------------------------------------------------
//
// G images per CTA, P in {64, 128, 256, 512}, hidden H = P / 16. Per CTA, o and the identity are [G*hw][P] of T
// (contiguous), handled as 16-byte vectors of 8 channels: vector v is row v / (P/8), channels 8 (v % (P/8)) ...
template <int P, int G>
struct Geo {
  static constexpr int H = P / 16;                 // hidden units
  static constexpr int C4 = P / 4, C8 = P / 8;     // float4 / 8-channel vectors per row
  static constexpr int kPairs = G * P / 2;         // squeeze: column pairs of the CTA
  static constexpr int S = kThreads / kPairs;      // squeeze: row slices per column pair
  static constexpr int S1 = (C4 + 31) / 32;        // fc1: float4 columns per lane
  static constexpr int F2 = H / 4;                 // fc2: float4 per output channel = lanes per channel
  static constexpr int K2 = (P * F2 + kThreads - 1) / kThreads;  // fc2: float4 per thread
  using Scatter1 = Scatter<G, 16>;
  using Scatter2 = Scatter<G * K2, F2 / 2>;
  static_assert(P % 64 == 0 && H <= 32 && H % 4 == 0, "P in {64, 128, 256, 512}");
  static_assert(kThreads % kPairs == 0 && S >= 1, "G * P <= 2 * kThreads, powers of two");
  static_assert((P * F2) % 32 == 0 && (P * F2 <= kThreads || (P * F2) % kThreads == 0), "fc2 mapping");
  static_assert(G >= 1 && G <= 32 && (G & (G - 1)) == 0, "G a power of two");
};

// Squeeze: o_pairs is the CTA's o in shared memory ([G*hw][P/2] pairs of T). Thread (slice s, column pair) sums rows
// s, s + S, ... of one image's column pair; the S slice sums are added in slice order (deterministic). Columns of
// images past the last (ge < G) read as 0. Writes mean[G][P]; contains a barrier when S > 1 (all threads call it).
template <class T, int P, int G>
__device__ __forceinline__ void squeeze_means(const uint32_t* o_pairs, float* colpart, float* mean, int hw, int ge) {
  using Gm = Geo<P, G>;
  const int t = threadIdx.x;
  const int pair = t % Gm::kPairs, s = t / Gm::kPairs;
  const int g = pair / (P / 2), cp = pair % (P / 2);  // column 2 cp of image g; g * P + 2 cp == 2 pair
  float2 acc = make_float2(0.f, 0.f);
  if (g < ge) {
    const uint32_t* col = o_pairs + size_t(g) * hw * (P / 2) + cp;
#pragma unroll 4
    for (int i = s; i < hw; i += Gm::S) {
      const float2 f = pair_to_f2<T>(col[i * (P / 2)]);
      acc.x += f.x;
      acc.y += f.y;
    }
  }
  if constexpr (Gm::S == 1) {
    reinterpret_cast<float2*>(mean)[pair] = make_float2(acc.x / float(hw), acc.y / float(hw));
  } else {
    reinterpret_cast<float2*>(colpart)[s * Gm::kPairs + pair] = acc;
    __syncthreads();
    if (t < G * P) {
      float sum = 0.f;
#pragma unroll
      for (int k = 0; k < Gm::S; ++k) sum += colpart[k * G * P + t];
      mean[t] = sum / float(hw);
    }
  }
}

// Four consecutive fc weights from `w` (fp32, or T when kWT) as one float4: element index 4 i.
template <class T, bool kWT, bool kGlobal>
__device__ __forceinline__ float4 load_w4(const void* w, int i) {
  if constexpr (kWT) {
    const uint2* p = static_cast<const uint2*>(w) + i;
    const uint2 u = kGlobal ? __ldg(p) : *p;
    const float2 lo = pair_to_f2<T>(u.x), hi = pair_to_f2<T>(u.y);
    return make_float4(lo.x, lo.y, hi.x, hi.y);
  } else {
    const float4* p = static_cast<const float4*>(w) + i;
    return kGlobal ? __ldg(p) : *p;
  }
}

// fc1 + ReLU. Warp w < H holds row (w + rot) % H of w1, lane l the float4 columns l, l + 32, ... (conflict-free
// reads of the means); all G images at once, one reduce-scatter over the warp.
template <int P, int G>
__device__ __forceinline__ void fc1(const float4 (&w1r)[Geo<P, G>::S1], float b1r, const float* mean, float* hid,
                                    int rot) {
  using Gm = Geo<P, G>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (warp >= Gm::H) return;  // warp-uniform
  float acc[G];
#pragma unroll
  for (int g = 0; g < G; ++g) acc[g] = 0.f;
#pragma unroll
  for (int s = 0; s < Gm::S1; ++s) {
    const int col4 = lane + 32 * s;
    if (Gm::C4 % 32 == 0 || col4 < Gm::C4) {
#pragma unroll
      for (int g = 0; g < G; ++g) acc[g] = dot4(w1r[s], reinterpret_cast<const float4*>(mean + g * P)[col4], acc[g]);
    }
  }
  float h[1];
  reduce_scatter<G, 1, 16>(acc, h, lane);
  if ((lane & Gm::Scatter1::kWhole) == 0)
    hid[Gm::Scatter1::base(lane) * Gm::H + (warp + rot) % Gm::H] = relu_nan(h[0] + b1r);
}

// fc1's weights of this thread: row (warp + rot) % H of w1 (zeros for warps >= H); w1 fp32, or T when kWT.
template <class T, int P, int G, bool kWT, bool kGlobal>
__device__ __forceinline__ void load_w1(const void* w1, const float* b1, float4 (&w1r)[Geo<P, G>::S1], float& b1r,
                                        int rot) {
  using Gm = Geo<P, G>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool on = warp < Gm::H;
  const int j = (warp + rot) % Gm::H;
  const int row4 = (on ? j : 0) * Gm::C4;
#pragma unroll
  for (int s = 0; s < Gm::S1; ++s) {
    const int col4 = lane + 32 * s;
    w1r[s] = on && (Gm::C4 % 32 == 0 || col4 < Gm::C4) ? load_w4<T, kWT, kGlobal>(w1, row4 + col4)
                                                         : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  b1r = on ? (kGlobal ? __ldg(b1 + j) : b1[j]) : 0.f;
}

// fc2's weights of this thread (w2 fp32, or T when kWT): float4s f = t + k kThreads of w2 (channel f / F2, columns
// 4 (t % F2) ...: contiguous across the warp; t = the thread index with the warps rotated by rot), and b2 of the
// channels it will write (fc2).
template <class T, int P, int G, bool kWT, bool kGlobal>
__device__ __forceinline__ void load_w2(const void* w2, const float* b2, float4 (&w2r)[Geo<P, G>::K2],
                                        float (&b2r)[Geo<P, G>::Scatter2::kOut], int rot) {
  using Gm = Geo<P, G>;
  const int t = (threadIdx.x + 32 * rot) & (kThreads - 1);  // whole warps rotated: lanes unchanged
#pragma unroll
  for (int k = 0; k < Gm::K2; ++k) {
    const int f = t + k * kThreads;
    w2r[k] = f < P * Gm::F2 ? load_w4<T, kWT, kGlobal>(w2, f) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  const int base2 = Gm::Scatter2::base(t & 31);
#pragma unroll
  for (int i = 0; i < Gm::Scatter2::kOut; ++i) {
    const int f = t + ((base2 + i) % Gm::K2) * kThreads;
    b2r[i] = f < P * Gm::F2 ? (kGlobal ? __ldg(b2 + f / Gm::F2) : b2[f / Gm::F2]) : 0.f;
  }
}

// fc2 + sigmoid. The F2 lanes of a channel each dot one float4 of its weights with the hidden units, for every image
// and k; a reduce-scatter over those lanes leaves each lane Scatter2::kOut finished (image, k) sums.
template <int P, int G>
__device__ __forceinline__ void fc2(const float4 (&w2r)[Geo<P, G>::K2], const float (&b2r)[Geo<P, G>::Scatter2::kOut],
                                    const float* hid, float* gate, int rot) {
  using Gm = Geo<P, G>;
  constexpr int K2 = Gm::K2, F2 = Gm::F2;
  const int t = (threadIdx.x + 32 * rot) & (kThreads - 1), lane = t & 31;  // as in load_w2
  if (t >= P * F2 * K2) return;  // warp-uniform; only threads past the last channel when K2 == 1
  float part[G * K2];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const float4 h4 = reinterpret_cast<const float4*>(hid + g * Gm::H)[t % F2];
#pragma unroll
    for (int k = 0; k < K2; ++k) part[g * K2 + k] = dot4(w2r[k], h4, 0.f);
  }
  float tot[Gm::Scatter2::kOut];
  reduce_scatter<G * K2, Gm::Scatter2::kOut, F2 / 2>(part, tot, lane);
  if ((lane & Gm::Scatter2::kWhole) != 0) return;
  const int base2 = Gm::Scatter2::base(lane);
#pragma unroll
  for (int i = 0; i < Gm::Scatter2::kOut; ++i) {
    const int j = base2 + i, g = j / K2, f = t + (j % K2) * kThreads;
    if (f < P * F2) gate[g * P + f / F2] = 1.f / (1.f + __expf(-(tot[i] + b2r[i])));
  }
}

// Excite and join of vector v: y = relu(o * gate + identity) -> y, a_next = y + nb1a (global, T; faithful where y > 0)
// and, for the NCHW
// output, the stage ([G*hw][P], fp32 or T).
template <class T, int P, int G>
__device__ __forceinline__ void excite_vector(const SqueezeExciteArgs& a, int64_t base, int v, int hw, uint4 o8,
                                              uint4 id8, const float* gate, float nb1a, void* stage) {
  constexpr int C8 = P / 8;
  const int row = v / C8, c0 = (v % C8) * 8;
  const float4* gp = reinterpret_cast<const float4*>(gate + (G == 1 ? 0 : row / hw) * P + c0);
  const float4 g0 = gp[0], g1 = gp[1];
  const float gv[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
  float of[8], idf[8], y[8];
  unpack8<T>(o8, of);
  unpack8<T>(id8, idf);
#pragma unroll
  for (int e = 0; e < 8; ++e) y[e] = relu_nan(fmaf(of[e], gv[e], idf[e]));
  if (a.y) reinterpret_cast<uint4*>(static_cast<T*>(a.y) + base)[v] = pack8<T>(y);
  if (a.a_next) reinterpret_cast<uint4*>(static_cast<T*>(a.a_next) + base)[v] = pack8_after_relu<T>(y, nb1a);
  if (a.out_nchw) {
    if (a.out_f32) {
      float4* d = reinterpret_cast<float4*>(static_cast<float*>(stage) + size_t(row) * P + c0);
      d[0] = make_float4(y[0], y[1], y[2], y[3]);
      d[1] = make_float4(y[4], y[5], y[6], y[7]);
    } else {
      reinterpret_cast<uint4*>(stage)[v] = pack8<T>(y);
    }
  }
}

// NCHW output from the stage: the CTA's images are one contiguous range of ge * P * hw elements (P % 16 == 0 and a
// 16-byte aligned out_nchw keep every 16-byte vector aligned); element e = (g * P + c) * hw + i is stage[g*hw + i][c].
template <class T, int P>
__device__ __forceinline__ void write_nchw(const SqueezeExciteArgs& a, int64_t base, int hw, int ge, const void* stage) {
  const int total = ge * P * hw, chw = P * hw, t = threadIdx.x;
  if (a.out_f32) {
    const float* st = static_cast<const float*>(stage);
    float4* out = reinterpret_cast<float4*>(static_cast<float*>(a.out_nchw) + base);
    for (int e0 = t * 4; e0 < total; e0 += kThreads * 4) {
      int g = e0 / chw, c = (e0 - g * chw) / hw, i = e0 - g * chw - c * hw;
      float r[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        r[u] = st[(g * hw + i) * P + c];
        if (++i == hw) {
          i = 0;
          if (++c == P) c = 0, ++g;
        }
      }
      out[e0 / 4] = make_float4(r[0], r[1], r[2], r[3]);
    }
  } else {
    const T* st = static_cast<const T*>(stage);
    uint4* out = reinterpret_cast<uint4*>(static_cast<T*>(a.out_nchw) + base);
    for (int e0 = t * 8; e0 < total; e0 += kThreads * 8) {
      int g = e0 / chw, c = (e0 - g * chw) / hw, i = e0 - g * chw - c * hw;
      float r[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        r[u] = to_f(st[(g * hw + i) * P + c]);
        if (++i == hw) {
          i = 0;
          if (++c == P) c = 0, ++g;
        }
      }
      out[e0 / 8] = pack8<T>(r);
    }
  }
}

}  // namespace kfuse::kernels::se_phases
