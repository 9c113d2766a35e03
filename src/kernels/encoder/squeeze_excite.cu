// Squeeze-excitation and the residual join of one block: the channel means, both tiny Linear layers and the gate stay
// on chip, so the block's tail costs one pass over o and the identity instead of PyTorch's six kernels.
//
// Why this shape. At the hot sizes (N = 128; hw x P = 256x64, 64x128, 16x256, 4x512) an image is 4-32 KB of o, L2
// resident, and the arithmetic is tiny: the time is L2 traffic and latency. The previous kernel (one CTA per image,
// now the generic fallback) paid an L2 round trip in each serial phase and, in block 4, read 128 KB of fp32 FC
// weights per image in dependent, strided loops. The fast kernel (P in {64, 128, 256, 512}, hidden = P/16, at most 2
// 16-byte vectors of o per thread, 48 KB of shared memory) pays one round trip:
//   - every thread issues all its loads at the start: its o vectors, then (behind a barrier, so that all o requests
//     are queued first: the squeeze waits for o alone) its slice of the fc weights and its identity vectors. o and the
//     identity stay in registers for the excite pass (o is read once); the weights go to registers too, with
//     warp-contiguous 16-byte loads (no shared-memory opt-in, no re-reads);
//   - squeeze: o is staged in shared memory as T and summed per column in fixed-order row slices;
//   - fc1: one warp per hidden unit, lane-strided float4 columns; fc2: the H/4 lanes of a channel each hold one float4
//     of its weights; both reduce with a warp reduce-scatter (fewer shuffles than one butterfly per value);
//   - excite from the registers; the NCHW output (block 4) is transposed through shared memory for 16-byte stores.
// Measured on H100 (N = 128, ncu with caches flushed, old -> new): 14.4 -> 7.4, 10.2 -> 5.5, 8.8 -> 5.5,
// 19.4 -> 5.9 us; back to back in a graph (L2 warm): 7.8 -> 4.6, 5.9 -> 3.4, 6.0 -> 3.2, 17.4 -> 4.0 us, against
// 2.4 / 1.0 us for an empty kernel of the same grid. What is left is mostly the L2 bandwidth of the loads (block 4:
// 128 KB of weights per CTA) and, in the phases after them, shared-memory and shuffle instructions queued behind the
// outstanding loads in the load/store pipe. (A variant that loaded everything by TMA bulk copy into shared memory was
// no faster and was dropped.) At P = 512, once N needs several waves, G = 2 or 4 images share a CTA and its weight
// loads. At one image per CTA and P = 512 the fc weights come as T where the caller has them (SqueezeExciteArgs::
// w1_t, w2_t: 64 instead of 128 KB per CTA). Anything else (other P, hidden != P/16, large hw, unaligned pointers)
// takes the generic kernel. Where the caller computed fc1's pre-activations with conv2 (SqueezeExciteArgs::pre_hidden,
// launch_squeeze_projection), the fast kernel skips the squeeze and fc1. No floating-point atomics, fixed reduction orders: the same input gives the same bits.
#include <atomic>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/encoder/encoder_kernels.h"
#include "kernels/encoder/numeric.cuh"
#include "kernels/phase_stamps.cuh"
#include "kernels/programmatic_launch.h"

