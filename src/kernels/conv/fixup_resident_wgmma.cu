// The FixUp convolution (conv_fixup.h, tile ConvTile::kSm90_resident) as a hand-written Hopper kernel for the small
// late layers of the encoder at inference batches: whole images of input resident in shared memory, filters streamed
// by the TMA unit, warpgroup MMAs with the im2col gathered by ldmatrix. sm_90a only; fp16 and bf16.
//
// Why. At batch 128, blocks 2-4's convolutions are GEMMs of 512-8192 rows whose CUTLASS kernels take 9-14 us for
// 1.2-2.4 GFLOP: each 64 x 64 CTA tile streams both operands through shared memory, and the activations' im2col
// re-reads every input pixel up to 9 times, so the SMs' L2 ingress (not the tensor rate) sets the time (PERF.md,
// session 2). Here a CTA computes 64 output pixels (64 / (p*q) whole images) x 64 output channels:
//   - the input of its images (G x h x w x c, at most 160 KB) is copied into shared memory once (cp.async, one group
//     per 64-channel slab, so the first MMAs wait for the first slab only);
//   - the GEMM's A operand (pixels x K) comes from registers: per 16-wide K step each lane's ldmatrix row address is
//     the input pixel its output pixel reads at the current tap, or a zero row for padding, so the im2col is free and
//     the padding needs no halo; a per-problem XOR swizzle of the 16-byte chunks (chosen on the host, see
//     pick_swizzle) keeps the eight rows of each 8x8 matrix in eight bank groups for stride 1 and 2;
//   - B (the filter, K-major) arrives as 64 x 64 (one tap x 64 input channels x 64 output channels) boxes of the
//     KRSC tensor by TMA with the 128-byte swizzle wgmma reads, through a ring of stages (full / empty mbarriers); a
//     producer warp issues them, and since the filters are not written by the kernel before this one, it starts
//     before the programmatic-launch wait;
//   - wgmma m64n64k16 (A from registers, B from shared memory), one commit group per box; four warpgroups take the
//     boxes in turn, each waiting for its own group before loading the next box's fragments (ptxas serializes wgmmas
//     whose register operands are written while others are in flight), and sum their partial tiles at the end;
//   - optionally (KFUSE_RESIDENT_CLUSTER = 2, 4, 8) clusters of consecutive M tiles share each box by TMA multicast;
//   - the epilogue applies post + act(alpha * acc + pre) with the stored-value rule of the CUTLASS epilogue
//     (fixup_epilogue.h, numeric.cuh pack2_after_relu), stages the 64 x 64 tile in shared memory and writes each
//     output pixel's 128 bytes with 16-byte stores.
// Per CTA the L2 ingress is the filter slice (64 x K) plus its images, against the filter slice plus 64 x K of im2col
// for a CUTLASS 64 x 64 tile. Measured (PERF.md session 20): correct, but 10-50% slower than CUTLASS on every layer of
// the encoder at batch 128; kept in the history only.
#include <array>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <map>
#include <mutex>
#include <type_traits>

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/conv/fixup_instances.h"
#include "kernels/encoder/numeric.cuh"
#include "kernels/programmatic_launch.h"
#include "kernels/shared_memory_ptx.cuh"
#include "kernels/wgmma_ptx.cuh"

