typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

#if KFUSE_BF16
#define KFUSE_MMA_TYPE "bf16"
#else
#define KFUSE_MMA_TYPE "f16"
#endif

__device__ __forceinline__ u32 smem_addr(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }

// Rounds two floats to 16 bits (round to nearest even) and packs them, lo in the low half.
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
#if KFUSE_BF16
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}
__device__ __forceinline__ u16 to_bits(float v) {
  u16 r;
#if KFUSE_BF16
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
#else
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(v));
#endif
  return r;
}
__device__ __forceinline__ float from_bits(u16 v) {
#if KFUSE_BF16
  return __uint_as_float(static_cast<u32>(v) << 16);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
  return f;
#endif
}

__device__ __forceinline__ void mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32." KFUSE_MMA_TYPE "." KFUSE_MMA_TYPE
      ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldsm4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// The transposing form: each thread gets a column pair of the 8x8 matrices instead of a row pair.
__device__ __forceinline__ void ldsm4_trans(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

__device__ __forceinline__ void st_shared_u32(u32 addr, u32 v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared_v4(u32 addr, u32 a, u32 b, u32 c, u32 d) {
  asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
__device__ __forceinline__ u32 ld_shared_u32(u32 addr) {
  u32 v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ void cp_async16(u32 dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// Until at most PENDING of this thread's most recent cp.async groups are still in flight.
template <int PENDING>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
}

// All threads of the CTA copy BYTES (a multiple of 16) from global to shared memory.
template <int BYTES, int THREADS>
__device__ __forceinline__ void copy_flat(u32 dst, const unsigned char* src) {
  for (int i = threadIdx.x * 16; i < BYTES; i += THREADS * 16) cp_async16(dst + i, src + i);
}

// All threads copy a ROWS x COLS tile (halves; COLS a multiple of 8) with rows SRC_STRIDE apart into shared memory
// with rows DST_STRIDE apart.
template <int ROWS, int COLS, int SRC_STRIDE, int DST_STRIDE, int THREADS>
__device__ __forceinline__ void copy_tile(u32 dst, const u16* src) {
  constexpr int PIECES = COLS / 8;
  for (int i = threadIdx.x; i < ROWS * PIECES; i += THREADS) {
    const int r = i / PIECES, c = (i % PIECES) * 8;
    cp_async16(dst + (r * DST_STRIDE + c) * 2, src + r * SRC_STRIDE + c);
  }
}

// THREADS threads (tid = 0 .. THREADS - 1: the CTA's, or one warp's lanes) copy rows [row0, row0 + ROWS) of a
// (batch x WIDTH) array into a shared tile of COLS columns (WIDTH rounded up to 16) with rows STRIDE halves apart,
// zero beyond the batch and beyond WIDTH: zeros, not stale data, because the tile is an mma operand summed over all
// its rows. 16-byte pieces inside the array go by cp.async (WIDTH % 8 == 0 keeps them 16-byte aligned); the rest
// (an input width that is not a multiple of 8) by plain loads, visible after the caller's next barrier like the
// cp.async pieces after its wait. UNITS > 0: the destination is a tile of 16-byte units instead (the wgmma backward's:
// unit (r, c) at ((r / 8) * UNITS + c) * 128 + (r % 8) * 16; STRIDE unused; dst at an 8-row group).
template <int ROWS, int WIDTH, int COLS, int STRIDE, int THREADS, int UNITS = 0>
__device__ __forceinline__ void copy_rows_zero_fill(u32 dst, const u16* __restrict__ src, i64 row0, i64 batch,
                                                    int tid) {
  constexpr int PIECES = COLS / 8;
  // 32-bit arithmetic inside the tile (the 64-bit parts once): keeps the unrolled copy's registers few.
  const u16* base = src + row0 * WIDTH;
  const int rows = static_cast<int>(min(static_cast<i64>(ROWS), batch - row0));
#pragma unroll
  for (int it = 0; it < (ROWS * PIECES + THREADS - 1) / THREADS; ++it) {
    const int i = tid + it * THREADS;
    if ((ROWS * PIECES) % THREADS != 0 && i >= ROWS * PIECES) break;
    const int r = i / PIECES, c = (i % PIECES) * 8;
    const u32 d = UNITS > 0 ? dst + (((r >> 3) * UNITS + (c >> 3)) << 7) + ((r & 7) << 4) : dst + (r * STRIDE + c) * 2;
    if (WIDTH % 8 == 0 && (COLS == WIDTH || c < WIDTH)) {
      if (r < rows) cp_async16(d, base + r * WIDTH + c);
      else st_shared_v4(d, 0u, 0u, 0u, 0u);
    } else {
      u32 v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int c0 = c + 2 * j;
        const u32 lo = r < rows && c0 < WIDTH ? static_cast<u32>(__ldg(base + r * WIDTH + c0)) : 0u;
        const u32 hi = r < rows && c0 + 1 < WIDTH ? static_cast<u32>(__ldg(base + r * WIDTH + c0 + 1)) : 0u;
        v[j] = lo | (hi << 16);
      }
      st_shared_v4(d, v[0], v[1], v[2], v[3]);
    }
  }
}

// A operand held in registers (a previous layer's output).
template <int MT, int KT>
struct RegA {
  const u32 (&r)[MT][KT][4];
  __device__ __forceinline__ void get(int mt, int kt, u32 (&o)[4]) const {
    o[0] = r[mt][kt][0];
    o[1] = r[mt][kt][1];
    o[2] = r[mt][kt][2];
    o[3] = r[mt][kt][3];
  }
};

// A operand read from the caller's input (batch x WIDTH, contiguous): zero beyond the batch and the width.
// `row` is the lane's first row (tile row g).
template <int WIDTH>
struct InputA {
  const u16* __restrict__ x;
  i64 row, batch;
  int q;
  __device__ __forceinline__ u32 pair(i64 r, int c) const {
    if (r >= batch) return 0u;
    const u16* p = x + r * WIDTH + c;
    if (WIDTH % 2 == 0) return c < WIDTH ? __ldg(reinterpret_cast<const unsigned int*>(p)) : 0u;
    const u32 lo = c < WIDTH ? static_cast<u32>(__ldg(p)) : 0u;
    const u32 hi = c + 1 < WIDTH ? static_cast<u32>(__ldg(p + 1)) : 0u;
    return lo | (hi << 16);
  }
  __device__ __forceinline__ void get(int mt, int kt, u32 (&o)[4]) const {
    const i64 r = row + mt * 16;
    const int c = kt * 16 + 2 * q;
    o[0] = pair(r, c);
    o[1] = pair(r + 8, c);
    o[2] = pair(r, c + 8);
    o[3] = pair(r + 8, c + 8);
  }
};

// acc += A[:, 16 KT0 .. 16 KT1) W[:, same]^T for NT 8-column tiles. The weight columns from K0 on sit in shared
// memory at `w` as rows (output columns) STRIDE halves apart. One ldmatrix.x4 gives the B fragments of two n-tiles.
template <int MT, int NT, int KT0, int KT1, int K0, int STRIDE, class Src>
__device__ __forceinline__ void mma_chunk(float (&acc)[MT][NT][4], const Src& a, u32 w, int lane) {
  const u32 base = w + ((((lane >> 4) << 3) + (lane & 7)) * STRIDE + (((lane >> 3) & 1) << 3)) * 2;
#pragma unroll
  for (int kt = KT0; kt < KT1; ++kt) {
    u32 af[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) a.get(mt, kt, af[mt]);
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      u32 b0, b1, b2, b3;
      ldsm4(base + (np * 16 * STRIDE + kt * 16 - K0) * 2, b0, b1, b2, b3);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma(acc[mt][2 * np], af[mt], b0, b1);
        mma(acc[mt][2 * np + 1], af[mt], b2, b3);
      }
    }
  }
}

template <bool HAS_BIAS, int MT, int NT>
__device__ __forceinline__ void init_acc(float (&acc)[MT][NT][4], const float* __restrict__ bias, int q) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const float b0 = HAS_BIAS ? bias[nt * 8 + 2 * q] : 0.0f, b1 = HAS_BIAS ? bias[nt * 8 + 2 * q + 1] : 0.0f;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      acc[mt][nt][0] = b0;
      acc[mt][nt][1] = b1;
      acc[mt][nt][2] = b0;
      acc[mt][nt][3] = b1;
    }
  }
}

