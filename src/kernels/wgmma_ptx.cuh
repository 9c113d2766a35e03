// The Hopper (sm_90a) PTX wrappers the hand-written warpgroup-MMA and cluster kernels share (conv/wgrad_wgmma.cu,
// encoder/fused_block_wgmma.cu, encoder/fused_down_block_group_wgmma.cu ...): wgmma's fence / commit / wait, the proxy
// fence between generic shared-memory writes and wgmma's reads, shared-memory matrix descriptors, mbarriers,
// stmatrix, and clusters' distributed shared memory. Device-only, inline; include it only
// from translation units compiled for sm_90a. Each kernel keeps its own MMA shape wrappers.
#pragma once

#include <cstdint>

namespace kfuse::kernels::ptx {

// Generic-proxy writes to shared memory (st.shared, cp.async, stmatrix) become visible to the async proxy (wgmma's
// operand reads): the writing threads fence, then synchronize with the readers.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N committed groups of this warpgroup's MMAs are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Keeps the compiler from touching registers an MMA in flight reads or writes before the wait that completes it.
template <int N>
__device__ __forceinline__ void hold(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int N>
__device__ __forceinline__ void hold(uint32_t (&a)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(a[i])::"memory");
}
template <int M, int N>
__device__ __forceinline__ void hold(uint32_t (&a)[M][N]) {
#pragma unroll
  for (int i = 0; i < M; ++i) hold(a[i]);
}

// A shared-memory matrix descriptor without swizzle (core matrices of 8 rows x 16 bytes, each row's 16 bytes
// contiguous): start address, leading byte offset (between the core matrices along K) and stride byte offset (between
// the core matrices along M or N), all encoded in 16-byte units. Adding (bytes >> 4) to a descriptor moves its start.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lead_bytes, uint32_t stride_bytes) {
  return static_cast<uint64_t>((addr >> 4) & 0x3fffu) | (static_cast<uint64_t>((lead_bytes >> 4) & 0x3fffu) << 16) |
         (static_cast<uint64_t>((stride_bytes >> 4) & 0x3fffu) << 32);
}

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Spins until the barrier's phase of the given parity has completed. kCluster: acquiring at cluster scope, where
// other CTAs' remote stores (st_async below) completed the phase; else at CTA scope (the default of try_wait).
template <bool kCluster = false>
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
  if constexpr (kCluster)
    asm volatile(
        "{\n.reg .pred done;\nwait_%=:\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_%=;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
  else
    asm volatile(
        "{\n.reg .pred done;\nwait_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_%=;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// One more arrival on the barrier that also expects `bytes` of asynchronous copies (bulk_copy_g2s) to complete.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// `bytes` (a multiple of 16; 16-byte aligned addresses) global -> shared by the TMA unit, completing on `bar`'s
// transaction count: one instruction of one thread for the whole copy, written through the async proxy (wgmma reads
// it after the barrier's wait without a proxy fence).
__device__ __forceinline__ void bulk_copy_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// Thread block clusters: this CTA's rank, distributed shared memory and the cluster barrier (PTX ISA: mapa,
// st.async, barrier.cluster).
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// The shared::cluster address of the same offset in CTA `rank`'s shared memory.
__device__ __forceinline__ uint32_t map_rank(uint32_t addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
// Remote stores that count their bytes on the destination CTA's mbarrier (`bar`: its shared::cluster address, from
// map_rank): the reader waits on its own barrier (mbar_wait<true>), with no cluster-wide barrier and no memory fence.
// (A release arrive on the cluster barrier compiles to MEMBAR.ALL.GPU before it and an L1 invalidation after the wait,
// seen in the SASS; such membars took 12% of a cluster kernel's stall samples.)
__device__ __forceinline__ void st_async(uint32_t addr, const uint4& v, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1,%2,%3,%4}, [%5];\n" ::"r"(addr),
               "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(bar)
               : "memory");
}
__device__ __forceinline__ void st_async(uint32_t addr, float a, float b, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1,%2}, [%3];\n" ::"r"(addr),
               "f"(a), "f"(b), "r"(bar)
               : "memory");
}
__device__ __forceinline__ void st_async(uint32_t addr, float a, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];\n" ::"r"(addr), "f"(a),
               "r"(bar)
               : "memory");
}
// The cluster barrier, relaxed: no ordering of memory, only "every thread of every CTA has arrived" (e.g. every CTA
// has started, so that remote stores may go to it). Every thread of the CTA executes both.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory"); }

// Four 8x8 16-bit matrices from registers (the mma accumulator fragment layout, packed in pairs) to shared memory,
// each transposed: lane l gives the address of row l % 8 of matrix l / 8, which receives column l % 8 of the
// fragment's matrix.
__device__ __forceinline__ void stsm_x4_trans(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// The same without the transpose: matrix l / 8's row l % 8 receives row l % 8 of the fragment's matrix (the
// accumulator's rows stay rows: a pixel-major tile with 8 channels per 16-byte row).
__device__ __forceinline__ void stsm_x4(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(r[0]), "r"(r[1]),
               "r"(r[2]), "r"(r[3])
               : "memory");
}

// Named barrier `id` (1-15; 0 is __syncthreads) over the first `count` threads of the CTA (a multiple of 32), for
// kernels whose other warps (a copy producer) never join.
__device__ __forceinline__ void named_barrier(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

}  // namespace kfuse::kernels::ptx
