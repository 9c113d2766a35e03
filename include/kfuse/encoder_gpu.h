// The encoder's fused CUDA inference path: CUTLASS implicit-GEMM convolutions with FixUp epilogues, a fused stem
// that reads the caller's input layout directly, fused squeeze-excitation + residual, the whole forward captured in
// a CUDA graph per input geometry and replayed on the caller's stream.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "kfuse/encoder_options.h"
#include "kfuse/encoder_params.h"
#include "kfuse/safetensors.h"  // DType
#include "kfuse/tuner.h"

namespace kfuse {

enum class GpuPrecision { kFloat16, kBFloat16 };

// A strided view of device memory, as DLPack describes a tensor: logical (N, C, H, W) shape, strides in elements.
struct DeviceTensorView {
  void* data = nullptr;
  DType dtype = DType::F16;
  Shape shape;
  Shape strides;
  int device = 0;
};

class EncoderGpu {
 public:
  // Throws Unsupported without a CUDA device of compute capability >= 8.0, InvalidArgument for configurations the
  // kernels do not cover (base_planes must be a multiple of 16).
  // `options` (kfuse/encoder_options.h) choose among the forward's and the training step's code paths; developer
  // A/B overrides from the environment apply on top (options() returns the result).
  EncoderGpu(const EncoderConfig& config, GpuPrecision precision, int device = 0, const EncoderOptions& options = {});
  ~EncoderGpu();
  EncoderGpu(const EncoderGpu&) = delete;
  EncoderGpu& operator=(const EncoderGpu&) = delete;

  const EncoderConfig& config() const;
  GpuPrecision precision() const;
  const EncoderOptions& options() const;

  // Packs the parameters into the kernels' layouts on the device (synchronous). These values hold until the next
  // set_weights or set_weights_device. One of them must precede forward().
  void set_weights(const EncoderParams<float>& params);
  // A per-channel affine map applied to the input as the stem reads it: v = x * scale[c] + shift[c]. This is how
  // uint8 renderer input is scaled by 1/255 and normalized exactly. Empty vectors restore the identity. Synchronous;
  // graphs captured before (kfuse's, or a caller's around forward()) read the new values.
  void set_input_affine(const std::vector<float>& scale, const std::vector<float>& shift);

  // y = encoder(x), asynchronous on `stream`. x: (N, C, H, W) with any strides, F32/F16/BF16/U8; y: contiguous NCHW
  // (N, out_channels, H/32, W/32) of the precision's dtype or F32. Throws InvalidArgument naming the problem.
  void forward(const DeviceTensorView& x, const DeviceTensorView& y, cudaStream_t stream);

  // Kernel choice per convolution (kfuse/tuner.h). The mode starts as KFUSE_TUNE says (default: tune each new
  // input geometry's convolutions on first use, unless the tuning cache already knows them; never while the stream
  // is being captured). kOff runs the built-in heuristic.
  void set_tuning_mode(TuningMode mode);
  TuningMode tuning_mode() const;
  // Tunes every convolution of the (N, H, W) geometry now (mode kOnFirstUse: cached choices are reused; kRetune:
  // time everything again) and returns one row per convolution. `progress(done, total, row)` follows each one.
  // Synchronous. Captured graphs of the encoder are rebuilt on their next replay.
  using TuneProgress = std::function<void(size_t done, size_t total, const OpTuningReport& row)>;
  std::vector<OpTuningReport> tune(int n, int h, int w, TuningMode mode = TuningMode::kRetune,
                                   const TuneProgress& progress = nullptr);
  // The same for the training step: the forward's convolutions, then per block the backward's weight and data
  // gradients (ops conv2d_wgrad / conv2d_dgrad, with cuDNN's algorithms among the candidates).
  std::vector<OpTuningReport> tune_training(int n, int h, int w, TuningMode mode = TuningMode::kRetune,
                                            const TuneProgress& progress = nullptr);