template <class Act, int MT, int NT>
__device__ __forceinline__ void apply_act(float (&acc)[MT][NT][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = Act::f(acc[mt][nt][i]);
}

// Rounds the fp32 accumulators to 16 bits and re-arranges them as the next layer's A operand (registers only).
template <int MT, int NT>
__device__ __forceinline__ void to_a(const float (&acc)[MT][NT][4], u32 (&a)[MT][NT / 2][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < NT / 2; ++j) {
      a[mt][j][0] = pack2(acc[mt][2 * j][0], acc[mt][2 * j][1]);
      a[mt][j][1] = pack2(acc[mt][2 * j][2], acc[mt][2 * j][3]);
      a[mt][j][2] = pack2(acc[mt][2 * j + 1][0], acc[mt][2 * j + 1][1]);
      a[mt][j][3] = pack2(acc[mt][2 * j + 1][2], acc[mt][2 * j + 1][3]);
    }
}

// Stores a C-layout tile as 16-bit values into rows of LD elements; rows >= batch and columns >= WIDTH are skipped.
template <int WIDTH, int LD, int MT, int NT>
__device__ __forceinline__ void store_c(const float (&acc)[MT][NT][4], u16* __restrict__ out, i64 row, i64 batch,
                                        int q) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const i64 r = row + mt * 16 + h * 8;
      if (r >= batch) continue;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int c = nt * 8 + 2 * q;
        u16* p = out + r * LD + c;
        const float v0 = acc[mt][nt][2 * h], v1 = acc[mt][nt][2 * h + 1];
        if (WIDTH % 2 == 0 && LD % 2 == 0) {
          if (c < WIDTH) *reinterpret_cast<u32*>(p) = pack2(v0, v1);
        } else {
          if (c < WIDTH) p[0] = to_bits(v0);
          if (c + 1 < WIDTH) p[1] = to_bits(v1);
        }
      }
    }
}

