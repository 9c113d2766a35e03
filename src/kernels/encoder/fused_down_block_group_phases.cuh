// The device side of block 3's group kernel (fused_down_block_group_wgmma.cu): its geometry and shared-memory
// layout, the register-A warpgroup MMA, the group's handshake through global memory, the tap loop and the kernel's
// phases, each a device function of its own. The reasons for this shape are at the top of
// fused_down_block_group_wgmma.cu.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/encoder/encoder_kernels.h"
#include "kernels/encoder/numeric.cuh"
#include "kernels/shared_memory_ptx.cuh"
#include "kernels/wgmma_ptx.cuh"

namespace kfuse::kernels::down_group {

constexpr int kCin = 128, kP = 256, kHidden = kP / 16;
constexpr int kRanks = 4, kPr = kP / kRanks;  // the group's CTAs, each with 64 output channels
constexpr int kImages = 4;                     // per group
constexpr int kInW = 8, kInPix = 64, kOutW = 4, kOutPix = 16, kRows = kImages * kOutPix;
// The filter stream of one CTA: chunk 0 the shortcut, 1-9 conv1's taps, 10 + 2 t + kh conv2's tap t, input half kh.
constexpr int kFilterPlane = kPr * 16;          // a (tap, 8-input-channel group) plane: 64 output channels x 16 B
constexpr int kChunkBytes = 16 * kFilterPlane;  // 16 KB: 128 input channels of one tap
constexpr int kConv2Chunk = 10, kChunks = 28, kTaps = 9;
constexpr int kStages = 6, kFirstChunks = 2;
// Activations: pixel-major, 16-byte chunks swizzled.
constexpr int kImgPix = kCin * 2, kImgBytes = kImages * kInPix * kImgPix;  // [image][8 x 8][16 chunks]
constexpr int kZeroBytes = kP * 2;                                         // a zero pixel of up to 32 chunks
constexpr int kTilePix = kPr * 2, kTileBytes = kRows * kTilePix;           // idt, v: [row][8 chunks]
constexpr int kH2Pix = kP * 2, kH2Bytes = kRows * kH2Pix;                  // [image][4 x 4][32 chunks]
constexpr int kCompute = 256;                                              // two warpgroups
constexpr int kThreads = kCompute + 32;                                    // + the producer warp
// Over the input image once conv1 is done: v, the identity, conv2's accumulator exchange (2 x 128 threads x 16 fp32).
constexpr int kVOff = 0, kIdtTileOff = kTileBytes, kXchgOff = 2 * kTileBytes, kXchgBytes = 2 * 128 * 16 * 4;
// The squeeze-excite's parameters of this CTA's channels, fp32: fc1 [16][64] (columns 64 rank ..), fc1_b [16],
// fc2 [64][16] (rows 64 rank ..), fc2_b [64].
constexpr int kFc1W = 0, kFc1B = kFc1W + kHidden * kPr * 4, kFc2W = kFc1B + kHidden * 4,
              kFc2B = kFc2W + kPr * kHidden * 4, kFcBytes = kFc2B + kPr * 4;
// Its scratch: channel means [image][64], fc1 partial sums [rank][image][16] (all 4 CTAs'), hidden units [warp][16],
// gates [warp][32], the CTA's ticket.
constexpr int kMean = 0, kHpart = kMean + kImages * kPr * 4, kHid = kHpart + kRanks * kImages * kHidden * 4,
              kGate = kHid + 8 * kHidden * 4, kTicket = kGate + 8 * 32 * 4, kSeBytes = kTicket + 16;
constexpr int kRingOff = 0, kScOff = kRingOff + kStages * kChunkBytes, kImgOff = kScOff + kChunkBytes,
              kZeroOff = kImgOff + kImgBytes, kH2Off = kZeroOff + kZeroBytes, kFcOff = kH2Off + kH2Bytes,
              kSeOff = kFcOff + kFcBytes, kBarOff = kSeOff + kSeBytes;
// full and empty per stage, the shortcut's filter, image_ready, conv1_done, shortcut_done
constexpr int kBarriers = 2 * kStages + 4;
constexpr size_t kSmemBytes = size_t(kBarOff) + kBarriers * 8;
static_assert(kXchgOff + kXchgBytes <= kImgBytes, "v, the identity and the exchange fit over the input image");
static_assert(kChunks == kConv2Chunk + 2 * kTaps, "shortcut, conv1's 9 taps, conv2's 9 taps x 2 halves");
static_assert(kBarOff % 8 == 0 && kSmemBytes <= 227 * 1024, "shared memory");

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KFUSE_FUSED_DOWN_GROUP_DEVICE 1
#endif

#ifdef KFUSE_FUSED_DOWN_GROUP_DEVICE
using ptx::lds128;
using ptx::smem_desc;
using ptx::smem_u32;
using ptx::sts128;

// d (64 x 64, fp32, the warpgroup's accumulator layout) += A (registers: warp w's rows 16 w .. 16 w + 15 as
// ldmatrix.x4 loads them, 64 x 16) * B (shared, K-major, 16 x 64).
template <bool kBf16>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b) {
  if constexpr (kBf16) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, 1, 1, 1, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
  } else {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, 1, 1, 1, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
  }
}

