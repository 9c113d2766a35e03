// Block 4's tail (256 -> 512 channels, 4 x 4 -> 2 x 2 maps, hidden 32) after its conv1 and conv2, as one Hopper
// kernel for inference: the shortcut idt = conv1x1(avgpool3x3(a, stride 2, pad 1)), the squeeze-excitation of o and
// the join y = relu(o * g + idt); a thread block cluster of 8 CTAs per 8 images, one image per CTA.
//
// Why. Block 4 ran its shortcut as a 3x3 convolution (the 1x1 filter / 9 on every tap) on a side branch beside conv1,
// and the squeeze-excite as a kernel of its own: the shortcut moves as many L2 -> SM bytes as conv1 (~37 MB at batch
// 128), slowing conv1 from 8.2 to 9.0-9.2 us where both are bound by L2 bandwidth, and the squeeze-excite re-reads
// 128 KB of fp32 fc weights per image (16 MB in all, ~4.8 us). Here the 8 CTAs of a
// cluster split every weight by output: CTA r computes output channels 64 r .. 64 r + 63 of the shortcut and of fc2,
// and hidden units 4 r .. 4 r + 3 of fc1, for all 8 images of the cluster, so each CTA streams an eighth of the
// weights (32 KB of the 1x1 filter, 16 KB of fc weights: ~7 MB for the batch instead of ~53) and the operands that a
// slice cannot compute alone travel through distributed shared memory:
//   1. every CTA pools its own image (fp32 sums / 9, rounded to T once: the 1x1 GEMM's operand) and takes its
//      channel means of o, and writes both into every CTA of the cluster (push, no remote reads);
//   2. once all of them are in: fc1's 4 units and the shortcut's 64 channels (mma.sync m16n8k16, M = 8 images x 4
//      pixels, K = 256) for the 8 images: the hidden units go to every CTA, each image's shortcut outputs to its CTA;
//   3. once those are in: fc2's 64 gates for the 8 images, each image's to its CTA;
//   4. once its gates are in, each CTA joins its image from its own shared memory: y = relu(o * g + idt), stored as
//      the caller asks (NHWC y, the next block's a, or the NCHW output transposed through shared memory).
// The exchanges are remote stores that count their bytes on the receiver's mbarrier (st.async ... complete_tx), one
// barrier per exchange: each CTA waits for its own data only, with no cluster-wide barrier in between.
// The weight slices are constant for the forward, so they load (cp.async) before the wait for the predecessor.
// A CTA whose image is past n (the last cluster) computes its slices for the others and stores nothing.
// Numerics: the squeeze-excite's rules (numeric.cuh: o = T(v * scale + shift) where o is raw, the NaN-keeping ReLU,
// sigmoid as 1 / (1 + exp(-s))); the shortcut stays fp32 into the join (the separate path's 3x3 form rounds the
// filter / 9 to T and its output to T); fixed reduction orders, no atomics: the same input gives the same bits, though
// not the separate path's bits (other orders, other roundings).
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/encoder/encoder_kernels.h"
#include "kernels/encoder/numeric.cuh"
#include "kernels/phase_stamps.cuh"
#include "kernels/programmatic_launch.h"
#include "kernels/shared_memory_ptx.cuh"
#include "kernels/wgmma_ptx.cuh"