namespace kfuse::kernels {
namespace {

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

// --- the fast kernel ----------------------------------------------------------------------------------------------

// Shared memory, byte offsets (all 16-byte aligned). stage: o of the CTA as T ([G*hw][P]), later y for the NCHW
// transpose (fp32 or T); colpart: [S][G*P] fp32 (absent when S == 1); mean: [G][P] fp32, then the gate; hid: [G][H].
struct RegLayout {
  size_t stage, colpart, mean, hid, total;
};
template <int P, int G>
__host__ __device__ inline RegLayout reg_layout(int hw, bool out_f32) {
  using Gm = Geo<P, G>;
  auto up16 = [](size_t b) { return (b + 15) / 16 * 16; };
  RegLayout l{};
  l.stage = 0;
  l.colpart = up16(size_t(G) * hw * P * (out_f32 ? 4 : 2));
  l.mean = l.colpart + (Gm::S > 1 ? size_t(Gm::S) * G * P * 4 : 0);
  l.hid = l.mean + size_t(G) * P * 4;
  l.total = l.hid + up16(size_t(G) * Gm::H * 4);
  return l;
}

// V: o / identity vectors per thread, G * hw * P / 8 <= V * kThreads. Every thread issues all its loads up front:
// o first; then, behind a barrier so that every warp's o requests are queued ahead of them (the squeeze waits for o
// alone), its fc weights and its identity vectors. o and the identity stay in registers for the excite pass.
// kWT: the fc weights come from w1_t / w2_t (T) instead of w1 / w2 (fp32).
template <class T, int P, int G, int V, bool kWT>
__global__ void __launch_bounds__(kThreads, 1) squeeze_excite_reg_kernel(const SqueezeExciteArgs a) {
  using Gm = Geo<P, G>;
  extern __shared__ __align__(128) unsigned char smem[];
  KFUSE_PHASES(10);  // development builds only (phase_stamps.cuh)
  KFUSE_STAMP(0, "start");
  pdl_wait_for_predecessor();
  pdl_allow_successor();
  const int hw = a.hw;
  const RegLayout lay = reg_layout<P, G>(hw, a.out_nchw && a.out_f32);
  T* stage = reinterpret_cast<T*>(smem + lay.stage);
  float* colpart = reinterpret_cast<float*>(smem + lay.colpart);
  float* mean = reinterpret_cast<float*>(smem + lay.mean);  // [G][P]; the gate after fc1
  float* hid = reinterpret_cast<float*>(smem + lay.hid);

  const int t = threadIdx.x;
  const int img0 = blockIdx.x * G;
  const int ge = min(G, a.n - img0);  // images of this CTA (the last one may have fewer)
  const int64_t base = int64_t(img0) * hw * P;
  const int64_t obase = G == 1 && a.o_stride ? int64_t(img0) * a.o_stride : base;  // o_stride: one image per CTA
  const int nvec = ge * hw * Gm::C8;
  const uint4* o = reinterpret_cast<const uint4*>(static_cast<const T*>(a.o) + obase);
  const uint4* idt = reinterpret_cast<const uint4*>(static_cast<const T*>(a.identity) + base);

  uint4 ov[V], iv[V];
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int v = t + k * kThreads;
    ov[k] = v < nvec ? __ldg(o + v) : make_uint4(0, 0, 0, 0);
  }
  // With pre_hidden (G == 1), fc1's pre-activation of hidden unit t comes with o (launch_squeeze_projection).
  const bool projected = a.pre_hidden != nullptr;  // uniform
  float pre = 0.f, pre_shift = 0.f, pre_b1 = 0.f;
  if (projected && t < Gm::H) {
    pre = to_f(__ldg(static_cast<const T*>(a.pre_hidden) + obase + t));
    pre_shift = __ldg(a.w1_rowsum + t);
    pre_b1 = __ldg(a.b1 + t);
  }
  float sc = 1.f, sh = 0.f;
  if (a.o_scale) {
    sc = __ldg(a.o_scale), sh = __ldg(a.o_shift);
#pragma unroll
    for (int k = 0; k < V; ++k) ov[k] = affine8<T>(ov[k], sc, sh);
  }
  __syncthreads();
  KFUSE_STAMP(1, "o_issue");
  float4 w1r[Gm::S1], w2r[Gm::K2];
  float b1r = 0.f, b2r[Gm::Scatter2::kOut];
  // The warps' weight rows are rotated by CTA (the sums do not depend on which warp computes them), so that the
  // CTAs, which all read the same weights, spread their requests over the L2 slices.
  const int rot = blockIdx.x & 31;
  if (!projected) load_w1<T, P, G, kWT, true>(kWT ? a.w1_t : a.w1, a.b1, w1r, b1r, rot);
  load_w2<T, P, G, kWT, true>(kWT ? a.w2_t : a.w2, a.b2, w2r, b2r, rot);
  const float nb1a = a.next_b1a ? __ldg(a.next_b1a) : 0.f;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int v = t + k * kThreads;
    iv[k] = v < nvec ? __ldg(idt + v) : make_uint4(0, 0, 0, 0);
  }

#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int v = t + k * kThreads;
    if (v < nvec) reinterpret_cast<uint4*>(stage)[v] = ov[k];
  }
  __syncthreads();
  KFUSE_STAMP(2, "o_arrive");
  if (!projected) {
    squeeze_means<T, P, G>(reinterpret_cast<const uint32_t*>(stage), colpart, mean, hw, ge);
    __syncthreads();
    KFUSE_STAMP(3, "squeeze");
    fc1<P, G>(w1r, b1r, mean, hid, rot);
  } else if (t < Gm::H) {  // fc1(mean(o)) = sc * (x . proj) + sh * rowsum(w1) + b1, o = sc * v + sh
    hid[t] = relu_nan(fmaf(sc, pre, sh * pre_shift) + pre_b1);
  }
  __syncthreads();
  KFUSE_STAMP(4, "fc1");
  fc2<P, G>(w2r, b2r, hid, mean, rot);  // the gate overwrites the means: fc1's reads are behind the barrier
  __syncthreads();
  KFUSE_STAMP(5, "fc2");
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int v = t + k * kThreads;
    if (v < nvec) excite_vector<T, P, G>(a, base, v, hw, ov[k], iv[k], mean, nb1a, stage);
  }
  KFUSE_STAMP(6, "excite");
  if (!a.out_nchw) {
    KFUSE_PRINT_PHASES("se_reg");
    return;
  }
  __syncthreads();
  KFUSE_STAMP(7, "excite_sync");
  write_nchw<T, P>(a, base, hw, ge, stage);
  KFUSE_STAMP(8, "nchw");
  KFUSE_PRINT_PHASES("se_reg");
}

