// Block 1 of the encoder (64 -> 64 channels, stride 1, identity shortcut, 16 x 16 maps) as one persistent kernel on
// Hopper warpgroup MMAs (sm_90a): conv1 + FixUp, conv2 + FixUp, the squeeze-excitation and the residual join, for
// inference and for the training forward (which also writes the backward's stash: h, h2 and conv2's raw output v).
//
// Why. The training forward ran block 1 as a cuDNN graph (conv1 + epilogue, 121 us at batch 2048), a CUTLASS conv2
// (98 us) and the squeeze-excite (84 us): ~300 us for 77 GFLOP, on the step's critical path, each kernel re-reading its
// input from DRAM. The mma.sync kernel of fused_block.cu keeps the image on chip but issues MMAs at ~40% of the tensor
// rate (8 warps, one CTA per SM). Here:
//   - the GEMM is transposed: M = the 64 output channels, N = 128 pixels (a 16-row x 8-column half of the image, one
//     half per warpgroup), K = 9 taps x 64 input channels; wgmma m64n128k16 with both operands in shared memory.
//     (With M = pixels, N = 64, every k16 step would read 4 KB of operands per 32 tensor cycles: the whole shared
//     memory bandwidth. This way 6 KB per 64 cycles.)
//   - the filter (A, K-major) is staged once per CTA as (tap, 8-channel group) planes of 64 rows x 16 bytes: a k16
//     step's operand is two planes (leading offset 1 KB), its 8-row core matrices 128 bytes apart. The weights are
//     packed in this layout (FusedBlockArgs::w1 / w2 here are tap-plane images, weight_layout.h kTapPlanes), so each
//     filter is one bulk copy by the TMA unit (per-thread cp.async of 2 x 4608 chunks took ~12% of the kernel);
//   - the image (B, K-major) lives as 8 channel-group planes of the (h+2) x (w+2) zero-haloed image, 16 bytes per
//     pixel: 8 consecutive pixels of a row are one core matrix, the next 8-pixel group of N is the next image row
//     (stride offset = the halo row pitch), the next 8 channels the next plane (leading offset). Tap (r, s)'s im2col
//     is the descriptor's start address: no copy. A plane is 16 bytes longer than the halo (5200 = 80 mod 128), so
//     the 8 chunks of one pixel (one 128-byte global row) fall in 8 bank groups;
//   - epilogues go through stmatrix.trans (the accumulator's 8 x 8 channel x pixel blocks land as the planes' 16-byte
//     pixel chunks), then one coalesced pass per tensor: 16-byte global stores of h / h2 / v / the block output, h2
//     written back over the image for conv2 (inference, with no stash to write, stores h2 straight from conv1's
//     accumulators: no pass); the squeeze-excite's weights are prefetched into L1 while conv2 runs;
//   - persistent: min(n, SMs) CTAs keep both filters (144 KB) resident and load the next image (cp.async, a second
//     buffer) while the current one computes.
//   - with FusedBlockArgs::stem set (inference, at most one image per CTA), the CTA computes the stem of its own image
//     instead of loading a: the stem's warp GEMM (stem_tile.cuh, 8 warps x 32 pixels = the 16 x 16 image, its B
//     fragments staged in the second buffer) writes a = T(relu(stem) + b1a) straight into the planes and the stem
//     output x (block 1's identity) into the second buffer, pixel-major with the 16-byte chunks XOR-swizzled by the
//     pixel (conflict-free stores from the mma layout and loads in the final pass). The stem kernel and its launch go,
//     and with them the wait for its last CTA and the round trips of a and x through L2 (the stem was ~8 us of the
//     forward's critical path; block 1's image load ~2.4 us more). The final pass runs rolled there (see the join).
// Shared memory: 2 x 72 KB filters + 2 x 40.6 KB image buffers + 512 B + 16 B of barriers: Hopper's 227 KB opt-in.
// Numerics as the separate kernels of the training forward: h = T(relu(acc + b1b)); h2 = T(h + b2a), faithful where
// h > 0 (numeric.cuh pack8_after_relu); v = T(acc); o = T(v * scale + b2b) (affine1); squeeze over o, fc1 + ReLU, fc2 +
// sigmoid in fp32; y = relu(o * gate + identity); a_next = T(y + next_b1a), faithful where y > 0. Fixed reduction
// orders, no atomics: the same input gives the same bits.
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/encoder/encoder_kernels.h"
#include "kernels/encoder/numeric.cuh"
#include "kernels/encoder/stem_tile.cuh"
#include "kernels/phase_stamps.cuh"
#include "kernels/programmatic_launch.h"
#include "kernels/shared_memory_ptx.cuh"
#include "kernels/wgmma_ptx.cuh"

