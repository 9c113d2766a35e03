// Which kernel runs a FixUp convolution: the candidate configurations (CUTLASS 2.x tiles x split-K, CUTLASS 3.x
// Hopper tiles, and cuDNN's forward algorithms followed by the FixUp epilogue as a separate pass), the built-in
// heuristic, and their tuning through the generic tuner (kfuse/tuner.h) on scratch
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
  // Parallel split-K (conv2d_fprop_fixup_parallel: fp32 partials, then a reduction pass with the epilogue) instead
  // of serial; split_k >= 2.
  bool parallel = false;
  // >= 0: cuDNN's forward algorithm of that number (tile and split_k unused), then the FixUp epilogue as a separate
  // element-wise pass (kernels/conv/fixup_epilogue_pass.h): the tuner's way to never be slower than cuDNN.
  int cudnn_algo = -1;
  bool is_cudnn() const { return cudnn_algo >= 0; }
  // One dense GEMM over the flattened images (kernels/conv/dense_conv.h: tiny images, no padding taps multiplied),
  // then the FixUp epilogue as a separate pass, like cuDNN's.
  bool dense = false;
  // With dense: the filter unrolled once ahead of time (prepare_conv_filter) rather than per call; run_fixup_conv
  // then takes the prepared filter as its `w`. The inference forward keeps one per weight set.
  bool unrolled = false;
  // The same kernels taking the KRSC filter as it is (unrolled -> per call): for callers that keep no prepared filter.
  ConvConfig unprepared() const {
    ConvConfig c = *this;
    c.unrolled = false;
    return c;
  }
  // Runs a library's launches (cuDNN's, cuBLAS's), which kfuse does not see: no programmatic launch next to them.
  bool is_library() const { return is_cudnn() || dense; }
  // e.g. "sm80_128x64_k2", "sm80_128x128_p8" (parallel), "sm90_128x64", "cudnn_a1", "dense_gemm",
  // "dense_unrolled": stable, they are the tuning cache's values.
  std::string name() const;
  bool operator==(const ConvConfig& o) const {
    return cudnn_algo == o.cudnn_algo && dense == o.dense && unrolled == o.unrolled &&
           (is_cudnn() || dense || (tile == o.tile && split_k == o.split_k && parallel == o.parallel));
  }
};

// What every provider of a FixUp convolution offers, dispatched on the configuration: whether it can run `p`
// (host-only; for cuDNN: whether the loaded cuDNN supports the algorithm), its device workspace, and the launch
// (asynchronous on `stream`; the error codes of conv2d_fprop_fixup, and cudaErrorNotSupported where cuDNN fails).
bool fixup_conv_can_implement(const ConvConfig& c, const kernels::Conv2dProblem& p, kernels::ConvDType dtype);
size_t fixup_conv_workspace_bytes(const ConvConfig& c, const kernels::Conv2dProblem& p, kernels::ConvDType dtype);
cudaError_t run_fixup_conv(const ConvConfig& c, const kernels::Conv2dProblem& p, kernels::ConvDType dtype,
                           const void* x, const void* w, void* y, const kernels::FixupEpilogue& epilogue,
                           void* workspace, size_t workspace_bytes, cudaStream_t stream);

// Configurations that run from a filter prepared ahead of time (ConvConfig::unrolled): its size (0: the
// configuration takes the KRSC filter as it is) and the preparation from the KRSC filter w into `dst` (that many
// bytes, 16-byte aligned; asynchronous on `stream`). Rerun it whenever w changes.
size_t prepared_filter_bytes(const ConvConfig& c, const kernels::Conv2dProblem& p, kernels::ConvDType dtype);
cudaError_t prepare_conv_filter(const ConvConfig& c, const kernels::Conv2dProblem& p, kernels::ConvDType dtype,
                                const void* w, void* dst, cudaStream_t stream, const unsigned* run_flag = nullptr);

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
// first (the tuner's reference candidate); parallel split-K where the tiles alone leave SMs idle; cuDNN's forward
// algorithms last, when cuDNN is available on the current device and kfuse's own kernels can run the problem (the
// encoder needs them anyway).
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
  void* prepared_ = nullptr;  // the prepared filters of the candidates that need one, back to back
  float* scalars_ = nullptr;
  size_t x_bytes_ = 0, w_bytes_ = 0, y_bytes_ = 0, ws_bytes_ = 0, prepared_bytes_ = 0;
};

}  // namespace kfuse