namespace kfuse::kernels {
namespace {

constexpr int kTileM = 64;                  // output pixels per CTA (whole images)
constexpr int kTileN = 64;                  // output channels per CTA
constexpr int kSlab = 64;                   // input channels per filter box (one 128-byte swizzle row)
constexpr int kBoxBytes = kTileN * kSlab * 2;
constexpr int kGroups = 4;                  // computing warpgroups: box b goes to warpgroup b % kGroups
constexpr int kConsumers = 128 * kGroups;
constexpr int kThreads = kConsumers + 32;   // plus one producer warp
constexpr int kMaxStages = 8;  // 16 measured no faster
// The final exchange of partial sums reuses the ring: kGroups x (kGroups - 1) slots of 8 values x 128 threads x 4 B.
constexpr int kMinStages = kGroups * (kGroups - 1) * 8 * 128 * 4 / (64 * 64 * 2);
constexpr int kMaxSlabs = 8;                // c <= 512 (cp.async.wait_group takes an immediate)
constexpr int kMaxInputBytes = 160 * 1024;
constexpr int kZeroBytes = 128;
constexpr int kOutBytes = kTileM * kTileN * 2;
constexpr int kAlignSlack = 1024;           // the dynamic shared memory base is aligned up to 1024 (128-byte swizzle)

struct Params {
  const uint16_t* x;
  uint16_t* y;
  const float* alpha;
  const float* pre;
  const float* post;
  int n, h, w, c, k, r, s, pad_h, pad_w, stride_h, stride_w, p, q;
  int images;       // per CTA: kTileM / (p * q)
  int stages;
  int swz_a, swz_e, swz_b, swz_f;  // chunk swizzle: pixel ^ ((pixel >> a) << e) ^ ((pixel >> b) << f)
  bool relu;
  int cluster;  // CTAs (consecutive M tiles) sharing each filter box by TMA multicast: 1, 2, 4 or 8
};

__host__ __device__ __forceinline__ int swizzle_of(int pixel, int a, int e, int b, int f) {
  return (pixel ^ ((pixel >> a) << e) ^ ((pixel >> b) << f)) & 7;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KFUSE_RESIDENT_WGMMA_DEVICE 1
#endif

#ifdef KFUSE_RESIDENT_WGMMA_DEVICE
using ptx::cp_async16;
using ptx::hold;
using ptx::ldsm_x4;
using ptx::mbar_arrive;
using ptx::mbar_arrive_expect_tx;
using ptx::mbar_init;
using ptx::mbar_wait;
using ptx::smem_u32;
using ptx::wgmma_commit;
using ptx::wgmma_fence;
using ptx::wgmma_wait;

#define KFUSE_WGMMA_D32                                                                                             \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29," \
  "%30,%31}"
#define KFUSE_WGMMA_D32_OPERANDS                                                                                     \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),      \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),        \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),       \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

// d (64 x 64, fp32, the warpgroup's C layout) += A (registers, 64 x 16) * B (shared, K-major, 128-byte swizzle).
template <bool kBf16>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b) {
  if constexpr (kBf16) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " KFUSE_WGMMA_D32
                 ", {%32,%33,%34,%35}, %36, 1, 1, 1, 0;\n"
                 : KFUSE_WGMMA_D32_OPERANDS
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
  } else {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " KFUSE_WGMMA_D32
                 ", {%32,%33,%34,%35}, %36, 1, 1, 1, 0;\n"
                 : KFUSE_WGMMA_D32_OPERANDS
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
  }
}
#undef KFUSE_WGMMA_D32
#undef KFUSE_WGMMA_D32_OPERANDS

// K-major operand in the 128-byte swizzle (8 rows x 128 bytes per 1024-byte atom, as TMA's SWIZZLE_128B writes it):
// the leading offset is unused, the stride offset is the next 8 rows.
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr) {
  return ptx::smem_desc(addr, 16, 1024) | (uint64_t(1) << 62);
}

__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// The filter box rows [row0, row0 + rows) into every CTA of the cluster in `mask`, at the same shared-memory offset,
// completing on each one's barrier at `bar`'s offset.
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar,
                                                      uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, "
      "%3}], [%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
      : "memory");
}

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}

// One arrival on the barrier at the same offset in CTA `rank` of the cluster.
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(bar), "r"(rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
}

