// Block 2 of the encoder (64 -> 128 channels, stride 2, the pooled shortcut, 16 x 16 -> 8 x 8 maps) as one kernel on
// Hopper warpgroup MMAs (sm_90a), for inference: the shortcut (3x3 average pool + 1x1 conv), conv1 + FixUp, conv2 +
// FixUp, the squeeze-excitation and the residual join; one CTA per image.
//
// Why. Block 2 ran as four kernels (conv1 and the shortcut side by side, conv2, the squeeze-excite): ~29 us of the
// forward's ~100 at batch 128 for 4.8 GFLOP, each convolution a CUTLASS kernel whose 64 x 64 tiles stream both operands
// from L2 (measured bound: the SMs' L2 ingress) plus a fixed ~3 us of launch, ramp and tail. Here a CTA keeps its
// image on chip from the input to the block output and streams only the filters (448 KB, the same bytes in the same
// order for every CTA), so the block costs one launch and ~460 KB of L2 reads per SM. With programmatic launch after
// block 1's kernel, the first 128 KB of filters and the squeeze-excite's weights arrive while that kernel finishes.
//
// How:
//   - M = the 64 output pixels (the whole 8 x 8 image), N = the 128 output channels in two warpgroups of 64, K = taps x
//     input channels; wgmma m64n64k16 with both operands in shared memory, K-major, no swizzle.
//   - the input a (x + b1a) sits as its four parity sub-images (even / odd rows x columns), each with a leading zero
//     halo row and column (9 x 9 pixels), one plane per 8-channel group: a stride-2 tap (r, s) of the 8 output pixels of
//     a row is then 8 consecutive pixels of one sub-image, so each tap's im2col is a descriptor start address, as in
//     block 1's kernel (fused_block_wgmma.cu);
//   - the shortcut pools the image in fp32 (sums / 9, one rounding to T: avgpool's padding counts) into a pixel-major
//     operand, then one 1x1 GEMM (K = 64);
//   - conv1's epilogue writes h2 = T(T(relu(acc + b1b)) + b2a) (faithful where h > 0) through stmatrix into a 10 x 10
//     zero-haloed image (16 channel-group planes), conv2's operand;
//   - the filters (shortcut, conv1's 9 taps, conv2's 9 taps x 2 input halves: 28 chunks of 16 KB, packed contiguously
//     in this order as tap planes, weight_layout.h kTapPlanes) stream through a ring of 8 stages: one producer thread
//     issues a bulk copy per chunk (TMA) on a full barrier and waits on an empty barrier per stage, which each compute
//     warp arrives at once its MMAs have read the chunk. The first 8 chunks load while the image arrives and is pooled.
//   - conv2's epilogue: v = T(acc), o = T(v * scale + b2b); the squeeze's per-channel sums in registers, over lanes, then
//     over warps in a fixed order; fc1 + ReLU in every warp, each thread's 8 gates (fc2 + sigmoid); y = relu(o * gate +
//     identity), a_next = T(y + next_b1a) (faithful where y > 0), 16-byte coalesced stores.
// Numerics as fused_block_wgmma.cu and the separate kernels: the same rules, fixed reduction orders, no atomics (the
// same input gives the same bits). Shared memory: 128 KB ring + 40.6 KB image + 25.3 KB h2 + 16 KB identity (the 8.1
// KB pooled image before it) + 2.6 KB sums, hidden units and gates + 8.6 KB squeeze-excite weights + barriers.
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/encoder/encoder_kernels.h"
#include "kernels/encoder/numeric.cuh"
#include "kernels/programmatic_launch.h"
#include "kernels/shared_memory_ptx.cuh"
#include "kernels/wgmma_ptx.cuh"

