// Loads an encoder checkpoint (safetensors, bps-nav's state_dict names) and encodes a batch, without Python:
//   encoder_inference [checkpoint.safetensors] [batch]
// Without a checkpoint it uses the embedded default network. On a CUDA GPU it runs the fused fp16 path and compares
// it with the CPU reference; without one it runs the CPU reference only.
#include <cmath>
#include <cstdio>
#include <random>
#include <string>

#include "kfuse/checkpoint.h"
#include "kfuse/device.h"
#include "kfuse/reference.h"
#if KFUSE_WITH_CUDA
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kfuse/encoder_gpu.h"
#endif

int main(int argc, char** argv) try {
  const std::string path = argc > 1 ? argv[1] : "";
  const int batch = argc > 2 ? std::stoi(argv[2]) : 8;
  const auto params = path.empty() ? kfuse::EncoderParams<float>::perturbed_init(kfuse::EncoderConfig{}, 0)
                                   : kfuse::load_encoder_checkpoint<float>(path);
  const kfuse::EncoderConfig& cfg = params.config();
  std::printf("network: %s, %lld parameters\n", cfg.to_string().c_str(), (long long)cfg.num_parameters());

  kfuse::HostTensor<float> x({batch, cfg.in_channels, 64, 64});
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(0.f, 1.f);
  for (float& v : x.values()) v = u(rng);
  const kfuse::HostTensor<float> y_ref = kfuse::reference_forward(params, x);
  double ref_sum = 0;
  for (float v : y_ref.values()) ref_sum += v;
  std::printf("CPU reference: output [%lld, %lld, %lld, %lld], sum %.6f\n", (long long)y_ref.dim(0),
              (long long)y_ref.dim(1), (long long)y_ref.dim(2), (long long)y_ref.dim(3), ref_sum);

  if (kfuse::cuda_device_count() == 0) {
    std::printf("no CUDA GPU: the fused path needs an NVIDIA GPU with compute capability 8.0 or newer\n");
    return 0;
  }
#if KFUSE_WITH_CUDA
  kfuse::EncoderGpu gpu(cfg, kfuse::GpuPrecision::kFloat16, 0);
  gpu.set_weights(params);
  float *dx = nullptr, *dy = nullptr;
  cudaMalloc(&dx, sizeof(float) * x.numel());
  cudaMalloc(&dy, sizeof(float) * y_ref.numel());
  cudaMemcpy(dx, x.data(), sizeof(float) * x.numel(), cudaMemcpyHostToDevice);
  kfuse::DeviceTensorView xv{dx, kfuse::DType::F32, x.shape(), {}, 0};
  const auto& s = x.shape();
  xv.strides = {s[1] * s[2] * s[3], s[2] * s[3], s[3], 1};
  const auto& o = y_ref.shape();
  kfuse::DeviceTensorView yv{dy, kfuse::DType::F32, o, {o[1] * o[2] * o[3], o[2] * o[3], o[3], 1}, 0};
  gpu.forward(xv, yv, nullptr);
  kfuse::HostTensor<float> y(o);
  if (cudaMemcpy(y.data(), dy, sizeof(float) * y.numel(), cudaMemcpyDeviceToHost) != cudaSuccess) {
    std::fprintf(stderr, "CUDA error: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 1;
  }
  double num = 0, den = 0, sum = 0;
  for (int64_t i = 0; i < y.numel(); ++i) {
    num += double(y[i] - y_ref[i]) * (y[i] - y_ref[i]);
    den += double(y_ref[i]) * y_ref[i];
    sum += y[i];
  }
  std::printf("GPU fp16: sum %.6f, relative difference to the CPU reference %.2e\n", sum, std::sqrt(num / den));
  cudaFree(dx);
  cudaFree(dy);
#endif
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}