// store_c through the warp's own shared staging area `stage` (16 * MT rows of LDS halves): the fragments go to
// shared memory as 32-bit words, then every lane copies whole 16-byte row segments out, so that one warp store
// covers 512 contiguous bytes instead of 4-byte pieces of 8 rows. The training forward's stash writes were bound by
// the L1 wavefronts of the scattered form (ncu: L1 85% busy, DRAM 62%); staging them took it from 0.49 to 0.39 ms at
// width 64 (PERF.md). Rows of WIDTH elements (WIDTH % 8 == 0,
// 16-byte aligned rows), starting at `row0` (the warp's first row); rows >= batch are skipped. Warp-synchronous.
template <int WIDTH, int LDS, int MT, int NT>
__device__ __forceinline__ void store_c_staged(const float (&acc)[MT][NT][4], u16* __restrict__ out, i64 row0,
                                               i64 batch, u32 stage, int lane) {
  static_assert(WIDTH % 8 == 0 && LDS % 8 == 0 && LDS >= NT * 8, "staged store: 16-byte rows");
  const int q = lane & 3, r8 = lane >> 2;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int r = mt * 16 + h * 8 + r8, c = nt * 8 + 2 * q;
        if (c < WIDTH) st_shared_u32(stage + (r * LDS + c) * 2, pack2(acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]));
      }
  __syncwarp();
  constexpr int CHUNKS = WIDTH / 8, TOTAL = 16 * MT * CHUNKS;