  // --- training step (forward + backward; encoder_train.cpp) ---------------------------------------------------
  // Binds the parameters in device memory, in PyTorch's layouts (what an optimizer holds): params[i] is parameter i
  // of config().parameter_specs(), contiguous, all of one dtype (F32, F16 or BF16). From then on every forward and
  // forward_train computes with their current values, whatever wrote them: each starts with a fingerprint of their
  // bytes on the device and repacks the weights where they changed (inside the captured graphs too; no host
  // synchronisation). The memory must stay valid while bound; call again when a parameter moves (new storage or
  // dtype: that call waits for the device). Replaces set_weights' values. `stream` is unused (kept for callers).
  void set_weights_device(const std::vector<const void*>& params, DType dtype, cudaStream_t stream);
  // The forward of a training step: y = encoder(x) as forward() computes it (same views and checks), keeping what
  // the backward needs (the spec's minimal stash, per input geometry). Returns the stash's id; the next
  // forward_train of the same geometry replaces the stash (stash_valid then turns false).
  uint64_t forward_train(const DeviceTensorView& x, const DeviceTensorView& y, cudaStream_t stream);
  bool stash_valid(uint64_t stash) const;
  // The backward of the step whose forward returned `stash`, for dL/dy = dy (contiguous NCHW, the dtype of that
  // forward's y); x must be that forward's input. Writes every parameter's gradient, fp32 in PyTorch's layouts in
  // parameter_specs order, into `grads` (device memory, config().num_parameters() floats; written, not accumulated)
  // and, when dx is given, dL/dx (contiguous NCHW of x's dtype: F32, F16 or BF16). Asynchronous on `stream`.
  void backward(uint64_t stash, const DeviceTensorView& x, const DeviceTensorView& dy, float* grads,
                const DeviceTensorView* dx, cudaStream_t stream);
  // The same backward in stages, for callers that hand gradients on as soon as they are final (data-parallel
  // training: the all-reduce of the last blocks' gradients then overlaps the earlier blocks' backward). Stage s in
  // [0, backward_stages() - 1) runs the backward of block blocks - 1 - s, the last stage the stem's. Run every stage
  // in order, 0 first, on one stream, each with backward()'s arguments; after stage s, parameter i's gradient in
  // `grads` is final where backward_stage_of_parameters()[i] <= s. The gradients equal backward()'s.
  int backward_stages() const;
  std::vector<int> backward_stage_of_parameters() const;
  void backward_stage(int stage, uint64_t stash, const DeviceTensorView& x, const DeviceTensorView& dy, float* grads,
                      const DeviceTensorView* dx, cudaStream_t stream);

  // CUDA graphs (default on). Inference: one per input geometry (N, H, W, input dtype and strides, output dtype),
  // run eagerly on its first call and captured on the second, the caller's pointers patched on replay. Training:
  // forward_train and backward each run eagerly the first time per (geometry, caller's pointers), are captured the
  // second time and replayed after (at most 8 graphs kept, the least recently used dropped); a stream already
  // capturing gets the plain launches. graph_count counts both.
  void set_use_graphs(bool on);
  size_t graph_count() const;

  // Programmatic dependent launch (compute capability 9.0+): a kernel of the forward may start while its predecessor
  // finishes, waiting on the device for its data. On where the device supports it, unless options.programmatic_launch is
  // 0 (1-3 pick which boundaries launch early; 3, the default, leaves out the blocks whose shortcut runs
  // concurrently); off for good if a capture with it ever fails.
  bool uses_programmatic_launch() const;

  // Which kernels run: the launch plan of the inference forward (training false) or of the training step on
  // n x C x h x w inputs, one entry per step in launch order. "stem" where the stem kernel runs; per block
  // "block<i>:" (from 1) and its route: "fused_block" (conv1, conv2 and the squeeze-excite as one kernel with the
  // image on chip), "fused_block_wgmma" (the Hopper warpgroup-MMA one; "+stem" where it computes the stem as well),
  // "fused_down_block" (a downsampling block as one kernel), or its kernels, comma-separated: "shortcut" (on a side
  // branch), "conv1" or "conv1_cudnn_graph" (with its FixUp epilogue, one cuDNN graph), "conv2" or
  // "conv2_squeeze_projection" (its GEMM also computes the squeeze-excite's fc1), "squeeze_excite". The training
  // step's entries then list its backward, last block first: "block<i>:backward", or
  // "block<i>:backward_dgrad2_cudnn_graph" where conv2's data gradient and the ReLU mask run as one cuDNN graph.
  // Choices made at a geometry's first forward (tuning, prepared filters, cuDNN graphs) show once it ran.
  std::vector<std::string> launch_plan(int n, int h, int w, bool training = false) const;

  struct Impl;  // opaque (src/encoder/encoder_gpu_impl.h)

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace kfuse
