// A whole residual block without a shortcut conv (the encoder's block 1: 64 -> 64 channels, stride 1) in one kernel
// for inference: conv1 + FixUp, conv2 + FixUp, squeeze-excitation and the residual join, one CTA per image.
//
// Why. At N = 128 block 1 ran as three kernels, conv1 12.3 us, conv2 11.6 us, squeeze-excite 5.5 us (H100, graph
// replay), for 4.8 GFLOP: each convolution paid its own ramp, pipeline fill, tail and an L2 round
// trip of its 4 MB output, and the implicit GEMM re-read every input pixel from L2 once per tap. Here an image is
// small enough to stay on chip from the block's input to its output:
//   - both filters (2 x 72 KB) and the image's input with a one-pixel zero halo ((h+2) x (w+2) x 64 x 2 B) go to
//     shared memory once (cp.async); conv2's filter streams in while conv1 runs;
//   - each 3x3 convolution is 9 taps x 4 k16 steps of mma.sync m16n8k16 whose A fragments come straight from the halo
//     tile (ldmatrix takes one row address per lane, so the im2col shift of a tap is only an address offset: no copy),
//     each step's fragments loaded while the previous step's MMAs run;
//   - conv1's FixUp epilogue h2 = relu(acc + b1b) + b2a is written back over the halo's interior (its border stays
//     zero: b2a is added before zero padding, as the network defines it); conv2 reads it from there;
//   - o = T(acc * scale + b2b) is staged in shared memory; the squeeze (channel means), fc1, fc2 and the gate are
//     computed in the CTA; the excite and join read the identity from global memory and write a_next (and y).
// 8 warps; warp w owns output rows (m16 tiles of 16 pixels in row-major order) w and w + 8, all 64 channels.
// Bank conflicts: a pixel row is 128 B (8 chunks of 16 B), and chunk c of pixel p lives at chunk c ^ (p & 7), so the
// 8 rows of an ldmatrix (8 consecutive pixels) hit 8 different bank groups; the filters ([64 rows][576] halves, 1152 B
// per row) use chunk c ^ (row & 7) likewise.
// Shared memory: 144 KB of filters + the halo (<= 640 pixels) + 5 KB of scratch: one CTA per SM on Hopper (227 KB opt-in); an
// A100 (163 KB) does not have room for it and keeps the three-kernel path (fused_block_smem_bytes says so).
// No atomics, fixed reduction orders: the same input gives the same bits.
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/encoder/encoder_kernels.h"
#include "kernels/encoder/numeric.cuh"
#include "kernels/programmatic_launch.h"
#include "kernels/shared_memory_ptx.cuh"

