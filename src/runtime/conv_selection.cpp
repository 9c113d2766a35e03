#include "runtime/conv_selection.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>

#include <cuda_runtime.h>

#include "kfuse/device.h"
#include "kfuse/error.h"
#include "runtime/half_bits.h"

namespace kfuse {

using kernels::Conv2dProblem;
using kernels::ConvDType;
using kernels::ConvTile;

namespace {

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string("kfuse: ") + what + " failed: " + cudaGetErrorString(e));
}

bool is_sm90_tile(ConvTile t) {
  return t == ConvTile::kSm90_128x64 || t == ConvTile::kSm90_64x64 || t == ConvTile::kSm90_64x64_c2x2 ||
         t == ConvTile::kSm90_128x64_s4 || t == ConvTile::kSm90_128x128 || t == ConvTile::kSm90_256x64;
}

struct TileInfo {
  ConvTile tile;
  const char* name;  // the cache's spelling: never rename (it would orphan cached choices)
  int m, n;
};
constexpr TileInfo kTiles[] = {
    {ConvTile::k128x64, "sm80_128x64", 128, 64},      {ConvTile::k64x64, "sm80_64x64", 64, 64},
    {ConvTile::k64x64x64, "sm80_64x64x64", 64, 64},   {ConvTile::k128x64x64, "sm80_128x64x64", 128, 64},
    {ConvTile::k64x128, "sm80_64x128", 64, 128},      {ConvTile::k128x128, "sm80_128x128", 128, 128},
    {ConvTile::k128x64w8, "sm80_128x64w8", 128, 64},  {ConvTile::kSm90_128x64, "sm90_128x64", 128, 64},
    {ConvTile::kSm90_64x64, "sm90_64x64", 64, 64},    {ConvTile::kSm90_64x64_c2x2, "sm90_64x64_c2x2", 64, 64},
    {ConvTile::kSm90_128x64_s4, "sm90_128x64_s4", 128, 64},  {ConvTile::kSm90_128x128, "sm90_128x128", 128, 128},
    {ConvTile::kSm90_256x64, "sm90_256x64", 256, 64},
};
const TileInfo& tile_info(ConvTile t) {
  for (const TileInfo& i : kTiles)
    if (i.tile == t) return i;
  throw Error("kfuse: unknown conv tile (internal error)");
}

int64_t gemm_m(const Conv2dProblem& p) { return int64_t(p.n) * p.p() * p.q(); }
int64_t gemm_k(const Conv2dProblem& p) { return int64_t(p.c) * p.r * p.s; }
int64_t tiles(const Conv2dProblem& p, ConvTile t) {
  const TileInfo& i = tile_info(t);
  return (gemm_m(p) + i.m - 1) / i.m * ((p.k + i.n - 1) / i.n);
}

void upload_random(void* dst, size_t elems, float scale, ConvDType dt, uint32_t seed) {
  std::vector<uint16_t> h(elems);
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  for (auto& v : h) v = float_to_bits(u(gen), dt);
  check_cuda(cudaMemcpy(dst, h.data(), 2 * elems, cudaMemcpyHostToDevice), "cudaMemcpy (tuning inputs)");
}

}  // namespace

std::string ConvConfig::name() const {
  const std::string base = tile_info(tile).name;
  return is_sm90_tile(tile) ? base : base + "_k" + std::to_string(split_k);
}

std::string conv_shape_key(const Conv2dProblem& p) {
  // snprintf rather than a chain of operator+ (g++ 12 warns falsely about the latter under -O2 -Wrestrict).
  char buf[160];
  std::snprintf(buf, sizeof(buf), "n%d_h%d_w%d_c%d_k%d_r%d_s%d_p%d_u%d", p.n, p.h, p.w, p.c, p.k, p.r, p.s, p.pad_h,
                p.stride_h);
  std::string key = buf;
  if (p.pad_w != p.pad_h || p.stride_w != p.stride_h) {  // asymmetric problems spell out the width's pad and stride
    std::snprintf(buf, sizeof(buf), "_pw%d_uw%d", p.pad_w, p.stride_w);
    key += buf;
  }
  return key;
}

ConvConfig conv_heuristic(const Conv2dProblem& p, int sm_count, ConvDType dtype) {
  ConvConfig c;
  c.tile = (gemm_m(p) >= 16384 && p.k <= 64) ? ConvTile::k128x64 : ConvTile::k64x64;
  const int64_t t = tiles(p, c.tile);
  c.split_k = 1;
  while (dtype == ConvDType::kF16 && t * c.split_k * 2 <= sm_count && gemm_k(p) / (c.split_k * 2) >= 256 &&
         c.split_k < 16)
    c.split_k *= 2;
  return c;
}