namespace kfuse::kernels {
namespace {

constexpr int kCin = 64, kP = 128, kHidden = kP / 16;
constexpr int kInH = 16, kInW = 16, kInPix = kInH * kInW;
constexpr int kOutW = 8, kPix = 64;
// The filter stream.
constexpr int kFilterPlane = kP * 16;        // a (tap, 8-input-channel group) plane: 128 output channels x 16 B
constexpr int kChunkBytes = 8 * kFilterPlane;  // 16 KB: 64 input channels of one tap
constexpr int kConv1Chunk = 1, kConv2Chunk = 10, kChunks = 28;
constexpr int kStages = 8;
// The input image as parity sub-images: plane (8-channel group) -> sub-image (row parity, column parity) -> 9 x 9.
constexpr int kSubW = 9, kSubRow = kSubW * 16, kSubBytes = kSubW * kSubRow;
constexpr int kImgPlane = 4 * kSubBytes + 16;  // 5200 = 325 x 16: an odd count of 16-byte units, so the 8 planes of one
constexpr int kImgBytes = 8 * kImgPlane;       // pixel fall in 8 different bank groups
// The pooled image: pixel-major planes (8 x 8 pixels, no halo).
constexpr int kPoolPlane = kPix * 16 + 16;
constexpr int kPoolBytes = 8 * kPoolPlane;
// h2: a 10 x 10 zero-haloed image, 16 planes.
constexpr int kH2W = kOutW + 2, kH2Row = kH2W * 16, kH2Plane = kH2W * kH2W * 16 + 16;
constexpr int kH2Bytes = 16 * kH2Plane;
// The identity and conv2's v: pixel-major, 16 chunks of 16 bytes per pixel, chunk c16 at slot c16 ^ (pixel & 7).
constexpr int kTileBytes = kPix * kP * 2;
constexpr int kCompute = 256;  // two warpgroups: output channels 0-63 and 64-127
constexpr int kThreads = kCompute + 32;  // + the producer warp
// The squeeze-excite's parameters, copied in at the start (they are on the block's critical tail otherwise: ~5 us of
// dependent L2 round trips measured): fc1 [8][128], fc1_b [8], fc2 [128][8], fc2_b [128], fp32.
constexpr int kFc1W = 0, kFc1B = kFc1W + kHidden * kP * 4, kFc2W = kFc1B + 64, kFc2B = kFc2W + kP * kHidden * 4,
              kFcBytes = kFc2B + kP * 4;
constexpr int kRingOff = 0, kImgOff = kRingOff + kStages * kChunkBytes, kH2Off = kImgOff + kImgBytes,
              kIdtOff = kH2Off + kH2Bytes, kPoolOff = kIdtOff, kPartOff = kIdtOff + kTileBytes,
              kFcOff = kPartOff + (8 * 64 + 8 + kP) * 4, kBarOff = kFcOff + kFcBytes;
constexpr size_t kSmemBytes = size_t(kBarOff) + (2 * kStages + 1) * 8;
constexpr int kFirstChunks = 2;  // streamed before the image is in
static_assert(kTileBytes <= kImgBytes, "v is staged over the input image");
static_assert(kPoolBytes <= kTileBytes, "the pooled image lives where the identity goes once the shortcut GEMM ran");
static_assert(kChunks == kConv2Chunk + 18, "shortcut, conv1's 9 taps, conv2's 9 taps x 2 halves");

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KFUSE_FUSED_DOWN_BLOCK_DEVICE 1
#endif

#ifdef KFUSE_FUSED_DOWN_BLOCK_DEVICE
using ptx::lds128;
using ptx::smem_desc;
using ptx::smem_u32;
using ptx::sts128;

// d (64 x 64, fp32, the warpgroup's accumulator layout) += A (shared, K-major, 64 x 16) * B (shared, K-major, 16 x 64).
template <bool kBf16>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b) {
  if constexpr (kBf16) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, 1, 1, 1, 0, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(desc_a), "l"(desc_b));
  } else {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, 1, 1, 1, 0, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(desc_a), "l"(desc_b));
  }
}

// Byte offset, within a plane of the parity image, of stride-2 tap (r, s) for output pixel (0, 0): input row 2i + r - 1
// is row parity 1 - (r == 1), sub-image row i + (r > 0) (row 0 is the halo, i.e. input row -1).
__device__ __forceinline__ constexpr int tap_offset(int r, int s) {
  return ((r == 1 ? 0 : 2) + (s == 1 ? 0 : 1)) * kSubBytes + (r > 0 ? kSubRow : 0) + (s > 0 ? 16 : 0);
}
// Pixel-major tile with swizzled 16-byte chunks (the identity, v).
__device__ __forceinline__ uint32_t tile_chunk(uint32_t base, int pix, int c16) {
  return base + (pix * 16 + (c16 ^ (pix & 7))) * 16;
}