#pragma unroll
  for (int i = lane; i < TOTAL; i += 32) {
    const int r = i / CHUNKS, c = (i % CHUNKS) * 8;
    if (row0 + r < batch) {
      uint4 v;
      asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "r"(stage + (r * LDS + c) * 2)
                   : "memory");
      *reinterpret_cast<uint4*>(out + (row0 + r) * WIDTH + c) = v;
    }
  }
  __syncwarp();  // the next staged store reuses the area
}

// Loads a C-layout tile of 16-bit values as floats; zero beyond the batch and WIDTH.
template <int WIDTH, int LD, int MT, int NT>
__device__ __forceinline__ void load_c(float (&v)[MT][NT][4], const u16* __restrict__ in, i64 row, i64 batch,
                                       int q) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const i64 r = row + mt * 16 + h * 8;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int c = nt * 8 + 2 * q;
        float v0 = 0.0f, v1 = 0.0f;
        if (r < batch) {
          const u16* p = in + r * LD + c;
          if (WIDTH % 2 == 0 && LD % 2 == 0) {
            if (c < WIDTH) {
              const u32 both = __ldg(reinterpret_cast<const unsigned int*>(p));
              v0 = from_bits(static_cast<u16>(both & 0xffffu));
              v1 = from_bits(static_cast<u16>(both >> 16));
            }
          } else {
            if (c < WIDTH) v0 = from_bits(__ldg(p));
            if (c + 1 < WIDTH) v1 = from_bits(__ldg(p + 1));
          }
        }
        v[mt][nt][2 * h] = v0;
        v[mt][nt][2 * h + 1] = v1;
      }
    }
}

// Stores a warp's A fragments (16-bit activation gradients: its 16 MT rows x 16 KT columns) into a shared tile with
// rows STRIDE halves apart; rows >= batch as zeros. `trow`: the lane's first row (tile row g) inside the tile; `row`:
// the same row in the batch.
template <int STRIDE, int MT, int KT>
__device__ __forceinline__ void store_a_shared(u32 tile, const u32 (&a)[MT][KT][4], int trow, i64 row, i64 batch,
                                               int q) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const bool inside = row + mt * 16 + h * 8 < batch;
      const u32 base = tile + ((trow + mt * 16 + h * 8) * STRIDE + 2 * q) * 2;
#pragma unroll
      for (int kt = 0; kt < KT; ++kt) {
        st_shared_u32(base + kt * 32, inside ? a[mt][kt][h] : 0u);
        st_shared_u32(base + kt * 32 + 16, inside ? a[mt][kt][2 + h] : 0u);
      }
    }
}

// Loads a C-layout tile of 16-bit values as floats from a shared tile with rows STRIDE halves apart (`trow` as for
// store_a_shared).
template <int STRIDE, int MT, int NT>
__device__ __forceinline__ void load_c_shared(float (&v)[MT][NT][4], u32 tile, int trow, int q) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const u32 both = ld_shared_u32(tile + ((trow + mt * 16 + h * 8) * STRIDE + nt * 8 + 2 * q) * 2);
        v[mt][nt][2 * h] = from_bits(static_cast<u16>(both & 0xffffu));
        v[mt][nt][2 * h + 1] = from_bits(static_cast<u16>(both >> 16));
      }
}

// The A fragment of dz^T at (out-tile ot, k-step ks) from a shared dz tile with rows DSTRIDE halves apart: lane l
// addresses row l % 8 of 8x8 block l / 8, blocks (k0, m0), (k0, m0 + 8), (k0 + 8, m0), (k0 + 8, m0 + 8) = a0..a3,
// through ldmatrix.trans (dz is stored k-major).
template <int DSTRIDE>
__device__ __forceinline__ u32 dz_t_base(u32 dz, int lane) {
  return dz + (((lane & 7) + ((lane >> 4) << 3)) * DSTRIDE + (((lane >> 3) & 1) << 3)) * 2;
}
template <int DSTRIDE>
__device__ __forceinline__ void load_dz_t(u32 (&a)[4], u32 base, int ks, int ot) {
  ldsm4_trans(base + (ks * 16 * DSTRIDE + ot * 16) * 2, a[0], a[1], a[2], a[3]);
}

