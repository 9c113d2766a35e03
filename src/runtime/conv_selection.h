// Which kernel runs a FixUp convolution: the candidate configurations (CUTLASS 2.x tiles x split-K, CUTLASS 3.x
// Hopper tiles), the built-in heuristic, and their tuning through the generic tuner (kfuse/tuner.h) on scratch
// buffers of random data, so that any op holding a Conv2dProblem can ask for the fastest correct configuration.
#pragma once

#include <string>
#include <vector>

#include "kernels/conv/conv_fixup.h"
#include "kfuse/tuner.h"

namespace kfuse {

struct ConvConfig {
  kernels::ConvTile tile = kernels::ConvTile::k64x64;
  int split_k = 1;
  // e.g. "sm80_128x64_k2", "sm90_128x64": stable, they are the tuning cache's values.
  std::string name() const;
  bool operator==(const ConvConfig& o) const { return tile == o.tile && split_k == o.split_k; }
};

// "n128_h16_w16_c64_k64_r3_s3_p1_u1": the problem as a tuning-cache shape.
std::string conv_shape_key(const kernels::Conv2dProblem& p);

// The built-in choice (tuning off, or nothing cached): 128x64 tiles for the wide, shallow early layers, 64x64
// elsewhere, split K (fp16 only) when the tiles alone would leave most of the `sm_count` SMs idle. Always
// implementable for problems the 2.x kernels accept. No split K in bf16: the serial split-K kernels pass their
// partial sums through the output tensor, rounded to the output type, and bf16's 8-bit significand made that the
// largest error of the small-batch forward (and of its gradients).
ConvConfig conv_heuristic(const kernels::Conv2dProblem& p, int sm_count,
                          kernels::ConvDType dtype = kernels::ConvDType::kF16);

// Every configuration that can run `p` in `dtype` on a device of compute capability `cc_major`, the heuristic's
// first (the tuner's reference candidate).
std::vector<ConvConfig> conv_candidates(const kernels::Conv2dProblem& p, kernels::ConvDType dtype, int cc_major,
                                        int sm_count);

// Scratch device memory for tuning convolutions: random inputs and weights, two outputs, split-K workspace, the
// epilogue scalars. Grows on demand; freed with the object.
class ConvTuningScratch {
 public:
  ConvTuningScratch() = default;
  ~ConvTuningScratch();
  ConvTuningScratch(const ConvTuningScratch&) = delete;
  ConvTuningScratch& operator=(const ConvTuningScratch&) = delete;

  // Tunes one convolution (with a relu or identity FixUp epilogue, as the op will run it) and returns the chosen
  // configuration; `row` receives the report (op, shape, default and tuned times, spread, choice). Synchronous on
  // a private stream of the current device. Throws kfuse::Error on CUDA failures.
  ConvConfig tune(const kernels::Conv2dProblem& p, kernels::ConvDType dtype, bool relu, TuningCache& cache,
                  TuningMode mode, OpTuningReport& row, const TunerOptions& options = {});

 private:
  void reserve(size_t x_bytes, size_t w_bytes, size_t y_bytes, size_t ws_bytes);
  void* x_ = nullptr;
  void* w_ = nullptr;
  void* y_ = nullptr;
  void* ws_ = nullptr;
  float* scalars_ = nullptr;
  size_t x_bytes_ = 0, w_bytes_ = 0, y_bytes_ = 0, ws_bytes_ = 0;
};

}  // namespace kfuse