// --- the generic kernel (any P % 8 == 0, any hidden, any hw) --------------------------------------------------------

template <class T>
__global__ void __launch_bounds__(kThreads) squeeze_excite_generic_kernel(const SqueezeExciteArgs a) {
  extern __shared__ float smem_generic[];
  pdl_wait_for_predecessor();
  pdl_allow_successor();
  float* mean = smem_generic;       // [p]
  float* gate = smem_generic + a.p;  // [p]
  float* hidden = smem_generic + 2 * a.p;  // [hidden]
  const int img = blockIdx.x;
  const int64_t base = int64_t(img) * a.hw * a.p;
  const T* o = static_cast<const T*>(a.o) + base;
  const T* idt = static_cast<const T*>(a.identity) + base;

  // Squeeze: consecutive threads take consecutive channels (coalesced rows of o); when P < kThreads the spare
  // threads take other rows, and the row slices are summed in a fixed order (deterministic, no atomics).
  float* partial = hidden + a.hidden;  // [slices][p]
  const int slices = a.p >= kThreads ? 1 : kThreads / a.p;
  const bool raw = a.o_scale != nullptr;
  const float sc = raw ? *a.o_scale : 1.f, sh = raw ? *a.o_shift : 0.f;
  auto o_at = [&](int64_t e) { return raw ? affine1<T>(to_f(o[e]), sc, sh) : to_f(o[e]); };
  for (int t = threadIdx.x; t < slices * a.p; t += kThreads) {
    const int c = t % a.p, slice = t / a.p;
    float s = 0.f;
#pragma unroll 4
    for (int i = slice; i < a.hw; i += slices) s += o_at(int64_t(i) * a.p + c);
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
    float of[8], idf[8], y[8];
    const uint4 o8 = *reinterpret_cast<const uint4*>(o + e);
    unpack8<T>(raw ? affine8<T>(o8, sc, sh) : o8, of);
    unpack8<T>(*reinterpret_cast<const uint4*>(idt + e), idf);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      y[k] = relu_keep_nan(of[k] * gate[c0 + k] + idf[k]);
    }
    if (a.y) *reinterpret_cast<uint4*>(static_cast<T*>(a.y) + base + e) = pack8<T>(y);
    if (a.a_next) *reinterpret_cast<uint4*>(static_cast<T*>(a.a_next) + base + e) = pack8_after_relu<T>(y, nb1a);
    if (a.out_nchw) {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const int64_t idx = (int64_t(img) * a.p + c0 + k) * a.hw + i;
        if (a.out_f32)
          static_cast<float*>(a.out_nchw)[idx] = y[k];
        else
          static_cast<T*>(a.out_nchw)[idx] = to_t<T>(y[k]);
      }
    }
  }
}

// --- dispatch --------------------------------------------------------------------------------------------------------

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// SM count of the current device (cached per device; 132 if the query fails).
int sm_count() {
  static std::atomic<int> cache[64];  // 0 = not queried yet
  int dev = 0, n = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    cudaGetLastError();
    return 132;
  }
  if (dev < 64 && (n = cache[dev].load(std::memory_order_relaxed)) > 0) return n;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) {
    cudaGetLastError();
    return 132;
  }
  if (dev < 64) cache[dev].store(n, std::memory_order_relaxed);
  return n;
}

// Images per CTA at P = 512, where the FC weights (128 KB fp32, re-read by every CTA) dominate the bytes: one image
// per CTA is the fastest per CTA, but once the grid needs several waves, packing images costs less than the extra
// waves. Relative CTA times measured on H100 (P = 512, hw = 4): G = 1 : 2 : 4 ~ 1 : 1.15 : 1.6.
int images_per_cta_512(int n, int sms) {
  constexpr int kG[3] = {1, 2, 4};
  constexpr double kCost[3] = {1.0, 1.15, 1.6};
  int best = 1;
  double best_t = 1e30;
  for (int i = 0; i < 3; ++i) {
    const int ctas = (n + kG[i] - 1) / kG[i];
    const double t = double((ctas + sms - 1) / sms) * kCost[i];
    if (t < best_t) best_t = t, best = kG[i];
  }
  return best;
}