// Swizzle of the input image's pixel (iy, ix): the 8 rows of an ldmatrix matrix are 8 output pixels (2 rows x 4
// columns), whose stride-2 taps read ix / 2 = ox + const (4 consecutive values) and iy / 2 = oy + const (2
// consecutive): 8 different values of f. Out-of-image pixels (-1) keep the formula (the zero pixel is read through
// it, so the 8 rows still differ).
__device__ __forceinline__ int img_swizzle(int iy, int ix) { return ((ix >> 1) & 3) | (((iy >> 1) & 1) << 2); }
// Swizzle of a 4 x 4 map's pixel (h2, the tiles): stride-1 taps read 4 consecutive ix and 2 consecutive iy; for an
// in-map pixel p = 4 iy + ix it is p & 7.
__device__ __forceinline__ int map_swizzle(int iy, int ix) { return (ix & 3) | ((iy & 1) << 2); }

// Where a lane's ldmatrix row of A starts (a pixel of 16-byte chunks, or the zero pixel) and that pixel's swizzle.
struct RowSource {
  uint32_t pixel;
  int swz;
};
// One chunk's A fragments: 8 k-steps of 16 channels from chunk `first` of the row's pixel; `hi` (lane / 16) picks
// the upper 8 channels of each step.
__device__ __forceinline__ void load_a(uint32_t (&a)[8][4], RowSource src, int first, int hi) {
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) ptx::ldsm_x4(a[kk], src.pixel + (((first + 2 * kk + hi) ^ src.swz) << 4));
}

// The group's handshake on a counter in global memory (CUTLASS's semaphore pattern): the writing threads' global
// writes, a barrier among them, then one thread's release increment (group_arrive, `per_launch` increments per group
// and launch); a thread later waits until the counter shows all of this launch's increments (the generation: an
// increment's old value / per_launch), then a barrier of the readers (group_wait). Counters only grow.
__device__ __forceinline__ unsigned group_arrive(unsigned* counter, unsigned per_launch) {
  unsigned old;
  asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
  asm volatile("atom.relaxed.gpu.global.add.u32 %0, [%1], 1;\n" : "=r"(old) : "l"(counter) : "memory");
  return (old / per_launch + 1) * per_launch;
}
__device__ __forceinline__ void group_wait(const unsigned* counter, unsigned target) {
  unsigned now;
  do {
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(now) : "l"(counter) : "memory");
  } while (int(now - target) < 0);
}
__device__ __forceinline__ void group_handshake(unsigned* counter, int tid) {
  ptx::named_barrier(1, 256);
  if (tid == 0) group_wait(counter, group_arrive(counter, kRanks));
  ptx::named_barrier(1, 256);
}