namespace kfuse::kernels {
namespace {

constexpr int kP = 64;                     // channels in and out
constexpr int kHidden = kP / 16;           // squeeze-excite hidden units
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxPixels = 2 * kWarps * 16;  // two m16 tiles per warp
constexpr int kMaxHaloPixels = 640;
constexpr int kRowBytes = kP * 2;           // one pixel's channels: 8 chunks of 16 B
constexpr int kTaps = 9;
constexpr int kK = kTaps * kP;              // GEMM K of one 3x3 conv: 576
constexpr int kFilterPitch = kK * 2;        // bytes per output channel row of a staged filter: 72 chunks
constexpr int kFilterBytes = kP * kFilterPitch;  // 73728
// Shared fp32 scratch: per-warp channel sums, mean, hidden, gate, then the squeeze-excite's parameters (fc1 weight and
// bias, fc2 weight and bias), staged at the start so that the squeeze-excite's serial phases wait on no global load.
constexpr int kFc1W = kHidden * kP, kFc2W = kP * kHidden;
constexpr int kScratchFloats = kWarps * kP + kP + kHidden + kP + kFc1W + kFc2W + kHidden + kP;

__host__ __device__ constexpr size_t smem_bytes_for(int halo_pixels) {
  return size_t(2) * kFilterBytes + size_t(halo_pixels) * kRowBytes + sizeof(float) * kScratchFloats;
}

using ptx::cp_async16;
using ptx::cp_async_commit;
using ptx::cp_async_wait;
using ptx::ldsm_x4;
using ptx::smem_u32;

// Byte offset of 16-byte chunk c of row r in a swizzled array of `pitch`-byte rows.
__device__ __forceinline__ uint32_t swz(int r, int c, int pitch) {
  return uint32_t(r) * pitch + (uint32_t(c ^ (r & 7)) << 4);
}

// A filter [64][3][3][64] (KRSC) of T into shared memory: row n = output channel, 72 chunks of 8 input values.
__device__ __forceinline__ void stage_filter(uint32_t dst, const void* w) {
  const char* src = static_cast<const char*>(w);
  for (int i = threadIdx.x; i < kP * (kK / 8); i += kThreads) {
    const int n = i / (kK / 8), c = i % (kK / 8);
    cp_async16(dst + swz(n, c, kFilterPitch), src + int64_t(i) * 16);
  }
}

// acc = 0 before a convolution.
__device__ __forceinline__ void zero(float (&acc)[2][8][4]) {
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[m][nt][e] = 0.f;
}

// An epilogue's pass over this thread's accumulators of the warp's valid m16 tiles: for accumulator row r (0: g,
// 1: g + 8) of tile m and n8 tile nt, stores pack(acc pair) as 4 bytes at channels 8 nt + 2 q, +1 of shared-memory
// row row(m, r) (128-byte rows, swizzled as the halo tile).
template <class Row, class Pack>
__device__ __forceinline__ void store_pairs(const float (&acc)[2][8][4], int tiles, unsigned char* base, Row row,
                                            Pack pack) {
  const int q = threadIdx.x & 3;
#pragma unroll
  for (int m = 0; m < 2; ++m)
    if (m < tiles)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          *reinterpret_cast<uint32_t*>(base + swz(row(m, r), nt, kRowBytes) + 4 * q) =
              pack(acc[m][nt][2 * r], acc[m][nt][2 * r + 1]);
}

// acc[m][nt] += the 3x3 convolution of the halo tile for this warp's two m16 tiles and the 8 n8 tiles of all 64
// output channels: 9 taps x 4 k16 steps, each step's fragments loaded (ldmatrix) while the previous step's 16 MMAs
// run. hc[m]: halo index of the centre pixel of this lane's ldmatrix row of tile m (a valid pixel even for a tile
// past the image, whose results the caller drops: the loop stays free of branches).
template <class T>
__device__ __forceinline__ void conv3x3(float (&acc)[2][8][4], uint32_t halo, uint32_t filt, const int (&hc)[2],
                                        int wp) {
  constexpr int kSteps = kTaps * (kP / 16);
  const int lane = threadIdx.x & 31;
  const int a_chunk = lane >> 4;                                   // k 0-7 or 8-15 of a k16 step
  const uint32_t b_base = filt + uint32_t((lane & 7) + 8 * (lane >> 4)) * kFilterPitch;  // this lane's B row
  const int b_chunk = (lane >> 3) & 1, b_xor = lane & 7;           // the row's swizzle: (row & 7) = lane & 7
  auto load = [&](int st, uint32_t (&a)[2][4], uint32_t (&b)[4][4]) {
    const int tap = st >> 2, kc = st & 3;
    const int d = (tap / 3 - 1) * wp + (tap % 3 - 1);
#pragma unroll
    for (int m = 0; m < 2; ++m) ldsm_x4(a[m], halo + swz(hc[m] + d, 2 * kc + a_chunk, kRowBytes));
    const uint32_t boff = uint32_t(((tap * 8 + 2 * kc + b_chunk) ^ b_xor) << 4);
#pragma unroll
    for (int np = 0; np < 4; ++np) ldsm_x4(b[np], b_base + np * 16 * kFilterPitch + boff);  // n8 tiles 2np, 2np+1
  };
  uint32_t a[2][2][4], b[2][4][4];
  load(0, a[0], b[0]);
#pragma unroll 2
  for (int st = 0; st < kSteps; ++st) {
    const int cur = st & 1;
    if (st + 1 < kSteps) load(st + 1, a[cur ^ 1], b[cur ^ 1]);
#pragma unroll
    for (int np = 0; np < 4; ++np)
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        mma16816<T>(acc[m][2 * np], a[cur][m], b[cur][np][0], b[cur][np][1]);
        mma16816<T>(acc[m][2 * np + 1], a[cur][m], b[cur][np][2], b[cur][np][3]);
      }
  }
}

// The squeeze-excite's parameters (16-byte aligned arrays of multiples of 4 floats) into shared memory.
__device__ __forceinline__ void stage_se_params(const FusedBlockArgs& p, float* fc1_w, float* fc2_w, float* fc1_b,
                                                float* fc2_b, int tid) {
  const float* src[4] = {p.fc1_w, p.fc2_w, p.fc1_b, p.fc2_b};
  float* dst[4] = {fc1_w, fc2_w, fc1_b, fc2_b};
  const int count[4] = {kFc1W, kFc2W, kHidden, kP};
#pragma unroll
  for (int k = 0; k < 4; ++k)
    for (int i = tid; i < count[k] / 4; i += kThreads) cp_async16(smem_u32(dst[k] + 4 * i), src[k] + 4 * i);
}

// This warp's m16 tiles: warp and warp + 8 (pixels 16 t .. 16 t + 15, row-major). The lane's ldmatrix row (hc), and
// the two accumulator rows g and g + 8 (hrow), as halo indices of their centre pixels.
__device__ __forceinline__ void tile_rows(int (&hc)[2], int (&hrow)[2][2], int tiles, int warp, int lane, int g,
                                          int w, int wp) {
#pragma unroll
  for (int m = 0; m < 2; ++m) {
    const int t = m < tiles ? warp + m * kWarps : 0;  // a tile past the image computes tile 0 again, unused
    const int pl = 16 * t + (lane & 7) + 8 * ((lane >> 3) & 1);
    hc[m] = (pl / w + 1) * wp + pl % w + 1;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int pa = 16 * t + g + 8 * r;
      hrow[m][r] = (pa / w + 1) * wp + pa % w + 1;
    }
  }
}

