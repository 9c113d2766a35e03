#include "encoder/backward_conv_selection.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/conv/cudnn_conv.h"
#include "kernels/conv/dense_conv.h"
#include "kernels/conv/wgrad_wgmma.h"
#include "kfuse/device.h"
#include "kfuse/error.h"
#include "runtime/cuda_check.h"
#include "runtime/half_bits.h"
#include "runtime/op_tuning.h"

namespace kfuse {

using kernels::BackwardTile;
using kernels::Conv2dProblem;
using kernels::ConvDType;
using kernels::CudnnConvOp;

namespace {

const char* tile_name(BackwardTile t) {
  switch (t) {
    case BackwardTile::k128x128: return "128x128";
    case BackwardTile::k128x64: return "128x64";
    case BackwardTile::k64x64: return "64x64";
  }
  return "?";
}

int64_t wgrad_tiles(const Conv2dProblem& p, BackwardTile t) {
  const int tm = t == BackwardTile::k64x64 ? 64 : 128;
  const int tn = t == BackwardTile::k128x128 ? 128 : 64;
  return int64_t((p.k + tm - 1) / tm) * ((p.r * p.s * p.c + tn - 1) / tn);
}

int64_t wgrad_gemm_k(const Conv2dProblem& p) { return int64_t(p.n) * p.p() * p.q(); }

// Split K so that `tiles` fill the machine about twice, keeping at least 256 of K per slice.
int wgrad_split(const Conv2dProblem& p, BackwardTile t, int sm_count) {
  const int64_t tiles = wgrad_tiles(p, t);
  int64_t split = std::max<int64_t>(1, (2 * sm_count + tiles - 1) / tiles);
  split = std::min<int64_t>({split, 256, std::max<int64_t>(1, wgrad_gemm_k(p) / 256)});
  return int(split);
}

}  // namespace

// --- weight gradient --------------------------------------------------------------------------------------------
std::string WgradChoice::name() const {
  if (dense) return "dense_gemm";
  if (wgmma) return "sm90_wgmma";
  return cudnn ? "cudnn_a" + std::to_string(algo)
               : std::string("sm80_") + tile_name(tile) + "_k" + std::to_string(split_k);
}

WgradChoice wgrad_heuristic(const Conv2dProblem& p, ConvDType dtype, int sm_count) {
  WgradChoice c;
  c.tile = dtype == ConvDType::kBF16 ? BackwardTile::k128x64
           : p.k >= 128              ? BackwardTile::k128x128
                                     : BackwardTile::k64x64;
  c.split_k = wgrad_split(p, c.tile, sm_count);
  return c;
}

bool wgrad_can_implement(const WgradChoice& c, const Conv2dProblem& p, ConvDType dtype) {
  if (c.dense) return kernels::dense_conv_can_implement(p, dtype);
  if (c.wgmma) return kernels::wgrad_wgmma_can_implement(p, dtype);
  if (c.cudnn) return kernels::cudnn_conv_workspace_bytes(CudnnConvOp::kWgrad, p, dtype, c.algo) != SIZE_MAX;
  return kernels::conv2d_wgrad_can_implement(p, dtype, c.tile, c.split_k);
}

std::vector<WgradChoice> wgrad_candidates(const Conv2dProblem& p, ConvDType dtype, int sm_count) {
  std::vector<WgradChoice> out;
  auto add = [&](const WgradChoice& c) {
    for (const WgradChoice& have : out)
      if (have.name() == c.name()) return;
    if (wgrad_can_implement(c, p, dtype)) out.push_back(c);
  };
  add(wgrad_heuristic(p, dtype, sm_count));
  for (BackwardTile t : {BackwardTile::k128x128, BackwardTile::k128x64, BackwardTile::k64x64}) {
    const int s = wgrad_split(p, t, sm_count);
    for (int split : {s / 2, s, 2 * s}) {
      WgradChoice c;
      c.tile = t;
      c.split_k = std::clamp(split, 1, 256);
      add(c);
    }
  }
  for (int algo : kernels::cudnn_conv_algorithms(CudnnConvOp::kWgrad, p, dtype)) {
    WgradChoice c;
    c.cudnn = true;
    c.algo = algo;
    add(c);
  }
  WgradChoice dense;
  dense.dense = true;
  add(dense);  // tiny images only (dense_conv_can_implement)
  WgradChoice wgmma;
  wgmma.wgmma = true;
  add(wgmma);  // Hopper, block 1's shape (wgrad_wgmma_can_implement)
  return out;
}

size_t wgrad_workspace_bytes(const WgradChoice& c, const Conv2dProblem& p, ConvDType dtype) {
  if (c.dense) return kernels::dense_conv_wgrad_workspace_bytes(p, dtype);
  if (c.wgmma) return kernels::wgrad_wgmma_workspace_bytes(p, dtype);
  if (c.cudnn) {
    const size_t b = kernels::cudnn_conv_workspace_bytes(CudnnConvOp::kWgrad, p, dtype, c.algo);
    return b == SIZE_MAX ? 0 : b;
  }
  return kernels::conv2d_wgrad_workspace_bytes(p, dtype, c.tile, c.split_k);
}

cudaError_t run_wgrad(const WgradChoice& c, const Conv2dProblem& p, ConvDType dtype, const void* dy, const void* x,
                      void* dw, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (c.cudnn) return kernels::cudnn_conv_wgrad(p, dtype, c.algo, dy, x, dw, workspace, workspace_bytes, stream);
  if (c.dense)
    return kernels::dense_conv_wgrad(p, dtype, dy, x, static_cast<float*>(dw), workspace, workspace_bytes, stream);
  if (c.wgmma)
    return kernels::wgrad_wgmma(p, dtype, dy, x, static_cast<float*>(dw), workspace, workspace_bytes, stream);
  return kernels::conv2d_wgrad(p, dtype, c.tile, c.split_k, dy, x, static_cast<float*>(dw), workspace,
                               workspace_bytes, stream);
}

// --- data gradient ----------------------------------------------------------------------------------------------
std::string DgradChoice::name() const {
  switch (kind) {
    case Kind::kFlippedForward: return "fwd_" + fprop.name();
    case Kind::kStrided: return std::string("strided_") + tile_name(tile);
    case Kind::kCudnn: return "cudnn_a" + std::to_string(algo);
  }
  return "?";
}

std::vector<uint16_t> flip_filters(const Conv2dProblem& p, const std::vector<uint16_t>& w) {
  std::vector<uint16_t> f(w.size());
  for (int k = 0; k < p.k; ++k)
    for (int r = 0; r < p.r; ++r)
      for (int s = 0; s < p.s; ++s)
        for (int c = 0; c < p.c; ++c)
          f[((size_t(c) * p.r + (p.r - 1 - r)) * p.s + (p.s - 1 - s)) * p.k + k] =
              w[((size_t(k) * p.r + r) * p.s + s) * p.c + c];
  return f;
}

Conv2dProblem flipped_forward_problem(const Conv2dProblem& p) {
  Conv2dProblem f = p;
  f.c = p.k;
  f.k = p.c;
  return f;
}

namespace {
bool flippable(const Conv2dProblem& p) {
  // The flipped forward conv has the forward's output extent exactly when it is a "same" convolution.
  return p.stride_h == 1 && p.stride_w == 1 && p.r == 2 * p.pad_h + 1 && p.s == 2 * p.pad_w + 1;
}
}  // namespace

DgradChoice dgrad_heuristic(const Conv2dProblem& p, ConvDType dtype, const ConvConfig& fprop) {
  DgradChoice c;
  if (flippable(p)) {
    c.kind = DgradChoice::Kind::kFlippedForward;
    c.fprop = fprop.unprepared();  // the flipped filter changes every step: nothing to prepare ahead
  } else {
    c.kind = DgradChoice::Kind::kStrided;
    c.tile = dtype == ConvDType::kBF16 || p.c < 128 ? BackwardTile::k128x64 : BackwardTile::k128x128;
  }
  return c;
}

bool dgrad_can_implement(const DgradChoice& c, const Conv2dProblem& p, ConvDType dtype) {
  switch (c.kind) {
    case DgradChoice::Kind::kFlippedForward:
      return flippable(p) && fixup_conv_can_implement(c.fprop, flipped_forward_problem(p), dtype);
    case DgradChoice::Kind::kStrided: return kernels::conv2d_dgrad_can_implement(p, dtype, c.tile);
    case DgradChoice::Kind::kCudnn:
      return kernels::cudnn_conv_workspace_bytes(CudnnConvOp::kDgrad, p, dtype, c.algo) != SIZE_MAX;
  }
  return false;
}

std::vector<DgradChoice> dgrad_candidates(const Conv2dProblem& p, ConvDType dtype, const ConvConfig& fprop) {
  std::vector<DgradChoice> out;
  auto add = [&](const DgradChoice& c) {
    for (const DgradChoice& have : out)
      if (have.name() == c.name()) return;
    if (dgrad_can_implement(c, p, dtype)) out.push_back(c);
  };
  add(dgrad_heuristic(p, dtype, fprop));
  if (!flippable(p)) {
    for (BackwardTile t : {BackwardTile::k128x128, BackwardTile::k128x64, BackwardTile::k64x64}) {
      DgradChoice c;
      c.kind = DgradChoice::Kind::kStrided;
      c.tile = t;
      add(c);
    }
  }
  for (int algo : kernels::cudnn_conv_algorithms(CudnnConvOp::kDgrad, p, dtype)) {
    DgradChoice c;
    c.kind = DgradChoice::Kind::kCudnn;
    c.algo = algo;
    add(c);
  }
  return out;
}

size_t dgrad_workspace_bytes(const DgradChoice& c, const Conv2dProblem& p, ConvDType dtype) {
  switch (c.kind) {
    case DgradChoice::Kind::kFlippedForward:
      return fixup_conv_workspace_bytes(c.fprop, flipped_forward_problem(p), dtype);
    case DgradChoice::Kind::kStrided: return kernels::conv2d_dgrad_workspace_bytes(p, dtype, c.tile);
    case DgradChoice::Kind::kCudnn: {
      const size_t b = kernels::cudnn_conv_workspace_bytes(CudnnConvOp::kDgrad, p, dtype, c.algo);
      return b == SIZE_MAX ? 0 : b;
    }
  }
  return 0;
}

cudaError_t run_dgrad(const DgradChoice& c, const Conv2dProblem& p, ConvDType dtype, const void* dy, const void* w,
                      const void* w_flip, void* dx, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  switch (c.kind) {
    case DgradChoice::Kind::kFlippedForward:
      return run_fixup_conv(c.fprop, flipped_forward_problem(p), dtype, dy, w_flip, dx, kernels::FixupEpilogue{},
                            workspace, workspace_bytes, stream);
    case DgradChoice::Kind::kStrided:
      return kernels::conv2d_dgrad(p, dtype, c.tile, dy, w, dx, workspace, workspace_bytes, stream);
    case DgradChoice::Kind::kCudnn:
      return kernels::cudnn_conv_dgrad(p, dtype, c.algo, dy, w, dx, workspace, workspace_bytes, stream);
  }
  return cudaErrorInvalidValue;
}

// --- tuning -----------------------------------------------------------------------------------------------------
struct BackwardConvTuningScratch::Buffers {
  void* dy = nullptr;
  void* x = nullptr;
  void* w = nullptr;
  void* w_flip = nullptr;
  void* out = nullptr;
  void* ws = nullptr;
  size_t dy_bytes = 0, x_bytes = 0, w_bytes = 0, w_flip_bytes = 0, out_bytes = 0, ws_bytes = 0;

