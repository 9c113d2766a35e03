// Parameter packing and gradient layout kernels of the training step (weight_layout.h).
//
// Packing (pack_params_kernel) is a set of transposes: each filter is read in PyTorch's [k][c][r][s] order and
// written in one of the kernels' orders. One launch runs the whole job table as a persistent grid (as many CTAs as
// fit on the device) over a list of tiles: every CTA scans the table into a per-job prefix of tile counts in shared
// memory, then takes every gridDim.x-th tile. A filter job's tile is 32 output channels x 32 input channels (256 for
// a 1x1 filter) x all taps. Its 32 source rows, each c-tile * r * s contiguous elements, go to shared memory as
// they are with 16-byte cp.async copies (the whole tile in flight at once, no registers held); the CTA then writes
// the destination's contiguous runs (kKrsc and kPooled: c; kFlip: k; kTapPlanes: (k, c % 8)) as 16-byte vectors,
// converting to T on the way. Reads and writes are both coalesced whatever the gather's stride, and every tile moves
// about as many bytes, so the grid balances. For the default network (4.85 M parameters, ~10.8 M packed elements)
// that is ~19 MB read (fp32 parameters; a filter packed twice is read again from L2) and ~22 MB written: ~15 us at
// an H100's ~2.8 TB/s, where gathering element by element over the output took 116 us. Misaligned or odd-sized
// jobs take the same tiles with 2-byte moves; the copies, the stem's tiny operand and filters of more than 9 taps
// keep an element-wise gather.
//
// The gradient side (grad_finalize, add_and_sum) is in grad_layout.cu.
#include "kernels/encoder/weight_layout.h"

#include <atomic>
#include <cstring>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/encoder/numeric.cuh"
#include "kernels/shared_memory_ptx.cuh"