// Register-path fast kernel when its limits hold (<= 2 vectors per thread, default shared memory); false otherwise.
template <class T, int P, int G, bool kWT = false>
bool launch_reg(const SqueezeExciteArgs& a, cudaStream_t stream) {
  const int64_t per_cta = int64_t(G) * a.hw * (P / 8);
  if (per_cta > int64_t(kMaxVectorsPerThread) * kThreads) return false;
  const size_t smem = reg_layout<P, G>(a.hw, a.out_nchw && a.out_f32).total;
  if (smem > kDefaultSmem) return false;
  const int grid = (a.n + G - 1) / G;
  if (per_cta <= kThreads)
    launch_kernel(squeeze_excite_reg_kernel<T, P, G, 1, kWT>, grid, kThreads, smem, stream, true, a);
  else
    launch_kernel(squeeze_excite_reg_kernel<T, P, G, 2, kWT>, grid, kThreads, smem, stream, true, a);
  return true;  // a launch error stays for launch_typed's cudaGetLastError
}

template <class T>
bool launch_fast(const SqueezeExciteArgs& a, cudaStream_t stream) {
  if (a.hidden * 16 != a.p) return false;
  // o strided per image (with fc1's pre-activations): one image per CTA, the only layout the kernel indexes that way.
  const bool strided = a.o_stride != 0 || a.pre_hidden;
  if (strided &&
      (!a.pre_hidden || !a.w1_rowsum || !a.o_scale || !a.o_shift || a.o_stride < int64_t(a.hw) * a.p ||
       a.o_stride % 8 != 0 || !aligned16(a.pre_hidden)))
    return false;
  if (!aligned16(a.o) || !aligned16(a.identity) || !aligned16(a.w1) || !aligned16(a.w2) ||
      (a.y && !aligned16(a.y)) || (a.a_next && !aligned16(a.a_next)) || (a.out_nchw && !aligned16(a.out_nchw)))
    return false;
  switch (a.p) {
    case 64: return launch_reg<T, 64, 1>(a, stream);
    case 128: return launch_reg<T, 128, 1>(a, stream);
    case 256: return launch_reg<T, 256, 1>(a, stream);
    case 512: {
      // One image per CTA with the weights in T where given (the inference forward at batch 128 and below: 128 KB
      // of fp32 weights per CTA were most of that kernel's time); each falls back to fewer images when hw is too
      // large.
      const int g = strided ? 1 : images_per_cta_512(a.n, sm_count());
      if (g == 1 && a.w1_t && a.w2_t && aligned16(a.w1_t) && aligned16(a.w2_t))
        return launch_reg<T, 512, 1, true>(a, stream);
      return (g >= 4 && launch_reg<T, 512, 4>(a, stream)) || (g >= 2 && launch_reg<T, 512, 2>(a, stream)) ||
             launch_reg<T, 512, 1>(a, stream);
    }
    default: return false;
  }
}

template <class T>
cudaError_t launch_typed(const SqueezeExciteArgs& a, cudaStream_t stream) {
  if (launch_fast<T>(a, stream)) return cudaGetLastError();
  if (a.o_stride != 0 || a.pre_hidden) return cudaErrorInvalidValue;  // the fast kernel's layouts only
  const int slices = a.p >= kThreads ? 1 : kThreads / a.p;
  const size_t smem = sizeof(float) * (2 * size_t(a.p) + a.hidden + size_t(slices) * a.p);
  if (smem > kDefaultSmem) return cudaErrorInvalidValue;
  launch_kernel(squeeze_excite_generic_kernel<T>, a.n, kThreads, smem, stream, true, a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_squeeze_excite(const SqueezeExciteArgs& a, ConvDType dtype, cudaStream_t stream) {
  if (!a.o || !a.identity || !a.w1 || !a.b1 || !a.w2 || !a.b2 || a.n <= 0 || a.hw <= 0 || a.p % 8 || a.hidden <= 0 ||
      (a.a_next && !a.next_b1a) || (!a.y && !a.a_next && !a.out_nchw) || (!a.o_scale != !a.o_shift))
    return cudaErrorInvalidValue;
  return dtype == ConvDType::kF16 ? launch_typed<__half>(a, stream) : launch_typed<__nv_bfloat16>(a, stream);
}

}  // namespace kfuse::kernels