// The squeeze's per-thread channel sums over the lanes of a warp, then over the warps (a fixed order), / hw into
// mean.
__device__ __forceinline__ void sums_to_mean(float (&sum)[8], float* red, float* mean, int hw, int tid, int warp,
                                             int lane) {
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    sum[k] += __shfl_xor_sync(0xffffffffu, sum[k], 8);
    sum[k] += __shfl_xor_sync(0xffffffffu, sum[k], 16);
  }
  if (lane < 8)
#pragma unroll
    for (int k = 0; k < 8; ++k) red[warp * kP + 8 * lane + k] = sum[k];
  __syncthreads();
  if (tid < kP) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += red[w * kP + tid];
    mean[tid] = s / float(hw);
  }
}

// fc1 + ReLU (one warp per hidden unit), then fc2 + sigmoid (one thread per channel) into gate.
__device__ __forceinline__ void excite_gates(const float* mean, float* hid, float* gate, const float* fc1_w,
                                             const float* fc1_b, const float* fc2_w, const float* fc2_b, int tid,
                                             int warp, int lane) {
  if (warp < kHidden) {  // fc1 + ReLU: one warp per hidden unit
    float s = fc1_w[warp * kP + lane] * mean[lane] + fc1_w[warp * kP + lane + 32] * mean[lane + 32];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) hid[warp] = relu_keep_nan(s + fc1_b[warp]);
  }
  __syncthreads();
  if (tid < kP) {  // fc2 + sigmoid
    float s = fc2_b[tid];
#pragma unroll
    for (int j = 0; j < kHidden; ++j) s += fc2_w[tid * kHidden + j] * hid[j];
    gate[tid] = 1.f / (1.f + __expf(-s));
  }
}