// Every thread of every CTA of the cluster (a CTA-wide barrier too).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// cp.async.wait_group with a run-time count (at most kMaxSlabs - 1 groups left pending).
__device__ __forceinline__ void cp_async_wait_dyn(int pending) {
  switch (pending) {
    case 0: asm volatile("cp.async.wait_group 0;\n" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;\n" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;\n" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;\n" ::: "memory"); break;
    case 4: asm volatile("cp.async.wait_group 4;\n" ::: "memory"); break;
    case 5: asm volatile("cp.async.wait_group 5;\n" ::: "memory"); break;
    case 6: asm volatile("cp.async.wait_group 6;\n" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 7;\n" ::: "memory"); break;
  }
}

// Named barrier `id` (1..15) of the computing warpgroups only (the producer warp never joins).
__device__ __forceinline__ void named_sync(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kConsumers) : "memory");
}
#endif  // KFUSE_RESIDENT_WGMMA_DEVICE

template <class T, bool kBf16>
__global__ void __launch_bounds__(kThreads, 1)
    fixup_resident_kernel(const __grid_constant__ CUtensorMap wmap, const Params prm) {
#ifdef KFUSE_RESIDENT_WGMMA_DEVICE
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t full[kMaxStages], empty[kMaxStages];
  const uint32_t base = (smem_u32(smem_raw) + kAlignSlack - 1) & ~uint32_t(kAlignSlack - 1);
  const int tid = threadIdx.x;
  const int taps = prm.r * prm.s, slabs = prm.c / kSlab, boxes = taps * slabs;
  const int pix_in = prm.h * prm.w, pq = prm.p * prm.q;
  const int first_image = blockIdx.x * prm.images;
  const int images_here = min(prm.images, prm.n - first_image);
  const uint32_t ring = base;
  const uint32_t input = ring + uint32_t(prm.stages) * kBoxBytes;
  const uint32_t in_bytes = uint32_t(prm.images) * pix_in * prm.c * 2;
  const uint32_t zero = input + in_bytes;
  const uint32_t out_tile = zero + kZeroBytes;
  const uint32_t row_bytes = uint32_t(prm.c) * 2;

  if (tid == 0) {
    for (int st = 0; st < prm.stages; ++st) {
      mbar_init(smem_u32(&full[st]), 1);
      // The four warps of the warpgroup that took the box, in every CTA of the cluster (each CTA writes a slice of
      // every CTA's stage).
      mbar_init(smem_u32(&empty[st]), 4 * prm.cluster);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  cluster_sync();  // no CTA multicasts into, or arrives on, a barrier of another before it is initialized

  if (tid >= kConsumers) {
    // Producer warp: one lane streams the filter boxes (slab-major, tap-minor: the order the consumers take them).
    if (tid == kConsumers) {
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&wmap)) : "memory");
      // With a cluster, CTA `rank` loads output-channel rows [rank * 64 / cluster, ...) of each box into all of them.
      const int rank = prm.cluster > 1 ? int(cluster_rank()) : 0;
      const int slice_rows = kTileN / prm.cluster;
      const uint32_t slice_off = uint32_t(rank * slice_rows) * 128;
      const uint16_t mask = uint16_t((1u << prm.cluster) - 1);
      const int n0 = blockIdx.y * kTileN + rank * slice_rows;
      int st = 0, phase = 0, slab = 0, tap = 0;
      for (int b = 0; b < boxes; ++b) {
        if (b >= prm.stages) mbar_wait(smem_u32(&empty[st]), phase ^ 1);
        mbar_arrive_expect_tx(smem_u32(&full[st]), kBoxBytes);
        const uint32_t dst = ring + uint32_t(st) * kBoxBytes + slice_off;
        if (prm.cluster > 1)
          tma_load_2d_multicast(dst, &wmap, tap * prm.c + slab * kSlab, n0, smem_u32(&full[st]), mask);
        else
          tma_load_2d(dst, &wmap, tap * prm.c + slab * kSlab, n0, smem_u32(&full[st]));
        if (++tap == taps) tap = 0, ++slab;
        if (++st == prm.stages) st = 0, phase ^= 1;
      }
    }
    __syncwarp();  // the producer lane rejoins its warp before the cluster barrier (.aligned)
  } else {

  // ---- the computing warpgroups ----
  const int wg = tid >> 7, wq = (tid >> 5) & 3, lane = tid & 31;
  // Per-slab waits need every warpgroup to take a box of every slab (at least kGroups taps); else one wait for all.
  const bool per_slab_sync = taps >= kGroups;
  if (tid < kZeroBytes / 16) asm volatile("st.shared.v4.u32 [%0], {%1,%1,%1,%1};\n" ::"r"(zero + tid * 16), "r"(0));

  pdl_wait_for_predecessor();
  pdl_allow_successor();

  // The images' input, one cp.async group per 64-channel slab; chunk j of pixel i lands at chunk
  // (j & ~7) | ((j ^ swizzle(i)) & 7) of the pixel's row.
  {
    const uint16_t* src = prm.x + size_t(first_image) * pix_in * prm.c;
    const int chunks = images_here * pix_in * (kSlab / 8);
    for (int slab = 0; slab < slabs; ++slab) {
      for (int i = tid; i < chunks; i += kConsumers) {
        const int pixel = i >> 3, jj = i & 7;
        const int sw = swizzle_of(pixel, prm.swz_a, prm.swz_e, prm.swz_b, prm.swz_f);
        cp_async16(input + uint32_t(pixel) * row_bytes + uint32_t(slab * 8 + ((jj ^ sw) & 7)) * 16,
                   src + size_t(pixel) * prm.c + slab * kSlab + jj * 8);
      }
      ptx::cp_async_commit();
    }
    if (!per_slab_sync) {
      cp_async_wait_dyn(0);
      named_sync(1);
    }
  }

  // This lane's A row: output pixel m of the tile (lanes 0-15 and 16-31 read the low / high 8 channels of a step).
  const int m = wq * 16 + (lane & 15), khalf = lane >> 4;
  const int img = m / pq, rem = m - img * pq, oy = rem / prm.q, ox = rem - oy * prm.q;
  const bool row_valid = img < images_here;
  const int iy0 = oy * prm.stride_h - prm.pad_h, ix0 = ox * prm.stride_w - prm.pad_w;
  const int pixel0 = img * pix_in + iy0 * prm.w + ix0;  // the pixel tap (0, 0) reads (maybe outside the image)

  float acc[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = 0.0f;

  // Warpgroup wg takes the boxes b = wg, wg + kGroups, ...: per box the A fragments of its 4 k16 steps by ldmatrix,
  // 4 wgmmas as one commit group, and a wait for them before the stage goes back and the next box's fragments load
  // (ptxas serializes wgmmas whose register operands are written while earlier ones are in flight). The tensor pipe
  // stays busy through the other warpgroups' MMAs while one loads; the box's (slab, tap) advance by additions only.
  // (ty, tx) follow tap + slab * taps row by row: a wrap past the last tap moves r rows back.
  int slab = 0, tap = wg, ty = 0, tx = wg;
  while (tx >= prm.s) tx -= prm.s, ++ty;
  while (tap >= taps) tap -= taps, ++slab, ty -= prm.r;
  int slab_synced = -1;
  for (int b = wg; b < boxes; b += kGroups) {
    if (per_slab_sync && slab != slab_synced) {  // the first box of a slab this warpgroup takes
      slab_synced = slab;
      cp_async_wait_dyn(slabs - 1 - slab);
      named_sync(2 + slab);  // every thread's copies of this slab have landed
    }
    const int iy = iy0 + ty, ix = ix0 + tx;
    const bool real = row_valid && iy >= 0 && iy < prm.h && ix >= 0 && ix < prm.w;
    const int pixel = pixel0 + ty * prm.w + tx;  // may be out of range (then only its swizzle is used)
    const int sw = swizzle_of(pixel, prm.swz_a, prm.swz_e, prm.swz_b, prm.swz_f);
    const uint32_t row = real ? input + uint32_t(pixel) * row_bytes + uint32_t(slab * 128) : zero;
    uint32_t a[4][4];
#pragma unroll
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) ldsm_x4(a[kk], row + uint32_t(((kk * 2 + khalf) ^ sw) & 7) * 16);
    const int st = b % prm.stages;
    mbar_wait(smem_u32(&full[st]), (b / prm.stages) & 1);
    wgmma_fence();
    const uint32_t stage = ring + uint32_t(st) * kBoxBytes;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_m64n64k16_rs<kBf16>(acc, a[kk], desc_sw128(stage + kk * 32));
    wgmma_commit();
    wgmma_wait<0>();
    hold(a[0]), hold(a[1]), hold(a[2]), hold(a[3]);
    hold(acc);
    if (lane == 0) {
      if (prm.cluster > 1) {
        for (int q = 0; q < prm.cluster; ++q) mbar_arrive_cluster(smem_u32(&empty[st]), uint32_t(q));
      } else {
        mbar_arrive(smem_u32(&empty[st]));
      }
    }
    // Next box of this warpgroup: kGroups taps further.
    tap += kGroups, tx += kGroups;
    while (tx >= prm.s) tx -= prm.s, ++ty;
    while (tap >= taps) tap -= taps, ++slab, ty -= prm.r;
  }

  // The warpgroups' partial sums meet in shared memory, over the ring (every box has been consumed once all are
  // here): warpgroup g finishes output columns 16g .. 16g + 15 (accumulators 8g .. 8g + 7) and receives them from the
  // other three, laid out value-major so that a warp's 32 lanes touch 32 consecutive words. Summed in warpgroup order.
  ptx::fence_proxy_async();  // the ring's last reads were wgmma's (async proxy); st.shared follows
  named_sync(1);
  {
    const int lt = tid & 127;
    // Receiver r's slot from giver g (g != r): (r * (kGroups - 1) + g - (g > r)) * 8 + i, 512 bytes per value i.
#pragma unroll
    for (int r = 0; r < kGroups; ++r) {
      if (r == wg) continue;
#pragma unroll
      for (int i = 0; i < 8; ++i)
        asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(ring + uint32_t(((r * (kGroups - 1) + wg - (wg > r)) * 8 + i) * 128 + lt) * 4),
                     "f"(acc[r * 8 + i])
                     : "memory");
    }
    named_sync(1);
    float sum[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) sum[i] = 0.0f;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        float v;
        if (g == wg) {
          v = 0.0f;
#pragma unroll
          for (int r = 0; r < kGroups; ++r)
            if (r == wg) v = acc[r * 8 + i];  // constant indices: acc stays in registers
        } else {
          asm volatile("ld.shared.f32 %0, [%1];\n"
                       : "=f"(v)
                       : "r"(ring + uint32_t(((wg * (kGroups - 1) + g - (g > wg)) * 8 + i) * 128 + lt) * 4)
                       : "memory");
        }
        sum[i] = g == 0 ? v : sum[i] + v;
      }
    }

    // Epilogue (columns 16 * wg .. + 15): post + act(alpha * acc + pre), rounded as the CUTLASS epilogue rounds;
    // staged with the 16-byte chunk of column group g of row r at chunk g ^ (r & 7) (conflict-free).
    const float alpha = prm.alpha ? *prm.alpha : 1.0f, pre = prm.pre ? *prm.pre : 0.0f;
    const float post = prm.post ? *prm.post : 0.0f;