namespace kfuse::kernels {
namespace {


// ---- parameter packing ---------------------------------------------------------------------------------------------

constexpr int kPackThreads = 256;
constexpr int kTileK = 32;           // output channels per tile
constexpr int kTileC = 32;           // input channels per tile of a filter with taps (and of kPooled's 9 copies)
constexpr int kTileC1x1 = 256;       // ... of a 1x1 filter: about as many elements as a 3x3 tile
constexpr int kMaxTiledTaps = 9;     // larger filters (none in the encoder) are gathered element by element
// 4-byte words of shared memory per tile row (raw_pitch): a 32-channel row of an fp32 3x3 filter and its padding.
constexpr int kRawPitchMax = kTileC * kMaxTiledTaps + 4;
constexpr int kElementTile = 2048;   // output elements per tile of the element-wise jobs
constexpr int kJobChunk = 1024;      // jobs whose tile prefix a CTA holds at once (a table has ~100)
constexpr int kJobsPerThread = kJobChunk / kPackThreads;
// 5 CTAs of ~41 KB of shared memory fit an SM; the register cap that lets 5 run (48) costs one spilled index,
// reloaded once per tile.
constexpr int kPackMinCtasPerSm = 5;
static_assert(kTileC1x1 + 4 <= kRawPitchMax && kTileC * kMaxTiledTaps % 8 == 0, "a tile row must fit raw_pitch");
static_assert(kTileC1x1 <= kPackThreads && kTileK * 8 <= kPackThreads, "a pass of the CTA covers whole runs");

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

__device__ inline float load_param(const void* src, ParamDType dt, int64_t i) {
  switch (dt) {
    case ParamDType::kF16: return __half2float(static_cast<const __half*>(src)[i]);
    case ParamDType::kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(src)[i]);
    default: return static_cast<const float*>(src)[i];
  }
}

// One output element of a T-valued job, gathered from its source (the documented layouts, for the element-wise
// path).
__device__ inline float gather_element(const PackJob& j, int64_t i) {
  if (j.kind == PackKind::kKrsc) {  // dst [k][r][s][c]
    const int64_t c = i % j.c, rs = (i / j.c) % (j.r * j.s), k = i / (int64_t(j.c) * j.r * j.s);
    return load_param(j.src, j.src_dtype, (k * j.c + c) * j.r * j.s + rs);
  }
  if (j.kind == PackKind::kFlip) {  // dst [c][r][s][k] = src[k][c][R-1-r][S-1-s]
    const int64_t k = i % j.k, rs = (i / j.k) % (j.r * j.s), c = i / (int64_t(j.k) * j.r * j.s);
    const int64_t r = rs / j.s, s = rs % j.s;
    return load_param(j.src, j.src_dtype, ((k * j.c + c) * j.r + (j.r - 1 - r)) * j.s + (j.s - 1 - s));
  }
  if (j.kind == PackKind::kPooled) {  // dst [k][9][c] = src[k][c] / 9
    const int64_t c = i % j.c, k = i / (9 * int64_t(j.c));
    return load_param(j.src, j.src_dtype, k * j.c + c) / 9.0f;
  }
  if (j.kind == PackKind::kTapPlanes) {  // dst [r][s][c / 8][k][c % 8]
    const int64_t e = i % 8, k = (i / 8) % j.k, plane = i / (8 * int64_t(j.k));
    const int64_t groups = j.c / 8, t = plane / groups, c = (plane % groups) * 8 + e;
    return load_param(j.src, j.src_dtype, ((j.k0 + k) * j.c + c) * j.r * j.s + t);
  }
  const int64_t p = i % j.k, row = i / j.k;  // kStem: dst [kpad][p], row < kin ? src[p][row] : 0
  return row < j.c ? load_param(j.src, j.src_dtype, p * j.c + row) : 0.f;
}

// Taps per source row of a tiled job (kPooled's source is a 1x1 filter whatever r and s say).
__device__ inline int job_taps(const PackJob& j) { return j.kind == PackKind::kPooled ? 1 : j.r * j.s; }

__device__ inline bool is_tiled(const PackJob& j) {
  const bool filter = j.kind == PackKind::kKrsc || j.kind == PackKind::kFlip || j.kind == PackKind::kPooled ||
                      j.kind == PackKind::kTapPlanes;
  const int taps = job_taps(j);
  return filter && taps >= 1 && taps <= kMaxTiledTaps;
}

__device__ inline int tile_c(const PackJob& j) {
  return job_taps(j) == 1 && j.kind != PackKind::kPooled ? kTileC1x1 : kTileC;
}

__device__ inline int job_tiles(const PackJob& j) {
  if (is_tiled(j)) return j.k > 0 && j.c > 0 ? ceil_div(j.k, kTileK) * ceil_div(j.c, tile_c(j)) : 0;
  return j.count > 0 ? int((j.count + kElementTile - 1) / kElementTile) : 0;
}

// The element-wise path: kCopyF32 (fp32 out), kStem, and filters of more than kMaxTiledTaps taps.
template <class T>
__device__ void pack_elements(const PackJob& j, int tile, uint8_t* base) {
  const int64_t end = min(j.count, int64_t(tile + 1) * kElementTile);
  for (int64_t i = int64_t(tile) * kElementTile + threadIdx.x; i < end; i += kPackThreads) {
    if (j.kind == PackKind::kCopyF32)
      reinterpret_cast<float*>(base + j.dst_offset)[i] = load_param(j.src, j.src_dtype, i);
    else
      reinterpret_cast<T*>(base + j.dst_offset)[i] = to_t<T>(gather_element(j, i));
  }
}

// ---- a filter job's tile: source rows into shared memory ----

// The source's element storage: fp32, or the bits of fp16 / bf16.
template <ParamDType D>
using SrcElem = std::conditional_t<D == ParamDType::kF32, float, uint16_t>;

template <ParamDType D>
__device__ __forceinline__ float src_to_f(SrcElem<D> e) {
  if constexpr (D == ParamDType::kF32)
    return e;
  else if constexpr (D == ParamDType::kF16)
    return bits_to_f<__half>(e);
  else
    return bits_to_f<__nv_bfloat16>(e);
}

// The tile: output channels kb .. kb + kt - 1 of the job and input channels c0 .. c0 + ct - 1, all `taps`, in
// shared memory as the source holds them: rows of `pitch` source elements, element (k, c, tap) at
// k * pitch + c * taps + tap.
struct TileGeom {
  int kb, c0, kt, ct, taps, pitch;
  int k, c;  // the job's output and input channels
};

// A row pitch of 4 words past a multiple of 8: rows stay 16-byte aligned (cp.async, vector reads) and a warp walking
// down 32 rows of one column (kTapPlanes, kFlip) meets 8 banks rather than one.
template <ParamDType D>
__device__ int raw_pitch(int len) {
  constexpr int kPerWord = 4 / sizeof(SrcElem<D>);
  const int words = (len + kPerWord - 1) / kPerWord;
  return ((words + 7) / 8 * 8 + 4) * kPerWord;
}

// The tile's kt source rows of ct * taps contiguous elements (row k at src + first + k * row_stride) into `raw`:
// 16-byte cp.async copies where the rows allow them (all of a tile's bytes in flight at once, no registers held),
// element by element elsewhere.
template <ParamDType D>
__device__ void load_raw(const void* src, int64_t first, int64_t row_stride, const TileGeom& g, SrcElem<D>* raw) {
  constexpr int V = 16 / sizeof(SrcElem<D>);
  const SrcElem<D>* p = static_cast<const SrcElem<D>*>(src) + first;
  const int len = g.ct * g.taps, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (reinterpret_cast<uintptr_t>(p) % 16 == 0 && row_stride % V == 0 && len % V == 0) {
    const uint32_t base = ptx::smem_u32(raw);
    for (int r = warp; r < g.kt; r += kPackThreads / 32)
      for (int v = lane; v < len / V; v += 32)
        ptx::cp_async16(base + uint32_t((r * g.pitch + v * V) * sizeof(SrcElem<D>)), p + r * row_stride + v * V);
    ptx::cp_async_commit();
    ptx::cp_async_wait<0>();
  } else {
    for (int r = warp; r < g.kt; r += kPackThreads / 32)
      for (int e = lane; e < len; e += 32) raw[r * g.pitch + e] = __ldg(p + r * row_stride + e);
  }
}

// ---- a filter job's tile: shared memory to the destination's runs ----

// T's bits of raw elements: the element-wise path's conversion (to fp32, kPooled's / 9 in fp32, round to T).
template <class T, ParamDType D, bool kDivide9>
struct RawToT {
  const SrcElem<D>* raw;
  __device__ __forceinline__ uint32_t bits(SrcElem<D> e) const {
    const float f = src_to_f<D>(e);
    return t_bits<T>(to_t<T>(kDivide9 ? f / 9.0f : f));
  }
  __device__ __forceinline__ uint32_t operator()(int i) const { return bits(raw[i]); }
  // 8 elements `step` apart from raw[s] as a 16-byte vector of T; consecutive ones (step 1, s a multiple of 8) are
  // read 16 bytes at a time.
  __device__ __forceinline__ uint4 vec8(int s, int step) const {
    SrcElem<D> e[8];
    if (step == 1) {
      const auto* v = reinterpret_cast<const uint4*>(raw + s);
#pragma unroll
      for (int q = 0; q < int(sizeof(e) / 16); ++q) {
        const uint4 u = v[q];
        memcpy(reinterpret_cast<char*>(e) + 16 * q, &u, 16);
      }
    } else {
#pragma unroll
      for (int x = 0; x < 8; ++x) e[x] = raw[s + x * step];
    }
    return make_uint4(bits(e[0]) | bits(e[1]) << 16, bits(e[2]) | bits(e[3]) << 16, bits(e[4]) | bits(e[5]) << 16,
                      bits(e[6]) | bits(e[7]) << 16);
  }
};

// A run's index as (q, r) = (run / d, run % d) for its layout's divisor d, stepped without dividing.
struct RunIndex {
  int q, r;
  __device__ void advance(int dq, int dr, int d) {
    q += dq, r += dr;
    if (r >= d) r -= d, ++q;
  }
};

// Each layout below lists the tile's destination as runs() runs of run_len() contiguous elements: start(run, at) is
// the first one's index in dst (at: the run's RunIndex for divisor()), smem(at, i) the raw index of the run's
// element i, and elements i and i + 1 of a run lie step() apart in the raw tile (within an aligned group of 8).

// kKrsc, dst [k][r][s][c]: one run of the tile's c per (k, tap).
struct KrscRuns {
  TileGeom g;
  __device__ int runs() const { return g.kt * g.taps; }
  __device__ int run_len() const { return g.ct; }
  __device__ int divisor() const { return g.taps; }  // (k, tap)
  __device__ int64_t start(int run, RunIndex) const { return (int64_t(g.kb) * g.taps + run) * g.c + g.c0; }
  __device__ int smem(RunIndex at, int i) const { return at.q * g.pitch + i * g.taps + at.r; }
  __device__ int step() const { return g.taps; }
};

// kFlip, dst [c][r][s][k] = src[k][c][R-1-r][S-1-s]: one run of the tile's k per (c, tap); flat tap t reads R*S-1-t.
struct FlipRuns {
  TileGeom g;
  __device__ int runs() const { return g.ct * g.taps; }
  __device__ int run_len() const { return g.kt; }
  __device__ int divisor() const { return g.taps; }  // (c, tap)
  __device__ int64_t start(int run, RunIndex) const { return (int64_t(g.c0) * g.taps + run) * g.k + g.kb; }
  __device__ int smem(RunIndex at, int i) const { return i * g.pitch + (at.q + 1) * g.taps - 1 - at.r; }
  __device__ int step() const { return g.pitch; }
};

// kTapPlanes, dst [r][s][c / 8][k][c % 8]: one run of (k, c % 8) per (tap, whole 8-channel group of the tile).
struct TapPlanesRuns {
  TileGeom g;
  int groups;
  __device__ int runs() const { return g.taps * groups; }
  __device__ int run_len() const { return g.kt * 8; }
  __device__ int divisor() const { return groups; }  // (tap, group)
  __device__ int64_t start(int, RunIndex at) const {
    return ((int64_t(at.q) * (g.c / 8) + g.c0 / 8 + at.r) * g.k + g.kb) * 8;
  }
  __device__ int smem(RunIndex at, int i) const { return i / 8 * g.pitch + (at.r * 8 + i % 8) * g.taps + at.q; }
  __device__ int step() const { return g.taps; }
};

// The runs of a layout, consecutive threads on consecutive elements (a pass of the CTA covers kPackThreads /
// per_run whole runs): 16-byte vectors when every run's length and start are multiples of 8 and the job covers its
// whole layout, else single elements below `count`.
template <bool kVec, class Runs, class Conv>
__device__ void store_runs(const Runs& L, const Conv& conv, uint16_t* dst, int64_t count) {
  constexpr int V = kVec ? 8 : 1;
  const int per_run = L.run_len() / V, per_pass = kPackThreads / per_run;  // run_len() <= kPackThreads
  if (int(threadIdx.x) >= per_pass * per_run) return;
  const int pos = threadIdx.x % per_run * V, d = L.divisor(), dq = per_pass / d, dr = per_pass % d;
  int run = threadIdx.x / per_run;
  for (RunIndex at{run / d, run % d}; run < L.runs(); run += per_pass, at.advance(dq, dr, d)) {
    const int64_t o = L.start(run, at) + pos;
    if constexpr (kVec)
      *reinterpret_cast<uint4*>(dst + o) = conv.vec8(L.smem(at, pos), L.step());
    else if (o < count)
      dst[o] = static_cast<uint16_t>(conv(L.smem(at, pos)));
  }
}

template <class Runs, class Conv>
__device__ void store_layout(const Runs& L, bool vec, const Conv& conv, uint16_t* dst, int64_t count) {
  if (vec)
    store_runs<true>(L, conv, dst, count);
  else
    store_runs<false>(L, conv, dst, count);
}

// kPooled, dst [k][9][c] = src[k][c] / 9: each value converted once and stored as the nine runs of its k.
template <bool kVec, class Conv>
__device__ void store_pooled(const TileGeom& g, const Conv& conv, uint16_t* dst, int64_t count) {
  constexpr int V = kVec ? 8 : 1;
  const int per_row = g.ct / V, per_pass = kPackThreads / per_row;  // ct <= kTileC
  if (int(threadIdx.x) >= per_pass * per_row) return;
  const int pos = threadIdx.x % per_row * V;
  for (int k = threadIdx.x / per_row; k < g.kt; k += per_pass) {
    const int64_t o = int64_t(g.kb + k) * 9 * g.c + g.c0 + pos;
    if constexpr (kVec) {
      const uint4 v = conv.vec8(k * g.pitch + pos, 1);
#pragma unroll
      for (int t = 0; t < 9; ++t) *reinterpret_cast<uint4*>(dst + o + int64_t(t) * g.c) = v;
    } else {
      const auto v = static_cast<uint16_t>(conv(k * g.pitch + pos));
#pragma unroll
      for (int t = 0; t < 9; ++t)
        if (o + int64_t(t) * g.c < count) dst[o + int64_t(t) * g.c] = v;
    }
  }
}

template <class T, ParamDType D>
__device__ void store_tile(const PackJob& j, const TileGeom& g, const SrcElem<D>* raw, uint8_t* base) {
  auto* dst = reinterpret_cast<uint16_t*>(base + j.dst_offset);
  const int64_t elems = int64_t(j.k) * j.c * (j.kind == PackKind::kPooled ? 9 : g.taps);
  // Vector runs need 16-byte aligned run starts: the channel count along the run a multiple of 8 (the tile's
  // origin is), and the whole layout inside `count`.
  const bool vec = reinterpret_cast<uintptr_t>(dst) % 16 == 0 && j.count >= elems;
  const RawToT<T, D, false> conv{raw};
  switch (j.kind) {
    case PackKind::kKrsc: store_layout(KrscRuns{g}, vec && j.c % 8 == 0, conv, dst, j.count); break;
    case PackKind::kFlip: store_layout(FlipRuns{g}, vec && j.k % 8 == 0, conv, dst, j.count); break;
    case PackKind::kPooled: {
      const RawToT<T, D, true> conv9{raw};
      if (vec && j.c % 8 == 0)
        store_pooled<true>(g, conv9, dst, j.count);
      else
        store_pooled<false>(g, conv9, dst, j.count);
      break;
    }
    default: {  // kTapPlanes: channels past the last whole group of 8 have no place in the layout
      const int groups = max(0, (min(g.c0 + g.ct, j.c / 8 * 8) - g.c0) / 8);
      if (groups > 0) store_layout(TapPlanesRuns{g, groups}, vec, conv, dst, j.count);
    }
  }
}

template <class T, ParamDType D>
__device__ void pack_tile_from(const PackJob& j, TileGeom g, uint8_t* base, uint32_t* smem) {
  g.pitch = raw_pitch<D>(g.ct * g.taps);
  auto* raw = reinterpret_cast<SrcElem<D>*>(smem);
  const int64_t k_first = (j.kind == PackKind::kTapPlanes ? j.k0 : 0) + g.kb;
  load_raw<D>(j.src, (k_first * j.c + g.c0) * g.taps, int64_t(j.c) * g.taps, g, raw);
  __syncthreads();
  store_tile<T, D>(j, g, raw, base);
  __syncthreads();  // the next tile reuses the shared memory
}

template <class T>
__device__ void pack_tile(const PackJob& j, int index, uint8_t* base, uint32_t* smem) {
  const int ct = tile_c(j), c_tiles = ceil_div(j.c, ct);
  TileGeom g;
  g.kb = index / c_tiles * kTileK, g.c0 = index % c_tiles * ct;
  g.kt = min(kTileK, j.k - g.kb), g.ct = min(ct, j.c - g.c0);
  g.taps = job_taps(j), g.k = j.k, g.c = j.c, g.pitch = 0;
  switch (j.src_dtype) {
    case ParamDType::kF16: pack_tile_from<T, ParamDType::kF16>(j, g, base, smem); break;
    case ParamDType::kBF16: pack_tile_from<T, ParamDType::kBF16>(j, g, base, smem); break;
    default: pack_tile_from<T, ParamDType::kF32>(j, g, base, smem);
  }
}

// ---- the job table as a list of tiles ----

// Exclusive prefix sum over the CTA's threads (in thread order), and the total.
__device__ int block_exclusive_sum(int v, int* scratch, int* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) scratch[warp] = x;
  __syncthreads();
  if (threadIdx.x == 0) {
    int s = 0;
    for (int w = 0; w < kPackThreads / 32; ++w) {
      const int t = scratch[w];
      scratch[w] = s;
      s += t;
    }
    scratch[kPackThreads / 32] = s;
  }
  __syncthreads();
  *total = scratch[kPackThreads / 32];
  return scratch[warp] + x - v;
}