namespace kfuse::kernels {
namespace {

constexpr int kCin = 256, kP = 512, kHidden = kP / 16;
constexpr int kRanks = 8;                                      // CTAs (and images) per cluster
constexpr int kSlice = kP / kRanks, kUnits = kHidden / kRanks;  // per CTA: 64 output channels, 4 hidden units
constexpr int kInW = 4, kOutW = 2, kOutPix = kOutW * kOutW;
constexpr int kRows = kRanks * kOutPix;  // the shortcut GEMM's M: 8 images x 4 output pixels
constexpr int kThreads = 256;            // 8 warps; thread t holds channels 8 (t % 64) .. of output pixel t / 64
static_assert(kThreads * 8 == kOutPix * kP, "one 16-byte vector of o per thread");
static_assert(kThreads / 32 == kRanks, "fc1: one warp per image of the cluster");
static_assert(kSlice == 8 * (kThreads / 32), "the shortcut GEMM: 8 output channels per warp");

// Shared memory, bytes. T rows padded by 16 bytes (528 B: the 8 rows of an ldmatrix matrix hit 8 different 16-byte
// bank groups), fc2's rows of 32 fp32 padded to 36 (conflict-free 16-byte loads by consecutive channels).
constexpr int kTRow = (kCin + 8) * 2;
constexpr int kW2Row = kHidden + 4;
constexpr int kPooledOff = 0;                                  // [8 images x 4 pixels][256] T, all ranks' images
constexpr int kWscOff = kPooledOff + kRows * kTRow;            // [64][256] T: this CTA's rows of the 1x1 filter
constexpr int kW1Off = kWscOff + kSlice * kTRow;               // [4][512] fp32: this CTA's rows of fc1
constexpr int kW2Off = kW1Off + kUnits * kP * 4;               // [64][36] fp32: this CTA's rows of fc2
constexpr int kMeanOff = kW2Off + kSlice * kW2Row * 4;         // [8][512] fp32: the cluster's channel means
constexpr int kHidOff = kMeanOff + kRanks * kP * 4;            // [8][32] fp32: the cluster's hidden units
constexpr int kIdtOff = kHidOff + kRanks * kHidden * 4;        // [4][512] fp32: this image's shortcut
constexpr int kGateOff = kIdtOff + kOutPix * kP * 4;           // [512] fp32: this image's gates
constexpr int kOOff = kGateOff + kP * 4;                       // [4][512] fp32: this image's o, later y
constexpr int kBarOff = kOOff + kOutPix * kP * 4;              // 3 mbarriers: the exchanges' arrivals
constexpr int kSmemBytes = kBarOff + 3 * 8;
static_assert(kWscOff % 16 == 0 && kW1Off % 16 == 0 && kW2Off % 16 == 0 && kMeanOff % 16 == 0 && kHidOff % 16 == 0 &&
                  kIdtOff % 16 == 0 && kGateOff % 16 == 0 && kOOff % 16 == 0 && kBarOff % 8 == 0,
              "aligned regions");
static_assert(kSmemBytes <= 113 * 1024, "two CTAs per SM");

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KFUSE_SHORTCUT_EXCITE_DEVICE 1
#endif

#ifdef KFUSE_SHORTCUT_EXCITE_DEVICE
using ptx::cluster_arrive_relaxed;
using ptx::cluster_rank;
using ptx::cluster_wait;
using ptx::map_rank;
using ptx::smem_u32;
using ptx::st_async;

// Bytes each CTA receives per exchange (every CTA of the cluster sends its part, itself included), which its
// mbarrier expects: 1. the pooled rows (8 x 4 x 256 T) and the means (8 x 512 fp32); 2. the hidden units (8 x 32
// fp32) and its image's shortcut (4 x 512 fp32); 3. its image's gates (512 fp32).
constexpr uint32_t kExchange1Bytes = kRows * kCin * 2 + kRanks * kP * 4;
constexpr uint32_t kExchange2Bytes = kRanks * kHidden * 4 + kOutPix * kP * 4;
constexpr uint32_t kExchange3Bytes = kP * 4;

// The join of this CTA's image: y = relu(o * g + idt) for this thread's 8 channels (of: its o) of output pixel t / 64,
// from the gates and the shortcut in shared memory, stored as the caller asks.
template <class T>
__device__ __forceinline__ void join(const ShortcutExciteArgs& p, unsigned char* smem, int image,
                                     const float (&of)[8]) {
  const SqueezeExciteArgs& se = p.se;
  const int tid = threadIdx.x;
  const int px = tid / (kP / 8), c0 = 8 * (tid % (kP / 8));
  float y[8];
  {
    const float4* idt = reinterpret_cast<const float4*>(smem + kIdtOff + (px * kP + c0) * 4);
    const float4* gate = reinterpret_cast<const float4*>(smem + kGateOff + c0 * 4);
    const float4 i0 = idt[0], i1 = idt[1], g0 = gate[0], g1 = gate[1];
    const float iv[8] = {i0.x, i0.y, i0.z, i0.w, i1.x, i1.y, i1.z, i1.w};
    const float gv[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
#pragma unroll
    for (int e = 0; e < 8; ++e) y[e] = relu_nan(fmaf(of[e], gv[e], iv[e]));
  }
  const size_t vec = size_t(image) * kOutPix * kP / 8 + tid;  // NHWC vector of (image, px, c0)
  if (se.y) reinterpret_cast<uint4*>(se.y)[vec] = pack8<T>(y);
  if (se.a_next) reinterpret_cast<uint4*>(se.a_next)[vec] = pack8_after_relu<T>(y, __ldg(se.next_b1a));
  if (!se.out_nchw) return;
  // NCHW: the image's 2048 outputs are contiguous, element c * 4 + px; through shared memory (o's buffer: every
  // thread has read its o into registers and the means are long taken), thread t stores channels 2 t and 2 t + 1.
  {
    float4* st = reinterpret_cast<float4*>(smem + kOOff + (px * kP + c0) * 4);
    st[0] = make_float4(y[0], y[1], y[2], y[3]);
    st[1] = make_float4(y[4], y[5], y[6], y[7]);
  }
  __syncthreads();
  const float* ys = reinterpret_cast<const float*>(smem + kOOff);
  float r[8];
#pragma unroll
  for (int k = 0; k < 2; ++k)
#pragma unroll
    for (int q = 0; q < kOutPix; ++q) r[k * kOutPix + q] = ys[q * kP + 2 * tid + k];
  const size_t e0 = size_t(image) * kP * kOutPix + 8 * size_t(tid);
  if (se.out_f32) {
    float4* out = reinterpret_cast<float4*>(static_cast<float*>(se.out_nchw) + e0);
    out[0] = make_float4(r[0], r[1], r[2], r[3]);
    out[1] = make_float4(r[4], r[5], r[6], r[7]);
  } else {
    *reinterpret_cast<uint4*>(static_cast<T*>(se.out_nchw) + e0) = pack8<T>(r);
  }
}
#endif

template <class T>
__global__ void __cluster_dims__(kRanks, 1, 1) __launch_bounds__(kThreads)
    shortcut_excite_cluster_kernel(const ShortcutExciteArgs p) {
#ifdef KFUSE_SHORTCUT_EXCITE_DEVICE
  extern __shared__ __align__(128) unsigned char smem[];
  const SqueezeExciteArgs& se = p.se;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t rank = cluster_rank();
  const int image = int(blockIdx.x);  // one image per CTA; the cluster's images are 8 (blockIdx.x / 8) + 0 .. 7
  const bool valid = image < se.n;
  const uint32_t base = smem_u32(smem);
  const uint32_t bar = base + kBarOff;  // exchange k's mbarrier: bar + 8 k
  KFUSE_PHASES(8);  // development builds only (phase_stamps.cuh)
  KFUSE_STAMP(0, "start");
  if (tid == 0) {
#pragma unroll
    for (int k = 0; k < 3; ++k) ptx::mbar_init(bar + 8 * k, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    ptx::mbar_arrive_expect_tx(bar, kExchange1Bytes);
    ptx::mbar_arrive_expect_tx(bar + 8, kExchange2Bytes);
    ptx::mbar_arrive_expect_tx(bar + 16, kExchange3Bytes);
  }

  // Weights: this CTA's slices (constant for the forward: loaded before the wait for the predecessor).
  {
    const char* wsc = static_cast<const char*>(p.shortcut) + size_t(rank) * kSlice * kCin * 2;
#pragma unroll
    for (int k = 0; k < kSlice * kCin * 2 / 16 / kThreads; ++k) {  // 8 per thread: row i / 32, 16-byte chunk i % 32
      const int i = tid + k * kThreads;
      ptx::cp_async16(base + kWscOff + (i >> 5) * kTRow + (i & 31) * 16, wsc + size_t(i) * 16);
    }
    const char* w1 = reinterpret_cast<const char*>(se.w1) + size_t(rank) * kUnits * kP * 4;
#pragma unroll
    for (int k = 0; k < kUnits * kP * 4 / 16 / kThreads; ++k) {  // 2 per thread, contiguous
      const int i = tid + k * kThreads;
      ptx::cp_async16(base + kW1Off + i * 16, w1 + size_t(i) * 16);
    }
    const char* w2 = reinterpret_cast<const char*>(se.w2) + size_t(rank) * kSlice * kHidden * 4;
#pragma unroll
    for (int k = 0; k < kSlice * kHidden * 4 / 16 / kThreads; ++k) {  // 2 per thread: row i / 8, chunk i % 8
      const int i = tid + k * kThreads;
      ptx::cp_async16(base + kW2Off + (i >> 3) * kW2Row * 4 + (i & 7) * 16, w2 + size_t(i) * 16);
    }
    ptx::cp_async_commit();
  }
  const float b1v = __ldg(se.b1 + rank * kUnits + (lane & (kUnits - 1)));  // fc1: lane's unit (lane % 4)
  const float b2v = __ldg(se.b2 + rank * kSlice + (tid & (kSlice - 1)));    // fc2: thread's channel (tid % 64)
  cluster_arrive_relaxed();  // this CTA has started, its barriers set: once every CTA has, remote stores may begin

  pdl_wait_for_predecessor();
  pdl_allow_successor();
  KFUSE_STAMP(1, "wait");

  // This image's o: thread t holds output pixel t / 64, channels 8 (t % 64) .. (NHWC: vector t of the image).
  uint4 o8 = make_uint4(0, 0, 0, 0);
  if (valid)
    o8 = __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(se.o) + size_t(image) * kOutPix * kP) + tid);
  if (se.o_scale) o8 = affine8<T>(o8, __ldg(se.o_scale), __ldg(se.o_shift));
  float of[8];
  unpack8<T>(o8, of);
  {
    float4* dst = reinterpret_cast<float4*>(smem + kOOff) + 2 * tid;
    dst[0] = make_float4(of[0], of[1], of[2], of[3]);
    dst[1] = make_float4(of[4], of[5], of[6], of[7]);
  }
  // The 3x3 average pool (stride 2, padding 1, always / 9) of this image's a: threads 0-127, output pixel t / 32,
  // channels 8 (t % 32) ..; summed in fp32 in a fixed tap order, rounded to T once.
  uint4 pooled = make_uint4(0, 0, 0, 0);
  if (tid < kOutPix * kCin / 8 && valid) {
    const int opx = tid >> 5, cv = tid & 31, oy = opx / kOutW, ox = opx % kOutW;
    const uint4* a = reinterpret_cast<const uint4*>(static_cast<const T*>(p.a) + size_t(image) * kInW * kInW * kCin);
    float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int dy = -1; dy <= 1; ++dy) {
      const int iy = 2 * oy + dy;
      if (iy < 0 || iy >= kInW) continue;
#pragma unroll
      for (int dx = -1; dx <= 1; ++dx) {
        const int ix = 2 * ox + dx;
        if (ix < 0 || ix >= kInW) continue;
        float f[8];
        unpack8<T>(__ldg(a + (iy * kInW + ix) * (kCin / 8) + cv), f);
#pragma unroll
        for (int e = 0; e < 8; ++e) s[e] += f[e];
      }
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) s[e] = s[e] / 9.f;
    pooled = pack8<T>(s);
  }
  __syncthreads();  // o in shared memory
  // Channel means of this image: thread t, channels 2 t and 2 t + 1 (pixels summed in order).
  float2 mean2;
  {
    const float2* o2 = reinterpret_cast<const float2*>(smem + kOOff);
    const float2 v0 = o2[tid], v1 = o2[kP / 2 + tid], v2 = o2[kP + tid], v3 = o2[3 * kP / 2 + tid];
    mean2 = make_float2((((v0.x + v1.x) + v2.x) + v3.x) / float(kOutPix),
                        (((v0.y + v1.y) + v2.y) + v3.y) / float(kOutPix));
  }