// The barriers (a full and an empty one per ring stage, image_ready) and the zero halos of the input and h2 images.
__device__ __forceinline__ void init_barriers_and_halos(int tid, uint32_t full0, uint32_t empty0, uint32_t image_ready,
                                                        uint32_t img, uint32_t h2) {
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      ptx::mbar_init(full0 + 8 * s, 1);
      ptx::mbar_init(empty0 + 8 * s, kCompute / 32);
    }
    ptx::mbar_init(image_ready, kCompute / 32);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  // The halos of the input and h2 images stay zero: loads and epilogues write only interiors.
  if (tid < kCompute) {
    for (int i = tid; i < kImgBytes / 16; i += kCompute) sts128(img + 16 * i, make_uint4(0u, 0u, 0u, 0u));
    for (int i = tid; i < kH2Bytes / 16; i += kCompute) sts128(h2 + 16 * i, make_uint4(0u, 0u, 0u, 0u));
  }
}

// The producer thread: the 28 filter chunks through the ring.
__device__ __forceinline__ void stream_filters(const void* filters, uint32_t ring, uint32_t full0, uint32_t empty0,
                                               uint32_t image_ready) {
  const char* src = static_cast<const char*>(filters);
  for (int c = 0; c < kChunks; ++c) {
    const int s = c % kStages;
    // Past the first two chunks, only once the image has landed: otherwise the first 128 KB of filters share the
    // SM's L2 ingress with the image, which every warp waits for (measured: 3 us for its 32 KB).
    if (c == kFirstChunks) ptx::mbar_wait(image_ready, 0);
    if (c >= kStages) ptx::mbar_wait(empty0 + 8 * s, (c / kStages - 1) & 1);
    ptx::mbar_arrive_expect_tx(full0 + 8 * s, kChunkBytes);
    ptx::bulk_copy_g2s(ring + s * kChunkBytes, src + size_t(c) * kChunkBytes, kChunkBytes, full0 + 8 * s);
  }
}

// The squeeze-excite's weights (parameters too) in the first cp.async group, waited for with the image.
__device__ __forceinline__ void load_se_weights(const FusedDownBlockArgs& p, uint32_t fc, int tid) {
  const struct {
    const float* src;
    int off, bytes;
  } fc_params[4] = {{p.fc1_w, kFc1W, kHidden * kP * 4}, {p.fc1_b, kFc1B, kHidden * 4},
                    {p.fc2_w, kFc2W, kP * kHidden * 4}, {p.fc2_b, kFc2B, kP * 4}};
#pragma unroll
  for (const auto& f : fc_params)
    for (int i = tid; i < f.bytes / 16; i += kCompute) ptx::cp_async16(fc + f.off + 16 * i, f.src + 4 * i);
  ptx::cp_async_commit();
}

// The input image into the parity planes: 256 pixels x 8 chunks, consecutive threads on consecutive 16 bytes.
__device__ __forceinline__ void load_image(const void* a, int image, uint32_t img, uint32_t image_ready, int tid) {
  const uint4* a_in = static_cast<const uint4*>(a) + int64_t(image) * kInPix * 8;
#pragma unroll
  for (int k = 0; k < kInPix * 8 / kCompute; ++k) {
    const int id = k * kCompute + tid, pix = id >> 3, c8 = id & 7, y = pix / kInW, x = pix % kInW;
    ptx::cp_async16(img + c8 * kImgPlane + ((y & 1) * 2 + (x & 1)) * kSubBytes + ((y >> 1) + 1) * kSubRow +
                        ((x >> 1) + 1) * 16,
                    a_in + id);
  }
  ptx::cp_async_commit();
  ptx::cp_async_wait<0>();
  __syncwarp();
  if ((tid & 31) == 0) ptx::mbar_arrive(image_ready);
}