// Excite and join: y = relu(o * gate + identity); a_next = y + next_b1a (faithful where y > 0), y when asked.
template <class T, int kVecs>
__device__ __forceinline__ void excite_join(const FusedBlockArgs& p, const unsigned char* halo_ptr, const float* gate,
                                            const uint4 (&id8)[kVecs], int64_t img, int hw, int pix0, int c8) {
  const float nb1a = p.a_next ? __ldg(p.next_b1a) : 0.f;
  float gv[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) gv[k] = gate[8 * c8 + k];
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int pix = pix0 + 32 * j;
    if (pix >= hw) break;
    float of[8], idf[8], y[8];
    unpack8<T>(*reinterpret_cast<const uint4*>(halo_ptr + swz(pix, c8, kRowBytes)), of);
    unpack8<T>(id8[j], idf);
#pragma unroll
    for (int k = 0; k < 8; ++k) y[k] = relu_keep_nan(fmaf(of[k], gv[k], idf[k]));
    const int64_t off = (img * hw + pix) * 8 + c8;
    if (p.y) static_cast<uint4*>(p.y)[off] = pack8<T>(y);
    if (p.a_next) static_cast<uint4*>(p.a_next)[off] = pack8_after_relu<T>(y, nb1a);
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads, 1) fused_block_kernel(const FusedBlockArgs p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const uint32_t filt1 = smem_u32(smem), filt2 = filt1 + kFilterBytes, halo = filt2 + kFilterBytes;
  unsigned char* const halo_ptr = smem + 2 * kFilterBytes;
  const int wp = p.w + 2, halo_pixels = (p.h + 2) * wp, hw = p.h * p.w;
  float* const red = reinterpret_cast<float*>(halo_ptr + size_t(halo_pixels) * kRowBytes);  // [kWarps][kP]
  float* const mean = red + kWarps * kP;
  float* const hid = mean + kP;
  float* const gate = hid + kHidden;
  float* const fc1_w = gate + kP;  // 16-byte aligned: every array above holds a multiple of 4 floats
  float* const fc2_w = fc1_w + kFc1W;
  float* const fc1_b = fc2_w + kFc2W;
  float* const fc2_b = fc1_b + kHidden;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2;
  const int64_t img = blockIdx.x;

  // The filters are parameters, never written by the kernel before this one in the stream: they load before the
  // programmatic wait (the predecessor had started, so everything before it had finished).
  stage_filter(filt1, p.w1);
  stage_se_params(p, fc1_w, fc2_w, fc1_b, fc2_b, tid);
  cp_async_commit();
  pdl_wait_for_predecessor();
  pdl_allow_successor();
  {  // the input with its zero halo (in the kernel: as a function of its own, nvcc unrolls this loop differently)
    const uint4* a = static_cast<const uint4*>(p.a) + img * hw * (kP / 8);
    for (int i = tid; i < halo_pixels * 8; i += kThreads) {
      const int hp = i >> 3, c = i & 7, hi = hp / wp, hj = hp % wp;
      const uint32_t dst = halo + swz(hp, c, kRowBytes);
      if (hi >= 1 && hi <= p.h && hj >= 1 && hj <= p.w)
        cp_async16(dst, a + ((hi - 1) * p.w + (hj - 1)) * 8 + c);
      else
        *reinterpret_cast<uint4*>(halo_ptr + (dst - halo)) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
  cp_async_commit();
  stage_filter(filt2, p.w2);
  cp_async_commit();

  const int tiles = (hw / 16 > warp + kWarps) ? 2 : (hw / 16 > warp ? 1 : 0);
  int hc[2], hrow[2][2];
  tile_rows(hc, hrow, tiles, warp, lane, g, p.w, wp);
  const float b1b = __ldg(p.scalars + 1), b2a = __ldg(p.scalars + 2), scale = __ldg(p.scalars + 3),
              b2b = __ldg(p.scalars + 4);

  float acc[2][8][4];
  zero(acc);
  cp_async_wait<1>();  // conv1's filter and the halo (conv2's filter may still be in flight)
  __syncthreads();
  conv3x3<T>(acc, halo, filt1, hc, wp);
  __syncthreads();  // every warp is done reading a: h2 goes over it

  // conv1's FixUp: h2 = relu(acc + b1b) + b2a (faithful where active), into the halo's interior (its border stays
  // zero).
  store_pairs(acc, tiles, halo_ptr, [&](int m, int r) { return hrow[m][r]; }, [&](float lo, float hi) {
    return pack2_after_relu<T>(relu_keep_nan(lo + b1b), relu_keep_nan(hi + b1b), b2a);
  });
  zero(acc);
  cp_async_wait<0>();
  __syncthreads();
  conv3x3<T>(acc, halo, filt2, hc, wp);
  __syncthreads();  // every warp is done reading h2: o goes into the same space

  // conv2's FixUp o = T(acc * scale + b2b), staged as [pixel][64] (swizzled rows).
  store_pairs(acc, tiles, halo_ptr, [&](int m, int r) { return 16 * (warp + m * kWarps) + g + 8 * r; },
              [&](float lo, float hi) { return pack2<T>(fmaf(lo, scale, b2b), fmaf(hi, scale, b2b)); });
  // The identity's vectors of this thread (chunk tid & 7 of pixels tid / 8 + 32 j), issued before the squeeze so
  // that their latency overlaps it.
  constexpr int kVecs = kMaxPixels * 8 / kThreads;
  const int c8 = tid & 7, pix0 = tid >> 3;
  const uint4* idv = static_cast<const uint4*>(p.identity) + img * hw * 8;
  uint4 id8[kVecs];
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int pix = pix0 + 32 * j;
    id8[j] = pix < hw ? __ldg(idv + pix * 8 + c8) : make_uint4(0u, 0u, 0u, 0u);
  }
  __syncthreads();

  // Squeeze: per-channel sums of T(o), fixed order (pixels of a thread, then lanes of a warp, then warps). (This
  // loop stays in the kernel: in a function of its own, nvcc numbers sum's registers differently and the SASS
  // changes.)
  float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int pix = pix0; pix < hw; pix += 32) {
    float f[8];
    unpack8<T>(*reinterpret_cast<const uint4*>(halo_ptr + swz(pix, c8, kRowBytes)), f);
#pragma unroll
    for (int k = 0; k < 8; ++k) sum[k] += f[k];
  }
  sums_to_mean(sum, red, mean, hw, tid, warp, lane);
  __syncthreads();
  excite_gates(mean, hid, gate, fc1_w, fc1_b, fc2_w, fc2_b, tid, warp, lane);
  __syncthreads();
  excite_join<T>(p, halo_ptr, gate, id8, img, hw, pix0, c8);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

size_t fused_block_smem_bytes(int h, int w) {
  if (h <= 0 || w <= 0 || h * w > kMaxPixels || (h * w) % 16 != 0 || (h + 2) * (w + 2) > kMaxHaloPixels) return 0;
  return smem_bytes_for((h + 2) * (w + 2));
}

cudaError_t launch_fused_block(const FusedBlockArgs& p, ConvDType dtype, cudaStream_t stream) {
  const size_t smem = fused_block_smem_bytes(p.h, p.w);
  if (smem == 0 || p.n <= 0 || p.planes != kP || p.hidden != kHidden || !p.a || !p.identity || !p.w1 || !p.w2 ||
      !p.scalars || !p.fc1_w || !p.fc1_b || !p.fc2_w || !p.fc2_b || (!p.y && !p.a_next) ||
      (p.a_next && !p.next_b1a))
    return cudaErrorInvalidValue;
  if (!aligned16(p.a) || !aligned16(p.identity) || !aligned16(p.w1) || !aligned16(p.w2) || !aligned16(p.fc1_w) ||
      !aligned16(p.fc1_b) || !aligned16(p.fc2_w) || !aligned16(p.fc2_b) ||
      (p.y && !aligned16(p.y)) || (p.a_next && !aligned16(p.a_next)))
    return cudaErrorInvalidValue;
  auto kernel = dtype == ConvDType::kF16 ? fused_block_kernel<__half> : fused_block_kernel<__nv_bfloat16>;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (err != cudaSuccess) return err;
  launch_kernel(kernel, p.n, kThreads, smem, stream, true, p);
  return cudaGetLastError();
}

}  // namespace kfuse::kernels