  ~Buffers() {
    for (void* p : {dy, x, w, w_flip, out, ws}) cudaFree(p);
  }
  static void grow(void*& p, size_t& have, size_t need, const char* what) {
    if (need <= have) return;
    cudaFree(p);
    p = nullptr;
    have = 0;
    check_cuda(cudaMalloc(&p, need), what);
    have = need;
  }
  // Random dy, x and w of problem p, and w's flipped transpose.
  void fill(const Conv2dProblem& p, ConvDType dtype, size_t out_bytes_needed, size_t ws_needed) {
    const size_t dy_elems = size_t(p.n) * p.p() * p.q() * p.k;
    const size_t x_elems = size_t(p.n) * p.h * p.w * p.c;
    const size_t w_elems = size_t(p.k) * p.r * p.s * p.c;
    grow(dy, dy_bytes, 2 * dy_elems, "cudaMalloc (tuning dy)");
    grow(x, x_bytes, 2 * x_elems, "cudaMalloc (tuning x)");
    grow(w, w_bytes, 2 * w_elems, "cudaMalloc (tuning w)");
    grow(w_flip, w_flip_bytes, 2 * w_elems, "cudaMalloc (tuning w_flip)");
    grow(out, out_bytes, out_bytes_needed, "cudaMalloc (tuning output)");
    grow(ws, ws_bytes, std::max<size_t>(ws_needed, 256), "cudaMalloc (tuning workspace)");
    upload_random(dy, dy_elems, 1.0f, dtype, 4321u);
    upload_random(x, x_elems, 1.0f, dtype, 8765u);
    const float ws_scale = 1.0f / std::sqrt(float(p.r * p.s * p.c));
    std::vector<uint16_t> hw(w_elems);
    {
      upload_random(w, w_elems, ws_scale, dtype, 2468u);
      check_cuda(cudaMemcpy(hw.data(), w, 2 * w_elems, cudaMemcpyDeviceToHost), "cudaMemcpy (tuning w)");
    }
    const std::vector<uint16_t> hf = flip_filters(p, hw);
    check_cuda(cudaMemcpy(w_flip, hf.data(), 2 * w_elems, cudaMemcpyHostToDevice), "cudaMemcpy (tuning w_flip)");
  }
};

BackwardConvTuningScratch::BackwardConvTuningScratch() : b_(std::make_unique<Buffers>()) {}
BackwardConvTuningScratch::~BackwardConvTuningScratch() = default;

namespace {
double tolerance(ConvDType dtype) { return dtype == ConvDType::kF16 ? 5e-3 : 2e-2; }
}  // namespace

WgradChoice BackwardConvTuningScratch::tune_wgrad(const Conv2dProblem& p, ConvDType dtype, TuningCache& cache,
                                                  TuningMode mode, OpTuningReport& row,
                                                  const TunerOptions& options) {
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  const std::vector<WgradChoice> cands = wgrad_candidates(p, dtype, cuda_device_info(dev).sm_count);
  KFUSE_CHECK(!cands.empty(), InvalidArgument, "no weight-gradient kernel can run ", conv_shape_key(p));
  std::vector<std::string> names;
  for (const WgradChoice& c : cands) names.push_back(c.name());
  const TuningKey key = device_tuning_key("conv2d_wgrad", conv_shape_key(p), dtype, names);
  const size_t w_elems = size_t(p.k) * p.r * p.s * p.c;

  auto make_timer = [&] {
    size_t ws = 0;
    for (const WgradChoice& c : cands) ws = std::max(ws, wgrad_workspace_bytes(c, p, dtype));
    b_->fill(p, dtype, 4 * w_elems, ws);
    Buffers& b = *b_;
    auto launch = [&b, &p, dtype, &cands](size_t i, cudaStream_t stream) {
      check_cuda(run_wgrad(cands[i], p, dtype, b.dy, b.x, b.out, b.ws, b.ws_bytes, stream),
                 "weight gradient " + cands[i].name() + " (tuning)");
    };
    // Every candidate's output: fp32 or T, whichever it writes.
    auto output = [&cands, out = b.out, w_elems, dtype](size_t i) {
      return CandidateTimer::Output{out, w_elems, cands[i].writes_t() ? value_type(dtype) : kernels::ValueType::kF32};
    };
    return std::make_unique<CandidateTimer>(launch, poison_fn(b.out, 4 * w_elems), output, tolerance(dtype));
  };
  const TuningResult r = tune_op(cache, key, names, make_timer, mode, options, row);
  return cands[r.chosen];
}

DgradChoice BackwardConvTuningScratch::tune_dgrad(const Conv2dProblem& p, ConvDType dtype, const ConvConfig& fprop,
                                                  TuningCache& cache, TuningMode mode, OpTuningReport& row,
                                                  const TunerOptions& options) {
  const std::vector<DgradChoice> cands = dgrad_candidates(p, dtype, fprop);
  KFUSE_CHECK(!cands.empty(), InvalidArgument, "no data-gradient kernel can run ", conv_shape_key(p));
  std::vector<std::string> names;
  for (const DgradChoice& c : cands) names.push_back(c.name());
  const TuningKey key = device_tuning_key("conv2d_dgrad", conv_shape_key(p), dtype, names);
  const size_t x_elems = size_t(p.n) * p.h * p.w * p.c;

  auto make_timer = [&] {
    size_t ws = 0;
    for (const DgradChoice& c : cands) ws = std::max(ws, dgrad_workspace_bytes(c, p, dtype));
    b_->fill(p, dtype, 2 * x_elems, ws);
    Buffers& b = *b_;
    auto launch = [&b, &p, dtype, &cands](size_t i, cudaStream_t stream) {
      check_cuda(run_dgrad(cands[i], p, dtype, b.dy, b.w, b.w_flip, b.out, b.ws, b.ws_bytes, stream),
                 "data gradient " + cands[i].name() + " (tuning)");
    };
    return std::make_unique<CandidateTimer>(launch, poison_fn(b.out, 2 * x_elems), output_t_fn(b.out, x_elems, dtype),
                                            tolerance(dtype));
  };
  const TuningResult r = tune_op(cache, key, names, make_timer, mode, options, row);
  return cands[r.chosen];
}

}  // namespace kfuse