// The shortcut's pool: avgpool3x3 / stride 2 / pad 1 of a, padding counted (always / 9), in fp32, one rounding.
template <class T>
__device__ __forceinline__ void pool_image(uint32_t img, uint32_t pool, int tid) {
#pragma unroll 1
  for (int k = 0; k < kPix * 8 / kCompute; ++k) {
    const int id = k * kCompute + tid, po = id >> 3, c8 = id & 7, i = po / kOutW, j = po % kOutW;
    float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int t = 0; t < 9; ++t) {
      float f[8];
      unpack8<T>(lds128(img + c8 * kImgPlane + tap_offset(t / 3, t % 3) + (i * kSubW + j) * 16), f);
#pragma unroll
      for (int e = 0; e < 8; ++e) sum[e] += f[e];
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) sum[e] = sum[e] / 9.f;
    sts128(pool + c8 * kPoolPlane + po * 16, pack8<T>(sum));
  }
}

// The filter ring as a compute warp sees it: the B descriptors of this warpgroup's 64 output channels in a stage,
// the wait for a chunk, and its release.
struct FilterRing {
  uint32_t ring, full0, empty0, b_half;
  int lane;
  __device__ __forceinline__ uint64_t b_desc(int slot, int kk) const {
    return smem_desc(ring + slot * kChunkBytes + 2 * kk * kFilterPlane + b_half, kFilterPlane, 8 * 16);
  }
  __device__ __forceinline__ void wait(int c) const { ptx::mbar_wait(full0 + 8 * (c % kStages), (c / kStages) & 1); }
  // Once this warp's MMAs that read chunk c completed (after a wgmma wait): its stage may be refilled.
  __device__ __forceinline__ void release(int c) const {
    __syncwarp();
    if (lane == 0) ptx::mbar_arrive(empty0 + 8 * (c % kStages));
  }
};

// The shortcut (chunk 0) and conv1 (chunks 1-9), one commit group per chunk, one group left in flight.
template <bool kBf16>
__device__ __forceinline__ void shortcut_and_conv1(float (&acc_sc)[32], float (&acc)[32], const FilterRing& fr,
                                                   uint32_t pool, uint32_t img) {
#pragma unroll
  for (int i = 0; i < 32; ++i) acc_sc[i] = 0.f, acc[i] = 0.f;
  fr.wait(0);
  ptx::hold(acc_sc);
  ptx::hold(acc);  // zeroed before the first batch: ptxas would otherwise wait for it before conv1's
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    wgmma_m64n64k16_ss<kBf16>(acc_sc, smem_desc(pool + 2 * kk * kPoolPlane, kPoolPlane, 8 * 16), fr.b_desc(0, kk));
  ptx::wgmma_commit();
#pragma unroll
  for (int t = 0; t < 9; ++t) {
    const int c = kConv1Chunk + t;
    fr.wait(c);
    ptx::hold(acc);
    ptx::wgmma_fence();  // as CUTLASS's mainloop: one fence per batch, so that ptxas need not inject waits
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma_m64n64k16_ss<kBf16>(
          acc, smem_desc(img + 2 * kk * kImgPlane + tap_offset(t / 3, t % 3), kImgPlane, kSubRow),
          fr.b_desc(c % kStages, kk));
    ptx::wgmma_commit();
    ptx::wgmma_wait<1>();
    ptx::hold(acc);
    fr.release(c - 1);
  }
  ptx::wgmma_wait<0>();
  ptx::hold(acc);
  ptx::hold(acc_sc);
  fr.release(kConv2Chunk - 1);
}

// Epilogues through stmatrix: the identity T(acc_sc) into its tile, h2 into the haloed image. Lane l addresses row
// l % 8 of matrix l / 8: pixel 16 w4 + 8 (matrix & 1) + l % 8, channel block (8 wg + 2 jj + (matrix >> 1)).
template <class T>
__device__ __forceinline__ void store_identity_and_h2(const float (&acc_sc)[32], const float (&acc)[32], uint32_t idt,
                                                      uint32_t h2_row, int pix_l, int wg, int mi, float b1b,
                                                      const FaithfulPost& h2_post) {
#pragma unroll
  for (int jj = 0; jj < 4; ++jj) {
    const int cb = 8 * wg + 2 * jj + (mi >> 1);
    uint32_t r[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) r[u] = pack2<T>(acc_sc[8 * jj + 2 * u], acc_sc[8 * jj + 2 * u + 1]);
    ptx::stsm_x4(tile_chunk(idt, pix_l, cb), r);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      r[u] = relu_post_pair<T>(acc[8 * jj + 2 * u], acc[8 * jj + 2 * u + 1], b1b, h2_post);
    }
    ptx::stsm_x4(h2_row + cb * kH2Plane, r);
  }
}