// The 9 taps of a convolution into acc: tap t's A fragments from a_src(t) (chunk `first` on), its filter chunk at
// b_addr(t) (16 KB, tap planes) once wait(t) returned; release(t) once its MMAs completed. One commit group per tap,
// one group in flight, the next tap's fragments loading while a tap's MMAs run (two register buffers, so the loop
// takes two taps per iteration and stays rolled).
template <bool kBf16, class Src, class BAddr, class Wait, class Release>
__device__ __forceinline__ void conv_taps(float (&acc)[32], uint32_t (&a)[2][8][4], int first, int hi, Src a_src,
                                          BAddr b_addr, Wait wait, Release release) {
  auto step = [&](auto buffer, int t) {
    constexpr int B = decltype(buffer)::value;
    wait(t);
    ptx::hold(acc);
    ptx::hold(a[B]);
    ptx::wgmma_fence();  // one fence per batch (as CUTLASS's mainloop), so that ptxas need not inject waits
    const uint32_t b = b_addr(t);
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
      wgmma_m64n64k16_rs<kBf16>(acc, a[B][kk], smem_desc(b + 2 * kk * kFilterPlane, kFilterPlane, 8 * 16));
    ptx::wgmma_commit();
    if (t > 0) {
      ptx::wgmma_wait<1>();
      ptx::hold(acc);
      ptx::hold(a[B ^ 1]);
      release(t - 1);
    }
    if (t + 1 < kTaps) load_a(a[B ^ 1], a_src(t + 1), first, hi);
  };
  load_a(a[0], a_src(0), first, hi);
#pragma unroll 1
  for (int t = 0; t + 1 < kTaps; t += 2) {
    step(std::integral_constant<int, 0>{}, t);
    step(std::integral_constant<int, 1>{}, t + 1);
  }
  step(std::integral_constant<int, 0>{}, kTaps - 1);
  ptx::wgmma_wait<0>();
  ptx::hold(acc);
  release(kTaps - 1);
}

// The barriers (full and empty per ring stage, the shortcut's filter, image_ready, conv1_done, shortcut_done), the
// ticket and the zero pixel. Returns the ticket once the CTA-wide barrier published it.
__device__ __forceinline__ int init_barriers_and_ticket(unsigned* sync, unsigned char* smem, uint32_t full0,
                                                        uint32_t zero, int tid) {
  const uint32_t empty0 = full0 + 8 * kStages, sc_full = empty0 + 8 * kStages, image_ready = sc_full + 8,
                 conv1_done = image_ready + 8, shortcut_done = conv1_done + 8;
  if (tid == 0) {
    // The ticket: CTAs take them in the order they start; atomicInc wraps to 0 after the grid's last one. Asked
    // first: its round trip overlaps the barriers' initialization.
    const unsigned ticket = atomicInc(sync, gridDim.x - 1);
    for (int s = 0; s < kStages; ++s) {
      ptx::mbar_init(full0 + 8 * s, 1);
      ptx::mbar_init(empty0 + 8 * s, 4);  // the 4 warps of the warpgroup that reads the chunk
    }
    ptx::mbar_init(sc_full, 1);
    ptx::mbar_init(image_ready, kCompute / 32);
    ptx::mbar_init(conv1_done, 4);
    ptx::mbar_init(shortcut_done, 4);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    reinterpret_cast<unsigned*>(smem + kSeOff + kTicket)[0] = ticket;
  }
  if (tid < kZeroBytes / 16) sts128(zero + 16 * tid, make_uint4(0u, 0u, 0u, 0u));
  __syncthreads();  // publishes the barriers' initialization and the ticket; the last CTA-wide barrier
  return int(reinterpret_cast<const unsigned*>(smem + kSeOff + kTicket)[0]);
}

// The squeeze-excite's weights of this CTA's channels in the first cp.async group, waited for with the image.
__device__ __forceinline__ void load_se_weights(const FusedDownBlockArgs& p, uint32_t fc, int rank, int tid) {
  for (int i = tid; i < kHidden * kPr / 4; i += kCompute)  // fc1 columns 64 rank .. 64 rank + 63 of each row
    ptx::cp_async16(fc + kFc1W + 16 * i, p.fc1_w + (i / (kPr / 4)) * kP + kPr * rank + 4 * (i % (kPr / 4)));
  for (int i = tid; i < kPr * kHidden / 4; i += kCompute)
    ptx::cp_async16(fc + kFc2W + 16 * i, p.fc2_w + kPr * kHidden * rank + 4 * i);
  if (tid < kHidden / 4) ptx::cp_async16(fc + kFc1B + 16 * tid, p.fc1_b + 4 * tid);
  if (tid < kPr / 4) ptx::cp_async16(fc + kFc2B + 16 * tid, p.fc2_b + kPr * rank + 4 * tid);
  ptx::cp_async_commit();
}