#pragma unroll
    for (int nh = 0; nh < 2; ++nh) {
      const int nb = wg * 2 + nh;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = wq * 16 + (lane >> 2) + half * 8;
        float v0 = fmaf(alpha, sum[nh * 4 + half * 2], pre), v1 = fmaf(alpha, sum[nh * 4 + half * 2 + 1], pre);
        if (prm.relu) {
          if (v0 < 0.0f) v0 = 0.0f;  // `v < 0 ? 0 : v` keeps NaN, as the CUTLASS epilogue does
          if (v1 < 0.0f) v1 = 0.0f;
        }
        const uint32_t packed = pack2_after_relu<T>(v0, v1, post);
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(out_tile + uint32_t(r) * 128 +
                                                     uint32_t((nb ^ (r & 7)) * 16 + (lane & 3) * 4)),
                     "r"(packed)
                     : "memory");
      }
    }
  }
  named_sync(1);
  const int rows_here = images_here * pq;
  uint16_t* out = prm.y + size_t(blockIdx.x) * kTileM * prm.k + blockIdx.y * kTileN;
#pragma unroll
  for (int it = 0; it < kTileM * 8 / kConsumers; ++it) {
    const int idx = tid + it * kConsumers, r = idx >> 3, g = idx & 7;
    if (r < rows_here) {
      uint4 v;
      asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "r"(out_tile + uint32_t(r) * 128 + uint32_t((g ^ (r & 7)) * 16)));
      *reinterpret_cast<uint4*>(out + size_t(r) * prm.k + g * 8) = v;
    }
  }
  }  // the computing warpgroups
  // No CTA leaves while another may still multicast into its shared memory or arrive on its barriers.
  cluster_sync();
