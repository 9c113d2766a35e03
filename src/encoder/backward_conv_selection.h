// Which kernel runs each backward convolution of the training step: kfuse's CUTLASS kernels (conv_backward.h, and the
// forward FixUp kernels with flipped filters for stride-1 data gradients) or cuDNN's (cudnn_conv.h), chosen per shape
// by the tuner like the forward convolutions (conv_selection.h). All take the FORWARD problem p.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/conv/conv_backward.h"
#include "kernels/conv/conv_fixup.h"
#include "kfuse/tuner.h"
#include "encoder/conv_selection.h"

namespace kfuse {

// Weight gradient dw = wgrad(dy, x), KRSC.
struct WgradChoice {
  bool cudnn = false;
  bool dense = false;  // one dense GEMM over the flattened images (kernels/conv/dense_conv.h), fp32 out
  bool wgmma = false;  // Hopper, 3x3 / 64 -> 64 on small images (kernels/conv/wgrad_wgmma.h), fp32 out
  kernels::BackwardTile tile = kernels::BackwardTile::k128x128;  // CUTLASS
  int split_k = 1;                                              // CUTLASS
  int algo = 0;                                                 // cuDNN
  // "sm80_128x128_k8", "cudnn_a1", "dense_gemm", "sm90_wgmma": stable, they are the tuning cache's values.
  std::string name() const;
  // cuDNN writes dw in the activations' type T, CUTLASS in fp32.
  bool writes_t() const { return cudnn; }
};
// The built-in choice: CUTLASS, the tile by k, K split so that the tiles fill the machine about twice.
WgradChoice wgrad_heuristic(const kernels::Conv2dProblem& p, kernels::ConvDType dtype, int sm_count);
// The heuristic first, then CUTLASS tile / split-K variants, then cuDNN's algorithms where cuDNN is available.
std::vector<WgradChoice> wgrad_candidates(const kernels::Conv2dProblem& p, kernels::ConvDType dtype, int sm_count);
bool wgrad_can_implement(const WgradChoice& c, const kernels::Conv2dProblem& p, kernels::ConvDType dtype);
size_t wgrad_workspace_bytes(const WgradChoice& c, const kernels::Conv2dProblem& p, kernels::ConvDType dtype);
// dw: fp32 or T KRSC (writes_t()), 16-byte aligned.
cudaError_t run_wgrad(const WgradChoice& c, const kernels::Conv2dProblem& p, kernels::ConvDType dtype, const void* dy,
                      const void* x, void* dw, void* workspace, size_t workspace_bytes, cudaStream_t stream);

// Data gradient dx = conv^T(dy), NHWC T.
struct DgradChoice {
  enum class Kind {
    kFlippedForward,  // stride 1: kfuse's forward FixUp conv of the transposed problem with flipped filters
    kStrided,         // kfuse's CUTLASS strided dgrad
    kCudnn,
  };
  Kind kind = Kind::kFlippedForward;
  ConvConfig fprop;                                              // kFlippedForward
  kernels::BackwardTile tile = kernels::BackwardTile::k128x64;  // kStrided
  int algo = 0;                                                  // kCudnn
  // "fwd_sm80_128x64_k1", "strided_128x64", "cudnn_a1"
  std::string name() const;
};
// The flipped, transposed filters of problem p, [c][r][s][k] = w[k][R-1-r][S-1-s][c] (16-bit values, host).
std::vector<uint16_t> flip_filters(const kernels::Conv2dProblem& p, const std::vector<uint16_t>& w);
// The forward problem of a stride-1 data gradient with flipped filters: dy (p.k channels) -> dx (p.c channels).
kernels::Conv2dProblem flipped_forward_problem(const kernels::Conv2dProblem& p);
// The built-in choice: stride 1 runs the flipped forward with `fprop` (the forward conv's configuration for
// flipped_forward_problem(p)), larger strides the CUTLASS strided dgrad.
DgradChoice dgrad_heuristic(const kernels::Conv2dProblem& p, kernels::ConvDType dtype, const ConvConfig& fprop);
std::vector<DgradChoice> dgrad_candidates(const kernels::Conv2dProblem& p, kernels::ConvDType dtype,
                                          const ConvConfig& fprop);
bool dgrad_can_implement(const DgradChoice& c, const kernels::Conv2dProblem& p, kernels::ConvDType dtype);
size_t dgrad_workspace_bytes(const DgradChoice& c, const kernels::Conv2dProblem& p, kernels::ConvDType dtype);
// w: the forward filters KRSC [k][r][s][c]; w_flip: the flipped, transposed ones [c][r][s][k] (kFlippedForward only).
cudaError_t run_dgrad(const DgradChoice& c, const kernels::Conv2dProblem& p, kernels::ConvDType dtype, const void* dy,
                      const void* w, const void* w_flip, void* dx, void* workspace, size_t workspace_bytes,
                      cudaStream_t stream);

// Tunes backward convolutions on scratch buffers of random data (synchronous, on a private stream of the current
// device); grows on demand, frees with the object. Throws kfuse::Error on CUDA failures.
class BackwardConvTuningScratch {
 public:
  BackwardConvTuningScratch();
  ~BackwardConvTuningScratch();
  BackwardConvTuningScratch(const BackwardConvTuningScratch&) = delete;
  BackwardConvTuningScratch& operator=(const BackwardConvTuningScratch&) = delete;

  WgradChoice tune_wgrad(const kernels::Conv2dProblem& p, kernels::ConvDType dtype, TuningCache& cache,
                         TuningMode mode, OpTuningReport& row, const TunerOptions& options = {});
  DgradChoice tune_dgrad(const kernels::Conv2dProblem& p, kernels::ConvDType dtype, const ConvConfig& fprop,
                         TuningCache& cache, TuningMode mode, OpTuningReport& row, const TunerOptions& options = {});

 private:
  struct Buffers;
  std::unique_ptr<Buffers> b_;
};

}  // namespace kfuse