// The group's 4 input images, swizzled (images past n: zeros; their rows are never stored).
__device__ __forceinline__ void load_images(const FusedDownBlockArgs& p, int image0, uint32_t img,
                                            uint32_t image_ready, int tid) {
  const uint4* a_in = static_cast<const uint4*>(p.a);
#pragma unroll 4
  for (int k = 0; k < kImages * kInPix * 16 / kCompute; ++k) {
    const int id = k * kCompute + tid, i = id >> 10, pix = (id >> 4) & 63, c = id & 15;
    const uint32_t dst = img + (i * kInPix + pix) * kImgPix + ((c ^ img_swizzle(pix >> 3, pix & 7)) << 4);
    if (image0 + i < p.n)
      ptx::cp_async16(dst, a_in + (int64_t(image0 + i) * kInPix + pix) * 16 + c);
    else
      sts128(dst, make_uint4(0u, 0u, 0u, 0u));
  }
  ptx::cp_async_commit();
  ptx::cp_async_wait<0>();
  __syncwarp();
  if ((tid & 31) == 0) ptx::mbar_arrive(image_ready);
}

// The filter ring as a compute warp sees it (chunk c >= 1 in stage (c - 1) % kStages).
struct FilterRing {
  uint32_t ring, full0, empty0;
  int lane;
  __device__ __forceinline__ static int slot_of(int c) { return (c - 1) % kStages; }
  __device__ __forceinline__ uint32_t chunk(int c) const { return ring + slot_of(c) * kChunkBytes; }
  __device__ __forceinline__ void wait(int c) const { ptx::mbar_wait(full0 + 8 * slot_of(c), ((c - 1) / kStages) & 1); }
  // Once this warp's MMAs that read chunk c completed (after a wgmma wait): its stage may be refilled.
  __device__ __forceinline__ void release(int c) const {
    __syncwarp();
    if (lane == 0) ptx::mbar_arrive(empty0 + 8 * slot_of(c));
  }
};

// This lane's ldmatrix / stmatrix row: output pixel pl of image w4 (row 16 w4 + pl of M), and where its A rows of
// conv1's (stride 2) and conv2's taps start.
struct LaneRow {
  int w4, pl, oy, ox, row;
  __device__ __forceinline__ RowSource conv1(uint32_t img, uint32_t zero, int t) const {
    const int iy = 2 * oy + t / 3 - 1, ix = 2 * ox + t % 3 - 1;
    const uint32_t px = iy >= 0 && ix >= 0 ? img + (w4 * kInPix + iy * kInW + ix) * kImgPix : zero;
    return RowSource{px, img_swizzle(iy, ix)};
  }
  __device__ __forceinline__ RowSource conv2(uint32_t h2, uint32_t zero, int t) const {
    const int iy = oy + t / 3 - 1, ix = ox + t % 3 - 1;
    const bool in = iy >= 0 && iy < kOutW && ix >= 0 && ix < kOutW;
    return RowSource{in ? h2 + (w4 * kOutPix + iy * kOutW + ix) * kH2Pix : zero, map_swizzle(iy, ix)};
  }
};

