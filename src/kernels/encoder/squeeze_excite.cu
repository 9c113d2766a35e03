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
#include "kernels/encoder/squeeze_excite_phases.cuh"
#include "kernels/phase_stamps.cuh"
#include "kernels/programmatic_launch.h"

namespace kfuse::kernels {
namespace {

using namespace se_phases;

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