namespace kfuse::kernels {
namespace {

constexpr int kP = 64;                        // channels in and out
constexpr int kHidden = kP / 16;              // squeeze-excite hidden units
constexpr int kH = 16, kW = 16, kPix = kH * kW;
constexpr int kHaloW = kW + 2, kHaloPix = (kH + 2) * kHaloW;
constexpr int kRowPitch = kHaloW * 16;        // bytes per halo row of a plane
constexpr int kPlane = kHaloPix * 16 + 16;    // bytes per channel-group plane (see above: 80 mod 128)
constexpr int kBufBytes = 8 * kPlane;         // one image
constexpr int kTapPlane = kP * 16;            // a filter's (tap, channel group) plane: 64 output channels x 16 B
constexpr int kFilterBytes = 9 * 8 * kTapPlane;
constexpr int kScratchFloats = 2 * kP;        // per-half channel sums
constexpr size_t kSmemBytes = 2 * size_t(kFilterBytes) + 2 * size_t(kBufBytes) + sizeof(float) * kScratchFloats;
constexpr int kThreads = 256;                 // two warpgroups: image columns 0-7 and 8-15
constexpr int kPassChunks = kPix * 8 / kThreads;  // 16-byte chunks per thread in a pass over one image
constexpr int kPassPixels = kThreads / 8;     // a pass's pixel step: 32 pixels = 2 image rows
constexpr int kPassStride = 2 * kRowPitch;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KFUSE_FUSED_BLOCK_WGMMA_DEVICE 1
#endif

#ifdef KFUSE_FUSED_BLOCK_WGMMA_DEVICE
using ptx::cp_async16;
using ptx::cp_async_commit;
using ptx::cp_async_wait;
using ptx::fence_proxy_async;
using ptx::hold;
using ptx::lds128;
using ptx::smem_desc;
using ptx::smem_u32;
using ptx::sts128;
using ptx::stsm_x4_trans;

// d (64 x 128, fp32, the warpgroup's accumulator layout) += A (shared, K-major, 64 x 16) * B (shared, K-major, 16 x 128).
template <bool kBf16>
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
  if constexpr (kBf16) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, 1, 1, 1, 0, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(desc_a), "l"(desc_b));
  } else {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, 1, 1, 1, 0, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(desc_a), "l"(desc_b));
  }
}

// The stem output x of the fused stem, kept in the second buffer: pixel-major, 8 chunks of 16 bytes per pixel, chunk
// c8 of pixel pix at slot c8 ^ (pix & 7).
__device__ __forceinline__ uint32_t xs_chunk(uint32_t base, int pix, int c8) {
  return base + (pix * 8 + (c8 ^ (pix & 7))) * 16;
}

// One image's interior into a buffer (the halo stays zero): this thread's chunks, kPassPixels pixels apart.
__device__ __forceinline__ void load_image(uint32_t dst, const uint4* src) {
#pragma unroll
  for (int k = 0; k < kPassChunks; ++k) cp_async16(dst + k * kPassStride, src + k * kPassPixels * 8);
}

