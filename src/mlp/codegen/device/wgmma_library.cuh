// Hopper warpgroup MMA (wgmma). The four warps of a warpgroup issue each instruction together: it multiplies 64
// rows (16 per warp; the A fragments in registers exactly as mma.sync's m16n8k16 A operand) by a K = 16 slice of
// the weights in shared memory (a matrix descriptor) into N columns of fp32 accumulators, which a warp holds as N / 8
// mma.sync C tiles of its 16 rows. Asynchronous: committed in groups and waited for by count.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(PENDING) : "memory");
}
// After the wait that completes them: keeps the compiler from reading the accumulators any earlier.
template <int NT>
__device__ __forceinline__ void wgmma_fence_acc(float (&d)[1][NT][4]) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[0][j][e])::"memory");
}
// The descriptor of a weight matrix of K columns in the core-matrix layout at shared address `addr`: leading byte
// offset 128 (the next 8 columns), stride byte offset K * 16 (the next 8 rows), no swizzle; all in 16-byte units.
__device__ __forceinline__ unsigned long long wgmma_desc(u32 addr, int k) {
  return static_cast<unsigned long long>((addr >> 4) & 0x3fffu) | (8ull << 16) |
         (static_cast<unsigned long long>(k) << 32);
}
// All threads copy an N x K weight matrix (rows SRC_LD halves apart: the packed forward region) into the
// core-matrix layout: the 16-byte piece (row r, columns 8c..) to core matrix (r / 8, c), row r % 8.
// DST_PIECES: the destination's 16-byte pieces per row (more than K / 8 where a bias slice follows, see below).
template <int N, int K, int SRC_LD, int THREADS, int DST_PIECES = K / 8>
__device__ __forceinline__ void copy_core_matrices(u32 dst, const u16* src) {
  constexpr int PIECES = K / 8;
  for (int i = threadIdx.x; i < N * PIECES; i += THREADS) {
    const int r = i / PIECES, c = i % PIECES;
    cp_async16(dst + ((r >> 3) * DST_PIECES + c) * 128 + (r & 7) * 16, src + r * SRC_LD + c * 8);
  }
}
// The same for a streamed chunk, every row block. The 16-byte slots go in shared-memory order: eight consecutive
// threads fill one core matrix (8 rows of one 16-byte column piece: 128 contiguous bytes, no bank conflict), a
// warp four pieces of those rows (64 contiguous bytes of each global row). (Row order, eight threads along a row,
// wrote eight core matrices 128 bytes apart at once; neither order changed ncu's 2x L2 sectors or the time, see
// PERF.md: a swizzled layout would serve both sides.) Each thread's addresses are one base plus immediate offsets, the base through an
// opaque move: otherwise the compiler hoists every chunk's addresses out of the row-block loop (100 64-bit
// registers at width 256: ptxas spilled). The chunk starts OFFSET + extra halves into `w` (extra: a run-time
// layer's distance).
template <int N, int K, int SRC_LD, int THREADS, long long OFFSET>
__device__ __forceinline__ void copy_chunk_core_matrices(u32 dst, const u16* w, int extra) {
  constexpr int PIECES = K / 8, SLOTS = N * PIECES;
  const u16* src;
  asm volatile("mov.b64 %0, %1;" : "=l"(src) : "l"(w));
  src += OFFSET + extra;
  if constexpr ((THREADS / 8) % PIECES == 0) {
    constexpr int ROW_STEP = THREADS / PIECES;  // rows per pass
    const int rest = threadIdx.x >> 3, c = rest % PIECES, r = rest / PIECES * 8 + (threadIdx.x & 7);
    const u32 d = dst + threadIdx.x * 16;
    const u16* s = src + r * SRC_LD + c * 8;
#pragma unroll
    for (int it = 0; it < (SLOTS + THREADS - 1) / THREADS; ++it) {
      if (SLOTS % THREADS != 0 && static_cast<int>(threadIdx.x) + it * THREADS >= SLOTS) break;
      cp_async16(d + it * THREADS * 16, s + it * ROW_STEP * SRC_LD);
    }
  } else {
    for (int i = threadIdx.x; i < SLOTS; i += THREADS) {
      const int rest = i >> 3, c = rest % PIECES, r = rest / PIECES * 8 + (i & 7);
      cp_async16(dst + i * 16, src + r * SRC_LD + c * 8);
    }
  }
}
// The bias as one more K = 16 slice of a layer's weights (pieces K8 and K8 + 1 of each row, PIECES per row): column
// K of row r holds bias[r] in 16 bits (the module's bias is 16-bit already: exact), the other 15 zeros. One MMA with
// a ones column in A then starts the accumulators at the bias (scale-d 0), instead of per-thread register moves.
template <int N, int PIECES, int K8, int THREADS>
__device__ __forceinline__ void fill_bias_slice(u32 dst, const float* __restrict__ bias) {
  for (int r = threadIdx.x; r < N; r += THREADS) {
    const u32 row = dst + ((r >> 3) * PIECES + K8) * 128 + (r & 7) * 16;
    st_shared_v4(row, static_cast<u32>(to_bits(bias[r])), 0u, 0u, 0u);
    st_shared_v4(row + 128, 0u, 0u, 0u, 0u);
  }
}
// A warp's A fragments of 16 rows x 16 KT columns from a shared tile with rows LD halves apart (ldmatrix: lanes
// 0-15 address rows 0-15 of a slice's left 8 columns, lanes 16-31 those of its right 8).
template <int LD, int KT>
__device__ __forceinline__ void load_a_tile(u32 (&a)[1][KT][4], u32 tile, int lane) {
  const u32 base = tile + ((lane & 15) * LD + ((lane >> 4) << 3)) * 2;
#pragma unroll
  for (int kt = 0; kt < KT; ++kt) ldsm4(base + kt * 32, a[0][kt][0], a[0][kt][1], a[0][kt][2], a[0][kt][3]);
}
// ReLU on A fragments of 16-bit pairs.
template <int KT>
__device__ __forceinline__ void relu_pairs(u32 (&a)[1][KT][4]) {
#pragma unroll
  for (int kt = 0; kt < KT; ++kt)
#pragma unroll
    for (int i = 0; i < 4; ++i)
#if KFUSE_BF16
      asm("max.bf16x2 %0, %1, %2;" : "=r"(a[0][kt][i]) : "r"(a[0][kt][i]), "r"(0u));
#else
      asm("max.f16x2 %0, %1, %2;" : "=r"(a[0][kt][i]) : "r"(a[0][kt][i]), "r"(0u));
#endif
}
// The backward's tiles (codegen/mlp_wgmma_backward.h): 64 rows in 16-byte units, unit (r, c) at
// ((r / 8) * UNITS + c) * 128 + (r % 8) * 16.
template <int UNITS>
__device__ __forceinline__ u32 unit_addr(u32 tile, int r, int c) {
  return tile + (((r >> 3) * UNITS + c) << 7) + ((r & 7) << 4);
}
// The descriptor of such a tile as an MN-major operand (K = rows): leading byte offset = the next 8 rows
// (UNITS * 128 bytes), stride byte offset = the next 8 columns (128 bytes).
template <int UNITS>
__device__ __forceinline__ unsigned long long wgmma_desc_mn(u32 addr) {
  return static_cast<unsigned long long>((addr >> 4) & 0x3fffu) | (static_cast<unsigned long long>(UNITS * 8) << 16) |
         (8ull << 32);
}
// Generic-proxy shared-memory writes (st.shared, cp.async) made visible to wgmma's operand reads (async proxy).
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// The 128 threads of warpgroup wg (named barrier 1 + wg; 0 is __syncthreads').
__device__ __forceinline__ void warpgroup_barrier(int wg) {
  asm volatile("bar.sync %0, 128;" ::"r"(wg + 1) : "memory");
}
// A warp's A fragments of its 16 rows (from tile row wr) x 16 KT columns.
template <int UNITS, int KT>
__device__ __forceinline__ void load_a_units(u32 (&a)[1][KT][4], u32 tile, int wr, int lane) {
  const int r = wr + (lane & 15), hi = lane >> 4;
#pragma unroll
  for (int kt = 0; kt < KT; ++kt)
    ldsm4(unit_addr<UNITS>(tile, r, 2 * kt + hi), a[0][kt][0], a[0][kt][1], a[0][kt][2], a[0][kt][3]);
}
// A warp's A fragments (16-bit) into its 16 rows of the tile: register i of k-step kt is row g + 8 (i & 1),
// columns 16 kt + 8 (i >> 1) + 2q.
template <int UNITS, int KT>
__device__ __forceinline__ void store_a_units(u32 tile, const u32 (&a)[1][KT][4], int wr, int lane) {
  const int r = wr + (lane >> 2), q = lane & 3;
#pragma unroll
  for (int kt = 0; kt < KT; ++kt)
#pragma unroll
    for (int i = 0; i < 4; ++i) st_shared_u32(unit_addr<UNITS>(tile, r + 8 * (i & 1), 2 * kt + (i >> 1)) + 4 * q, a[0][kt][i]);
}
// A warp's C-layout accumulators of its 16 rows (from wr, a multiple of 8), rounded to 16 bits, into the tile
// (unit c = columns 8c ..). One base address plus immediate offsets: 64 addresses per layer, hoisted out of the
// row-block loop, would take registers the accumulators need.
template <int UNITS, int NT>
__device__ __forceinline__ void store_c_units(u32 tile, const float (&acc)[1][NT][4], int wr, int lane) {
  const u32 base = unit_addr<UNITS>(tile, wr + (lane >> 2), 0) + 4 * (lane & 3);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      st_shared_u32(base + (h * UNITS + nt) * 128, pack2(acc[0][nt][2 * h], acc[0][nt][2 * h + 1]));
}
// The C-layout values of a warp's 16 rows as floats.
template <int UNITS, int NT>
__device__ __forceinline__ void load_c_units(float (&v)[1][NT][4], u32 tile, int wr, int lane) {
  const int r = wr + (lane >> 2), q = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const u32 both = ld_shared_u32(unit_addr<UNITS>(tile, r + 8 * h, nt) + 4 * q);
      v[0][nt][2 * h] = from_bits(static_cast<u16>(both & 0xffffu));
      v[0][nt][2 * h + 1] = from_bits(static_cast<u16>(both >> 16));
    }
}
// Zeros in units [C0, C1) of a warp's 16 rows.
template <int UNITS, int C0, int C1>
__device__ __forceinline__ void zero_units(u32 tile, int wr, int lane) {
  for (int i = lane; i < 16 * (C1 - C0); i += 32)
    st_shared_v4(unit_addr<UNITS>(tile, wr + (i & 15), C0 + (i >> 4)), 0u, 0u, 0u, 0u);
}
// Unit c of all 64 rows set to ones (t = the thread's index in its warpgroup).
template <int UNITS>
__device__ __forceinline__ void fill_unit_column(u32 tile, int c, int t) {
  const u32 one = static_cast<u32>(to_bits(1.0f)) * 0x10001u;
  if (t < 64) st_shared_v4(unit_addr<UNITS>(tile, t, c), one, one, one, one);
}
// A thread's running sums of its rows of g (per column pair): a transposed layer's bias gradient.
template <int NT>
__device__ __forceinline__ void add_row_sums(float (&s)[NT][2], const float (&g)[1][NT][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    s[nt][0] += g[0][nt][0] + g[0][nt][2];
    s[nt][1] += g[0][nt][1] + g[0][nt][3];
  }
}
// The warp's sums over its lanes (the 8 row groups) into scratch row `warp` (OUT_P floats).
template <int OUT_P, int NT>
__device__ __forceinline__ void store_row_sums(float (&s)[NT][2], float* scratch, int warp, int lane) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float v = s[nt][e];
      v += __shfl_xor_sync(0xffffffffu, v, 4);
      v += __shfl_xor_sync(0xffffffffu, v, 8);
      v += __shfl_xor_sync(0xffffffffu, v, 16);
      if (lane < 4) scratch[warp * OUT_P + nt * 8 + 2 * lane + e] = v;
    }
}
// A warp's 16 rows of W_UNITS units of a tile (from tile row wr) to global rows of LD halves starting at row0 (rows
// >= batch skipped): 16 bytes per lane, whole rows per instruction, where 4-byte stores of the fragments would
// cost L2 twice the requests (PERF.md). Warp-synchronous: the warp's own rows, __syncwarp() around it.
template <int UNITS, int W_UNITS, int LD>
__device__ __forceinline__ void copy_units_out(u16* __restrict__ out, u32 tile, int wr, i64 row0, i64 batch,
                                               int lane) {
  u16* const base = out + row0 * LD;
  const int rows_left = static_cast<int>(min(static_cast<i64>(16), batch - row0));
#pragma unroll
  for (int k = 0; k < (16 * W_UNITS + 31) / 32; ++k) {
    const int i = lane + 32 * k, r = i / W_UNITS, c = i % W_UNITS;
    if (i < 16 * W_UNITS && r < rows_left) {
      uint4 v;
      asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "r"(unit_addr<UNITS>(tile, wr + r, c)));
      *reinterpret_cast<uint4*>(base + r * LD + 8 * c) = v;
    }
  }
}
// The thread's C-layout pairs of rows `row` and row + 8 of a global array of rows of W halves, as packed 16-bit
// pairs (half the registers of floats while they wait: a prefetch); zero beyond the batch.
template <int W, int NT>
__device__ __forceinline__ void load_pairs(u32 (&v)[NT][2], const u16* __restrict__ in, i64 row, i64 batch, int q) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      v[nt][h] = row + 8 * h < batch ? __ldg(reinterpret_cast<const unsigned int*>(in + (row + 8 * h) * W + 8 * nt + 2 * q))
                                     : 0u;
}
template <int NT>
__device__ __forceinline__ void unpack_pairs(float (&t)[1][NT][4], const u32 (&v)[NT][2]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      t[0][nt][2 * h] = from_bits(static_cast<u16>(v[nt][h] & 0xffffu));
      t[0][nt][2 * h + 1] = from_bits(static_cast<u16>(v[nt][h] >> 16));
    }
}
// Adds one 64-row M tile (from M0) of a weight-gradient accumulator into the gradient sums (PyTorch's (OUT, IN)
// layout, true widths). Normal: m = output feature, n = input feature, column IN_P = the ones unit's (the bias
// gradient, into bias). Transposed: m = input feature, n = output feature.
template <bool TRANSPOSED, bool BIAS, int OUT, int IN, int IN_P, int M0, int NT>
__device__ __forceinline__ void add_wgrad(const float (&d)[1][NT][4], float* w, float* bias, int wq, int lane) {
  const int g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int m = M0 + 16 * wq + g + 8 * (e >> 1), n = 8 * j + 2 * q + (e & 1);
      if (TRANSPOSED) {
        if (m < IN && n < OUT) w[n * IN + m] += d[0][j][e];
      } else if (m < OUT) {
        if (n < IN) w[m * IN + n] += d[0][j][e];
        else if (BIAS && n == IN_P) bias[m] += d[0][j][e];
      }
    }
}
