// The encoder's fused CUDA inference path: CUTLASS implicit-GEMM convolutions with FixUp epilogues, a fused stem
// that reads the caller's input layout directly, fused squeeze-excitation + residual, the whole forward captured in
// a CUDA graph per input geometry and replayed on the caller's stream.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
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
  // uint8 renderer input is scaled by 1/255 and normalized exactly. Empty vectors restore the identity.
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

  // How many blocks of the inference forward on H x W inputs run as one fused kernel each (conv1, conv2 and the
  // squeeze-excite of a 64-channel identity-shortcut block with its image on chip: block 1 at up to 64 x 64 inputs).
  // Where the device has the shared memory for it (227 KB per block: Hopper), unless options.fused_blocks is off.
  int fused_block_count(int h, int w) const;
  // How many of those run as the Hopper warpgroup-MMA kernel (compute capability 9.0, 16 x 16 maps: 64 x 64 inputs),
  // which the training forward also uses (writing the backward's stash), unless options.wgmma_blocks (or fused_blocks) is off.
  int wgmma_block_count(int h, int w) const;
  // How many downsampling blocks of the inference forward on h x w inputs run as one Hopper warpgroup-MMA kernel each
  // (kernels::launch_fused_down_block_wgmma: 64 -> 128 channels at 16 x 16 input maps and 128 -> 256 at 8 x 8, i.e.
  // blocks 2 and 3 of the default network at 64 x 64), as options.fused_down says (0: none;
  // 2: block 2's shape only).
  int down_block_count(int h, int w) const;
  // How many blocks of the inference forward on n x C x h x w inputs have conv2's GEMM compute their squeeze-excite's
  // fc1 pre-activations (kernels::launch_squeeze_projection: the last block, when its conv2 runs as the dense GEMM
  // from a prepared filter, n at most the SM count), as decided at that geometry's first forward; 0 before it or
  // where options.se_projection is off.
  int squeeze_projection_count(int n, int h, int w) const;
  // Whether the inference forward on n x C x h x w inputs computes the stem inside block 1's warpgroup-MMA kernel
  // (each CTA the stem of its own image: n at most the SM count), unless options.fused_stem is off.
  bool stem_in_block(int n, int h, int w) const;
  // How many blocks of the training step on n x C x h x w inputs run conv1 with its FixUp epilogue as one cuDNN graph
  // (and how many also conv2's data gradient with the ReLU mask), as decided at that geometry's first forward_train;
  // {0, 0} before it. options.cudnn_fused chooses: 1 where the tuner runs conv1 in cuDNN, 2 all, or 0.
  std::pair<int, int> cudnn_fused_count(int n, int h, int w) const;

  struct Impl;  // opaque (src/runtime/encoder_gpu_impl.h)

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace kfuse