#else
  // Compiled for another architecture: never launched (the launcher requires compute capability 9.0).
  __trap();
#endif
}

// ---- host side ----------------------------------------------------------------------------------------------------

int images_per_tile(const Conv2dProblem& p) {
  const int pq = p.p() * p.q();
  return (pq > 0 && pq <= kTileM && kTileM % pq == 0) ? kTileM / pq : 0;
}

size_t input_bytes(const Conv2dProblem& p) {
  return size_t(images_per_tile(p)) * p.h * p.w * p.c * 2;
}

bool problem_fits(const Conv2dProblem& p) {
  return p.n >= 1 && p.h >= 1 && p.w >= 1 && p.r >= 1 && p.s >= 1 && p.pad_h >= 0 && p.pad_w >= 0 &&
         p.stride_h >= 1 && p.stride_w >= 1 && p.c % kSlab == 0 && p.c / kSlab <= kMaxSlabs && p.k % kTileN == 0 &&
         p.k > 0 && images_per_tile(p) > 0 && input_bytes(p) <= size_t(kMaxInputBytes) &&
         int64_t(p.r) * p.s * p.c < (int64_t(1) << 31);
}

// The swizzle that spreads the rows of the ldmatrix reads over the most bank groups for this problem: every tap's
// 8-row groups are scored (the number of distinct pixels that land in the fullest bank group; padding rows read a
// zero row and count once) and the candidate with the lowest total is kept. Candidates: the plain pixel index (best
// for stride 1) and the forms that separate stride 2's even pixels across rows and images.
struct Swizzle {
  int a, e, b, f;
};
Swizzle score_swizzles(const Conv2dProblem& p) {
  static constexpr Swizzle kCandidates[] = {{1, 0, 1, 0}, {1, 0, 1, 1}, {1, 0, 4, 2}, {1, 0, 3, 1},
                                            {3, 0, 4, 0}, {1, 0, 5, 2}, {2, 0, 5, 1}};
  const int pq = p.p() * p.q(), pix = p.h * p.w;
  Swizzle best = kCandidates[0];
  long best_score = -1;
  for (const Swizzle& sw : kCandidates) {
    long score = 0;
    for (int ty = 0; ty < p.r; ++ty)
      for (int tx = 0; tx < p.s; ++tx)
        for (int j = 0; j < 8; ++j)
          for (int m0 = 0; m0 < kTileM; m0 += 8) {
            int count[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            bool zero_seen[8] = {false, false, false, false, false, false, false, false};
            for (int m = m0; m < m0 + 8; ++m) {
              const int img = m / pq, rem = m % pq, oy = rem / p.q(), ox = rem % p.q();
              const int iy = oy * p.stride_h - p.pad_h + ty, ix = ox * p.stride_w - p.pad_w + tx;
              const bool real = iy >= 0 && iy < p.h && ix >= 0 && ix < p.w;
              const int bank = (j ^ swizzle_of(img * pix + iy * p.w + ix, sw.a, sw.e, sw.b, sw.f)) & 7;
              if (!real) {
                if (zero_seen[bank]) continue;
                zero_seen[bank] = true;
              }
              ++count[bank];
            }
            int worst = 0;
            for (int c : count) worst = c > worst ? c : worst;
            score += worst;
          }
    if (best_score < 0 || score < best_score) best_score = score, best = sw;
  }
  return best;
}

// pick_swizzle's scoring runs ~30k row placements: remembered per geometry, so that a launch costs no host time
// beyond the tensor map (the tuner times back-to-back launches).
Swizzle pick_swizzle(const Conv2dProblem& p) {
  using Key = std::array<int, 9>;
  static std::mutex mutex;
  static std::map<Key, Swizzle> known;
  const Key key{p.h, p.w, p.r, p.s, p.pad_h, p.pad_w, p.stride_h, p.stride_w, p.c};
  std::lock_guard<std::mutex> lock(mutex);
  auto it = known.find(key);
  if (it == known.end()) it = known.emplace(key, score_swizzles(p)).first;
  return it->second;
}

struct DeviceLimits {
  int major = 0, minor = 0, smem_optin = 0;
};
bool device_limits(DeviceLimits& d) {
  int dev = 0;
  return cudaGetDevice(&dev) == cudaSuccess &&
         cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
         cudaDeviceGetAttribute(&d.minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess &&
         cudaDeviceGetAttribute(&d.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) == cudaSuccess;
}

size_t smem_bytes(const Conv2dProblem& p, int stages) {
  return size_t(kAlignSlack) + size_t(stages) * kBoxBytes + input_bytes(p) + kZeroBytes + kOutBytes;
}

// The most ring stages (kMinStages .. kMaxStages) that fit the device's opt-in shared memory; 0 if none does.
int ring_stages(const Conv2dProblem& p, int smem_optin) {
  // Static shared memory (the barriers) is small; leave 1 KB for it and the runtime's reservation.
  for (int st = kMaxStages; st >= kMinStages; --st)
    if (smem_bytes(p, st) + 1024 <= size_t(smem_optin)) return st;
  return 0;
}

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled through the runtime's driver entry point (no link against libcuda); nullptr if missing.
EncodeTiledFn encode_tiled() {
  static EncodeTiledFn fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess)
      return static_cast<EncodeTiledFn>(nullptr);
    return reinterpret_cast<EncodeTiledFn>(ptr);
  }();
  return fn;
}