// d = the 3x3 convolution of the image in `act` by the filter in `filt` for this warpgroup's half (act points at the
// half's first column): 9 taps x 4 k16 steps of m64n128k16, issued back to back, then waited for.
template <bool kBf16, class During>
__device__ __forceinline__ void conv3x3(float (&d)[64], uint32_t filt, uint32_t act, During during) {
#pragma unroll
  for (int i = 0; i < 64; ++i) d[i] = 0.f;
  const uint64_t da = smem_desc(filt, kTapPlane, 8 * 16), db = smem_desc(act, kPlane, kRowPitch);
  ptx::wgmma_fence();
#pragma unroll
  for (int t = 0; t < 9; ++t)
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma_m64n128k16_ss<kBf16>(d, da + (((t * 8 + 2 * kk) * kTapPlane) >> 4),
                                 db + ((2 * kk * kPlane + ((t / 3) * kHaloW + t % 3) * 16) >> 4));
  ptx::wgmma_commit();
  during();  // work of the calling thread while the MMAs run
  ptx::wgmma_wait<0>();
  hold(d);
}

// The accumulators as T pairs, transposed into the image's planes. d[4 j + e] is output channel 16 wq + g + 8 (e >> 1)
// at pixel (row j, column 8 half + 2 q + (e & 1)); one stmatrix.x4 stores rows j, j + 1 of both 8-channel blocks.
// lane_addr: this lane's row address for j = 0 (plane 2 wq + (matrix & 1), row 1 + (matrix >> 1), its column).
template <class F>
__device__ __forceinline__ void store_planes(uint32_t lane_addr, F pair) {
#pragma unroll
  for (int jj = 0; jj < 8; ++jj) {
    uint32_t r[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) r[u] = pair(2 * jj + (u >> 1), u & 1);
    stsm_x4_trans(lane_addr + jj * 2 * kRowPitch, r);
  }
}
// The filters are parameters, never written by the kernel before this one: both bulk copies start before the
// programmatic wait; conv1 waits for its own only.
__device__ __forceinline__ void start_filters_and_zero_buffers(const FusedBlockArgs& p, uint32_t filt1,
                                                               uint32_t filt2, uint32_t ready1, uint32_t ready2,
                                                               uint32_t buf0, int tid) {
  if (tid == 0) {
    ptx::mbar_init(ready1, 1);
    ptx::mbar_init(ready2, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    ptx::mbar_arrive_expect_tx(ready1, kFilterBytes);
    ptx::bulk_copy_g2s(filt1, p.w1, kFilterBytes, ready1);
    ptx::mbar_arrive_expect_tx(ready2, kFilterBytes);
    ptx::bulk_copy_g2s(filt2, p.w2, kFilterBytes, ready2);
  }
  // Both buffers zero (the halo stays so: loads and epilogues write only the interior), before any load lands.
  for (int i = tid; i < 2 * kBufBytes / 16; i += kThreads) sts128(buf0 + 16 * i, make_uint4(0u, 0u, 0u, 0u));
  __syncthreads();  // also publishes the barriers' initialization
}

// This CTA's image (the launcher guarantees n <= grid): its stem into buffer 0's planes (a) and buffer 1 (x, the
// identity), the B fragments staged in buffer 1 first (no next image uses it).
template <class T, class E, int kC>
__device__ __forceinline__ void stem_into_buffers(const FusedBlockArgs& p, unsigned char* smem, uint32_t buf0,
                                                  float (&sacc)[stem_tile::kMTiles][8][4], int warp) {
  static_assert(stem_tile::smem_steps<kC>() * 4 * 32 * 16 <= kBufBytes, "the stem's B fragments fit one buffer");
  static_assert(kThreads / 32 * stem_tile::kWarpPixels == kPix && stem_tile::kTileN == kP, "8 warps: one image");
  const int img = blockIdx.x, m_warp = img * kPix + warp * stem_tile::kWarpPixels;
  uint4* const staged_b = reinterpret_cast<uint4*>(smem + 2 * kFilterBytes + kBufBytes);
  stem_tile::warp_gemm<T, E, kC, kThreads>(p.stem, m_warp, 0, staged_b, sacc);
  __syncthreads();  // every warp is done with the staged B: x goes over it
  stem_tile::for_each_output<T>(p.stem, sacc, m_warp, 0, [&](int m, int col, uint4 xv, uint4 av) {
    const int pix = m - img * kPix;
    sts128(buf0 + (col >> 3) * kPlane + ((pix >> 4) + 1) * kRowPitch + ((pix & 15) + 1) * 16, av);
    sts128(xs_chunk(buf0 + kBufBytes, pix, col >> 3), xv);
  });
}

// The next image into the other buffer (free: the previous iteration ended with a barrier), one group per
// iteration even when empty, so that the waits below count the same everywhere; then this image is in.
__device__ __forceinline__ void prefetch_next_image(const FusedBlockArgs& p, const uint4* a_in, uint32_t buf0,
                                                    uint32_t pass_off, int pass_g, int it, int img) {
  if (img + int(gridDim.x) < p.n)
    load_image(buf0 + ((it + 1) & 1) * kBufBytes + pass_off, a_in + int64_t(img + gridDim.x) * kPix * 8 + pass_g);
  cp_async_commit();
  cp_async_wait<1>();  // this image (the next one may be in flight)
  fence_proxy_async();
  __syncthreads();
}

// This thread's chunks of the identity (its pass over the image from src).
__device__ __forceinline__ void load_identity(uint4 (&id8)[kPassChunks], const uint4* src) {
#pragma unroll
  for (int k = 0; k < kPassChunks; ++k) id8[k] = __ldg(src + k * kPassPixels * 8);
}

// The stash pass of the training forward: h (in the planes) to h_out, h2 = T(h + b2a) to h2_out and back into the
// planes for conv2.
template <class T>
__device__ __forceinline__ void stash_h_and_h2(uint32_t planes, uint4* h_out, uint4* h2_out, int64_t gimg, float b2a) {
  __syncthreads();
  // All of this thread's chunks are loaded first: with two warps per scheduler, a load-convert-store chain per
  // chunk would leave the pass waiting on each load in turn (the stores below are ordered after every load).
  uint4 hv[kPassChunks];
#pragma unroll
  for (int k = 0; k < kPassChunks; ++k) hv[k] = lds128(planes + k * kPassStride);
#pragma unroll
  for (int k = 0; k < kPassChunks; ++k) {
    const int64_t o = gimg + k * kPassPixels * 8;
    if (h_out) h_out[o] = hv[k];
    float f[8];
    unpack8<T>(hv[k], f);
    const uint4 h2 = pack8_after_relu<T>(f, b2a);
    if (h2_out) h2_out[o] = h2;
    sts128(planes + k * kPassStride, h2);
  }
}

// The squeeze-excite's weights (2.3 KB, read after conv2 by every thread) into L1 while conv2's MMAs run: 18 line
// prefetches instead of an L2 round trip after them. (Loads into registers here are sunk past the MMAs' wait by
// ptxas.)
__device__ __forceinline__ void prefetch_se_weights(const FusedBlockArgs& p, int tid) {
  constexpr int kLines = kHidden * kP * 4 / 128;  // fc1_w and fc2_w: 8 lines each
  if (tid < kLines) {
    ptx::prefetch_l1(p.fc1_w + tid * 32);
    ptx::prefetch_l1(p.fc2_w + tid * 32);
  } else if (tid == kLines) {
    ptx::prefetch_l1(p.fc1_b);
  } else if (tid < kLines + 3) {
    ptx::prefetch_l1(p.fc2_b + 32 * (tid - kLines - 1));  // fc2_b: 64 floats, 2 lines
  }
}

// conv2: v = T(acc) into vp, o = T(v * scale + b2b); the squeeze's per-channel sums of o over this thread's pixels,
// then over the lanes of a channel (q), into part[half] (summed over the two halves by the readers: a fixed order).
template <class T>
__device__ __forceinline__ void squeeze_sums(const float (&d)[64], uint32_t (&vp)[32], float* part, int half, int wq,
                                             int g, int q, float scale, float b2b) {
  float s0 = 0.f, s1 = 0.f;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    vp[2 * j] = pack2<T>(d[4 * j], d[4 * j + 1]);
    vp[2 * j + 1] = pack2<T>(d[4 * j + 2], d[4 * j + 3]);
    const float2 lo = pair_to_f2<T>(vp[2 * j]), hi = pair_to_f2<T>(vp[2 * j + 1]);
    s0 += affine1<T>(lo.x, scale, b2b);
    s0 += affine1<T>(lo.y, scale, b2b);
    s1 += affine1<T>(hi.x, scale, b2b);
    s1 += affine1<T>(hi.y, scale, b2b);
  }
#pragma unroll
  for (int off = 1; off <= 2; off <<= 1) {
    s0 += __shfl_xor_sync(0xffffffffu, s0, off);
    s1 += __shfl_xor_sync(0xffffffffu, s1, off);
  }
  if (q == 0) {
    part[half * kP + 16 * wq + g] = s0;
    part[half * kP + 16 * wq + g + 8] = s1;
  }
}