// conv2: chunk 10 + 2 t + kh is tap t's input channels 64 kh .. 64 kh + 63.
template <bool kBf16>
__device__ __forceinline__ void conv2(float (&acc)[32], const FilterRing& fr, uint32_t h2) {
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = 0.f;
#pragma unroll
  for (int t = 0; t < 9; ++t)
#pragma unroll
    for (int kh = 0; kh < 2; ++kh) {
      const int c = kConv2Chunk + 2 * t + kh;
      fr.wait(c);
      ptx::hold(acc);
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma_m64n64k16_ss<kBf16>(
            acc, smem_desc(h2 + (8 * kh + 2 * kk) * kH2Plane + ((t / 3) * kH2W + t % 3) * 16, kH2Plane, kH2Row),
            fr.b_desc(c % kStages, kk));
      ptx::wgmma_commit();
      if (c > kConv2Chunk) {
        ptx::wgmma_wait<1>();
        ptx::hold(acc);
        fr.release(c - 1);
      }
    }
  ptx::wgmma_wait<0>();
  ptx::hold(acc);
  fr.release(kChunks - 1);
}

// v = T(acc) into its tile; the squeeze's sums of o = T(v * scale + b2b): this thread's two rows, then the 8 lanes of
// a channel (g), into part[warp] (the 4 warps of the warpgroup are summed by the readers).
template <class T>
__device__ __forceinline__ void store_v_and_squeeze(const float (&acc)[32], uint32_t vt, float* part, int pix_l,
                                                    int wg, int mi, int warp, int g, int q, float scale, float b2b) {
  float cs[16];
#pragma unroll
  for (int jj = 0; jj < 4; ++jj) {
    const int cb = 8 * wg + 2 * jj + (mi >> 1);
    uint32_t r[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) r[u] = pack2<T>(acc[8 * jj + 2 * u], acc[8 * jj + 2 * u + 1]);
    ptx::stsm_x4(tile_chunk(vt, pix_l, cb), r);
    // r[0] / r[1]: column block 2 jj, rows g / g + 8; r[2] / r[3]: block 2 jj + 1.
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const float2 lo = pair_to_f2<T>(r[2 * b]), hi = pair_to_f2<T>(r[2 * b + 1]);
      cs[2 * (2 * jj + b)] = affine1<T>(lo.x, scale, b2b) + affine1<T>(hi.x, scale, b2b);
      cs[2 * (2 * jj + b) + 1] = affine1<T>(lo.y, scale, b2b) + affine1<T>(hi.y, scale, b2b);
    }
  }
#pragma unroll
  for (int k = 0; k < 16; ++k) {
#pragma unroll
    for (int off = 4; off <= 16; off <<= 1) cs[k] += __shfl_xor_sync(0xffffffffu, cs[k], off);
  }
  if (g == 0) {
#pragma unroll
    for (int k = 0; k < 16; ++k) part[warp * 64 + 8 * (k >> 1) + 2 * q + (k & 1)] = cs[k];
  }
}

// fc1 + ReLU: warp k computes hidden unit k (lane's channels lane + 32 u, then over the lanes), into shared memory;
// then one gate per channel (fc2 + sigmoid) by the first 128 threads. Short dependency chains between two barriers:
// each warp computing all 8 units (40 dependent shuffles) and each thread 8 gates made this tail ~30% of the
// kernel's stall samples (ncu).
__device__ __forceinline__ void excite_gates(const float* part, float* hid, float* gates, const float* fc1_w,
                                             const float* fc1_b, const float* fc2_w, const float* fc2_b, int tid,
                                             int warp, int lane) {
  static_assert(kHidden == kCompute / 32, "one warp per hidden unit");
  {
    float s = 0.f;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int c = lane + 32 * u, w0 = 4 * (c >> 6), cl = c & 63;
      const float m = (((part[w0 * 64 + cl] + part[(w0 + 1) * 64 + cl]) + part[(w0 + 2) * 64 + cl]) +
                       part[(w0 + 3) * 64 + cl]) /
                      float(kPix);
      s += fc1_w[warp * kP + c] * m;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) hid[warp] = relu_keep_nan(s + fc1_b[warp]);
  }
  ptx::named_barrier(1, kCompute);
  if (tid < kP) {
    float s = fc2_b[tid];
#pragma unroll
    for (int k = 0; k < kHidden; ++k) s += fc2_w[tid * kHidden + k] * hid[k];
    gates[tid] = 1.f / (1.f + __expf(-s));
  }
}