std::vector<ConvConfig> conv_candidates(const Conv2dProblem& p, ConvDType dtype, int cc_major, int sm_count) {
  std::vector<ConvConfig> out;
  auto add = [&](ConvConfig c) {
    if (std::find(out.begin(), out.end(), c) != out.end()) return;
    if (is_sm90_tile(c.tile) && cc_major != 9) return;
    if (!kernels::conv2d_fprop_fixup_can_implement(p, dtype, c.tile, c.split_k)) return;
    out.push_back(c);
  };
  add(conv_heuristic(p, sm_count, dtype));
  for (ConvTile t : {ConvTile::k128x64, ConvTile::k64x64, ConvTile::k64x64x64, ConvTile::k128x64x64, ConvTile::k64x128,
                     ConvTile::k128x128, ConvTile::k128x64w8}) {
    // Split K while the slices stay >= 128 deep and the grid stays within ~4 waves.
    for (int s = 1; s <= 16; s *= 2) {
      if (s > 1 && (dtype != ConvDType::kF16 || gemm_k(p) / s < 128 || tiles(p, t) * s > 4 * int64_t(sm_count)))
        break;
      add({t, s});
    }
  }
  add({ConvTile::kSm90_128x64, 1});
  add({ConvTile::kSm90_64x64, 1});
  add({ConvTile::kSm90_64x64_c2x2, 1});
  add({ConvTile::kSm90_128x64_s4, 1});
  // Big tiles only where the grid still fills the machine (the training batch): at N = 128 they would leave most
  // SMs idle and only lengthen tuning.
  for (ConvTile t : {ConvTile::kSm90_128x128, ConvTile::kSm90_256x64})
    if (tiles(p, t) >= 2 * int64_t(sm_count)) add({t, 1});
  return out;
}

ConvTuningScratch::~ConvTuningScratch() {
  cudaFree(x_);
  cudaFree(w_);
  cudaFree(y_);
  cudaFree(ws_);
  cudaFree(scalars_);
}

void ConvTuningScratch::reserve(size_t x_bytes, size_t w_bytes, size_t y_bytes, size_t ws_bytes) {
  auto grow = [](void*& p, size_t& have, size_t need, const char* what) {
    if (need <= have) return;
    cudaFree(p);
    p = nullptr;
    have = 0;
    check_cuda(cudaMalloc(&p, need), what);
    have = need;
  };
  grow(x_, x_bytes_, x_bytes, "cudaMalloc (tuning input)");
  grow(w_, w_bytes_, w_bytes, "cudaMalloc (tuning weights)");
  grow(y_, y_bytes_, y_bytes, "cudaMalloc (tuning output)");
  grow(ws_, ws_bytes_, std::max<size_t>(ws_bytes, 256), "cudaMalloc (tuning workspace)");
  if (!scalars_) {
    check_cuda(cudaMalloc(reinterpret_cast<void**>(&scalars_), 3 * sizeof(float)), "cudaMalloc (tuning scalars)");
    const float s[3] = {1.25f, 0.125f, -0.25f};  // alpha, pre, post: non-trivial, so every epilogue term is checked
    check_cuda(cudaMemcpy(scalars_, s, sizeof(s), cudaMemcpyHostToDevice), "cudaMemcpy (tuning scalars)");
  }
}