// The gates' weights in registers and their intermediate values. The kernel declares them: nvcc places a
// function's own arrays ahead of the kernel's, and its register assignment (hence the SASS) then differs.
struct GateRegs {
  float w1r[kHidden][2], b1r[kHidden], w2r[8][kHidden], b2r[8];
  float hv[kHidden];
  float sv[8];
};

// fc1 + ReLU in every warp (the same bits everywhere: the same order), then this thread's 8 gates (fc2 + sigmoid)
// for its pass chunks' channels (c8): no serial phase, no more barriers.
__device__ __forceinline__ void excite_gates(const FusedBlockArgs& p, const float* part, float (&gv)[8], int c8,
                                             int lane, GateRegs& r) {
  // Every weight load first (L1 hits after the prefetch above), then the arithmetic: written as one chain per
  // gate, the compiler kept each gate's loads behind the previous gate's division.
#pragma unroll
  for (int k = 0; k < kHidden; ++k) {
    r.w1r[k][0] = __ldg(p.fc1_w + k * kP + lane);
    r.w1r[k][1] = __ldg(p.fc1_w + k * kP + lane + 32);
    r.b1r[k] = __ldg(p.fc1_b + k);
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    r.b2r[e] = __ldg(p.fc2_b + 8 * c8 + e);
#pragma unroll
    for (int k = 0; k < kHidden; ++k) r.w2r[e][k] = __ldg(p.fc2_w + (8 * c8 + e) * kHidden + k);
  }
  const float m0 = (part[lane] + part[kP + lane]) / float(kPix);
  const float m1 = (part[lane + 32] + part[kP + lane + 32]) / float(kPix);
#pragma unroll
  for (int k = 0; k < kHidden; ++k) {
    float s = r.w1r[k][0] * m0 + r.w1r[k][1] * m1;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    r.hv[k] = relu_keep_nan(s + r.b1r[k]);
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    r.sv[e] = r.b2r[e];
#pragma unroll
    for (int k = 0; k < kHidden; ++k) r.sv[e] += r.w2r[e][k] * r.hv[k];
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) gv[e] = 1.f / (1.f + __expf(-r.sv[e]));
}