template <class T, bool kBf16>
cudaError_t launch(const Conv2dProblem& p, const void* x, const void* w, void* y, const FixupEpilogue& e, int split_k,
                   void* /*workspace*/, size_t /*workspace_bytes*/, cudaStream_t stream) {
  if (split_k != 1 || !problem_fits(p)) return cudaErrorInvalidValue;
  auto aligned = [](const void* ptr) { return ptr != nullptr && reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  if (!aligned(x) || !aligned(w) || !aligned(y)) return cudaErrorInvalidValue;
  DeviceLimits d;
  if (!device_limits(d)) return cudaErrorNoDevice;
  if (d.major != 9 || d.minor != 0) return cudaErrorInvalidDevice;
  const int stages = ring_stages(p, d.smem_optin);
  if (stages == 0) return cudaErrorInvalidValue;
  const EncodeTiledFn encode = encode_tiled();
  if (encode == nullptr) return cudaErrorNotSupported;

  // CTAs per cluster sharing the filter boxes (multicast): consecutive M tiles; the grid is padded to a multiple (the
  // extra CTAs have no images and only take part in the loads).
  const int m_tiles = (p.n + images_per_tile(p) - 1) / images_per_tile(p);
  // Default 1: multicast measured no faster at batch 128 (cluster 2) or slower (4, 8); KFUSE_RESIDENT_CLUSTER tries it.
  int cluster = 1;
  if (const char* v = std::getenv("KFUSE_RESIDENT_CLUSTER"); v && *v) cluster = std::atoi(v);
  if (cluster > 1 && m_tiles < cluster) cluster = m_tiles >= 4 ? 4 : (m_tiles >= 2 ? 2 : 1);
  if (cluster != 1 && cluster != 2 && cluster != 4 && cluster != 8) return cudaErrorInvalidValue;

  // The filter as a 2-D tensor: rows = the k output channels, columns = r * s * c (tap-major, channel-minor). A box is
  // one cluster rank's slice of 64 / cluster output channels.
  CUtensorMap map;
  std::memset(&map, 0, sizeof(map));
  const cuuint64_t dims[2] = {cuuint64_t(p.r) * p.s * p.c, cuuint64_t(p.k)};
  const cuuint64_t strides[1] = {dims[0] * 2};
  const cuuint32_t box[2] = {kSlab, cuuint32_t(kTileN / cluster)};
  const cuuint32_t element_strides[2] = {1, 1};
  if (encode(&map, kBf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, const_cast<void*>(w),
             dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
    return cudaErrorInvalidValue;

  Params prm{};
  prm.x = static_cast<const uint16_t*>(x);
  prm.y = static_cast<uint16_t*>(y);
  prm.alpha = e.alpha, prm.pre = e.pre, prm.post = e.post, prm.relu = e.relu;
  prm.n = p.n, prm.h = p.h, prm.w = p.w, prm.c = p.c, prm.k = p.k, prm.r = p.r, prm.s = p.s;
  prm.pad_h = p.pad_h, prm.pad_w = p.pad_w, prm.stride_h = p.stride_h, prm.stride_w = p.stride_w;
  prm.p = p.p(), prm.q = p.q();
  prm.images = images_per_tile(p);
  prm.stages = stages;
  prm.cluster = cluster;
  const Swizzle sw = pick_swizzle(p);
  prm.swz_a = sw.a, prm.swz_e = sw.e, prm.swz_b = sw.b, prm.swz_f = sw.f;

  const size_t smem = smem_bytes(p, stages);
  auto kernel = fixup_resident_kernel<T, kBf16>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (err != cudaSuccess) return err;
  const dim3 grid((m_tiles + cluster - 1) / cluster * cluster, p.k / kTileN);
  cudaLaunchAttribute attrs[2];
  unsigned count = 0;
  attrs[count].id = cudaLaunchAttributeClusterDimension;
  attrs[count].val.clusterDim.x = unsigned(cluster);
  attrs[count].val.clusterDim.y = 1;
  attrs[count].val.clusterDim.z = 1;
  ++count;
  if (pdl_requested()) {
    attrs[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attrs;
  config.numAttrs = count;
  err = cudaLaunchKernelEx(&config, kernel, map, prm);
  return err != cudaSuccess ? err : cudaGetLastError();
}

bool can_implement(const Conv2dProblem& p, int split_k) { return split_k == 1 && problem_fits(p); }

}  // namespace

namespace detail {

bool fixup_resident_f16_can_implement(const Conv2dProblem& p, int split_k) { return can_implement(p, split_k); }
size_t fixup_resident_f16_workspace_bytes(const Conv2dProblem&, int) { return 0; }
cudaError_t fixup_resident_f16_launch(const Conv2dProblem& p, const void* x, const void* w, void* y,
                                      const FixupEpilogue& e, int split_k, void* ws, size_t ws_bytes,
                                      cudaStream_t stream) {
  return launch<__half, false>(p, x, w, y, e, split_k, ws, ws_bytes, stream);
}

bool fixup_resident_bf16_can_implement(const Conv2dProblem& p, int split_k) { return can_implement(p, split_k); }
size_t fixup_resident_bf16_workspace_bytes(const Conv2dProblem&, int) { return 0; }
cudaError_t fixup_resident_bf16_launch(const Conv2dProblem& p, const void* x, const void* w, void* y,
                                       const FixupEpilogue& e, int split_k, void* ws, size_t ws_bytes,
                                       cudaStream_t stream) {
  return launch<__nv_bfloat16, true>(p, x, w, y, e, split_k, ws, ws_bytes, stream);
}

}  // namespace detail
}  // namespace kfuse::kernels