  KFUSE_STAMP(2, "load_pool_mean");
  cluster_wait();  // every CTA of the cluster has started
  KFUSE_STAMP(3, "cluster_start");
  // Exchange 1: the pooled row (image `rank`, pixel t / 32) and the means into every CTA of the cluster.
  {
    const uint32_t pooled_at = base + kPooledOff + (rank * kOutPix + (tid >> 5)) * kTRow + (tid & 31) * 16;
    const uint32_t mean_at = base + kMeanOff + (rank * kP + 2 * tid) * 4;
#pragma unroll
    for (int q = 0; q < kRanks; ++q) {
      const uint32_t qbar = map_rank(bar, q);
      if (tid < kOutPix * kCin / 8) st_async(map_rank(pooled_at, q), pooled, qbar);
      st_async(map_rank(mean_at, q), mean2.x, mean2.y, qbar);
    }
  }
  ptx::cp_async_wait<0>();
  __syncthreads();          // this CTA's weight slices, from every thread's copies
  ptx::mbar_wait<true>(bar, 0);  // 1: the pooled inputs and the means of all 8 images
  KFUSE_STAMP(4, "exchange1");

  // fc1: warp w takes image w of the cluster, its 4 units (this CTA's slice); lane l columns 4 (l + 32 j) ...
  {
    const float4* mean4 = reinterpret_cast<const float4*>(smem + kMeanOff) + warp * (kP / 4);
    const float4* w14 = reinterpret_cast<const float4*>(smem + kW1Off);
    float acc[kUnits] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < kP / 4 / 32; ++j) {
      const float4 m = mean4[lane + 32 * j];
#pragma unroll
      for (int u = 0; u < kUnits; ++u) acc[u] = dot4(w14[u * (kP / 4) + lane + 32 * j], m, acc[u]);
    }
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1)
#pragma unroll
      for (int u = 0; u < kUnits; ++u) acc[u] += __shfl_xor_sync(0xffffffffu, acc[u], off);
    // Every lane holds the 4 sums; lane l sends unit l % 4 to CTA l / 4.
    const int u = lane & (kUnits - 1);
    const float h = relu_nan((u == 0 ? acc[0] : u == 1 ? acc[1] : u == 2 ? acc[2] : acc[3]) + b1v);
    st_async(map_rank(base + kHidOff + (warp * kHidden + rank * kUnits + u) * 4, lane >> 2), h,
             map_rank(bar + 8, lane >> 2));
  }
  // The shortcut: rows (image, pixel) x this warp's 8 output channels, K = 256 in 16 steps of m16n8k16, A (pooled)
  // and B (the 1x1 filter's rows, K-contiguous: mma's column-major B) by ldmatrix.
  {
    float acc[2][4] = {};
    const uint32_t a_at = base + kPooledOff + (lane & 15) * kTRow + (lane >> 4) * 16;
    const uint32_t b_at = base + kWscOff + (warp * 8 + (lane & 7)) * kTRow + (lane >> 4) * 32 + ((lane >> 3) & 1) * 16;
#pragma unroll
    for (int kp = 0; kp < kCin / 32; ++kp) {  // two k16 steps per B load
      uint32_t b[4];
      ptx::ldsm_x4(b, b_at + kp * 64);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          uint32_t a[4];
          ptx::ldsm_x4(a, a_at + mt * 16 * kTRow + (2 * kp + h) * 32);
          mma16816<T>(acc[mt], a, b[2 * h], b[2 * h + 1]);
        }
      }
    }
    // acc[mt][0..1]: row 16 mt + lane / 4, channels 2 (lane % 4) + 0..1 of the warp's 8; [2..3]: row + 8.
    const int ch = rank * kSlice + warp * 8 + 2 * (lane & 3);
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        const int row = 16 * mt + 8 * hi + (lane >> 2), img = row / kOutPix, px = row % kOutPix;
        st_async(map_rank(base + kIdtOff + (px * kP + ch) * 4, img), acc[mt][2 * hi], acc[mt][2 * hi + 1],
                 map_rank(bar + 8, img));
      }
  }
  ptx::mbar_wait<true>(bar + 8, 0);  // 2: the hidden units of all 8 images, this image's shortcut
  KFUSE_STAMP(5, "fc1_shortcut");

  // fc2 + sigmoid: thread t, channel t % 64 of this CTA's slice, images 2 (t / 64) and 2 (t / 64) + 1.
  {
    const int c = tid & (kSlice - 1), g0 = 2 * (tid / kSlice);
    const float4* wrow = reinterpret_cast<const float4*>(smem + kW2Off + c * kW2Row * 4);
    const float4* hid = reinterpret_cast<const float4*>(smem + kHidOff);
    float s0 = b2v, s1 = b2v;
#pragma unroll
    for (int k = 0; k < kHidden / 4; ++k) {
      const float4 w = wrow[k];
      s0 = dot4(w, hid[g0 * (kHidden / 4) + k], s0);
      s1 = dot4(w, hid[(g0 + 1) * (kHidden / 4) + k], s1);
    }
    const uint32_t gate_at = base + kGateOff + (rank * kSlice + c) * 4;
    st_async(map_rank(gate_at, g0), 1.f / (1.f + __expf(-s0)), map_rank(bar + 16, g0));
    st_async(map_rank(gate_at, g0 + 1), 1.f / (1.f + __expf(-s1)), map_rank(bar + 16, g0 + 1));
  }
  ptx::mbar_wait<true>(bar + 16, 0);  // 3: this image's gates
  KFUSE_STAMP(6, "fc2");
  cluster_arrive_relaxed();     // everything for this CTA has arrived (the wait is at the end)

  if (valid) join<T>(p, smem, image, of);
  KFUSE_STAMP(7, "join");
  KFUSE_PRINT_PHASES("tail");
  cluster_wait();  // every CTA has all its data: no remote store in flight to or from this one