// Excite and join: v to the stash; y = relu(o * gate + identity); a_next = y + next_b1a (faithful where y > 0). The
// identity: id8 (loaded while conv2 ran), or the fused stem's x in buffer 1.
template <class T, bool kStem>
__device__ __forceinline__ void excite_join_pass(uint4* v_out, uint4* y_out, uint4* a_next, uint32_t buf,
                                                 uint32_t pass_off, uint32_t xs,
                                                 const uint4 (&id8)[kPassChunks], const float (&gv)[8], int64_t gimg,
                                                 int pix0, int c8, float scale, float b2b, float nb1a) {
  const FaithfulPost next_post = faithful_post<T>(nb1a);
  auto join = [&](int k, const uint4& vk, const uint4& idk) {
    const int64_t o = gimg + k * kPassPixels * 8;
    if (v_out) v_out[o] = vk;
    uint4 y8, a8;
    excite_join8<T>(vk, idk, gv, scale, b2b, next_post, y8, a8);
    if (y_out) y_out[o] = y8;
    if (a_next) a_next[o] = a8;
  };
  if constexpr (kStem) {
    // Two chunks per iteration (independent chains for the two warps per scheduler), rolled: unrolled, this pass is
    // ~22 KB of straight-line code, which the fused stem's larger kernel no longer finds in the instruction cache
    // (ncu: warps stalled on instruction fetch, 9 us instead of 2.4).
    static_assert(kPassChunks % 2 == 0, "pairs of chunks");
#pragma unroll 1
    for (int k = 0; k < kPassChunks; k += 2) {
      const uint4 v0 = lds128(buf + pass_off + k * kPassStride), v1 = lds128(buf + pass_off + (k + 1) * kPassStride);
      const uint4 x0 = lds128(xs_chunk(xs, pix0 + k * kPassPixels, c8));
      const uint4 x1 = lds128(xs_chunk(xs, pix0 + (k + 1) * kPassPixels, c8));
      join(k, v0, x0);
      join(k + 1, v1, x1);
    }
  } else {
    uint4 vv[kPassChunks];
#pragma unroll
    for (int k = 0; k < kPassChunks; ++k) vv[k] = lds128(buf + pass_off + k * kPassStride);
#pragma unroll
    for (int k = 0; k < kPassChunks; ++k) join(k, vv[k], id8[k]);
  }
}
#endif  // KFUSE_FUSED_BLOCK_WGMMA_DEVICE