// Warpgroup 0: conv1 (chunks 1-9 of the ring), then h2 through stmatrix into this CTA's channels of the local h2
// (lane l addresses row l % 8 of matrix l / 8: pixel pl, channel block 2 jj + hi), then to args.h2 and the group's
// counter. Returns the counter's target (thread 0; 0 elsewhere).
template <class T, bool kBf16>
__device__ __forceinline__ unsigned conv1_and_publish_h2(const FusedDownBlockArgs& p, float (&acc)[32],
                                                         uint32_t (&a)[2][8][4], const FilterRing& fr, LaneRow lr,
                                                         uint32_t img, uint32_t zero, uint32_t h2, uint32_t conv1_done,
                                                         float b1b, const FaithfulPost& h2_post, int rank, int group,
                                                         int image0, int hi, int tid) {
  const int lane = fr.lane;
  unsigned h2_target = 0;
  conv_taps<kBf16>(
      acc, a, 0, hi, [&](int t) { return lr.conv1(img, zero, t); }, [&](int t) { return fr.chunk(1 + t); },
      [&](int t) { fr.wait(1 + t); }, [&](int t) { fr.release(1 + t); });
  __syncwarp();
  if (lane == 0) ptx::mbar_arrive(conv1_done);
#pragma unroll
  for (int jj = 0; jj < 4; ++jj) {
    const int cb = 2 * jj + hi;
    uint32_t r[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      r[u] = relu_post_pair<T>(acc[8 * jj + 2 * u], acc[8 * jj + 2 * u + 1], b1b, h2_post);
    }
    ptx::stsm_x4(h2 + lr.row * kH2Pix + (((kPr / 8 * rank + cb) ^ (lr.pl & 7)) << 4), r);
  }
  __syncwarp();
  // Each warp copies the rows it wrote (its image: 16 pixels x 8 chunks) and increments the counter itself (16
  // increments per group and launch), so that the warpgroup needs no barrier of its own.
  uint4* const h2_global = static_cast<uint4*>(p.h2);
  const int image = image0 + lr.w4;
#pragma unroll
  for (int k = 0; k < kOutPix * 8 / 32; ++k) {
    const int id = k * 32 + lane, px = 16 * lr.w4 + (id >> 3), j = id & 7;
    if (image < p.n)
      h2_global[(int64_t(image) * kOutPix + (px & 15)) * (kP / 8) + kPr / 8 * rank + j] =
          lds128(h2 + px * kH2Pix + (((kPr / 8 * rank + j) ^ (px & 7)) << 4));
  }
  __syncwarp();
  if (lane == 0) {
    const unsigned target = group_arrive(p.sync + 1 + 2 * group, kRanks * 4);
    if (tid == 0) h2_target = target;
  }
  return h2_target;
}

// Warpgroup 1: the shortcut's taps on conv1's A fragments with the 1x1 filter (its own buffer, the same on every tap:
// the pooled shortcut is the sum over the taps / 9), then the identity into its tile over the input image.
template <class T, bool kBf16>
__device__ __forceinline__ void shortcut_to_identity(float (&acc)[32], uint32_t (&a)[2][8][4], LaneRow lr,
                                                     uint32_t img, uint32_t zero, uint32_t scf, uint32_t idt,
                                                     uint32_t conv1_done, uint32_t sc_full, uint32_t shortcut_done,
                                                     int hi, int lane) {
  ptx::mbar_wait(conv1_done, 0);
  ptx::mbar_wait(sc_full, 0);
  conv_taps<kBf16>(
      acc, a, 0, hi, [&](int t) { return lr.conv1(img, zero, t); }, [&](int) { return scf; }, [](int) {}, [](int) {});
  // This warpgroup is done with the input image: the identity goes over it. (An mbarrier: with 128-thread named
  // barriers for each warpgroup, compute-sanitizer's racecheck reported hazards across the 256-thread barriers
  // after conv2, which it does not without them.)
  __syncwarp();
  if (lane == 0) ptx::mbar_arrive(shortcut_done);
  ptx::mbar_wait(shortcut_done, 0);
#pragma unroll
  for (int jj = 0; jj < 4; ++jj) {
    const int cb = 2 * jj + hi;
    uint32_t r[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) r[u] = pack2<T>(acc[8 * jj + 2 * u] / 9.f, acc[8 * jj + 2 * u + 1] / 9.f);
    ptx::stsm_x4(idt + lr.row * kTilePix + ((cb ^ (lr.pl & 7)) << 4), r);
  }
}