#else
  // Compiled for another architecture: never launched (shortcut_excite_cluster_smem_bytes requires compute
  // capability 9.0).
  __trap();
#endif
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace

bool shortcut_excite_cluster_shape(int in_planes, int planes, int hidden, int stride) {
  return in_planes == kCin && planes == kP && hidden == kHidden && stride == 2;
}

size_t shortcut_excite_cluster_smem_bytes(int in_planes, int planes, int hidden, int stride, int h, int w,
                                          int cc_major, int cc_minor) {
  return shortcut_excite_cluster_shape(in_planes, planes, hidden, stride) && h == kInW && w == kInW &&
                 cc_major == 9 && cc_minor == 0
             ? size_t(kSmemBytes)
             : 0;
}

cudaError_t launch_shortcut_excite_cluster(const ShortcutExciteArgs& p, ConvDType dtype, cudaStream_t stream) {
  const SqueezeExciteArgs& se = p.se;
  if (p.in_planes != kCin || se.p != kP || se.hidden != kHidden || p.h != kInW || p.w != kInW ||
      se.hw != kOutPix || se.n < 1 || !p.a || !p.shortcut || !se.o || !se.w1 || !se.b1 || !se.w2 || !se.b2 ||
      (se.o_scale == nullptr) != (se.o_shift == nullptr) || (se.a_next && !se.next_b1a))
    return cudaErrorInvalidValue;
  const void* vectors[] = {p.a, p.shortcut, se.o, se.w1, se.w2, se.y, se.a_next, se.out_nchw};
  for (const void* v : vectors)
    if (v && !aligned16(v)) return cudaErrorInvalidValue;
  int device = 0, major = 0, minor = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (err != cudaSuccess) return err;
  if (major != 9 || minor != 0) return cudaErrorInvalidDevice;
  const auto kernel = dtype == ConvDType::kF16 ? shortcut_excite_cluster_kernel<__half>
                                               : shortcut_excite_cluster_kernel<__nv_bfloat16>;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  const int grid = (se.n + kRanks - 1) / kRanks * kRanks;  // whole clusters; CTAs past n store nothing
  err = launch_kernel(kernel, dim3(grid), dim3(kThreads), size_t(kSmemBytes), stream, true, p);
  return err != cudaSuccess ? err : cudaGetLastError();
}

}  // namespace kfuse::kernels