ConvConfig ConvTuningScratch::tune(const Conv2dProblem& p, ConvDType dtype, bool relu, TuningCache& cache,
                                   TuningMode mode, OpTuningReport& row, const TunerOptions& options) {
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  const DeviceInfo info = cuda_device_info(dev);
  const std::vector<ConvConfig> cands = conv_candidates(p, dtype, info.major, info.sm_count);
  KFUSE_CHECK(!cands.empty(), InvalidArgument, "no convolution kernel can run ", conv_shape_key(p));
  std::vector<std::string> names;
  for (const ConvConfig& c : cands) names.push_back(c.name());

  TuningKey key;
  key.device = info.name;
  key.sm_count = info.sm_count;
  key.cuda_runtime = info.runtime_version;
  key.driver = info.driver_version;
  key.op = relu ? "conv2d_fprop_fixup_relu" : "conv2d_fprop_fixup";
  key.shape = conv_shape_key(p);
  key.dtype = dtype == ConvDType::kF16 ? "f16" : "bf16";
  key.layout = "nhwc_krsc";
  key.candidates = candidate_set_checksum(names);

  row = OpTuningReport{};
  row.op = key.op;
  row.shape = key.shape;
  row.dtype = key.dtype;
  row.default_choice = names[0];

  const size_t x_elems = size_t(p.n) * p.h * p.w * p.c;
  const size_t w_elems = size_t(p.k) * p.r * p.s * p.c;
  const size_t y_elems = size_t(gemm_m(p)) * p.k;
  size_t ws = 0;
  for (const ConvConfig& c : cands)
    ws = std::max(ws, kernels::conv2d_fprop_fixup_workspace_bytes(p, dtype, c.tile, c.split_k));

  // Cached choices need no buffers; everything else runs on random data of the problem's size.
  std::vector<uint16_t> ref, out;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  int reps = 1;
  auto cleanup = [&] {
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    if (stream) cudaStreamDestroy(stream);
  };
  kernels::FixupEpilogue e;  // points at scalars_ once prepare() allocated them
  bool prepared = false;
  auto prepare = [&] {
    if (prepared) return;
    reserve(2 * x_elems, 2 * w_elems, 2 * y_elems, ws);
    e = kernels::FixupEpilogue{scalars_, scalars_ + 1, scalars_ + 2, relu};
    upload_random(x_, x_elems, 1.0f, dtype, 1234u);
    upload_random(w_, w_elems, 1.0f / std::sqrt(float(gemm_k(p))), dtype, 5678u);
    check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    check_cuda(cudaEventCreate(&start), "cudaEventCreate");
    check_cuda(cudaEventCreate(&stop), "cudaEventCreate");
    prepared = true;
  };
  auto launch = [&](size_t i) {
    check_cuda(kernels::conv2d_fprop_fixup(p, dtype, cands[i].tile, x_, w_, y_, e, cands[i].split_k, ws_, ws_bytes_,
                                           stream),
               "conv2d_fprop_fixup (tuning)");
  };
  auto copy_out = [&](std::vector<uint16_t>& v) {
    v.resize(y_elems);
    check_cuda(cudaMemcpyAsync(v.data(), y_, 2 * y_elems, cudaMemcpyDeviceToHost, stream), "cudaMemcpy (tuning)");
    check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  };
  // One measurement = `reps` back-to-back launches between two events (sized on the reference to ~100 us, so the
  // events' resolution and the launch gaps do not dominate), the time per launch returned.
  auto measure = [&](size_t i) -> double {
    prepare();
    if (ref.empty() && i == 0) {
      check_cuda(cudaMemsetAsync(y_, 0xff, 2 * y_elems, stream), "cudaMemset");  // poison: NaN in fp16 and bf16
      launch(0);
      copy_out(ref);
      check_cuda(cudaEventRecord(start, stream), "cudaEventRecord");
      launch(0);
      check_cuda(cudaEventRecord(stop, stream), "cudaEventRecord");
      check_cuda(cudaEventSynchronize(stop), "cudaEventSynchronize");
      float ms = 0;
      cudaEventElapsedTime(&ms, start, stop);
      reps = std::clamp(int(std::ceil(0.1 / std::max(ms, 1e-4f))), 1, 50);
    }
    if (i != 0) check_cuda(cudaMemsetAsync(y_, 0xff, 2 * y_elems, stream), "cudaMemset");
    check_cuda(cudaEventRecord(start, stream), "cudaEventRecord");
    for (int r = 0; r < reps; ++r) launch(i);
    check_cuda(cudaEventRecord(stop, stream), "cudaEventRecord");
    check_cuda(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    check_cuda(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    return double(ms) / reps;
  };
  // Normwise relative difference against the reference candidate: all candidates accumulate in fp32, so they
  // differ by summation order and one rounding of the output (~1e-3 in fp16, ~8e-3 in bf16).
  auto check = [&](size_t) -> bool {
    copy_out(out);
    double num = 0, den = 0;
    for (size_t j = 0; j < y_elems; ++j) {
      const double a = bits_to_float(out[j], dtype), b = bits_to_float(ref[j], dtype);
      if (!std::isfinite(a)) return false;
      num += (a - b) * (a - b);
      den += b * b;
    }
    return std::sqrt(num) <= (dtype == ConvDType::kF16 ? 5e-3 : 2e-2) * std::sqrt(den) + 1e-30;
  };

  TuningResult r;
  try {
    r = kfuse::tune(cache, key, names, measure, check, 0, mode, options);
  } catch (...) {
    cleanup();
    throw;
  }
  cleanup();
  row.choice = names[r.chosen];
  row.from_cache = r.from_cache;
  if (!r.candidates.empty()) {
    row.default_ms = r.candidates[0].median_ms;
    row.tuned_ms = r.candidates[r.chosen].median_ms;
    row.spread_ms = r.candidates[r.chosen].max_ms - r.candidates[r.chosen].min_ms;
    row.candidates = r.candidates;
  } else if (r.from_cache) {
    if (const auto c = cache.get(key)) {
      row.default_ms = c->default_ms;
      row.tuned_ms = c->median_ms;
      row.spread_ms = c->spread_ms;
    }
  }
  return cands[r.chosen];
}

}  // namespace kfuse