// Weight and bias gradients of one layer over one row block (codegen/mlp_wgrad_plan.h): acc += dz^T h and
// bacc += dz^T 1 for the warp's out-tiles (m) and in-pairs (n), k = the KSTEPS * 16 rows of the shared tiles dz
// (rows x out, rows DSTRIDE halves apart) and h (rows x in, HSTRIDE). Both operands are stored k-major, so both go
// through ldmatrix.trans: the A fragment of dz^T at (m0, k0) is the four 8x8 blocks of dz at rows k0 / k0 + 8 and
// columns m0 / m0 + 8; the B fragments of two n-tiles of h likewise.
template <int OT, int IP, int WO, int WI, int OUT_TILES, int IN_PAIRS, int KSTEPS, int DSTRIDE, int HSTRIDE, bool BIAS>
__device__ __forceinline__ void wgrad_accumulate(float (&acc)[OT][2 * IP][4], float (&bacc)[OT][4], u32 dz, u32 h,
                                                 int warp, int lane) {
  const int wo = warp % WO, wi = warp / WO;
  // A fragments: dz_t_base. B: lane l addresses row l % 8 of 8x8 block l / 8, blocks (k0, n0), (k0 + 8, n0),
  // (k0, n0 + 8), (k0 + 8, n0 + 8) = b0, b1 of n-tile n0 / 8, then of the next.
  const u32 a_base = dz_t_base<DSTRIDE>(dz, lane);
  const u32 b_base = h + (((lane & 7) + (((lane >> 3) & 1) << 3)) * HSTRIDE + ((lane >> 4) << 3)) * 2;
  const u32 ones = pack2(1.0f, 1.0f);
#pragma unroll
  for (int ks = 0; ks < KSTEPS; ++ks) {
    u32 b[IP][4];
#pragma unroll
    for (int j = 0; j < IP; ++j) {
      const int ip = wi + j * WI;
      if (IN_PAIRS % WI == 0 || ip < IN_PAIRS)
        ldsm4_trans(b_base + (ks * 16 * HSTRIDE + ip * 16) * 2, b[j][0], b[j][1], b[j][2], b[j][3]);
    }
#pragma unroll
    for (int i = 0; i < OT; ++i) {
      const int ot = wo + i * WO;
      if (OUT_TILES % WO != 0 && ot >= OUT_TILES) continue;
      u32 a[4];
      load_dz_t<DSTRIDE>(a, a_base, ks, ot);
#pragma unroll
      for (int j = 0; j < IP; ++j) {
        if (IN_PAIRS % WI != 0 && wi + j * WI >= IN_PAIRS) continue;
        mma(acc[i][2 * j], a, b[j][0], b[j][1]);
        mma(acc[i][2 * j + 1], a, b[j][2], b[j][3]);
      }
      // The warps_in warps of this out-tile take turns over the k-steps.
      if (BIAS && ks % WI == wi) mma(bacc[i], a, ones, ones);
    }
  }
}

// The bias gradient alone (a layer whose weight gradient is made outside the kernel): bacc += dz^T 1 for the warp's
// out-tiles, the same split and the same turns over the k-steps as in wgrad_accumulate.
template <int OT, int WO, int WI, int OUT_TILES, int KSTEPS, int DSTRIDE>
__device__ __forceinline__ void bias_accumulate(float (&bacc)[OT][4], u32 dz, int warp, int lane) {
  const int wo = warp % WO, wi = warp / WO;
  const u32 a_base = dz_t_base<DSTRIDE>(dz, lane);
  const u32 ones = pack2(1.0f, 1.0f);
#pragma unroll
  for (int ks = 0; ks < KSTEPS; ++ks) {
    if (ks % WI != wi) continue;
#pragma unroll
    for (int i = 0; i < OT; ++i) {
      const int ot = wo + i * WO;
      if (OUT_TILES % WO != 0 && ot >= OUT_TILES) continue;
      u32 a[4];
      load_dz_t<DSTRIDE>(a, a_base, ks, ot);
      mma(bacc[i], a, ones, ones);
    }
  }
}