// E: the stem input's element type when the kernel computes its image's stem (p.stem; kC: its channels, 0 = run
// time), void when it loads a.
template <class T, bool kBf16, class E, int kC>
__global__ void __launch_bounds__(kThreads, 1) fused_block_wgmma_kernel(const FusedBlockArgs p) {
#ifdef KFUSE_FUSED_BLOCK_WGMMA_DEVICE
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t filter_ready[2];
  const uint32_t filt1 = smem_u32(smem), filt2 = filt1 + kFilterBytes, buf0 = filt2 + kFilterBytes;
  float* const part = reinterpret_cast<float*>(smem + 2 * kFilterBytes + 2 * kBufBytes);  // [2 halves][64]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wq = warp & 3, half = warp >> 2;
  const int g = lane >> 2, q = lane & 3;
  KFUSE_PHASES(10);  // development builds only (phase_stamps.cuh)
  KFUSE_STAMP(0, "start");

  const uint32_t ready1 = smem_u32(&filter_ready[0]), ready2 = smem_u32(&filter_ready[1]);
  start_filters_and_zero_buffers(p, filt1, filt2, ready1, ready2, buf0, tid);
  pdl_wait_for_predecessor();
  pdl_allow_successor();
  KFUSE_STAMP(1, "wait");

  // This thread's chunks in the passes over an image: channel group c8 of pixels pix0 + 32 k.
  const int pix0 = tid >> 3, c8 = tid & 7;
  const uint32_t pass_off = c8 * kPlane + ((pix0 >> 4) + 1) * kRowPitch + ((pix0 & 15) + 1) * 16;
  const int pass_g = pix0 * 8 + c8;  // in 16-byte units from the image's start
  const uint4* const a_in = static_cast<const uint4*>(p.a);
  const uint4* const idt = static_cast<const uint4*>(p.identity);
  constexpr bool kStem = !std::is_void_v<E>;
  if constexpr (kStem) {
    float sacc[stem_tile::kMTiles][8][4];  // the kernel's (as GateRegs)
    stem_into_buffers<T, E, kC>(p, smem, buf0, sacc, warp);
  } else {
    load_image(buf0 + pass_off, a_in + int64_t(blockIdx.x) * kPix * 8 + pass_g);
  }
  cp_async_commit();
  KFUSE_STAMP(2, "stem_or_load");

  const int mi = lane >> 3;
  const uint32_t stsm_off = (2 * wq + (mi & 1)) * kPlane + ((mi >> 1) + 1) * kRowPitch + (8 * half + (lane & 7) + 1) * 16;
  const float b1b = __ldg(p.scalars + 1), b2a = __ldg(p.scalars + 2), scale = __ldg(p.scalars + 3),
              b2b = __ldg(p.scalars + 4);
  const float nb1a = p.a_next ? __ldg(p.next_b1a) : 0.f;
  uint4* const h_out = static_cast<uint4*>(p.h_out);
  uint4* const h2_out = static_cast<uint4*>(p.h2_out);
  uint4* const v_out = static_cast<uint4*>(p.v_out);
  uint4* const y_out = static_cast<uint4*>(p.y);
  uint4* const a_next = static_cast<uint4*>(p.a_next);

  float d[64];
  for (int it = 0, img = blockIdx.x; img < p.n; ++it, img += gridDim.x) {
    const uint32_t buf = buf0 + (it & 1) * kBufBytes;
    prefetch_next_image(p, a_in, buf0, pass_off, pass_g, it, img);
    if (it == 0) ptx::mbar_wait(ready1, 0);
    KFUSE_STAMP(3, "image");
    conv3x3<kBf16>(d, filt1, buf + 8 * half * 16, [] {});
    KFUSE_STAMP(4, "conv1");
    __syncthreads();  // both warpgroups are done reading the image: h goes over it

    // conv1's FixUp: h = T(relu(acc + b1b)), h2 = T(h + b2a) (faithful where h > 0). Inference (no stash asked
    // for) stores h2 straight from the accumulators; the training forward stores h, then one pass writes h and h2 to
    // global memory and h2 back into the planes for conv2.
    const int64_t gimg = int64_t(img) * kPix * 8 + pass_g;
    const bool stash = !kStem && (h_out || h2_out);  // the fused stem is inference only: no stash code there
    if (!stash) {
      const FaithfulPost post = faithful_post<T>(b2a);
      store_planes(buf + stsm_off, [&](int j, int cb) {
        return relu_post_pair<T>(d[4 * j + 2 * cb], d[4 * j + 2 * cb + 1], b1b, post);
      });
    } else {
      store_planes(buf + stsm_off, [&](int j, int cb) {
        return pack2<T>(relu_keep_nan(d[4 * j + 2 * cb] + b1b), relu_keep_nan(d[4 * j + 2 * cb + 1] + b1b));
      });
    }
    uint4 id8[kPassChunks];  // the identity, loaded while conv2 runs (the fused stem's is in shared memory)
    if constexpr (!kStem) load_identity(id8, idt + gimg);
    if (stash) stash_h_and_h2<T>(buf + pass_off, h_out, h2_out, gimg, b2a);
    fence_proxy_async();
    __syncthreads();
    if (it == 0) ptx::mbar_wait(ready2, 0);
    KFUSE_STAMP(5, "epilogue");
    conv3x3<kBf16>(d, filt2, buf + 8 * half * 16, [&] { prefetch_se_weights(p, tid); });
    KFUSE_STAMP(6, "conv2");

    uint32_t vp[32];
    squeeze_sums<T>(d, vp, part, half, wq, g, q, scale, b2b);
    __syncthreads();  // the partial sums are in; both warpgroups are done reading h2: v goes over it
    KFUSE_STAMP(7, "squeeze");
    store_planes(buf + stsm_off, [&](int j, int cb) { return vp[2 * j + cb]; });
    float gv[8];
    GateRegs gate_regs;
    excite_gates(p, part, gv, c8, lane, gate_regs);
    __syncthreads();  // v is in the planes
    KFUSE_STAMP(8, "fc");

    excite_join_pass<T, kStem>(v_out, y_out, a_next, buf, pass_off, buf0 + kBufBytes, id8, gv, gimg, pix0, c8, scale,
                               b2b, nb1a);
    __syncthreads();  // the buffer is free for the image after next
    KFUSE_STAMP(9, "join");
    if (it == 0) KFUSE_PRINT_PHASES("block1");
  }
#else
  // Compiled for another architecture: never launched (fused_block_wgmma_smem_bytes requires compute capability 9.0).
  __trap();
#endif
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

using FusedBlockKernel = void (*)(const FusedBlockArgs);

// The kernel that computes the stem for input `stem` (the stem kernel's specialisations: stem_tile::dispatch_input).
template <class T, bool kBf16>
FusedBlockKernel fused_stem_kernel(const StemArgs& stem) {
  return stem_tile::dispatch_input(stem, FusedBlockKernel{nullptr}, [&]<class E, int kC>() -> FusedBlockKernel {
    return fused_block_wgmma_kernel<T, kBf16, E, kC>;
  });
}

}  // namespace