// first_tile[i] = the global index of job i's first tile, for the n jobs of a chunk whose tiles start at `done`.
// Returns the chunk's tile count.
__device__ int plan_chunk(const PackJob* jobs, int n, int done, int* first_tile, int* scratch) {
  const int mine = threadIdx.x * kJobsPerThread;
  int tiles[kJobsPerThread], sum = 0;
#pragma unroll
  for (int q = 0; q < kJobsPerThread; ++q) {
    tiles[q] = mine + q < n ? job_tiles(jobs[mine + q]) : 0;
    sum += tiles[q];
  }
  int total = 0, at = done + block_exclusive_sum(sum, scratch, &total);
#pragma unroll
  for (int q = 0; q < kJobsPerThread; ++q) {
    if (mine + q < n) first_tile[mine + q] = at;
    at += tiles[q];
  }
  __syncthreads();
  return total;
}

// The job of global tile t: the last of the chunk's n jobs whose first tile is <= t (jobs without tiles share their
// successor's first tile and are passed over).
__device__ int find_job(const int* first_tile, int n, int t) {
  int lo = 0, hi = n;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (first_tile[mid] <= t)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

template <class T>
__global__ void __launch_bounds__(kPackThreads, kPackMinCtasPerSm)
    pack_params_kernel(const PackJob* jobs, int count, uint8_t* base, const unsigned* run_flag) {
  if (run_flag != nullptr && *run_flag == 0u) return;  // uniform: every thread reads the same flag
  __shared__ __align__(16) uint32_t tile[kTileK * kRawPitchMax];
  __shared__ int first_tile[kJobChunk];
  __shared__ int scratch[kPackThreads / 32 + 1];
  const int grid = gridDim.x;
  int done = 0;  // tiles of the chunks before
  for (int j0 = 0; j0 < count; j0 += kJobChunk) {
    const int n = min(kJobChunk, count - j0);
    const int total = plan_chunk(jobs + j0, n, done, first_tile, scratch);
    // This CTA's tiles: blockIdx.x, blockIdx.x + gridDim.x, ... (in global tile order).
    for (int t = done + (int(blockIdx.x) - done % grid + grid) % grid; t < done + total; t += grid) {
      const int i = find_job(first_tile, n, t);
      const PackJob j = jobs[j0 + i];
      if (is_tiled(j))
        pack_tile<T>(j, t - first_tile[i], base, tile);
      else
        pack_elements<T>(j, t - first_tile[i], base);
    }
    done += total;
    __syncthreads();  // the next chunk rewrites first_tile and scratch
  }
}

// The persistent grid: as many CTAs as the device holds at once (the occupancy is cached per device).
template <class T>
cudaError_t pack_grid(int* grid) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> ctas_per_sm[kMaxDevices];
  int dev = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (err != cudaSuccess) return err;
  int per_sm = dev < kMaxDevices ? ctas_per_sm[dev].load(std::memory_order_relaxed) : 0;
  if (per_sm == 0) {
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, pack_params_kernel<T>, kPackThreads, 0);
    if (err != cudaSuccess) return err;
    per_sm = per_sm > 0 ? per_sm : 1;
    if (dev < kMaxDevices) ctas_per_sm[dev].store(per_sm, std::memory_order_relaxed);
  }
  *grid = sms * per_sm;
  return cudaSuccess;
}

}  // namespace

cudaError_t launch_pack_params(const PackJob* jobs, int count, void* dst_base, ConvDType dtype, cudaStream_t stream,
                               const unsigned* run_flag) {
  if (count <= 0 || jobs == nullptr || dst_base == nullptr) return cudaErrorInvalidValue;
  auto* base = static_cast<uint8_t*>(dst_base);
  int grid = 0;
  cudaError_t err = dtype == ConvDType::kF16 ? pack_grid<__half>(&grid) : pack_grid<__nv_bfloat16>(&grid);
  if (err != cudaSuccess) return err;
  if (dtype == ConvDType::kF16)
    pack_params_kernel<__half><<<grid, kPackThreads, 0, stream>>>(jobs, count, base, run_flag);
  else
    pack_params_kernel<__nv_bfloat16><<<grid, kPackThreads, 0, stream>>>(jobs, count, base, run_flag);
  return cudaGetLastError();
}

}  // namespace kfuse::kernels