// The other ranks' 192 channels of h2 from args.h2 (cp.async through L2), one commit group.
__device__ __forceinline__ void gather_h2(const FusedDownBlockArgs& p, uint32_t h2, int rank, int image0, int tid) {
  const uint4* const h2_global = static_cast<const uint4*>(p.h2);
#pragma unroll
  for (int k = 0; k < kRows * 24 / kCompute; ++k) {
    const int id = k * kCompute + tid, px = id / 24, c = (id % 24 + kPr / 8 * (rank + 1)) % (kP / 8),
              image = image0 + (px >> 4);
    if (image < p.n)
      ptx::cp_async16(h2 + px * kH2Pix + ((c ^ (px & 7)) << 4),
                      h2_global + (int64_t(image) * kOutPix + (px & 15)) * (kP / 8) + c);
  }
  ptx::cp_async_commit();
}

// The two halves' sums: warpgroup g keeps channels 32 g .. 32 g + 31 (accumulator registers 16 g .. 16 g + 15:
// selected with constant indices, so that the array stays in registers) and gives the other 16 registers to the
// other warpgroup's thread of the same warp and lane.
__device__ __forceinline__ void sum_halves(const float (&acc)[32], float (&mine)[16], uint32_t xchg, int wg, int tid) {
  const int tw = tid & 127;
  float theirs[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    mine[i] = wg == 0 ? acc[i] : acc[16 + i];
    theirs[i] = wg == 0 ? acc[16 + i] : acc[i];
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
    asm volatile("st.shared.v4.f32 [%0], {%1,%2,%3,%4};\n" ::"r"(xchg + ((1 - wg) * 512 + i * 128 + tw) * 16),
                 "f"(theirs[4 * i]), "f"(theirs[4 * i + 1]), "f"(theirs[4 * i + 2]), "f"(theirs[4 * i + 3])
                 : "memory");
  ptx::named_barrier(1, kCompute);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float4 v;
    asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(xchg + (wg * 512 + i * 128 + tw) * 16));
    mine[4 * i] += v.x, mine[4 * i + 1] += v.y, mine[4 * i + 2] += v.z, mine[4 * i + 3] += v.w;
  }
}

// v = T(acc) of the warpgroup's 32 channels into its tile; the squeeze's sums of o = T(v * scale + b2b) over the
// image's 16 pixels: this thread's two rows, then the 8 lanes of a channel (g = lane / 4), as means into mean.
template <class T>
__device__ __forceinline__ void store_v_and_means(const float (&mine)[16], uint32_t vt, float* se, LaneRow lr,
                                                  int wg, int hi, int lane, int q, float scale, float b2b) {
  float cs[8];
#pragma unroll
  for (int jj = 0; jj < 2; ++jj) {
    const int cb = 2 * (2 * wg + jj) + hi;
    uint32_t r[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) r[u] = pack2<T>(mine[8 * jj + 2 * u], mine[8 * jj + 2 * u + 1]);
    ptx::stsm_x4(vt + lr.row * kTilePix + ((cb ^ (lr.pl & 7)) << 4), r);
    // r[0] / r[1]: the pair's first column block, rows g / g + 8; r[2] / r[3]: its second.
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const float2 lo = pair_to_f2<T>(r[2 * b]), up = pair_to_f2<T>(r[2 * b + 1]);
      cs[2 * (2 * jj + b)] = affine1<T>(lo.x, scale, b2b) + affine1<T>(up.x, scale, b2b);
      cs[2 * (2 * jj + b) + 1] = affine1<T>(lo.y, scale, b2b) + affine1<T>(up.y, scale, b2b);
    }
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) {
#pragma unroll
    for (int off = 4; off <= 16; off <<= 1) cs[k] += __shfl_xor_sync(0xffffffffu, cs[k], off);
  }
  float* const mean = se + kMean / 4 + lr.w4 * kPr;  // [image][64]
  if (lane < 4) {
#pragma unroll
    for (int k = 0; k < 8; ++k) mean[32 * wg + 8 * (k >> 1) + 2 * q + (k & 1)] = cs[k] / float(kOutPix);
  }
}

