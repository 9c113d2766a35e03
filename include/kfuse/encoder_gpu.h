// The encoder's fused CUDA inference path: CUTLASS implicit-GEMM convolutions with FixUp epilogues, a fused stem
// that reads the caller's input layout directly, fused squeeze-excitation + residual, the whole forward captured in
// a CUDA graph per input geometry and replayed on the caller's stream.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include <cuda_runtime.h>

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
  EncoderGpu(const EncoderConfig& config, GpuPrecision precision, int device = 0);
  ~EncoderGpu();
  EncoderGpu(const EncoderGpu&) = delete;
  EncoderGpu& operator=(const EncoderGpu&) = delete;

  const EncoderConfig& config() const;
  GpuPrecision precision() const;

  // Packs the parameters into the kernels' layouts on the device (synchronous). Must precede forward().
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

  // CUDA graphs (default on): one per input geometry (N, H, W, input dtype and strides, output dtype).
  void set_use_graphs(bool on);
  size_t graph_count() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kfuse