// The join: this thread's 8 channels 8 c16 + e over its 4 pixels, y = relu(o * gate + identity) and a_next, 16-byte
// coalesced stores.
template <class T>
__device__ __forceinline__ void excite_join_store(const FusedDownBlockArgs& p, const float* gates, uint32_t vt,
                                                  uint32_t idt, int image, int tid, float scale, float b2b) {
  const int c16 = tid & 15;
  float gate[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) gate[e] = gates[8 * c16 + e];
  const FaithfulPost next_post = faithful_post<T>(p.a_next ? __ldg(p.next_b1a) : 0.f);
  uint4* const y_out = static_cast<uint4*>(p.y);
  uint4* const a_next = static_cast<uint4*>(p.a_next);
#pragma unroll
  for (int k = 0; k < kPix * 16 / kCompute; ++k) {
    const int pix = (tid >> 4) + k * (kCompute / 16);
    uint4 y8, a8;
    excite_join8<T>(lds128(tile_chunk(vt, pix, c16)), lds128(tile_chunk(idt, pix, c16)), gate, scale, b2b, next_post,
                    y8, a8);
    const int64_t o = (int64_t(image) * kPix + pix) * 16 + c16;
    if (y_out) y_out[o] = y8;
    if (a_next) a_next[o] = a8;
  }
}

#endif  // KFUSE_FUSED_DOWN_BLOCK_DEVICE