size_t fused_block_wgmma_smem_bytes(int h, int w, int cc_major, int cc_minor) {
  return h == kH && w == kW && cc_major == 9 && cc_minor == 0 ? kSmemBytes : 0;
}

cudaError_t launch_fused_block_wgmma(const FusedBlockArgs& p, ConvDType dtype, int sm_count, cudaStream_t stream) {
  int dev = 0, major = 0, minor = 0, optin = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (err != cudaSuccess) return err;
  const size_t smem = fused_block_wgmma_smem_bytes(p.h, p.w, major, minor);
  const bool stem = p.stem.x != nullptr;
  if (smem == 0 || smem > size_t(optin) || sm_count <= 0 || p.n <= 0 || p.planes != kP || p.hidden != kHidden ||
      (!stem && (!p.a || !p.identity)) || !p.w1 || !p.w2 || !p.scalars || !p.fc1_w || !p.fc1_b || !p.fc2_w ||
      !p.fc2_b || (!p.y && !p.a_next) || (p.a_next && !p.next_b1a))
    return cudaErrorInvalidValue;
  // The fused stem: one image per CTA, the stem's output is this kernel's 16 x 16 x 64 image; inference only (the
  // training forward's stash wants the stem output in memory: the separate stem kernel).
  if (stem && (p.n > sm_count || p.stem.n != p.n || p.stem.h != 4 * kH || p.stem.w != 4 * kW || p.stem.p0 != kP ||
               p.stem.c <= 0 || p.stem.kpad < 16 * p.stem.c || !p.stem.weight ||
               (p.stem.in_scale == nullptr) != (p.stem.in_shift == nullptr) || p.h_out || p.h2_out || p.v_out))
    return cudaErrorInvalidValue;
  const void* const pointers[] = {p.a, p.identity, p.w1, p.w2, p.y, p.a_next, p.h_out, p.h2_out, p.v_out};
  for (const void* ptr : pointers)
    if (ptr && !aligned16(ptr)) return cudaErrorInvalidValue;
  const auto kernel = stem ? (dtype == ConvDType::kF16 ? fused_stem_kernel<__half, false>(p.stem)
                                                       : fused_stem_kernel<__nv_bfloat16, true>(p.stem))
                           : (dtype == ConvDType::kF16 ? fused_block_wgmma_kernel<__half, false, void, 0>
                                                       : fused_block_wgmma_kernel<__nv_bfloat16, true, void, 0>);
  if (!kernel) return cudaErrorInvalidValue;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (err != cudaSuccess) return err;
  const int grid = p.n < sm_count ? p.n : sm_count;
  err = launch_kernel(kernel, grid, kThreads, smem, stream, true, p);
  return err != cudaSuccess ? err : cudaGetLastError();
}

}  // namespace kfuse::kernels