// fc1's partial sums over this CTA's 64 channels: warp (g, image) takes hidden units 8 g .. 8 g + 7, 4 lanes per
// unit, 16 channels per lane (each lane group starting at its own channel: the fc1 rows would share banks), kept
// here and pushed to the other CTAs' slot [rank].
__device__ __forceinline__ void fc1_partials(const FusedDownBlockArgs& p, const float* fc1_w, const float* mean,
                                             int group, int rank, int wg, int w4, int lane) {
  const int k = 8 * wg + (lane >> 2), part = lane & 3;
  float s = 0.f;
#pragma unroll
  for (int u = 0; u < 16; ++u) {
    const int c = 16 * part + ((u + (lane >> 2)) & 15);
    s += fc1_w[k * kPr + c] * mean[c];
  }
  s += __shfl_xor_sync(0xffffffffu, s, 1);
  s += __shfl_xor_sync(0xffffffffu, s, 2);
  if (part == 0) p.partials[(int64_t(group) * kRanks + rank) * kImages * kHidden + w4 * kHidden + k] = s;
}

// The 4 ranks' partial sums of the group: [rank][image][unit], 1 KB, through L2.
__device__ __forceinline__ void load_group_partials(const FusedDownBlockArgs& p, float* se, int group, int tid) {
  const float4* src = reinterpret_cast<const float4*>(p.partials + int64_t(group) * kRanks * kImages * kHidden);
  if (tid < kRanks * kImages * kHidden / 4) {
    const float4 v = __ldcg(src + tid);
    reinterpret_cast<float4*>(se + kHpart / 4)[tid] = v;
  }
}

// fc1 + ReLU (the 4 ranks' partial sums in rank order; both warpgroups compute the image's 16 units), then the
// warp's 32 gates (fc2 + sigmoid).
__device__ __forceinline__ void warp_gates(const float* se, float* hid, float* gates, const float* fc1_b,
                                           const float* fc2_w, const float* fc2_b, int wg, int w4, int lane) {
  if (lane < kHidden) {
    const float* hp = se + kHpart / 4 + w4 * kHidden + lane;
    const float s = ((hp[0] + hp[kImages * kHidden]) + hp[2 * kImages * kHidden]) + hp[3 * kImages * kHidden];
    hid[lane] = relu_keep_nan(s + fc1_b[lane]);
  }
  __syncwarp();
  {
    const int c = 32 * wg + lane;
    float s = fc2_b[c];
#pragma unroll
    for (int u = 0; u < kHidden; ++u) {
      const int k = (u + lane) & (kHidden - 1);
      s += fc2_w[c * kHidden + k] * hid[k];
    }
    gates[lane] = 1.f / (1.f + __expf(-s));
  }
  __syncwarp();
}

// The join: the warp's image, 16 pixels x its 4 chunks; 4 lanes store one pixel's 64 bytes.
template <class T>
__device__ __forceinline__ void excite_join_store(const FusedDownBlockArgs& p, const float* gates, uint32_t vt,
                                                  uint32_t idt, int image0, int rank, int wg, int w4, int lane,
                                                  float scale, float b2b) {
  const int image = image0 + w4;
  if (image >= p.n) return;
  const FaithfulPost next_post = faithful_post<T>(p.a_next ? __ldg(p.next_b1a) : 0.f);
  uint4* const y_out = static_cast<uint4*>(p.y);
  uint4* const a_next = static_cast<uint4*>(p.a_next);
#pragma unroll 1
  for (int k = 0; k < kOutPix * 4 / 32; ++k) {
    const int id = k * 32 + lane, px = id >> 2, j = id & 3, cb = 4 * wg + j, r = 16 * w4 + px;
    uint4 y8, a8;
    excite_join8<T>(lds128(vt + r * kTilePix + ((cb ^ (px & 7)) << 4)), lds128(idt + r * kTilePix + ((cb ^ (px & 7)) << 4)),
                    gates + 8 * j, scale, b2b, next_post, y8, a8);
    const int64_t o = (int64_t(image) * kOutPix + px) * (kP / 8) + kPr / 8 * rank + cb;
    if (y_out) y_out[o] = y8;
    if (a_next) a_next[o] = a8;
  }
}

#endif  // KFUSE_FUSED_DOWN_GROUP_DEVICE

}  // namespace kfuse::kernels::down_group
