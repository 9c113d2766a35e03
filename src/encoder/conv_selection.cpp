#include "encoder/conv_selection.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>

#include <cuda_runtime.h>

#include "kfuse/device.h"
#include "kfuse/error.h"
#include "kernels/conv/cudnn_conv.h"
#include "kernels/conv/dense_conv.h"
#include "kernels/conv/fixup_epilogue_pass.h"
#include "runtime/op_tuning.h"
#include "runtime/cuda_check.h"
#include "runtime/half_bits.h"

namespace kfuse {

using kernels::Conv2dProblem;
using kernels::ConvDType;
using kernels::ConvTile;

namespace {

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


}  // namespace

std::string ConvConfig::name() const {
  if (is_cudnn()) return "cudnn_a" + std::to_string(cudnn_algo);
  if (dense) return unrolled ? "dense_unrolled" : "dense_gemm";
  const std::string base = tile_info(tile).name;
  if (is_sm90_tile(tile)) return base;
  return base + (parallel ? "_p" : "_k") + std::to_string(split_k);
}

bool fixup_conv_can_implement(const ConvConfig& c, const Conv2dProblem& p, ConvDType dtype) {
  if (c.dense) return kernels::dense_conv_can_implement(p, dtype);  // K % 8 == 0 too: the epilogue pass's vectors
  if (c.parallel) return kernels::conv2d_fprop_fixup_parallel_can_implement(p, dtype, c.tile, c.split_k);
  if (!c.is_cudnn()) return kernels::conv2d_fprop_fixup_can_implement(p, dtype, c.tile, c.split_k);
  // The epilogue pass runs on 16-byte vectors: K % 8 == 0 keeps the output a whole number of them.
  return p.k % 8 == 0 &&
         kernels::cudnn_conv_workspace_bytes(kernels::CudnnConvOp::kFprop, p, dtype, c.cudnn_algo) != SIZE_MAX;
}

size_t fixup_conv_workspace_bytes(const ConvConfig& c, const Conv2dProblem& p, ConvDType dtype) {
  if (c.dense && c.unrolled) return kernels::dense_conv_fprop_unrolled_workspace_bytes(p, dtype);
  if (c.dense) return kernels::dense_conv_fprop_workspace_bytes(p, dtype);
  if (c.parallel) return kernels::conv2d_fprop_fixup_parallel_workspace_bytes(p, dtype, c.tile, c.split_k);
  if (!c.is_cudnn()) return kernels::conv2d_fprop_fixup_workspace_bytes(p, dtype, c.tile, c.split_k);
  const size_t b = kernels::cudnn_conv_workspace_bytes(kernels::CudnnConvOp::kFprop, p, dtype, c.cudnn_algo);
  return b == SIZE_MAX ? 0 : b;
}

cudaError_t run_fixup_conv(const ConvConfig& c, const Conv2dProblem& p, ConvDType dtype, const void* x,
                           const void* w, void* y, const kernels::FixupEpilogue& e, void* workspace,
                           size_t workspace_bytes, cudaStream_t stream) {
  if (c.parallel)
    return kernels::conv2d_fprop_fixup_parallel(p, dtype, c.tile, x, w, y, e, c.split_k, workspace, workspace_bytes,
                                                stream);
  if (!c.is_cudnn() && !c.dense)
    return kernels::conv2d_fprop_fixup(p, dtype, c.tile, x, w, y, e, c.split_k, workspace, workspace_bytes, stream);
  const cudaError_t err =
      c.dense && c.unrolled
          ? kernels::dense_conv_fprop_unrolled(p, dtype, x, w, y, workspace, workspace_bytes, stream)
      : c.dense ? kernels::dense_conv_fprop(p, dtype, x, w, y, workspace, workspace_bytes, stream)
                : kernels::cudnn_conv_fprop(p, dtype, c.cudnn_algo, x, w, y, workspace, workspace_bytes, stream);
  if (err != cudaSuccess || kernels::fixup_epilogue_is_identity(e)) return err;
  return kernels::fixup_epilogue_inplace(y, size_t(gemm_m(p)) * p.k, dtype, e, stream);
}

size_t prepared_filter_bytes(const ConvConfig& c, const Conv2dProblem& p, ConvDType dtype) {
  return c.dense && c.unrolled ? kernels::dense_conv_unrolled_filter_bytes(p, dtype) : 0;
}

cudaError_t prepare_conv_filter(const ConvConfig& c, const Conv2dProblem& p, ConvDType dtype, const void* w,
                                void* dst, cudaStream_t stream, const unsigned* run_flag) {
  if (!(c.dense && c.unrolled)) return cudaErrorInvalidValue;
  return kernels::dense_conv_unroll_filter(p, dtype, w, dst, stream, run_flag);
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
    if (!fixup_conv_can_implement(c, p, dtype)) return;
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
  // Parallel split-K where the tiles alone fill less than the machine: up to two waves, slices >= 128 deep, and at
  // most 64 MiB of fp32 partials (the encoder keeps two workspaces of the largest choice).
  constexpr size_t kMaxPartialBytes = size_t(64) << 20;
  for (ConvTile t : {ConvTile::k128x128, ConvTile::k64x128, ConvTile::k64x64x64, ConvTile::k128x64, ConvTile::k64x64})
    for (int s = 2; s <= 16 && tiles(p, t) < sm_count; s *= 2) {
      if (gemm_k(p) / s < 128 || tiles(p, t) * s > 2 * int64_t(sm_count)) break;
      ConvConfig c{t, s};
      c.parallel = true;
      if (size_t(s) * size_t(gemm_m(p)) * p.k * sizeof(float) <= kMaxPartialBytes) add(c);
    }
  add({ConvTile::kSm90_128x64, 1});
  add({ConvTile::kSm90_64x64, 1});
  add({ConvTile::kSm90_64x64_c2x2, 1});
  add({ConvTile::kSm90_128x64_s4, 1});
  // Big tiles only where the grid still fills the machine (the training batch): at N = 128 they would leave most
  // SMs idle and only lengthen tuning.
  for (ConvTile t : {ConvTile::kSm90_128x128, ConvTile::kSm90_256x64})
    if (tiles(p, t) >= 2 * int64_t(sm_count)) add({t, 1});
  ConvConfig dense;
  dense.dense = true;
  if (!out.empty()) add(dense);  // tiny images only (dense_conv_can_implement)
  dense.unrolled = true;
  if (!out.empty()) add(dense);
  if (!out.empty()) {
    // Workspace capped (the encoder keeps two halves of the largest one): fast forward algorithms need little.
    constexpr size_t kMaxCudnnWorkspace = size_t(256) << 20;
    for (int algo : kernels::cudnn_conv_algorithms(kernels::CudnnConvOp::kFprop, p, dtype, 3, kMaxCudnnWorkspace)) {
      ConvConfig c;
      c.cudnn_algo = algo;
      if (fixup_conv_can_implement(c, p, dtype)) out.push_back(c);
    }
  }
  return out;
}

ConvTuningScratch::~ConvTuningScratch() {
  cudaFree(x_);
  cudaFree(w_);
  cudaFree(y_);
  cudaFree(ws_);
  cudaFree(prepared_);
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
  const TuningKey key = device_tuning_key(relu ? "conv2d_fprop_fixup_relu" : "conv2d_fprop_fixup",
                                          conv_shape_key(p), dtype, names);

  const size_t x_elems = size_t(p.n) * p.h * p.w * p.c;
  const size_t w_elems = size_t(p.k) * p.r * p.s * p.c;
  const size_t y_elems = size_t(gemm_m(p)) * p.k;
  size_t ws = 0;
  std::vector<size_t> prepared_at(cands.size(), SIZE_MAX);  // offsets into prepared_
  size_t prepared_total = 0;
  for (size_t i = 0; i < cands.size(); ++i) {
    ws = std::max(ws, fixup_conv_workspace_bytes(cands[i], p, dtype));
    if (const size_t b = prepared_filter_bytes(cands[i], p, dtype); b > 0) {
      prepared_at[i] = prepared_total;
      prepared_total += (b + 255) / 256 * 256;
    }
  }

  // Cached choices need no buffers; everything else runs on random data of the problem's size.
  auto make_timer = [&] {
    reserve(2 * x_elems, 2 * w_elems, 2 * y_elems, ws);
    upload_random(x_, x_elems, 1.0f, dtype, 1234u);
    upload_random(w_, w_elems, 1.0f / std::sqrt(float(gemm_k(p))), dtype, 5678u);
    if (prepared_total > prepared_bytes_) {
      cudaFree(prepared_);
      prepared_ = nullptr;
      prepared_bytes_ = 0;
      check_cuda(cudaMalloc(&prepared_, prepared_total), "cudaMalloc (tuning prepared filters)");
      prepared_bytes_ = prepared_total;
    }
    for (size_t i = 0; i < cands.size(); ++i)
      if (prepared_at[i] != SIZE_MAX)
        check_cuda(prepare_conv_filter(cands[i], p, dtype, w_, static_cast<uint8_t*>(prepared_) + prepared_at[i],
                                       nullptr),
                   "preparing the filter of " + cands[i].name() + " (tuning)");
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize (tuning prepared filters)");
    const kernels::FixupEpilogue e{scalars_, scalars_ + 1, scalars_ + 2, relu};
    auto launch = [this, &p, dtype, &cands, &prepared_at, e](size_t i, cudaStream_t stream) {
      const void* w = prepared_at[i] == SIZE_MAX ? w_ : static_cast<const uint8_t*>(prepared_) + prepared_at[i];
      check_cuda(run_fixup_conv(cands[i], p, dtype, x_, w, y_, e, ws_, ws_bytes_, stream),
                 "conv2d_fprop_fixup (tuning, " + cands[i].name() + ")");
    };
    // All candidates accumulate in fp32: they differ by summation order and one rounding of the output (~1e-3 in
    // fp16, ~8e-3 in bf16).
    return std::make_unique<CandidateTimer>(launch, poison_fn(y_, 2 * y_elems), output_t_fn(y_, y_elems, dtype),
                                            dtype == ConvDType::kF16 ? 5e-3 : 2e-2);
  };
  const TuningResult r = tune_op(cache, key, names, make_timer, mode, options, row);
  return cands[r.chosen];
}

}  // namespace kfuse