// The CTA's weight gradient partial of one layer into `dst` (PyTorch's (OUT, IN) layout, true widths: the padding
// rows and columns are dropped).
template <int OT, int IP, int WO, int WI, int OUT, int IN>
__device__ __forceinline__ void store_wgrad_partial(const float (&acc)[OT][2 * IP][4], float* __restrict__ dst,
                                                    int warp, int lane) {
  const int wo = warp % WO, wi = warp / WO, g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int i = 0; i < OT; ++i)
#pragma unroll
    for (int t = 0; t < 2 * IP; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        // Out-tiles and in-pairs past the end give m >= OUT or n >= IN.
        const int m = (wo + i * WO) * 16 + g + (e >> 1) * 8;
        const int n = (2 * (wi + (t >> 1) * WI) + (t & 1)) * 8 + 2 * q + (e & 1);
        if (m < OUT && n < IN) dst[m * IN + n] = acc[i][t][e];
      }
}

// A warp's bias partials (every column of the ones product holds the sum: column 0, lanes with q == 0) into the
// layer's shared scratch, WI rows of OUT_P floats, one row per warps_in index.
template <int OT, int WO, int WI, int OUT_TILES, int OUT_P>
__device__ __forceinline__ void store_bias_partial(const float (&bacc)[OT][4], float* scratch, int warp, int lane) {
  const int wo = warp % WO, wi = warp / WO, g = lane >> 2;
  if ((lane & 3) != 0) return;
#pragma unroll
  for (int i = 0; i < OT; ++i) {
    const int ot = wo + i * WO;
    if (OUT_TILES % WO != 0 && ot >= OUT_TILES) continue;
    scratch[wi * OUT_P + ot * 16 + g] = bacc[i][0];
    scratch[wi * OUT_P + ot * 16 + g + 8] = bacc[i][2];
  }
}

// All threads: the layer's bias gradient partial = the sum of its WI scratch rows, in a fixed order.
template <int OUT, int OUT_P, int WI, int THREADS>
__device__ __forceinline__ void sum_bias_partials(const float* scratch, float* __restrict__ dst) {
  for (int i = threadIdx.x; i < OUT; i += THREADS) {
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < WI; ++w) s += scratch[w * OUT_P + i];
    dst[i] = s;
  }
}

template <int MT, int NT>
__device__ __forceinline__ void zero_acc(float (&acc)[MT][NT][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;
}

// Columns >= WIDTH (the padding of a layer whose width is not a multiple of 16) set to zero.
template <int WIDTH, int MT, int NT>
__device__ __forceinline__ void mask_columns(float (&acc)[MT][NT][4], int q) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int j = 0; j < 2; ++j)
      if (nt * 8 + 2 * q + j >= WIDTH)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) acc[mt][nt][j] = acc[mt][nt][j + 2] = 0.0f;
}

// Backward through an activation: g *= f'(x) with x the stored pre-activation (y recomputed where used) ...
template <class Act, int MT, int NT>
__device__ __forceinline__ void dact_from_x(float (&g)[MT][NT][4], const float (&x)[MT][NT][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) g[mt][nt][i] *= Act::df(x[mt][nt][i], Act::f(x[mt][nt][i]));
}
// ... from y, the stored output, where the derivative needs no x ...
template <class Act, int MT, int NT>
__device__ __forceinline__ void dact_from_y(float (&g)[MT][NT][4], const float (&y)[MT][NT][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) g[mt][nt][i] *= Act::df(0.0f, y[mt][nt][i]);
}
// ... or a constant derivative.
template <class Act, int MT, int NT>
__device__ __forceinline__ void dact_const(float (&g)[MT][NT][4]) {
  const float d = Act::df(0.0f, 0.0f);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) g[mt][nt][i] *= d;
}