template <class T, bool kBf16>
__global__ void __launch_bounds__(kThreads, 1) fused_down_block_wgmma_kernel(const FusedDownBlockArgs p) {
#ifdef KFUSE_FUSED_DOWN_BLOCK_DEVICE
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t base = smem_u32(smem);
  const uint32_t ring = base + kRingOff, img = base + kImgOff, pool = base + kPoolOff, h2 = base + kH2Off,
                 idt = base + kIdtOff, fc = base + kFcOff, full0 = base + kBarOff, empty0 = full0 + 8 * kStages,
                 image_ready = empty0 + 8 * kStages;
  float* const part = reinterpret_cast<float*>(smem + kPartOff);  // [8 warps][64 channels of the warp's group]
  const float* const fc1_w = reinterpret_cast<const float*>(smem + kFcOff + kFc1W);
  const float* const fc1_b = reinterpret_cast<const float*>(smem + kFcOff + kFc1B);
  const float* const fc2_w = reinterpret_cast<const float*>(smem + kFcOff + kFc2W);
  const float* const fc2_b = reinterpret_cast<const float*>(smem + kFcOff + kFc2B);
  const int tid = threadIdx.x;

  init_barriers_and_halos(tid, full0, empty0, image_ready, img, h2);
  __syncthreads();  // also publishes the barriers' initialization; the last CTA-wide barrier

  if (tid >= kCompute) {
    // The producer: the filters are parameters, never written by the kernels before this one, so the stream starts
    // before the programmatic wait.
    if (tid == kCompute) stream_filters(p.filters, ring, full0, empty0, image_ready);
    return;
  }
  load_se_weights(p, fc, tid);
  pdl_wait_for_predecessor();
  pdl_allow_successor();

  const int image = blockIdx.x;
  load_image(p.a, image, img, image_ready, tid);
  ptx::named_barrier(1, kCompute);
  pool_image<T>(img, pool, tid);
  ptx::fence_proxy_async();
  ptx::named_barrier(1, kCompute);

  const int lane = tid & 31, warp = tid >> 5, wg = warp >> 2, w4 = warp & 3, q = lane & 3, g = lane >> 2;
  // this warpgroup's 64 output channels in a filter plane
  const FilterRing fr{ring, full0, empty0, uint32_t(wg * (kFilterPlane / 2)), lane};

  float acc_sc[32], acc[32];
  shortcut_and_conv1<kBf16>(acc_sc, acc, fr, pool, img);
  ptx::named_barrier(1, kCompute);  // both warpgroups' shortcut MMAs are done with the pooled image: idt goes over it

  const float b1b = __ldg(p.scalars + 1), scale = __ldg(p.scalars + 3), b2b = __ldg(p.scalars + 4);
  const FaithfulPost h2_post = faithful_post<T>(__ldg(p.scalars + 2));  // b2a
  const int mi = lane >> 3, pix_l = 16 * w4 + 8 * (mi & 1) + (lane & 7);
  const uint32_t h2_row = h2 + ((pix_l / kOutW + 1) * kH2W + pix_l % kOutW + 1) * 16;
  store_identity_and_h2<T>(acc_sc, acc, idt, h2_row, pix_l, wg, mi, b1b, h2_post);
  ptx::fence_proxy_async();
  ptx::named_barrier(1, kCompute);  // conv2 reads every channel of h2

  conv2<kBf16>(acc, fr, h2);

  // v goes over the input image, which conv1 no longer reads.
  const uint32_t vt = img;
  store_v_and_squeeze<T>(acc, vt, part, pix_l, wg, mi, warp, g, q, scale, b2b);
  ptx::named_barrier(1, kCompute);  // the sums and v are in

  float* const hid = part + 8 * 64;  // the sums are read before the barrier below, gates after it
  float* const gates = hid + 8;
  excite_gates(part, hid, gates, fc1_w, fc1_b, fc2_w, fc2_b, tid, warp, lane);
  ptx::named_barrier(1, kCompute);
  excite_join_store<T>(p, gates, vt, idt, image, tid, scale, b2b);
#else
  // Compiled for another architecture: never launched (fused_down_block_smem_bytes requires compute capability 9.0).
  __trap();
#endif
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace

namespace {
size_t per_image_smem_bytes(int in_planes, int planes, int hidden, int h, int w, int cc_major, int cc_minor) {
  return in_planes == kCin && planes == kP && hidden == kHidden && h == kInH && w == kInW && cc_major == 9 &&
                 cc_minor == 0
             ? kSmemBytes
             : 0;
}
}  // namespace

size_t fused_down_block_smem_bytes(int in_planes, int planes, int hidden, int h, int w, int cc_major, int cc_minor) {
  if (const size_t s = per_image_smem_bytes(in_planes, planes, hidden, h, w, cc_major, cc_minor)) return s;
  return fused_down_block_group_smem_bytes(in_planes, planes, hidden, h, w, cc_major, cc_minor);
}

int fused_down_block_filter_ranks(int in_planes, int planes, int hidden) {
  if (in_planes == kCin && planes == kP && hidden == kHidden) return 1;
  return fused_down_block_group_ranks(in_planes, planes, hidden);
}

// Both shapes' checks here (the device, the shape, the arguments they share), then the kernel of the shape.
cudaError_t launch_fused_down_block_wgmma(const FusedDownBlockArgs& p, ConvDType dtype, cudaStream_t stream) {
  int dev = 0, major = 0, minor = 0, optin = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (err != cudaSuccess) return err;
  const size_t smem = fused_down_block_smem_bytes(p.in_planes, p.planes, p.hidden, p.h, p.w, major, minor);
  if (smem == 0 || smem > size_t(optin) || p.n <= 0 || !p.a || !p.filters || !p.scalars || !p.fc1_w || !p.fc1_b ||
      !p.fc2_w || !p.fc2_b || (!p.y && !p.a_next) || (p.a_next && !p.next_b1a))
    return cudaErrorInvalidValue;
  const void* const pointers[] = {p.a, p.filters, p.y, p.a_next};
  for (const void* ptr : pointers)
    if (ptr && !aligned16(ptr)) return cudaErrorInvalidValue;
  if (p.in_planes != kCin || p.planes != kP) return launch_fused_down_block_group_wgmma(p, dtype, smem, stream);
  const auto kernel = dtype == ConvDType::kF16 ? fused_down_block_wgmma_kernel<__half, false>
                                               : fused_down_block_wgmma_kernel<__nv_bfloat16, true>;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (err != cudaSuccess) return err;
  err = launch_kernel(kernel, p.n, kThreads, smem, stream, true, p);
  return err != cudaSuccess ? err : cudaGetLastError();
}

}  // namespace kfuse::kernels
